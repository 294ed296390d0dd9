// The kubelet's pod resources API; see pod_resources.h.
#include "kubernetes/pod_resources.h"

#include <sys/stat.h>

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "core/log.h"
#include "podresources_v1.grpc.pb.h"

namespace cushare::kubernetes {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::seconds kDeadline{3};
constexpr std::chrono::seconds kMinInterval{1};  // between two Lists a miss asks for
constexpr int kMaxMessage = 16 << 20;            // the kubelet's own limit for this API

}  // namespace

struct PodResourcesClient::Impl {
  std::string socket;
  std::chrono::milliseconds period;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<std::string, std::string>, broker::PodRef> byId;  // (resource, id) -> container
  broker::PodLabeler::Status status;
  bool wanted = false, stopping = false, logged = false;
  std::thread thread;

  // One List; false with *err.
  bool list(std::map<std::pair<std::string, std::string>, broker::PodRef>* out, std::string* err) {
    struct stat st {};
    if (::stat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
      *err = "no socket at " + socket + " (is the kubelet's pod-resources directory mounted?)";
      return false;
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    const auto channel = grpc::CreateCustomChannel("unix://" + socket, grpc::InsecureChannelCredentials(), args);
    const auto stub = v1::PodResourcesLister::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kDeadline);
    v1::ListPodResourcesRequest req;
    v1::ListPodResourcesResponse resp;
    const grpc::Status s = stub->List(&ctx, req, &resp);
    if (!s.ok()) {
      *err = "List on " + socket + ": " + s.error_message() + " (gRPC status " + std::to_string(s.error_code()) + ")";
      return false;
    }
    for (const v1::PodResources& p : resp.pod_resources())
      for (const v1::ContainerResources& c : p.containers())
        for (const v1::ContainerDevices& d : c.devices()) {
          if (d.resource_name().rfind("cushare.io/", 0) != 0) continue;
          for (const std::string& id : d.device_ids())
            (*out)[{d.resource_name(), id}] = broker::PodRef{p.namespace_(), p.name(), c.name()};
        }
    return true;
  }

  void run() {
    std::unique_lock<std::mutex> l(mu);
    Clock::time_point last{};
    while (!stopping) {
      wanted = false;  // a miss from now on asks for the List after this one
      l.unlock();
      std::map<std::pair<std::string, std::string>, broker::PodRef> fresh;
      std::string err;
      const bool ok = list(&fresh, &err);
      l.lock();
      last = Clock::now();
      if (ok) {
        byId = std::move(fresh);
        if (!status.up && logged) CUSHARE_BLOG(info, "kubernetes: the kubelet's pod resources answer again");
        status = {true, ""};
      } else {
        byId.clear();
        if (status.up || !logged || status.error != err)
          CUSHARE_BLOG(warn, "kubernetes: pod labels: {}; processes are not named by pod until it answers", err);
        status = {false, err};
      }
      logged = true;
      cv.notify_all();
      cv.wait_until(l, last + period, [&] { return stopping || wanted; });
      // A miss asked for a List: not before kMinInterval after the last.
      if (!stopping && wanted)
        cv.wait_until(l, last + kMinInterval, [&] { return stopping; });
    }
  }
};

PodResourcesClient::PodResourcesClient(std::string socket, std::chrono::milliseconds period)
    : impl_(std::make_unique<Impl>()) {
  impl_->socket = std::move(socket);
  impl_->period = period;
  impl_->status = {false, "not asked yet"};
}

PodResourcesClient::~PodResourcesClient() {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void PodResourcesClient::start() { impl_->thread = std::thread([this] { impl_->run(); }); }

std::optional<broker::PodRef> PodResourcesClient::find(const std::string& resource, const std::string& id) {
  std::lock_guard<std::mutex> g(impl_->mu);
  const auto it = impl_->byId.find({resource, id});
  if (it != impl_->byId.end()) return it->second;
  impl_->wanted = true;
  impl_->cv.notify_all();
  return std::nullopt;
}

broker::PodLabeler::Status PodResourcesClient::status() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->status;
}

}  // namespace cushare::kubernetes

// The fake kubelet; see fake_kubelet.h.
#include "fake_kubelet.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>

namespace cushare::test {

class FakeKubelet::Registration final : public v1beta1::Registration::Service {
 public:
  explicit Registration(FakeKubelet* k) : k_(k) {}
  grpc::Status Register(grpc::ServerContext*, const v1beta1::RegisterRequest* req, v1beta1::Empty*) override {
    {
      std::lock_guard<std::mutex> g(k_->mu_);
      if (!k_->refuse_.empty()) {
        ++k_->refused_;
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, k_->refuse_);
      }
    }
    // What the kubelet checks (devicemanager: version, resource name, endpoint).
    if (req->version() != "v1beta1")
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "unsupported version " + req->version());
    const std::string& r = req->resource_name();
    const size_t slash = r.find('/');
    if (slash == std::string::npos || slash == 0 || r.starts_with("kubernetes.io/") || slash + 1 == r.size())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "invalid extended resource name " + r);
    struct stat st{};
    if (req->endpoint().find('/') != std::string::npos ||
        ::stat((k_->dir_ + "/" + req->endpoint()).c_str(), &st) != 0 || !S_ISSOCK(st.st_mode))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "endpoint " + req->endpoint() + " is not a socket here");
    {
      std::lock_guard<std::mutex> g(k_->mu_);
      Plugin& p = k_->plugins_[r];
      p.request = *req;
      ++p.registrations;
      p.optionsAsked = false;
    }
    k_->cv_.notify_all();
    // Like the kubelet, talk to the plugin after answering.
    std::lock_guard<std::mutex> g(k_->mu_);
    if (!k_->stopping_) k_->watchers_.emplace_back([k = k_, r, e = req->endpoint()] { k->watchPlugin(r, e); });
    return grpc::Status::OK;
  }

 private:
  FakeKubelet* k_;
};

FakeKubelet::FakeKubelet(std::string dir) : dir_(std::move(dir)) {}

FakeKubelet::~FakeKubelet() { stop(false); }

bool FakeKubelet::start() {
  ::mkdir(dir_.c_str(), 0755);
  const std::string sock = dir_ + "/kubelet.sock";
  ::unlink(sock.c_str());
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = false;
  }
  service_ = std::make_unique<Registration>(this);
  grpc::ServerBuilder b;
  b.AddListeningPort("unix://" + sock, grpc::InsecureServerCredentials());
  b.RegisterService(service_.get());
  server_ = b.BuildAndStart();
  return server_ != nullptr;
}

void FakeKubelet::stop(bool deleteSockets) {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  if (server_) {  // waits for registrations in flight; none starts a watcher any more
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
  }
  std::vector<std::thread> watchers;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& c : streams_) c->TryCancel();
    streams_.clear();
    watchers.swap(watchers_);
  }
  cv_.notify_all();
  for (std::thread& t : watchers) t.join();
  ::unlink((dir_ + "/kubelet.sock").c_str());
  if (!deleteSockets) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    plugins_.clear();  // a new kubelet knows no plugin
  }
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string p = dir_ + "/" + e->d_name;
      struct stat st{};
      if (::lstat(p.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(p.c_str());
    }
    ::closedir(d);
  }
}

void FakeKubelet::refuseWith(const std::string& message) {
  std::lock_guard<std::mutex> g(mu_);
  refuse_ = message;
}

int FakeKubelet::refused() const {
  std::lock_guard<std::mutex> g(mu_);
  return refused_;
}

std::unique_ptr<v1beta1::DevicePlugin::Stub> FakeKubelet::dial(const std::string& resource) {
  std::string endpoint;
  {
    std::lock_guard<std::mutex> g(mu_);
    endpoint = plugins_[resource].request.endpoint();
  }
  return v1beta1::DevicePlugin::NewStub(
      grpc::CreateChannel("unix://" + dir_ + "/" + endpoint, grpc::InsecureChannelCredentials()));
}

void FakeKubelet::watchPlugin(const std::string& resource, const std::string& endpoint) {
  auto stub = v1beta1::DevicePlugin::NewStub(
      grpc::CreateChannel("unix://" + dir_ + "/" + endpoint, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1beta1::Empty e;
    v1beta1::DevicePluginOptions o;
    if (!stub->GetDevicePluginOptions(&ctx, e, &o).ok()) return;
    std::lock_guard<std::mutex> g(mu_);
    plugins_[resource].optionsAsked = true;
  }
  auto ctx = std::make_shared<grpc::ClientContext>();
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) return;
    streams_.push_back(ctx);
  }
  v1beta1::Empty e;
  auto reader = stub->ListAndWatch(ctx.get(), e);
  v1beta1::ListAndWatchResponse r;
  while (reader->Read(&r)) {
    {
      std::lock_guard<std::mutex> g(mu_);
      Plugin& p = plugins_[resource];
      p.devices.assign(r.devices().begin(), r.devices().end());
      ++p.lists;
    }
    cv_.notify_all();
  }
  reader->Finish();
}

bool FakeKubelet::waitFor(const std::string& resource, const std::function<bool(const Plugin&)>& pred, int ms) {
  std::unique_lock<std::mutex> l(mu_);
  return cv_.wait_for(l, std::chrono::milliseconds(ms), [&] { return pred(plugins_[resource]); });
}

FakeKubelet::Plugin FakeKubelet::plugin(const std::string& resource) {
  std::lock_guard<std::mutex> g(mu_);
  return plugins_[resource];
}

// ---- The pod resources API ----

class FakePodResources::Service final : public v1::PodResourcesLister::Service {
 public:
  grpc::Status List(grpc::ServerContext*, const v1::ListPodResourcesRequest*,
                    v1::ListPodResourcesResponse* out) override {
    std::lock_guard<std::mutex> g(mu);
    if (failing) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the fake kubelet is told to fail");
    // One PodResources per pod, as the kubelet answers: containers of a pod together.
    std::map<std::pair<std::string, std::string>, v1::PodResources*> pods;
    for (const Container& c : containers) {
      v1::PodResources*& p = pods[{c.ns, c.pod}];
      if (!p) {
        p = out->add_pod_resources();
        p->set_name(c.pod);
        p->set_namespace_(c.ns);
      }
      v1::ContainerResources* cr = p->add_containers();
      cr->set_name(c.container);
      v1::ContainerDevices* d = cr->add_devices();
      d->set_resource_name(c.resource);
      for (const std::string& id : c.ids) d->add_device_ids(id);
    }
    return grpc::Status::OK;
  }
  mutable std::mutex mu;
  std::vector<Container> containers;
  bool failing = false;
};

FakePodResources::FakePodResources(std::string path) : path_(std::move(path)), service_(std::make_unique<Service>()) {}
FakePodResources::~FakePodResources() { stop(); }

bool FakePodResources::start() {
  ::unlink(path_.c_str());
  grpc::ServerBuilder b;
  b.AddListeningPort("unix://" + path_, grpc::InsecureServerCredentials());
  b.RegisterService(service_.get());
  server_ = b.BuildAndStart();
  return server_ != nullptr;
}

void FakePodResources::stop() {
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_.reset();
  ::unlink(path_.c_str());
}

void FakePodResources::set(const std::vector<Container>& containers) {
  std::lock_guard<std::mutex> g(service_->mu);
  service_->containers = containers;
}

void FakePodResources::fail(bool on) {
  std::lock_guard<std::mutex> g(service_->mu);
  service_->failing = on;
}

}  // namespace cushare::test

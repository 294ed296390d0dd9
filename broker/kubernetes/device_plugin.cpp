// The kubelet device plugin; see device_plugin.h.
#include "kubernetes/device_plugin.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "container/cdi.h"
#include "core/log.h"
#include "core/pod_labels.h"
#include "deviceplugin_v1beta1.grpc.pb.h"

namespace cushare::kubernetes {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kKubeletSocket[] = "kubelet.sock";
constexpr size_t kMaxSocket = 107;
constexpr std::chrono::seconds kRegisterDeadline{5};  // one pass of registrations, all tenants together

bool alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

// One tenant's resource as its service sees it.
struct Shared {
  std::mutex mu;
  std::condition_variable cv;
  PluginTenant tenant;
  std::string resource;
  std::vector<std::pair<std::string, std::string>> ids;  // device ID, its GPU's UUID
  std::map<std::string, std::string> gpuDevices;          // GPU UUID -> its CDI device (gpu_cdi_device)
  std::map<std::string, std::vector<std::string>> nodes;  // GPU UUID -> device nodes Allocate gives
  std::map<std::string, bool> health;                     // GPU UUID -> healthy
  std::string allocationDir;                              // <allocation_dir>/<tenant>; empty: no mounts
  uint64_t generation = 1;                                // bumped on every change of the list
  bool stopping = false;
};

// Per device, the nodes Allocate gives as device specs: none where NVIDIA's CDI device is named.
std::map<std::string, std::vector<std::string>> nodesOf(const PluginSettings& s) {
  return s.gpuCdiDevice.empty() ? s.deviceNodes : std::map<std::string, std::vector<std::string>>{};
}

// Per GPU, the CDI device Allocate names for it; empty without gpuCdiDevice (a template the
// configuration already checked: a GPU it cannot name is left out, logged).
std::map<std::string, std::string> gpuDevicesOf(const PluginSettings& s) {
  std::map<std::string, std::string> out;
  if (s.gpuCdiDevice.empty()) return out;
  for (size_t i = 0; i < s.gpus.size(); ++i) {
    std::string name, why;
    const std::string index = i < s.gpuNames.size() ? s.gpuNames[i] : std::to_string(i);
    if (container::gpuCdiDevice(s.gpuCdiDevice, s.gpus[i], index, &name, &why)) out[s.gpus[i]] = name;
    else CUSHARE_BLOG(error, "kubernetes: gpu_cdi_device for {}: {}", s.gpus[i], why);
  }
  return out;
}

// A tenant's device IDs: devicesPerGpu per device it is placed on, in the broker's device order.
std::vector<std::pair<std::string, std::string>> deviceIds(const PluginSettings& s, const PluginTenant& t) {
  std::vector<std::pair<std::string, std::string>> ids;
  for (const std::string& gpu : s.gpus)
    if (!t.gpus || std::find(t.gpus->begin(), t.gpus->end(), gpu) != t.gpus->end())
      for (uint32_t n = 0; n < s.devicesPerGpu; ++n) ids.emplace_back(gpu + "::" + std::to_string(n), gpu);
  return ids;
}

// The directories above path, made where missing (0755); failures show when path is used.
void makeParents(const std::string& path) {
  for (size_t i = 1; i < path.size(); ++i)
    if (path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0755);
}

// A directory of the allocation tree: made when missing (mode `mode`), and then it must be a
// directory (not a link) of the broker's user that nobody else can write, else a tenant could
// plant an entry (or a link a runtime would follow) that a pod's process would be named by.
bool allocationDir(const std::string& path, mode_t mode, std::string* err) {
  if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
    *err = "cannot make " + path + ": " + std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *err = path + " is not a directory";
    return false;
  }
  if (st.st_uid != ::geteuid()) {
    *err = path + " belongs to uid " + std::to_string(st.st_uid) + ", not to the broker's user: another user made it";
    return false;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char m[8];
    std::snprintf(m, sizeof m, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *err = path + " is writable by others than its owner (mode " + m + "): a tenant could plant a directory there";
    return false;
  }
  return true;
}

// The allocation directories of one tenant's IDs (PluginSettings::allocationDir); false with *err.
bool makeAllocationDirs(const PluginSettings& s, const std::string& tenant,
                        const std::vector<std::pair<std::string, std::string>>& ids, std::string* err) {
  if (s.allocationDir.empty()) return true;
  makeParents(s.allocationDir);  // as a start makes the plugin directory's
  // The top is the broker's alone (0700): only root (the runtime that binds them) reaches the
  // directories below, so no tenant can bind a sibling pod's directory in a namespace of its own.
  if (!allocationDir(s.allocationDir, 0700, err)) return false;
  if (::chmod(s.allocationDir.c_str(), 0700) != 0) {  // the broker's own directory (checked above)
    *err = "cannot make " + s.allocationDir + " the broker's alone (mode 0700): " + std::strerror(errno);
    return false;
  }
  const std::string dir = s.allocationDir + "/" + tenant;
  if (!allocationDir(dir, 0755, err)) return false;
  for (const auto& [id, gpu] : ids)
    if (!allocationDir(dir + "/" + broker::allocationDirName(id), 0755, err)) return false;
  return true;
}

class Service final : public v1beta1::DevicePlugin::Service {
 public:
  explicit Service(std::shared_ptr<Shared> s) : s_(std::move(s)) {}

  grpc::Status GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                      v1beta1::DevicePluginOptions* out) override {
    out->set_pre_start_required(false);
    out->set_get_preferred_allocation_available(false);
    return grpc::Status::OK;
  }

  grpc::Status ListAndWatch(grpc::ServerContext* ctx, const v1beta1::Empty*,
                            grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override {
    uint64_t sent = 0;
    std::unique_lock<std::mutex> l(s_->mu);
    // Ends when the plugin stops or the kubelet goes: a stream that never ends would hold
    // Server::Shutdown forever.
    while (!s_->stopping && !ctx->IsCancelled()) {
      if (sent != s_->generation) {
        v1beta1::ListAndWatchResponse r;
        for (const auto& [id, gpu] : s_->ids) {
          v1beta1::Device* d = r.add_devices();
          d->set_id(id);
          const auto h = s_->health.find(gpu);
          d->set_health(h != s_->health.end() && h->second ? "Healthy" : "Unhealthy");
        }
        sent = s_->generation;
        l.unlock();
        const bool ok = writer->Write(r);
        l.lock();
        if (!ok) break;
      }
      s_->cv.wait_for(l, std::chrono::milliseconds(200));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetPreferredAllocation(grpc::ServerContext*, const v1beta1::PreferredAllocationRequest*,
                                      v1beta1::PreferredAllocationResponse*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "cushare does not prefer devices (its options say so)");
  }

  grpc::Status Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* req,
                        v1beta1::AllocateResponse* out) override {
    std::lock_guard<std::mutex> g(s_->mu);
    if (req->container_requests_size() == 0)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "an Allocate request without containers");
    for (const v1beta1::ContainerAllocateRequest& c : req->container_requests()) {
      if (c.devices_ids_size() == 0)
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a container request without device IDs");
      std::vector<std::string> gpus;  // the GPUs of the container's IDs, once each
      for (const std::string& id : c.devices_ids()) {
        const auto it = std::find_if(s_->ids.begin(), s_->ids.end(), [&](const auto& p) { return p.first == id; });
        if (it == s_->ids.end())
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "device ID '" + id.substr(0, 100) + "' is not one of " + s_->resource + "'s");
        if (std::find(gpus.begin(), gpus.end(), it->second) == gpus.end()) gpus.push_back(it->second);
      }
      v1beta1::ContainerAllocateResponse* r = out->add_container_responses();
      for (const std::string& gpu : gpus)
        if (const auto d = s_->gpuDevices.find(gpu); d != s_->gpuDevices.end()) r->add_cdi_devices()->set_name(d->second);
      // A MIG device's nodes (its GPU's /dev/nvidiaN once per container), for any runtime.
      std::vector<std::string> nodes;
      for (const std::string& gpu : gpus)
        if (const auto n = s_->nodes.find(gpu); n != s_->nodes.end())
          for (const std::string& path : n->second)
            if (std::find(nodes.begin(), nodes.end(), path) == nodes.end()) nodes.push_back(path);
      for (const std::string& path : nodes) {
        v1beta1::DeviceSpec* d = r->add_devices();
        d->set_container_path(path);
        d->set_host_path(path);
        d->set_permissions("rw");
      }
      for (const auto& [k, v] : s_->tenant.edits.env) (*r->mutable_envs())[k] = v;
      // MIG devices (docs/mig.md): the container's CUDA sees the MIG devices of its IDs, by UUID
      // (what CUDA_VISIBLE_DEVICES accepts however the runtime numbers the devices it gives).
      std::string mig;
      for (const std::string& gpu : gpus)
        if (gpu.rfind("MIG-", 0) == 0) mig += (mig.empty() ? "" : ",") + gpu;
      if (!mig.empty() && !r->envs().contains("CUDA_VISIBLE_DEVICES")) (*r->mutable_envs())["CUDA_VISIBLE_DEVICES"] = mig;
      for (const container::Mount& m : s_->tenant.edits.mounts) {
        v1beta1::Mount* pm = r->add_mounts();
        pm->set_container_path(m.containerPath);
        pm->set_host_path(m.hostPath);
        pm->set_read_only(m.readOnly);
      }
      if (!s_->tenant.cdiDevice.empty()) r->add_cdi_devices()->set_name(s_->tenant.cdiDevice);
      if (!s_->allocationDir.empty()) {
        // The container's first ID (in order: one container, one directory, whatever the
        // kubelet's order) names it to the broker (core/pod_labels.h).
        const std::string first = *std::min_element(c.devices_ids().begin(), c.devices_ids().end());
        const std::string host = s_->allocationDir + "/" + broker::allocationDirName(first);
        struct stat st {};
        // The broker's own directory, not a link (the runtime would follow one); else no mount,
        // where the runtime would fail the container.
        if (::lstat(host.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::geteuid()) {
          v1beta1::Mount* pm = r->add_mounts();
          pm->set_container_path(broker::kAllocationMountPoint);
          pm->set_host_path(host);
          pm->set_read_only(true);
        } else {
          CUSHARE_BLOG(error, "kubernetes: {} is missing: the container gets no allocation mount (no pod labels)", host);
        }
      }
    }
    CUSHARE_BLOG(info, "kubernetes: {}: allocated to {} container(s)", s_->resource, req->container_requests_size());
    return grpc::Status::OK;
  }

  grpc::Status PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                 v1beta1::PreStartContainerResponse*) override {
    return grpc::Status::OK;
  }

 private:
  std::shared_ptr<Shared> s_;
};

struct TenantServer {
  std::shared_ptr<Shared> shared;
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  std::string endpoint;  // file name in the plugin directory
  ino_t inode = 0;       // of the socket it listens on
  uint64_t served = 0;   // which serve() this is (plugin-wide): a registration answer for another is stale
  bool registered = false;
  bool wanted = false;   // to be registered on the watcher's next pass
  // Serving anew failed (the socket's path cannot be taken): the next try not before serveAfter,
  // the wait doubling from 200 ms to 5 s; the error logged when it first comes or changes.
  Clock::time_point serveAfter{};
  std::chrono::milliseconds serveBackoff{0};
  std::string serveError;
};

// One registration the watcher sends (outside the plugin's lock).
struct Registering {
  std::string name, endpoint, resource;
  uint64_t served = 0;
  size_t devices = 0;
  grpc::ClientContext ctx;
  v1beta1::Empty reply;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1beta1::Empty>> call;
};

// cushare-<tenant>.sock, or a hashed name when that would not fit a socket address.
std::string endpointFor(const std::string& dir, const std::string& tenant) {
  std::string name = "cushare-" + tenant + ".sock";
  if (dir.size() + 1 + name.size() > kMaxSocket) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "cushare-h%016zx.sock", std::hash<std::string>()(tenant));
    name = buf;
  }
  return name;
}

ino_t inodeOf(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

}  // namespace

bool validResourceName(const std::string& tenant, std::string* reason) {
  auto fail = [&](std::string why) {
    if (reason) *reason = std::move(why);
    return false;
  };
  if (tenant.empty() || tenant.size() > 63) return fail("a resource name is 1..63 characters");
  if (!alnum(tenant.front()) || !alnum(tenant.back()))
    return fail("a resource name must start and end with a letter or a digit");
  for (const char c : tenant)
    if (!alnum(c) && c != '-' && c != '_' && c != '.')
      return fail(std::string("character '") + c + "' is not allowed in a resource name");
  return true;
}

struct DevicePlugin::Impl {
  HealthProbe probe;
  PluginTiming timing;
  std::mutex mu;  // guards everything below
  PluginSettings settings;
  std::map<std::string, TenantServer> servers;
  std::map<std::string, bool> health;
  std::atomic<uint64_t> registrations{0};
  uint64_t servedCount = 0;  // under mu: each serve() of any tenant takes the next
  std::mutex sendingMu;                     // guards the two below (taken without mu)
  std::vector<grpc::ClientContext*> sending;  // registrations in flight: cancelled on stop
  bool stopping = false;
  int inotifyFd = -1;
  int stopFd = -1;
  std::thread watcher;
  Clock::time_point lastHealth{}, lastRetry{};

  std::string path(const std::string& name) const { return settings.dir + "/" + name; }

  bool serve(const std::string& name, TenantServer* t, std::string* err) {
    const std::string sock = path(t->endpoint);
    ::unlink(sock.c_str());
    t->shared->stopping = false;
    t->service = std::make_unique<Service>(t->shared);
    grpc::ServerBuilder b;
    b.AddListeningPort("unix://" + sock, grpc::InsecureServerCredentials());
    b.RegisterService(t->service.get());
    t->server = b.BuildAndStart();
    if (!t->server) {
      *err = "kubernetes: cannot serve " + t->shared->resource + " on " + sock;
      return false;
    }
    t->inode = inodeOf(sock);
    t->served = ++servedCount;  // unique across tenants and reloads: an old answer never matches
    t->registered = false;
    (void)name;
    return true;
  }

  void shutdown(TenantServer* t, bool removeSocket) {
    {
      std::lock_guard<std::mutex> g(t->shared->mu);
      t->shared->stopping = true;
    }
    t->shared->cv.notify_all();
    if (t->server) {
      t->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      t->server->Wait();
      t->server.reset();
    }
    const std::string sock = path(t->endpoint);
    if (removeSocket && t->inode != 0 && inodeOf(sock) == t->inode) ::unlink(sock.c_str());
    t->registered = false;
  }

  bool kubeletThere() const {
    struct stat st{};
    return ::stat(path(kKubeletSocket).c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
  }

  // Asks for t to be registered: the watcher sends it on its next pass (within 200 ms), outside
  // the plugin's lock, so that a kubelet that accepts connections but never answers stalls
  // neither start, nor a reload, nor the other tenants; a failed one is retried every retry
  // period (a kubelet that has just created its socket may not accept connections yet).
  void registerWithKubelet(TenantServer* t) {
    t->registered = false;
    t->wanted = true;
  }

  // Sends the wanted registrations together (one deadline for all of them: a hung kubelet costs
  // one deadline per pass, whatever the number of tenants), without the lock; cancelled by stop().
  void sendRegistrations() {
    std::vector<std::unique_ptr<Registering>> batch;
    std::string kubelet;
    {
      std::lock_guard<std::mutex> g(mu);
      if (!kubeletThere()) return;
      kubelet = path(kKubeletSocket);
      for (auto& [name, t] : servers) {
        if (!t.wanted) continue;
        t.wanted = false;
        auto r = std::make_unique<Registering>();
        r->name = name;
        r->endpoint = t.endpoint;
        r->resource = t.shared->resource;
        r->served = t.served;
        r->devices = t.shared->ids.size();
        batch.push_back(std::move(r));
      }
    }
    if (batch.empty()) return;
    auto channel = grpc::CreateChannel("unix://" + kubelet, grpc::InsecureChannelCredentials());
    auto stub = v1beta1::Registration::NewStub(channel);
    grpc::CompletionQueue cq;
    const auto deadline = std::chrono::system_clock::now() + kRegisterDeadline;
    {
      std::lock_guard<std::mutex> g(sendingMu);
      for (auto& r : batch) {
        v1beta1::RegisterRequest req;
        req.set_version("v1beta1");
        req.set_endpoint(r->endpoint);
        req.set_resource_name(r->resource);
        req.mutable_options()->set_pre_start_required(false);
        req.mutable_options()->set_get_preferred_allocation_available(false);
        r->ctx.set_deadline(deadline);
        r->call = stub->AsyncRegister(&r->ctx, req, &cq);
        r->call->Finish(&r->reply, &r->status, r.get());
        sending.push_back(&r->ctx);
      }
      if (stopping) for (grpc::ClientContext* c : sending) c->TryCancel();
    }
    for (size_t done = 0; done < batch.size();) {
      void* tag = nullptr;
      bool ok = false;
      if (!cq.Next(&tag, &ok)) break;
      ++done;
    }
    {
      std::lock_guard<std::mutex> g(sendingMu);
      sending.clear();
    }
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
    std::lock_guard<std::mutex> g(mu);
    for (const auto& r : batch) {
      const auto it = servers.find(r->name);
      if (it == servers.end() || it->second.served != r->served) continue;  // stopped or served anew since
      if (r->status.ok()) {
        it->second.registered = true;
        ++registrations;
        CUSHARE_BLOG(info, "kubernetes: registered {} ({} devices) with the kubelet", r->resource, r->devices);
      } else {
        CUSHARE_BLOG(warn, "kubernetes: the kubelet refused or did not answer the registration of {}: {}; trying again "
                     "in {:.1f} s", r->resource, r->status.error_message().substr(0, 300), timing.retry.count() / 1000.0);
      }
    }
  }

  // Serves anew and registers (the kubelet deleted the socket, or restarted). A failure is tried
  // again with a growing wait (200 ms doubling to 5 s), logged when it first comes or changes
  // (it was logged, and tried, every 200 ms for as long as it lasted).
  void restart(const std::string& name, TenantServer* t, Clock::time_point now) {
    shutdown(t, true);
    std::string err;
    if (!serve(name, t, &err)) {
      t->serveBackoff = std::min<std::chrono::milliseconds>(
          std::max<std::chrono::milliseconds>(2 * t->serveBackoff, std::chrono::milliseconds(200)),
          std::chrono::milliseconds(5000));
      t->serveAfter = now + t->serveBackoff;
      if (err != t->serveError)
        CUSHARE_BLOG(error,
                     "{}; trying again with a growing wait, up to every 5 s (logged again when the error "
                     "changes)",
                     err);
      t->serveError = err;
      return;
    }
    if (!t->serveError.empty())
      CUSHARE_BLOG(info, "kubernetes: serving {} again", t->shared->resource);
    t->serveBackoff = std::chrono::milliseconds(0);
    t->serveError.clear();
    registerWithKubelet(t);
  }

  void applyHealth(const std::map<std::string, bool>& h) {
    if (h != health) {
      for (const std::string& gpu : settings.gpus) {
        const auto was = health.find(gpu);
        const auto now = h.find(gpu);
        const bool wasOk = was != health.end() && was->second, nowOk = now != h.end() && now->second;
        if (wasOk != nowOk || was == health.end())
          spdlog::log(nowOk ? spdlog::level::info : spdlog::level::warn, "kubernetes: the {} devices of {} are {}",
                      settings.devicesPerGpu, gpu, nowOk ? "healthy" : "unhealthy");
      }
    }
    health = h;
    for (auto& [name, t] : servers) {
      std::lock_guard<std::mutex> g(t.shared->mu);
      if (t.shared->health != h) {
        t.shared->health = h;
        ++t.shared->generation;
        t.shared->cv.notify_all();
      }
    }
  }

  void tick(bool kubeletCreated) {
    std::lock_guard<std::mutex> g(mu);
    const auto now = Clock::now();
    if (now - lastHealth >= timing.health) {
      lastHealth = now;
      applyHealth(probe());
    }
    for (auto& [name, t] : servers) {
      // A new kubelet deletes every socket, then creates its own: serve again where the socket is
      // gone, and register with the new kubelet (a second registration of a live endpoint only
      // replaces the first). Judged by what is at the path, not by the deletion events: serving
      // anew removes the old socket itself, and taking that event for the kubelet's served anew
      // again, for ever (a CI run saw alpha re-served every millisecond).
      if (inodeOf(path(t.endpoint)) != t.inode) {
        if (now < t.serveAfter) continue;  // serving anew failed: waiting to try again
        if (t.serveError.empty())
          CUSHARE_BLOG(info, "kubernetes: the socket of {} was removed (a kubelet restart?); serving it again",
                       t.shared->resource);
        restart(name, &t, now);
      } else if (kubeletCreated) {
        CUSHARE_BLOG(info, "kubernetes: kubelet.sock was created (the kubelet restarted); registering {} again",
                     t.shared->resource);
        registerWithKubelet(&t);
      }
    }
    if (now - lastRetry >= timing.retry) {
      lastRetry = now;
      for (auto& [name, t] : servers)
        if (!t.registered && t.server) registerWithKubelet(&t);  // not an endpoint nobody serves
    }
  }

  void watch() {
    char buf[4096] __attribute__((aligned(alignof(inotify_event))));
    for (;;) {
      pollfd p[2] = {{inotifyFd, POLLIN, 0}, {stopFd, POLLIN, 0}};
      const int n = ::poll(p, 2, 200);
      if (n < 0 && errno != EINTR) break;
      if (p[1].revents) break;
      // Deletions only wake the loop (tick looks at what is at each path); a kubelet.sock created
      // means a new kubelet to register with.
      bool kubeletCreated = false;
      if (n > 0 && (p[0].revents & POLLIN)) {
        const ssize_t len = ::read(inotifyFd, buf, sizeof buf);
        for (ssize_t off = 0; len > 0 && off < len;) {
          const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
          const std::string name = e->len ? e->name : "";
          if ((e->mask & (IN_CREATE | IN_MOVED_TO)) && name == kKubeletSocket) kubeletCreated = true;
          off += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
        }
      }
      tick(kubeletCreated);
      sendRegistrations();
    }
  }

  bool add(const PluginTenant& pt, std::string* err) {
    std::string why;
    if (!validResourceName(pt.name, &why)) {
      CUSHARE_BLOG(warn, "kubernetes: tenant {} has no resource: {}", pt.name, why);
      return true;
    }
    TenantServer t;
    t.shared = std::make_shared<Shared>();
    t.shared->tenant = pt;
    t.shared->resource = kResourcePrefix + pt.name;
    t.shared->ids = deviceIds(settings, pt);
    t.shared->gpuDevices = gpuDevicesOf(settings);
    t.shared->nodes = nodesOf(settings);
    t.shared->health = health;
    if (!settings.allocationDir.empty()) {
      if (!makeAllocationDirs(settings, pt.name, t.shared->ids, err)) {
        *err = "kubernetes: allocation_dir: " + *err;
        return false;
      }
      t.shared->allocationDir = settings.allocationDir + "/" + pt.name;
    }
    t.endpoint = endpointFor(settings.dir, pt.name);
    if (!serve(pt.name, &t, err)) return false;
    registerWithKubelet(&t);
    servers.emplace(pt.name, std::move(t));
    return true;
  }
};

DevicePlugin::DevicePlugin(HealthProbe probe, PluginTiming timing) : impl_(std::make_unique<Impl>()) {
  impl_->probe = std::move(probe);
  impl_->timing = timing;
}

DevicePlugin::~DevicePlugin() { stop(); }

bool DevicePlugin::start(const PluginSettings& s, std::string* err) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> g(m.sendingMu);
    m.stopping = false;
  }
  std::lock_guard<std::mutex> g(m.mu);
  m.settings = s;
  makeParents(s.dir);
  ::mkdir(s.dir.c_str(), 0755);
  m.inotifyFd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  m.stopFd = ::eventfd(0, EFD_CLOEXEC);
  if (m.inotifyFd < 0 || m.stopFd < 0 ||
      ::inotify_add_watch(m.inotifyFd, s.dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM) < 0) {
    *err = "kubernetes: cannot watch the device plugin directory " + s.dir + ": " + std::strerror(errno);
    return false;
  }
  m.health = m.probe();
  m.lastHealth = m.lastRetry = Clock::now();
  for (const PluginTenant& t : s.tenants)
    if (!m.add(t, err)) return false;
  if (!m.kubeletThere())
    CUSHARE_BLOG(info, "kubernetes: no kubelet at {}/kubelet.sock yet; registering when it appears", s.dir);
  m.watcher = std::thread([&m] { m.watch(); });
  return true;
}

void DevicePlugin::update(const PluginSettings& s) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  const bool devicesChanged = s.gpus != m.settings.gpus || s.devicesPerGpu != m.settings.devicesPerGpu;
  m.settings.gpus = s.gpus;
  m.settings.devicesPerGpu = s.devicesPerGpu;
  m.settings.gpuCdiDevice = s.gpuCdiDevice;
  m.settings.deviceNodes = s.deviceNodes;
  const std::map<std::string, std::string> gpuDevices = gpuDevicesOf(m.settings);
  const std::map<std::string, std::vector<std::string>> nodes = nodesOf(m.settings);
  std::set<std::string> keep;
  for (const PluginTenant& t : s.tenants) keep.insert(t.name);
  for (auto it = m.servers.begin(); it != m.servers.end();) {
    if (keep.count(it->first)) {
      ++it;
      continue;
    }
    CUSHARE_BLOG(info, "kubernetes: {} is no longer configured; its plugin stops", it->second.shared->resource);
    m.shutdown(&it->second, true);
    it = m.servers.erase(it);
  }
  for (const PluginTenant& t : s.tenants) {
    auto it = m.servers.find(t.name);
    if (it == m.servers.end()) {
      std::string err;
      if (!m.add(t, &err)) CUSHARE_BLOG(error, "{}", err);
      continue;
    }
    std::lock_guard<std::mutex> sg(it->second.shared->mu);
    it->second.shared->tenant = t;
    it->second.shared->gpuDevices = gpuDevices;
    it->second.shared->nodes = nodes;
    // A reload that moves the tenant to other devices moves its resource with it (the kubelet
    // then places no new pod on the devices it left; running pods keep theirs).
    auto ids = deviceIds(m.settings, t);
    if (devicesChanged || ids != it->second.shared->ids) {
      std::string err;
      if (!makeAllocationDirs(m.settings, t.name, ids, &err))
        CUSHARE_BLOG(error, "kubernetes: allocation_dir: {}; {}'s new devices get no allocation mount", err,
                     it->second.shared->resource);
      if (ids != it->second.shared->ids)
        CUSHARE_BLOG(info, "kubernetes: {} now has {} devices", it->second.shared->resource, ids.size());
      it->second.shared->ids = std::move(ids);
      ++it->second.shared->generation;
      it->second.shared->cv.notify_all();
    }
  }
  m.settings.tenants = s.tenants;
}

void DevicePlugin::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> g(m.sendingMu);
    m.stopping = true;
    for (grpc::ClientContext* c : m.sending) c->TryCancel();
  }
  if (m.watcher.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(m.stopFd, &one, sizeof one);
    m.watcher.join();
  }
  std::lock_guard<std::mutex> g(m.mu);
  for (auto& [name, t] : m.servers) m.shutdown(&t, true);
  m.servers.clear();
  if (m.inotifyFd >= 0) ::close(m.inotifyFd);
  if (m.stopFd >= 0) ::close(m.stopFd);
  m.inotifyFd = m.stopFd = -1;
}

uint64_t DevicePlugin::registrations() const { return impl_->registrations.load(); }

}  // namespace cushare::kubernetes

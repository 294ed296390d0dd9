// A fake kubelet for the device plugin tests: written apart from the broker's plugin
// (broker/kubernetes/), it plays the kubelet's side of the v1beta1 protocol as the kubelet's
// documentation describes it. It serves Registration on <dir>/kubelet.sock, checks each request
// (version, resource name, an endpoint that is a socket in the directory), then dials the plugin
// like the kubelet: GetDevicePluginOptions first, then a ListAndWatch stream whose latest list it
// keeps. It restarts as a new kubelet does: every socket in the directory is deleted.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "deviceplugin_v1beta1.grpc.pb.h"
#include "podresources_v1.grpc.pb.h"

namespace cushare::test {

class FakeKubelet {
 public:
  explicit FakeKubelet(std::string dir);
  ~FakeKubelet();

  bool start();
  // Stops serving; with restart semantics (deleteSockets), removes every socket in the directory
  // as a new kubelet does, and forgets every plugin.
  void stop(bool deleteSockets);
  // The next registrations are refused with this message ("" : accepted again).
  void refuseWith(const std::string& message);

  struct Plugin {
    v1beta1::RegisterRequest request;
    int registrations = 0;                 // accepted, in all
    bool optionsAsked = false;             // GetDevicePluginOptions answered
    std::vector<v1beta1::Device> devices;  // the latest ListAndWatch list
    int lists = 0;                         // lists received on the streams
  };
  // Waits up to ms for pred over the resource's state (false on time-out).
  bool waitFor(const std::string& resource, const std::function<bool(const Plugin&)>& pred, int ms = 10000);
  Plugin plugin(const std::string& resource);
  int refused() const;

  // A client of the plugin that registered resource.
  std::unique_ptr<v1beta1::DevicePlugin::Stub> dial(const std::string& resource);

 private:
  class Registration;
  void watchPlugin(const std::string& resource, const std::string& endpoint);

  const std::string dir_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Plugin> plugins_;
  std::string refuse_;
  int refused_ = 0;
  bool stopping_ = false;
  std::unique_ptr<Registration> service_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::shared_ptr<grpc::ClientContext>> streams_;
  std::vector<std::thread> watchers_;
};

// The kubelet's pod resources API (v1 List) on <path>: answers with the pods set last. fail()
// makes List answer UNAVAILABLE until it is cleared.
class FakePodResources {
 public:
  struct Container {
    std::string ns, pod, container, resource;
    std::vector<std::string> ids;
  };
  explicit FakePodResources(std::string path);
  ~FakePodResources();
  bool start();
  void stop();
  void set(const std::vector<Container>& containers);
  void fail(bool on);

 private:
  class Service;
  const std::string path_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace cushare::test

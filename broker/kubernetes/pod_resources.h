// A client of the kubelet's pod resources API (List, v1; docs/kubernetes.md, "Pods, namespaces and
// containers"): which namespace, pod and container hold each device ID of each resource.
//
// Invariants:
// - find() never waits for the kubelet: it answers from the last List. A miss asks the client's
//   thread for a new List (at most one a second), so a container allocated since is named within
//   about a second of its first lookup; otherwise the list is refreshed every period.
// - A List that fails keeps nothing stale: the cache is emptied (a pod may have gone and its
//   device ID been given to another), status() says why, and a change of state is logged once.
// - gRPC lives here and in the device plugin only, never in the shim.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "core/pod_labels.h"

namespace cushare::kubernetes {

class PodResourcesClient {
 public:
  explicit PodResourcesClient(std::string socket, std::chrono::milliseconds period = std::chrono::seconds(10));
  ~PodResourcesClient();  // stops the thread
  PodResourcesClient(const PodResourcesClient&) = delete;
  PodResourcesClient& operator=(const PodResourcesClient&) = delete;

  void start();
  std::optional<broker::PodRef> find(const std::string& resource, const std::string& id);
  broker::PodLabeler::Status status() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cushare::kubernetes

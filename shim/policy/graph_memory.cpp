// Graph memory (memory alloc nodes, from the explicit API or captured cuMemAllocAsync). The
// driver allocates it when an executable graph is first launched or uploaded and keeps it for
// reuse until the executable graph is destroyed (or trimmed), so the shim charges, per device, the
// sum of the graph's alloc nodes at the first launch/upload of each executable graph (before the
// driver allocates: a graph that does not fit is not launched, CUDA_ERROR_OUT_OF_MEMORY) and
// returns it when the executable graph is destroyed. This is an upper bound of what the driver
// may hold for that graph: the limit can never be exceeded through graphs, at the price of
// counting memory the graph frees and reuses internally as held. See docs/memory-accounting.md.
#include <mutex>
#include <unordered_map>
#include <vector>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {

CUresult paceGraphLaunch(CUgraphExec exec, CUstream s, bool ptsz) noexcept;  // launch.cpp
namespace {

struct ExecMemory {
  std::vector<std::pair<int, uint64_t>> perDevice;  // (ordinal, bytes) of its alloc nodes
  bool charged = false;
};

struct GraphMemoryState {
  std::mutex mu;
  std::unordered_map<CUgraphExec, ExecMemory> execs;
};
GraphMemoryState& graphs() {
  static GraphMemoryState* g = new GraphMemoryState;
  return *g;
}

// Deeper nesting than any real graph: a cycle or a driver answering nonsense is refused.
constexpr int kMaxGraphDepth = 64;

// Sums the graph's memory alloc nodes per device, wherever they sit: at the top level, in child
// graphs (CUDA 12.9+ lets memory nodes into child graphs moved in with
// CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) and in conditional bodies, at any depth. Drivers document
// conditional bodies as free of memory nodes (and refuse them); the bodies are walked all the
// same where the driver can describe a conditional node (cuGraphNodeGetParams, CUDA 13.2+), and
// trusted to that rule where it cannot. False if any other graph or node cannot be read.
bool graphAllocations(CUgraph graph, ExecMemory* out, int depth = 0) noexcept {
  RealDriver& d = realDriver();
  if (!d.p_cuGraphGetNodes || !d.p_cuGraphNodeGetType || !d.p_cuGraphMemAllocNodeGetParams) return false;
  if (depth > kMaxGraphDepth) return false;
  size_t n = 0;
  if (d.p_cuGraphGetNodes(graph, nullptr, &n) != CUDA_SUCCESS) return false;
  std::vector<CUgraphNode> nodes(n);
  if (n && d.p_cuGraphGetNodes(graph, nodes.data(), &n) != CUDA_SUCCESS) return false;
  for (CUgraphNode node : nodes) {
    CUgraphNodeType t;
    if (d.p_cuGraphNodeGetType(node, &t) != CUDA_SUCCESS) return false;
    if (t == CU_GRAPH_NODE_TYPE_GRAPH) {
      CUgraph child = nullptr;
      if (!d.p_cuGraphChildGraphNodeGetGraph || d.p_cuGraphChildGraphNodeGetGraph(node, &child) != CUDA_SUCCESS ||
          !graphAllocations(child, out, depth + 1))
        return false;
      continue;
    }
    if (t == CU_GRAPH_NODE_TYPE_CONDITIONAL) {
      CUgraphNodeParams p = {};
      if (!d.p_cuGraphNodeGetParams || d.p_cuGraphNodeGetParams(node, &p) != CUDA_SUCCESS) continue;
      if (p.type != CU_GRAPH_NODE_TYPE_CONDITIONAL || (p.conditional.size && !p.conditional.phGraph_out))
        return false;
      for (unsigned i = 0; i < p.conditional.size; ++i)
        if (!graphAllocations(p.conditional.phGraph_out[i], out, depth + 1)) return false;
      continue;
    }
    if (t != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
    CUDA_MEM_ALLOC_NODE_PARAMS p = {};
    if (d.p_cuGraphMemAllocNodeGetParams(node, &p) != CUDA_SUCCESS) return false;
    const int ordinal = p.poolProps.location.id;
    bool found = false;
    for (auto& [o, bytes] : out->perDevice)
      if (o == ordinal) {
        bytes += p.bytesize;
        found = true;
      }
    if (!found) out->perDevice.emplace_back(ordinal, p.bytesize);
  }
  return true;
}

CUresult remember(CUresult r, CUgraphExec* exec, CUgraph graph) noexcept {
  if (r != CUDA_SUCCESS || !exec || devicesReady() != CUDA_SUCCESS) return r;
  ExecMemory m;
  if (!graphAllocations(graph, &m)) {
    // Cannot tell what the graph will allocate: refuse it rather than let it run uncounted.
    logLine(LogLevel::kError, "cannot read the memory nodes of a graph; refusing to instantiate it");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (m.perDevice.empty()) return r;
  try {
    std::lock_guard<std::mutex> g(graphs().mu);
    graphs().execs[*exec] = std::move(m);
  } catch (...) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return r;
}

// Charges an executable graph's memory before its first launch or upload.
CUresult chargeOnFirstUse(CUgraphExec exec) noexcept {
  std::lock_guard<std::mutex> g(graphs().mu);
  auto it = graphs().execs.find(exec);
  if (it == graphs().execs.end() || it->second.charged) return CUDA_SUCCESS;
  ShimState& s = state();
  auto& per = it->second.perDevice;
  for (size_t i = 0; i < per.size(); ++i) {
    const int ordinal = per[i].first;
    if (ordinal < 0 || ordinal >= s.deviceCount) continue;
    const uint64_t limit = plainLimit(ordinal);  // graph memory is never evictable
    if (!s.ledger->reserve(s.devices[ordinal].ledgerIndex, per[i].second, limit)) {
      for (size_t k = 0; k < i; ++k)
        if (per[k].first >= 0 && per[k].first < s.deviceCount)
          s.ledger->release(s.devices[per[k].first].ledgerIndex, per[k].second);
      logLine(LogLevel::kError, "tenant %s device %d: graph launch needing %llu bytes of graph memory denied: %llu of %llu bytes in use",
              s.config.tenant.c_str(), ordinal, static_cast<unsigned long long>(per[i].second),
              static_cast<unsigned long long>(s.ledger->used(s.devices[ordinal].ledgerIndex)),
              static_cast<unsigned long long>(limit));
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  it->second.charged = true;
  return CUDA_SUCCESS;
}

}  // namespace

CUresult hook_cuGraphInstantiate(CUgraphExec* exec, CUgraph graph, CUgraphNode* err, char* log, size_t n) noexcept {
  return remember(realDriver().p_cuGraphInstantiate(exec, graph, err, log, n), exec, graph);
}
CUresult hook_cuGraphInstantiate_v2(CUgraphExec* exec, CUgraph graph, CUgraphNode* err, char* log, size_t n) noexcept {
  return remember(realDriver().p_cuGraphInstantiate_v2(exec, graph, err, log, n), exec, graph);
}
CUresult hook_cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) noexcept {
  return remember(realDriver().p_cuGraphInstantiateWithFlags(exec, graph, flags), exec, graph);
}
CUresult hook_cuGraphInstantiateWithParams(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* p) noexcept {
  return remember(realDriver().p_cuGraphInstantiateWithParams(exec, graph, p), exec, graph);
}
CUresult hook_cuGraphInstantiateWithParams_ptsz(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* p) noexcept {
  return remember(realDriver().p_cuGraphInstantiateWithParams_ptsz(exec, graph, p), exec, graph);
}

CUresult hook_cuGraphLaunch(CUgraphExec exec, CUstream s) noexcept {
  if (CUresult r = chargeOnFirstUse(exec); r != CUDA_SUCCESS) return r;
  return paceGraphLaunch(exec, s, false);
}
CUresult hook_cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s) noexcept {
  if (CUresult r = chargeOnFirstUse(exec); r != CUDA_SUCCESS) return r;
  return paceGraphLaunch(exec, s, true);
}
CUresult hook_cuGraphUpload(CUgraphExec exec, CUstream s) noexcept {
  if (CUresult r = chargeOnFirstUse(exec); r != CUDA_SUCCESS) return r;
  return realDriver().p_cuGraphUpload(exec, s);
}
CUresult hook_cuGraphUpload_ptsz(CUgraphExec exec, CUstream s) noexcept {
  if (CUresult r = chargeOnFirstUse(exec); r != CUDA_SUCCESS) return r;
  return realDriver().p_cuGraphUpload_ptsz(exec, s);
}

CUresult hook_cuGraphExecDestroy(CUgraphExec exec) noexcept {
  const CUresult r = realDriver().p_cuGraphExecDestroy(exec);
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(graphs().mu);
  auto it = graphs().execs.find(exec);
  if (it == graphs().execs.end()) return r;
  if (it->second.charged) {
    ShimState& s = state();
    for (auto& [ordinal, bytes] : it->second.perDevice)
      if (ordinal >= 0 && ordinal < s.deviceCount) s.ledger->release(s.devices[ordinal].ledgerIndex, bytes);
  }
  graphs().execs.erase(it);
  return r;
}

}  // namespace cushare::shim

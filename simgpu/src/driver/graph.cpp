// Graphs: stream capture (begin/end, fork and join through events, capture info), the explicit
// graph API for kernel, memcpy, memset, host, empty, child-graph (cloned, or moved in with their
// memory nodes) and memory alloc/free nodes,
// instantiation and launch. An executable graph holds its own copies of the nodes, so editing
// or destroying the source graph does not change it; launch runs the nodes in dependency order
// through the same copy/memset/kernel code as direct calls.
//
// Graph memory: an alloc node's address is fixed when the node is made (as on real devices); the
// device memory behind it is counted when the node runs and returned when a free node (or
// cuMemFree/cuMemFreeAsync) frees it.
#include <algorithm>
#include <cstring>

#include "driver.h"

namespace simgpu {

struct GraphAlloc {
  CUdeviceptr ptr = 0;
  size_t size = 0;
  int device = 0;
  std::atomic<bool> live{false};
};

// A conditional node's handle (cuGraphConditionalHandleCreate). Only device code sets a
// condition (cudaGraphSetConditional), which host bodies cannot call: a node's condition is its
// handle's default value when CU_GRAPH_COND_ASSIGN_DEFAULT is set, else 0.
struct Conditional {
  unsigned defaultValue = 0;
  unsigned flags = 0;
  unsigned value() const { return flags & CU_GRAPH_COND_ASSIGN_DEFAULT ? defaultValue : 0; }
};

struct GraphNode {
  Graph* graph = nullptr;
  CUgraphNodeType type = CU_GRAPH_NODE_TYPE_EMPTY;
  std::vector<GraphNode*> deps;
  KernelParams kernel;
  CUDA_MEMCPY3D copy = {};
  CUDA_MEMSET_NODE_PARAMS memset = {};
  CUDA_HOST_NODE_PARAMS host = {};
  GraphAlloc* alloc = nullptr;  // alloc and free nodes
  Graph* child = nullptr;
  // Conditional nodes: the handle, the kind, the bodies and their handles (the driver-owned
  // array phGraph_out points at).
  Conditional* conditional = nullptr;
  CUgraphConditionalNodeType condType = CU_GRAPH_COND_TYPE_IF;
  std::vector<Graph*> bodies;
  std::vector<CUgraph> bodyHandles;
  Event* event = nullptr;
  GraphNode* source = nullptr;  // in an executable graph: the node it was copied from
};

struct Graph {
  std::vector<GraphNode*> nodes;
  std::vector<Stream*> captureStreams;  // streams that joined its capture
};

struct GraphExec {
  std::vector<GraphNode*> order;  // owned copies, topologically sorted
  int device = 0;
};

namespace {
std::mutex& graphMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::atomic<int> gGlobalCaptures{0};
thread_local CUstreamCaptureMode tlsCaptureMode = CU_STREAM_CAPTURE_MODE_GLOBAL;
std::atomic<uint64_t> gGraphMemUsed[kMaxDevices];
std::atomic<uint64_t> gGraphMemHigh[kMaxDevices];

GraphNode* addNode(Graph* g, CUgraphNodeType type, const CUgraphNode* deps, size_t n) {
  auto* node = new GraphNode;
  node->graph = g;
  node->type = type;
  for (size_t i = 0; i < n; ++i) node->deps.push_back(reinterpret_cast<GraphNode*>(deps[i]));
  std::lock_guard l(graphMutex());
  g->nodes.push_back(node);
  handleAdd(node, HandleType::kGraphNode);
  return node;
}

bool validDeps(Graph* g, const CUgraphNode* deps, size_t n) {
  if (n && !deps) return false;
  for (size_t i = 0; i < n; ++i) {
    auto* d = handleGet<GraphNode>(deps[i], HandleType::kGraphNode);
    if (!d || d->graph != g) return false;
  }
  return true;
}

CUresult newGraphAlloc(size_t size, int device, GraphAlloc** out) {
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t mapped;
  void* p = hostMap(size, &mapped);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  auto* ga = new GraphAlloc;
  ga->ptr = reinterpret_cast<CUdeviceptr>(p);
  ga->size = size;
  ga->device = device;
  Allocation a;
  a.base = ga->ptr;
  a.size = size;
  a.device = device;
  a.kind = MemKind::kGraph;
  a.mapping = p;
  a.mappingSize = mapped;
  a.owner = ga;
  a.id = nextId();
  registryAdd(a);
  *out = ga;
  return CUDA_SUCCESS;
}

CUresult graphAllocRun(GraphAlloc* ga) {
  if (ga->live.load()) return CUDA_ERROR_INVALID_VALUE;  // allocated twice without a free
  if (!deviceReserve(ga->device, ga->size)) return CUDA_ERROR_OUT_OF_MEMORY;
  ga->live.store(true);
  const uint64_t u = gGraphMemUsed[ga->device].fetch_add(ga->size) + ga->size;
  uint64_t h = gGraphMemHigh[ga->device].load();
  while (u > h && !gGraphMemHigh[ga->device].compare_exchange_weak(h, u)) {
  }
  return CUDA_SUCCESS;
}

}  // namespace

// Frees graph memory (free node, cuMemFree, cuMemFreeAsync). False if p is not live graph memory.
bool graphMemFree(CUdeviceptr p) {
  Allocation a;
  if (!registryFind(p, &a) || a.kind != MemKind::kGraph || a.base != p) return false;
  auto* ga = static_cast<GraphAlloc*>(a.owner);
  bool expected = true;
  if (!ga->live.compare_exchange_strong(expected, false)) return false;
  deviceRelease(ga->device, ga->size);
  gGraphMemUsed[ga->device].fetch_sub(ga->size);
  return true;
}

uint64_t graphMemUsed(int dev, bool high) { return high ? gGraphMemHigh[dev].load() : gGraphMemUsed[dev].load(); }
void graphMemResetHigh(int dev) { gGraphMemHigh[dev].store(gGraphMemUsed[dev].load()); }

void captureJoin(Graph* g, Stream* s) {
  std::lock_guard l(graphMutex());
  g->captureStreams.push_back(s);
}

bool anyGlobalCaptureActive() { return gGlobalCaptures.load(std::memory_order_relaxed) > 0; }

namespace {
CUresult runNode(GraphNode* n, Stream* s);

CUresult runGraphNodes(const std::vector<GraphNode*>& order, Stream* s) {
  for (GraphNode* n : order) CU_TRY(runNode(n, s));
  return CUDA_SUCCESS;
}

std::vector<GraphNode*> topoSort(const std::vector<GraphNode*>& nodes) {
  std::vector<GraphNode*> out;
  std::unordered_map<GraphNode*, int> state;
  std::function<void(GraphNode*)> visit = [&](GraphNode* n) {
    int& st = state[n];
    if (st) return;
    st = 1;
    for (GraphNode* d : n->deps) visit(d);
    out.push_back(n);
  };
  for (GraphNode* n : nodes) visit(n);
  return out;
}

CUresult runNode(GraphNode* n, Stream* s) {
  switch (n->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL:
      n->kernel.faultNs = managedTouch(n->kernel.device, n->kernel.args);
      return runKernelCopy(n->kernel);
    case CU_GRAPH_NODE_TYPE_MEMCPY:
      return copy3D(n->copy);
    case CU_GRAPH_NODE_TYPE_MEMSET:
      return setMemory(n->memset);
    case CU_GRAPH_NODE_TYPE_HOST:
      n->host.fn(n->host.userData);
      streamPositionAtLeast(deviceNowNs());  // the stream waited for the host function
      return CUDA_SUCCESS;
    case CU_GRAPH_NODE_TYPE_GRAPH:
      return runGraphNodes(topoSort(n->child->nodes), s);
    case CU_GRAPH_NODE_TYPE_CONDITIONAL: {
      // A while body runs at most once: nothing in simgpu can clear its condition.
      const unsigned v = n->conditional->value();
      size_t body = n->bodies.size();
      if (n->condType == CU_GRAPH_COND_TYPE_SWITCH) body = v;
      else if (v) body = 0;
      else if (n->condType == CU_GRAPH_COND_TYPE_IF && n->bodies.size() == 2) body = 1;
      return body < n->bodies.size() ? runGraphNodes(topoSort(n->bodies[body]->nodes), s) : CUDA_SUCCESS;
    }
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC:
      return graphAllocRun(n->alloc);
    case CU_GRAPH_NODE_TYPE_MEM_FREE:
      return graphMemFree(n->alloc->ptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD:
      if (n->event) {
        n->event->recorded = true;
        n->event->timeMs->store(static_cast<double>(streamPositionNs()) / 1e6);
      }
      return CUDA_SUCCESS;
    default:
      return CUDA_SUCCESS;
  }
}
}  // namespace

CUresult captureRecord(Stream* s, Op&& op) {
  Graph* g = s->captureGraph;
  GraphNode* node = nullptr;
  const CUgraphNode* deps = reinterpret_cast<const CUgraphNode*>(s->captureDeps.data());
  const size_t nd = s->captureDeps.size();
  switch (op.type) {
    case Op::kKernel:
      node = addNode(g, CU_GRAPH_NODE_TYPE_KERNEL, deps, nd);
      node->kernel = std::move(*op.kernel);
      delete op.kernel;
      break;
    case Op::kMemcpy:
      node = addNode(g, CU_GRAPH_NODE_TYPE_MEMCPY, deps, nd);
      node->copy = op.copy;
      break;
    case Op::kMemset:
      node = addNode(g, CU_GRAPH_NODE_TYPE_MEMSET, deps, nd);
      node->memset = op.memset;
      break;
    case Op::kHost:
      if (!op.host.fn) {
        s->captureStatus = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
      }
      node = addNode(g, CU_GRAPH_NODE_TYPE_HOST, deps, nd);
      node->host = op.host;
      break;
    default:
      // Stream memory operations and the like have no node form here.
      s->captureStatus = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  s->captureDeps.assign(1, node);
  return CUDA_SUCCESS;
}

// Records a stream-ordered allocation into the capture (cuMemAllocAsync while capturing).
CUresult captureAlloc(Stream* s, size_t size, CUdeviceptr* out) {
  GraphAlloc* ga;
  CU_TRY(newGraphAlloc(size, s->ctx->device, &ga));
  GraphNode* node = addNode(s->captureGraph, CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                            reinterpret_cast<const CUgraphNode*>(s->captureDeps.data()), s->captureDeps.size());
  node->alloc = ga;
  s->captureDeps.assign(1, node);
  *out = ga->ptr;
  return CUDA_SUCCESS;
}

CUresult captureFree(Stream* s, CUdeviceptr p) {
  Allocation a;
  if (!registryFind(p, &a) || a.kind != MemKind::kGraph || a.base != p) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(s->captureGraph, CU_GRAPH_NODE_TYPE_MEM_FREE,
                            reinterpret_cast<const CUgraphNode*>(s->captureDeps.data()), s->captureDeps.size());
  node->alloc = static_cast<GraphAlloc*>(a.owner);
  s->captureDeps.assign(1, node);
  return CUDA_SUCCESS;
}

}  // namespace simgpu

using namespace simgpu;

// ---- capture ----
namespace {
CUresult beginCapture(CUstream h, CUstreamCaptureMode mode) {
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s == s->ctx->legacy) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  auto* g = new Graph;
  handleAdd(g, HandleType::kGraph);
  s->captureGraph = g;
  s->captureStatus = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  s->captureMode = mode;
  s->captureOrigin = s;
  s->captureId = nextId();
  s->captureDeps.clear();
  g->captureStreams.push_back(s);
  if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) gGlobalCaptures.fetch_add(1);
  return CUDA_SUCCESS;
}

CUresult captureInfo(CUstream h, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                     const CUgraphNode** deps, size_t* nd) {
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  *status = s->captureStatus;
  const bool active = s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  Stream* origin = s->captureOrigin ? s->captureOrigin : s;
  if (id && active) *id = origin->captureId;
  if (graph) *graph = active ? reinterpret_cast<CUgraph>(s->captureGraph) : nullptr;
  if (deps) *deps = active ? reinterpret_cast<const CUgraphNode*>(s->captureDeps.data()) : nullptr;
  if (nd) *nd = active ? s->captureDeps.size() : 0;
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream h, CUstreamCaptureMode mode) {
  API_ENTER(h, mode);
  return beginCapture(h, mode);
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuStreamBeginCapture(CUstream h) __asm__("cuStreamBeginCapture");
CUresult simgpu_cuStreamBeginCapture(CUstream h) {
  API_ENTER(h);
  return beginCapture(h, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

CU_EXPORT CUresult cuStreamEndCapture(CUstream h, CUgraph* out) {
  API_ENTER(h, out);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  if (s->captureOrigin != s) return CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
  const bool invalid = s->captureStatus == CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  Graph* g = s->captureGraph;
  if (s->captureMode == CU_STREAM_CAPTURE_MODE_GLOBAL) gGlobalCaptures.fetch_sub(1);
  for (Stream* j : g->captureStreams) {
    j->captureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    j->captureGraph = nullptr;
    j->captureOrigin = nullptr;
    j->captureDeps.clear();
  }
  s->captureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
  s->captureGraph = nullptr;
  s->captureOrigin = nullptr;
  s->captureDeps.clear();
  g->captureStreams.clear();
  if (invalid) {
    *out = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *out = reinterpret_cast<CUgraph>(g);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus* status) {
  API_ENTER(h, status);
  return captureInfo(h, status, nullptr, nullptr, nullptr, nullptr);
}

extern "C" SIMGPU_EXPORT CUresult simgpu_cuStreamGetCaptureInfo(CUstream h, CUstreamCaptureStatus* st, cuuint64_t* id) __asm__("cuStreamGetCaptureInfo");
CUresult simgpu_cuStreamGetCaptureInfo(CUstream h, CUstreamCaptureStatus* st, cuuint64_t* id) {
  API_ENTER(h, st, id);
  return captureInfo(h, st, id, nullptr, nullptr, nullptr);
}
CU_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream h, CUstreamCaptureStatus* st, cuuint64_t* id, CUgraph* g,
                                             const CUgraphNode** deps, size_t* nd) {
  API_ENTER(h, st, id, g, deps, nd);
  return captureInfo(h, st, id, g, deps, nd);
}
CU_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream h, CUstreamCaptureStatus* st, cuuint64_t* id, CUgraph* g,
                                             const CUgraphNode** deps, const CUgraphEdgeData** edges, size_t* nd) {
  API_ENTER(h, st, id, g, deps, edges, nd);
  if (edges) *edges = nullptr;  // all edges are default edges
  return captureInfo(h, st, id, g, deps, nd);
}

namespace {
CUresult updateCaptureDeps(CUstream h, CUgraphNode* deps, size_t n, unsigned flags) {
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_ACTIVE) return CUDA_ERROR_ILLEGAL_STATE;
  if (!validDeps(s->captureGraph, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  if (flags == CU_STREAM_SET_CAPTURE_DEPENDENCIES) s->captureDeps.clear();
  else if (flags != CU_STREAM_ADD_CAPTURE_DEPENDENCIES) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < n; ++i) s->captureDeps.push_back(reinterpret_cast<GraphNode*>(deps[i]));
  return CUDA_SUCCESS;
}
}  // namespace

extern "C" SIMGPU_EXPORT CUresult simgpu_cuStreamUpdateCaptureDependencies(CUstream h, CUgraphNode* d, size_t n, unsigned f) __asm__("cuStreamUpdateCaptureDependencies");
CUresult simgpu_cuStreamUpdateCaptureDependencies(CUstream h, CUgraphNode* d, size_t n, unsigned f) {
  API_ENTER(h, d, n, f);
  return updateCaptureDeps(h, d, n, f);
}
CU_EXPORT CUresult cuStreamUpdateCaptureDependencies_v2(CUstream h, CUgraphNode* d, const CUgraphEdgeData* e, size_t n,
                                                        unsigned f) {
  API_ENTER(h, d, e, n, f);
  return updateCaptureDeps(h, d, n, f);
}

CU_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  API_ENTER(mode);
  if (!mode) return CUDA_ERROR_INVALID_VALUE;
  std::swap(*mode, tlsCaptureMode);
  return CUDA_SUCCESS;
}

// ---- child graphs ----
namespace {
// Caller holds graphMutex(). A deep copy of g: nodes with their dependencies remapped, child
// graphs copied too. Registered as handles when the application may read it (a child graph node's
// embedded graph), private otherwise (an executable graph's snapshot).
Graph* copyGraph(const Graph* g, bool handles) {
  auto* c = new Graph;
  std::unordered_map<GraphNode*, GraphNode*> copies;
  for (GraphNode* n : g->nodes) {
    auto* x = new GraphNode(*n);
    x->graph = c;
    x->source = n;
    copies[n] = x;
    c->nodes.push_back(x);
  }
  for (GraphNode* x : c->nodes) {
    for (GraphNode*& d : x->deps) d = copies[d];
    if (x->child) x->child = copyGraph(x->child, handles);
    for (size_t b = 0; b < x->bodies.size(); ++b) {
      x->bodies[b] = copyGraph(x->bodies[b], handles);
      x->bodyHandles[b] = reinterpret_cast<CUgraph>(x->bodies[b]);
    }
    if (handles) handleAdd(x, HandleType::kGraphNode);
  }
  if (handles) handleAdd(c, HandleType::kGraph);
  return c;
}

// Frees a private copy made by copyGraph(g, false) (an executable graph's), with its own copies.
void deleteCopy(Graph* g) {
  for (GraphNode* n : g->nodes) {
    if (n->child) deleteCopy(n->child);
    for (Graph* b : n->bodies) deleteCopy(b);
    delete n;
  }
  delete g;
}

// Caller holds graphMutex(). Whether g holds memory alloc or free nodes at any depth (child
// graphs and conditional bodies included).
bool hasMemoryNodes(const Graph* g) {
  for (const GraphNode* n : g->nodes) {
    if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || n->type == CU_GRAPH_NODE_TYPE_MEM_FREE ||
        (n->child && hasMemoryNodes(n->child)))
      return true;
    for (const Graph* b : n->bodies)
      if (hasMemoryNodes(b)) return true;
  }
  return false;
}

// Caller holds graphMutex(). Whether a conditional body anywhere in g holds memory nodes, which
// real drivers refuse ("allowed node types are kernel, empty, child graph, memset, memcpy and
// conditional nodes, recursively").
bool memoryNodesInConditionals(const Graph* g) {
  for (const GraphNode* n : g->nodes) {
    if (n->child && memoryNodesInConditionals(n->child)) return true;
    for (const Graph* b : n->bodies)
      if (hasMemoryNodes(b)) return true;
  }
  return false;
}
}  // namespace

// ---- explicit graphs ----
CU_EXPORT CUresult cuGraphCreate(CUgraph* out, unsigned int flags) {
  API_ENTER(out, flags);
  if (!out || flags) return CUDA_ERROR_INVALID_VALUE;
  auto* g = new Graph;
  handleAdd(g, HandleType::kGraph);
  *out = reinterpret_cast<CUgraph>(g);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphDestroy(CUgraph h) {
  API_ENTER(h);
  Graph* g = handleGet<Graph>(h, HandleType::kGraph);
  if (!g) return CUDA_ERROR_INVALID_VALUE;
  handleRemove(g);
  for (GraphNode* n : g->nodes) handleRemove(n);
  // Nodes stay allocated: executable graphs keep copies, but an alloc's GraphAlloc is shared.
  return CUDA_SUCCESS;
}

namespace {
Graph* graphOf(CUgraph h) { return handleGet<Graph>(h, HandleType::kGraph); }

CUresult addKernel(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, CUfunction func, CUkernel kern,
                   const unsigned grid[3], const unsigned block[3], unsigned shmem, void** params, void** extra) {
  Graph* g = graphOf(h);
  if (!g || !out || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  Function* f = handleGet<Function>(func ? static_cast<void*>(func) : static_cast<void*>(kern), HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_VALUE;
  KernelParams k;
  k.fn = f;
  for (int i = 0; i < 3; ++i) {
    k.grid[i] = grid[i];
    k.block[i] = block[i];
  }
  k.sharedMem = shmem;
  k.forGraph = true;
  Context* c = currentContext();
  k.device = c ? c->device : 0;
  CU_TRY(copyKernelArgs(&k, params, extra));
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_KERNEL, deps, n);
  node->kernel = std::move(k);
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}

CUresult addMemcpy(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, const CUDA_MEMCPY3D* p) {
  Graph* g = graphOf(h);
  if (!g || !out || !p || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_MEMCPY, deps, n);
  node->copy = *p;
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}

CUresult addMemset(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, const CUDA_MEMSET_NODE_PARAMS* p) {
  Graph* g = graphOf(h);
  if (!g || !out || !p || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  if (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_MEMSET, deps, n);
  node->memset = *p;
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}

CUresult addHost(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, CUhostFn fn, void* data) {
  Graph* g = graphOf(h);
  if (!g || !out || !fn || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_HOST, deps, n);
  node->host.fn = fn;
  node->host.userData = data;
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}

CUresult addSimple(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, CUgraphNodeType type,
                   GraphNode** made = nullptr) {
  Graph* g = graphOf(h);
  if (!g || !out || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(g, type, deps, n);
  *out = reinterpret_cast<CUgraphNode>(node);
  if (made) *made = node;
  return CUDA_SUCCESS;
}

CUresult addMemAlloc(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, CUDA_MEM_ALLOC_NODE_PARAMS* p) {
  Graph* g = graphOf(h);
  if (!g || !out || !p || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  if (p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE || !validDevice(p->poolProps.location.id))
    return CUDA_ERROR_INVALID_VALUE;
  GraphAlloc* ga;
  CU_TRY(newGraphAlloc(p->bytesize, p->poolProps.location.id, &ga));
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC, deps, n);
  node->alloc = ga;
  p->dptr = ga->ptr;
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}

CUresult addMemFree(CUgraphNode* out, CUgraph h, const CUgraphNode* deps, size_t n, CUdeviceptr p) {
  Graph* g = graphOf(h);
  if (!g || !out || !validDeps(g, deps, n)) return CUDA_ERROR_INVALID_VALUE;
  Allocation a;
  if (!registryFind(p, &a) || a.kind != MemKind::kGraph || a.base != p) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node = addNode(g, CU_GRAPH_NODE_TYPE_MEM_FREE, deps, n);
  node->alloc = static_cast<GraphAlloc*>(a.owner);
  *out = reinterpret_cast<CUgraphNode>(node);
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                           const CUDA_KERNEL_NODE_PARAMS* p) {
  API_ENTER(out, g, deps, n, p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  const unsigned grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ}, block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
  return addKernel(out, g, deps, n, p->func, p->kern, grid, block, p->sharedMemBytes, p->kernelParams, p->extra);
}

CU_EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                        const CUDA_MEMCPY3D* p, CUcontext ctx) {
  API_ENTER(out, g, deps, n, p, ctx);
  return addMemcpy(out, g, deps, n, p);
}

CU_EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                        const CUDA_MEMSET_NODE_PARAMS* p, CUcontext ctx) {
  API_ENTER(out, g, deps, n, p, ctx);
  return addMemset(out, g, deps, n, p);
}

CU_EXPORT CUresult cuGraphAddHostNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                      const CUDA_HOST_NODE_PARAMS* p) {
  API_ENTER(out, g, deps, n, p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return addHost(out, g, deps, n, p->fn, p->userData);
}

CU_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n) {
  API_ENTER(out, g, deps, n);
  return addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_EMPTY);
}

namespace {
// A child graph node. CLONE (the default, and cuGraphAddChildGraphNode) embeds a copy, which may
// not hold memory nodes; MOVE (CUDA 12.9+) embeds the graph itself, memory nodes included, and
// the application's handle to it is no longer its own.
CUresult addChild(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUgraph child,
                  CUgraphChildGraphNodeOwnership ownership) {
  Graph* c = graphOf(child);
  if (!c || c == graphOf(g)) return CUDA_ERROR_INVALID_VALUE;
  if (ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE && ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)
    return CUDA_ERROR_INVALID_VALUE;
  {
    std::lock_guard l(graphMutex());
    if (ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE && hasMemoryNodes(c)) return CUDA_ERROR_NOT_SUPPORTED;
  }
  GraphNode* node;
  CU_TRY(addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_GRAPH, &node));
  std::lock_guard l(graphMutex());
  node->child = ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE ? c : copyGraph(c, true);
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUgraph child) {
  API_ENTER(out, g, deps, n, child);
  return addChild(out, g, deps, n, child, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE);
}

CU_EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode h, CUgraph* out) {
  API_ENTER(h, out);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || !out || n->type != CU_GRAPH_NODE_TYPE_GRAPH) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUgraph>(n->child);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUevent e) {
  API_ENTER(out, g, deps, n, e);
  Event* ev = handleGet<Event>(e, HandleType::kEvent);
  if (!ev) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node;
  CU_TRY(addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_EVENT_RECORD, &node));
  node->event = ev;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUevent e) {
  API_ENTER(out, g, deps, n, e);
  if (!handleIs(e, HandleType::kEvent)) return CUDA_ERROR_INVALID_VALUE;
  return addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_WAIT_EVENT);
}

CU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                          CUDA_MEM_ALLOC_NODE_PARAMS* p) {
  API_ENTER(out, g, deps, n, p);
  return addMemAlloc(out, g, deps, n, p);
}

CU_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUdeviceptr p) {
  API_ENTER(out, g, deps, n, p);
  return addMemFree(out, g, deps, n, p);
}

namespace {
CUresult addConditional(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUDA_CONDITIONAL_NODE_PARAMS* p) {
  auto* c = handleGet<Conditional>(reinterpret_cast<void*>(p->handle), HandleType::kConditional);
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  const bool sizeOk = p->type == CU_GRAPH_COND_TYPE_WHILE    ? p->size == 1
                      : p->type == CU_GRAPH_COND_TYPE_IF     ? p->size == 1 || p->size == 2
                      : p->type == CU_GRAPH_COND_TYPE_SWITCH ? p->size > 0
                                                             : false;
  if (!sizeOk) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* node;
  CU_TRY(addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_CONDITIONAL, &node));
  node->conditional = c;
  node->condType = p->type;
  for (unsigned i = 0; i < p->size; ++i) {
    auto* body = new Graph;
    handleAdd(body, HandleType::kGraph);
    node->bodies.push_back(body);
    node->bodyHandles.push_back(reinterpret_cast<CUgraph>(body));
  }
  p->phGraph_out = node->bodyHandles.data();
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuGraphConditionalHandleCreate(CUgraphConditionalHandle* out, CUgraph g, CUcontext ctx,
                                                  unsigned int defaultLaunchValue, unsigned int flags) {
  API_ENTER(out, g, ctx, defaultLaunchValue, flags);
  if (!out || !graphOf(g) || (flags & ~static_cast<unsigned>(CU_GRAPH_COND_ASSIGN_DEFAULT)))
    return CUDA_ERROR_INVALID_VALUE;
  auto* c = new Conditional;
  c->defaultValue = defaultLaunchValue;
  c->flags = flags;
  handleAdd(c, HandleType::kConditional);
  *out = reinterpret_cast<CUgraphConditionalHandle>(c);
  return CUDA_SUCCESS;
}

// Describes child-graph and conditional nodes (as drivers since CUDA 13.2 do for conditionals;
// newer than the toolkit's cuda.h, so exported by hand, not through the generated table); other
// kinds have their own getters.
CU_EXPORT CUresult cuGraphNodeGetParams(CUgraphNode h, CUgraphNodeParams* p) {
  API_ENTER(h, p);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || !p) return CUDA_ERROR_INVALID_VALUE;
  *p = {};
  p->type = n->type;
  switch (n->type) {
    case CU_GRAPH_NODE_TYPE_GRAPH:
      p->graph.graph = reinterpret_cast<CUgraph>(n->child);
      return CUDA_SUCCESS;
    case CU_GRAPH_NODE_TYPE_CONDITIONAL:
      p->conditional.handle = reinterpret_cast<CUgraphConditionalHandle>(n->conditional);
      p->conditional.type = n->condType;
      p->conditional.size = static_cast<unsigned>(n->bodies.size());
      p->conditional.phGraph_out = n->bodyHandles.data();
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_NOT_SUPPORTED;
  }
}

CU_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, const CUgraphEdgeData* edges,
                                     size_t n, CUgraphNodeParams* p) {
  API_ENTER(out, g, deps, edges, n, p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  switch (p->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL: {
      const auto& k = p->kernel;
      const unsigned grid[3] = {k.gridDimX, k.gridDimY, k.gridDimZ}, block[3] = {k.blockDimX, k.blockDimY, k.blockDimZ};
      return addKernel(out, g, deps, n, k.func, k.kern, grid, block, k.sharedMemBytes, k.kernelParams, k.extra);
    }
    case CU_GRAPH_NODE_TYPE_MEMCPY:
      return addMemcpy(out, g, deps, n, &p->memcpy.copyParams);
    case CU_GRAPH_NODE_TYPE_MEMSET: {
      CUDA_MEMSET_NODE_PARAMS m = {};
      m.dst = p->memset.dst;
      m.pitch = p->memset.pitch;
      m.value = p->memset.value;
      m.elementSize = p->memset.elementSize;
      m.width = p->memset.width;
      m.height = p->memset.height;
      return addMemset(out, g, deps, n, &m);
    }
    case CU_GRAPH_NODE_TYPE_HOST:
      return addHost(out, g, deps, n, p->host.fn, p->host.userData);
    case CU_GRAPH_NODE_TYPE_EMPTY:
      return addSimple(out, g, deps, n, CU_GRAPH_NODE_TYPE_EMPTY);
    case CU_GRAPH_NODE_TYPE_GRAPH:
      return addChild(out, g, deps, n, p->graph.graph, p->graph.ownership);
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: {
      CUDA_MEM_ALLOC_NODE_PARAMS a = {};
      a.poolProps = p->alloc.poolProps;
      a.bytesize = p->alloc.bytesize;
      CU_TRY(addMemAlloc(out, g, deps, n, &a));
      p->alloc.dptr = a.dptr;
      return CUDA_SUCCESS;
    }
    case CU_GRAPH_NODE_TYPE_MEM_FREE:
      return addMemFree(out, g, deps, n, p->free.dptr);
    case CU_GRAPH_NODE_TYPE_CONDITIONAL:
      return addConditional(out, g, deps, n, &p->conditional);
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD:
      return cuGraphAddEventRecordNode(out, g, deps, n, p->eventRecord.event);
    case CU_GRAPH_NODE_TYPE_WAIT_EVENT:
      return cuGraphAddEventWaitNode(out, g, deps, n, p->eventWait.event);
    default:
      return CUDA_ERROR_NOT_SUPPORTED;
  }
}

extern "C" SIMGPU_EXPORT CUresult simgpu_cuGraphAddNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n,
                                                      CUgraphNodeParams* p) __asm__("cuGraphAddNode");
CUresult simgpu_cuGraphAddNode(CUgraphNode* out, CUgraph g, const CUgraphNode* deps, size_t n, CUgraphNodeParams* p) {
  return cuGraphAddNode_v2(out, g, deps, nullptr, n, p);
}

CU_EXPORT CUresult cuGraphGetNodes(CUgraph h, CUgraphNode* nodes, size_t* n) {
  API_ENTER(h, nodes, n);
  Graph* g = graphOf(h);
  if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  if (nodes)
    for (size_t i = 0; i < std::min(*n, g->nodes.size()); ++i) nodes[i] = reinterpret_cast<CUgraphNode>(g->nodes[i]);
  *n = g->nodes.size();
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphGetRootNodes(CUgraph h, CUgraphNode* nodes, size_t* n) {
  API_ENTER(h, nodes, n);
  Graph* g = graphOf(h);
  if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  size_t k = 0;
  for (GraphNode* node : g->nodes)
    if (node->deps.empty()) {
      if (nodes && k < *n) nodes[k] = reinterpret_cast<CUgraphNode>(node);
      ++k;
    }
  *n = k;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphNodeGetType(CUgraphNode h, CUgraphNodeType* type) {
  API_ENTER(h, type);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || !type) return CUDA_ERROR_INVALID_VALUE;
  *type = n->type;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode h, CUDA_MEM_ALLOC_NODE_PARAMS* p) {
  API_ENTER(h, p);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || !p || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
  *p = {};
  p->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->poolProps.location.id = n->alloc->device;
  p->bytesize = n->alloc->size;
  p->dptr = n->alloc->ptr;
  return CUDA_SUCCESS;
}

namespace {
CUresult addDependencies(CUgraph h, const CUgraphNode* from, const CUgraphNode* to, size_t n) {
  Graph* g = graphOf(h);
  if (!g || (n && (!from || !to)) || !validDeps(g, from, n) || !validDeps(g, to, n)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  for (size_t i = 0; i < n; ++i) reinterpret_cast<GraphNode*>(to[i])->deps.push_back(reinterpret_cast<GraphNode*>(from[i]));
  return CUDA_SUCCESS;
}
}  // namespace

extern "C" SIMGPU_EXPORT CUresult simgpu_cuGraphAddDependencies(CUgraph g, const CUgraphNode* f, const CUgraphNode* t, size_t n) __asm__("cuGraphAddDependencies");
CUresult simgpu_cuGraphAddDependencies(CUgraph g, const CUgraphNode* f, const CUgraphNode* t, size_t n) {
  API_ENTER(g, f, t, n);
  return addDependencies(g, f, t, n);
}
CU_EXPORT CUresult cuGraphAddDependencies_v2(CUgraph g, const CUgraphNode* f, const CUgraphNode* t,
                                             const CUgraphEdgeData* e, size_t n) {
  API_ENTER(g, f, t, e, n);
  return addDependencies(g, f, t, n);
}

namespace {
CUresult getEdges(CUgraph h, CUgraphNode* from, CUgraphNode* to, CUgraphEdgeData* data, size_t* n) {
  Graph* g = graphOf(h);
  if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  size_t k = 0;
  for (GraphNode* node : g->nodes)
    for (GraphNode* d : node->deps) {
      if (from && to && k < *n) {
        from[k] = reinterpret_cast<CUgraphNode>(d);
        to[k] = reinterpret_cast<CUgraphNode>(node);
        if (data) data[k] = {};
      }
      ++k;
    }
  if (from && to && k > *n) {
    *n = k;
    return CUDA_ERROR_INVALID_VALUE;
  }
  *n = k;
  return CUDA_SUCCESS;
}
}  // namespace

extern "C" SIMGPU_EXPORT CUresult simgpu_cuGraphGetEdges(CUgraph g, CUgraphNode* f, CUgraphNode* t, size_t* n) __asm__("cuGraphGetEdges");
CUresult simgpu_cuGraphGetEdges(CUgraph g, CUgraphNode* f, CUgraphNode* t, size_t* n) {
  API_ENTER(g, f, t, n);
  return getEdges(g, f, t, nullptr, n);
}
CU_EXPORT CUresult cuGraphGetEdges_v2(CUgraph g, CUgraphNode* f, CUgraphNode* t, CUgraphEdgeData* e, size_t* n) {
  API_ENTER(g, f, t, e, n);
  return getEdges(g, f, t, e, n);
}

// ---- instantiate and launch ----
namespace {
CUresult instantiate(CUgraphExec* out, CUgraph h) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  Graph* g = graphOf(h);
  if (!g) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  if (memoryNodesInConditionals(g)) return CUDA_ERROR_NOT_SUPPORTED;
  auto* e = new GraphExec;
  Context* c = currentContext();
  e->device = c ? c->device : 0;
  std::unordered_map<GraphNode*, GraphNode*> copies;
  for (GraphNode* n : topoSort(g->nodes)) {
    auto* copy = new GraphNode(*n);
    copy->source = n;
    if (copy->child) copy->child = copyGraph(copy->child, false);  // later edits do not reach it
    for (size_t b = 0; b < copy->bodies.size(); ++b) {
      copy->bodies[b] = copyGraph(copy->bodies[b], false);
      copy->bodyHandles[b] = reinterpret_cast<CUgraph>(copy->bodies[b]);
    }
    for (GraphNode*& d : copy->deps) d = copies[d];
    copies[n] = copy;
    e->order.push_back(copy);
  }
  handleAdd(e, HandleType::kGraphExec);
  *out = reinterpret_cast<CUgraphExec>(e);
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec* out, CUgraph g, unsigned long long flags) {
  API_ENTER(out, g, flags);
  return instantiate(out, g);
}

CU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec* out, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS* p) {
  API_ENTER(out, g, p);
  CUresult r = instantiate(out, g);
  if (p) {
    p->result_out = r == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    p->hErrNode_out = nullptr;
  }
  return r;
}

extern "C" SIMGPU_EXPORT CUresult simgpu_cuGraphInstantiate(CUgraphExec* out, CUgraph g, CUgraphNode* err, char* log,
                                                          size_t n) __asm__("cuGraphInstantiate");
CUresult simgpu_cuGraphInstantiate(CUgraphExec* out, CUgraph g, CUgraphNode* err, char* log, size_t n) {
  API_ENTER(out, g, err, log, n);
  if (err) *err = nullptr;
  if (log && n) log[0] = 0;
  return instantiate(out, g);
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuGraphInstantiate_v2(CUgraphExec* out, CUgraph g, CUgraphNode* err, char* log,
                                                             size_t n) __asm__("cuGraphInstantiate_v2");
CUresult simgpu_cuGraphInstantiate_v2(CUgraphExec* out, CUgraph g, CUgraphNode* err, char* log, size_t n) {
  return simgpu_cuGraphInstantiate(out, g, err, log, n);
}

CU_EXPORT CUresult cuGraphLaunch(CUgraphExec h, CUstream hs) {
  API_ENTER(h, hs);
  GraphExec* e = handleGet<GraphExec>(h, HandleType::kGraphExec);
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  Op op;
  op.run = [e, s] { return runGraphNodes(e->order, s); };
  return submit(s, std::move(op));
}

CU_EXPORT CUresult cuGraphUpload(CUgraphExec h, CUstream hs) {
  API_ENTER(h, hs);
  if (!handleIs(h, HandleType::kGraphExec)) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  return resolveStream(hs, &s);
}

namespace {
// Builds the kernel part of a node from CUDA_KERNEL_NODE_PARAMS (arguments copied).
CUresult kernelFromParams(const CUDA_KERNEL_NODE_PARAMS* p, KernelParams* k) {
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  Function* f = handleGet<Function>(p->func ? static_cast<void*>(p->func) : static_cast<void*>(p->kern),
                                    HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_VALUE;
  k->fn = f;
  const unsigned grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ}, block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
  for (int i = 0; i < 3; ++i) {
    k->grid[i] = grid[i];
    k->block[i] = block[i];
  }
  k->sharedMem = p->sharedMemBytes;
  Context* c = currentContext();
  k->device = c ? c->device : 0;
  k->forGraph = true;
  return copyKernelArgs(k, p->kernelParams, p->extra);
}

GraphNode* execNodeFor(GraphExec* e, CUgraphNode source) {
  for (GraphNode* n : e->order)
    if (n->source == reinterpret_cast<GraphNode*>(source)) return n;
  return nullptr;
}
}  // namespace

CU_EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode h, const CUDA_KERNEL_NODE_PARAMS* p) {
  API_ENTER(h, p);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || n->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
  KernelParams k;
  CU_TRY(kernelFromParams(p, &k));
  std::lock_guard l(graphMutex());
  n->kernel = std::move(k);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode h, CUDA_KERNEL_NODE_PARAMS* p) {
  API_ENTER(h, p);
  GraphNode* n = handleGet<GraphNode>(h, HandleType::kGraphNode);
  if (!n || !p || n->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard l(graphMutex());
  *p = {};
  p->func = n->kernel.fn->asFunction();
  p->gridDimX = n->kernel.grid[0];
  p->gridDimY = n->kernel.grid[1];
  p->gridDimZ = n->kernel.grid[2];
  p->blockDimX = n->kernel.block[0];
  p->blockDimY = n->kernel.block[1];
  p->blockDimZ = n->kernel.block[2];
  p->sharedMemBytes = n->kernel.sharedMem;
  n->kernel.argPtrs.clear();
  for (auto& a : n->kernel.args) n->kernel.argPtrs.push_back(a.data());
  p->kernelParams = n->kernel.extraBuffer ? nullptr : n->kernel.argPtrs.data();
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec h, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS* p) {
  API_ENTER(h, node, p);
  GraphExec* e = handleGet<GraphExec>(h, HandleType::kGraphExec);
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  GraphNode* n = execNodeFor(e, node);
  if (!n || n->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
  KernelParams k;
  CU_TRY(kernelFromParams(p, &k));
  n->kernel = std::move(k);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphExecMemcpyNodeSetParams(CUgraphExec h, CUgraphNode node, const CUDA_MEMCPY3D* p, CUcontext c) {
  API_ENTER(h, node, p, c);
  GraphExec* e = handleGet<GraphExec>(h, HandleType::kGraphExec);
  GraphNode* n = e ? execNodeFor(e, node) : nullptr;
  if (!n || !p || n->type != CU_GRAPH_NODE_TYPE_MEMCPY) return CUDA_ERROR_INVALID_VALUE;
  n->copy = *p;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphExecMemsetNodeSetParams(CUgraphExec h, CUgraphNode node, const CUDA_MEMSET_NODE_PARAMS* p,
                                                  CUcontext c) {
  API_ENTER(h, node, p, c);
  GraphExec* e = handleGet<GraphExec>(h, HandleType::kGraphExec);
  GraphNode* n = e ? execNodeFor(e, node) : nullptr;
  if (!n || !p || n->type != CU_GRAPH_NODE_TYPE_MEMSET) return CUDA_ERROR_INVALID_VALUE;
  n->memset = *p;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec h) {
  API_ENTER(h);
  GraphExec* e = handleGet<GraphExec>(h, HandleType::kGraphExec);
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  handleRemove(e);
  for (GraphNode* n : e->order) {
    if (n->child) deleteCopy(n->child);  // the executable graph's own copies
    for (Graph* b : n->bodies) deleteCopy(b);
    delete n;
  }
  delete e;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void* value) {
  API_ENTER(dev, attr, value);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  auto* v = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT:
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *v = graphMemUsed(dev, false); return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH:
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *v = graphMemUsed(dev, true); return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CU_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void* value) {
  API_ENTER(dev, attr, value);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (!value || *static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (attr != CU_GRAPH_MEM_ATTR_USED_MEM_HIGH && attr != CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH) return CUDA_ERROR_INVALID_VALUE;
  graphMemResetHigh(dev);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
  API_ENTER(dev);
  return validDevice(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

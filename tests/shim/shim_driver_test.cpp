// libcushare.so end to end on simgpu, through the driver API: run with LD_PRELOAD of the shim
// (see CMakeLists.txt for the environment of each registration). The program links libcuda
// directly (road 1: exported symbols) and also reaches the driver through cuGetProcAddress
// (road 2) and dlsym on a libcuda handle (road 3); every road must be limited.
#include <cuda.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <link.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_used.h"
#include "simgpu/nvml.h"

namespace {

constexpr size_t kMiB = 1ull << 20;
constexpr size_t kLimit = 256 * kMiB;

#define CU_ASSERT(x) ASSERT_EQ(CUDA_SUCCESS, (x)) << #x

class Ctx : public ::testing::Test {
 protected:
  void SetUp() override {
    CU_ASSERT(cuInit(0));
    CUdevice dev;
    CU_ASSERT(cuDeviceGet(&dev, 0));
    CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx_, dev));
    CU_ASSERT(cuCtxSetCurrent(ctx_));
  }
  void TearDown() override { cuDevicePrimaryCtxRelease(0); }
  static size_t freeMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return f;
  }
  static size_t totalMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return t;
  }
  CUcontext ctx_ = nullptr;
};

using Limited = Ctx;
using Unlimited = Ctx;

TEST_F(Limited, TenantViewIsTheLimit) {
  EXPECT_EQ(kLimit, totalMem());
  EXPECT_EQ(kLimit, freeMem());
  size_t total = 0;
  CU_ASSERT(cuDeviceTotalMem(&total, 0));
  EXPECT_EQ(kLimit, total);
}

TEST_F(Limited, PlainAllocationsStopAtTheLimit) {
  CUdeviceptr a = 0, b = 0;
  CU_ASSERT(cuMemAlloc(&a, 200 * kMiB));
  EXPECT_EQ(56 * kMiB, freeMem());
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&b, 57 * kMiB));
  CU_ASSERT(cuMemAlloc(&b, 56 * kMiB));  // exactly to the limit
  EXPECT_EQ(0u, freeMem());
  CUdeviceptr c = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&c, 1));
  CU_ASSERT(cuMemFree(a));
  CU_ASSERT(cuMemFree(b));
  EXPECT_EQ(kLimit, freeMem());
}

TEST_F(Limited, PitchedAndManagedAreCounted) {
  CUdeviceptr p = 0, m = 0;
  size_t pitch = 0;
  CU_ASSERT(cuMemAllocPitch(&p, &pitch, 1000, 1024, 4));
  EXPECT_EQ(kLimit - pitch * 1024, freeMem());
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocManaged(&m, kLimit, CU_MEM_ATTACH_GLOBAL));
  CU_ASSERT(cuMemAllocManaged(&m, 64 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(kLimit - pitch * 1024 - 64 * kMiB, freeMem());
  CU_ASSERT(cuMemFree(p));
  CU_ASSERT(cuMemFree(m));
  EXPECT_EQ(kLimit, freeMem());
}

TEST_F(Limited, StreamOrderedAllocationsAreCounted) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr a = 0, b = 0;
  CU_ASSERT(cuMemAllocAsync(&a, 128 * kMiB, s));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocAsync(&b, 129 * kMiB, s));
  CUmemoryPool pool;
  CU_ASSERT(cuDeviceGetDefaultMemPool(&pool, 0));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocFromPoolAsync(&b, 129 * kMiB, pool, s));
  CU_ASSERT(cuMemAllocFromPoolAsync(&b, 128 * kMiB, pool, s));
  CU_ASSERT(cuMemFreeAsync(a, s));
  CU_ASSERT(cuMemFreeAsync(b, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(kLimit, freeMem());
  CU_ASSERT(cuStreamDestroy(s));
}

// A pool's cached memory counts: freeing into a pool that keeps its blocks does not make room for
// allocations elsewhere, reusing the cached block is allowed, and a trim gives the room back.
TEST_F(Limited, PoolCachedMemoryIsCounted) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool;
  CU_ASSERT(cuDeviceGetDefaultMemPool(&pool, 0));
  cuuint64_t keepAll = UINT64_MAX;
  CU_ASSERT(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keepAll));
  CUdeviceptr a = 0, b = 0;
  CU_ASSERT(cuMemAllocAsync(&a, 200 * kMiB, s));
  CU_ASSERT(cuMemFreeAsync(a, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(56 * kMiB, freeMem()) << "the pool still holds its 200 MiB";
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&b, 100 * kMiB));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocAsync(&b, 150 * kMiB, s)) << "the pool would grow past the limit";
  CU_ASSERT(cuMemAllocAsync(&b, 200 * kMiB, s));  // the cached block is reused: no growth
  CU_ASSERT(cuMemFreeAsync(b, s));
  CU_ASSERT(cuStreamSynchronize(s));
  CU_ASSERT(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(kLimit, freeMem());
  cuuint64_t zero = 0;
  CU_ASSERT(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &zero));
  CU_ASSERT(cuStreamDestroy(s));
}

TEST_F(Limited, VirtualMemoryIsCountedUntilReleasedAndUnmapped) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  const size_t piece = 2 * kMiB;
  std::vector<CUmemGenericAllocationHandle> handles;
  CUmemGenericAllocationHandle h;
  CUresult r;
  while ((r = cuMemCreate(&h, piece, &prop, 0)) == CUDA_SUCCESS) handles.push_back(h);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, r);
  EXPECT_EQ(kLimit / piece, handles.size());
  // Map one, release its handle: still counted while mapped.
  CUdeviceptr va;
  CU_ASSERT(cuMemAddressReserve(&va, piece, 0, 0, 0));
  CU_ASSERT(cuMemMap(va, piece, 0, handles[0], 0));
  for (auto x : handles) CU_ASSERT(cuMemRelease(x));
  EXPECT_EQ(kLimit - piece, freeMem());
  CU_ASSERT(cuMemUnmap(va, piece));
  EXPECT_EQ(kLimit, freeMem());
  CU_ASSERT(cuMemAddressFree(va, piece));
}

TEST_F(Limited, ArraysAreCounted) {
  CUDA_ARRAY3D_DESCRIPTOR d = {};
  d.Width = 4096;
  d.Height = 4096;
  d.Depth = 8;
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 1;  // 512 MiB: over the limit
  CUarray a;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuArray3DCreate(&a, &d));
  d.Depth = 2;  // 128 MiB
  CU_ASSERT(cuArray3DCreate(&a, &d));
  EXPECT_EQ(kLimit - 128 * kMiB, freeMem());
  CU_ASSERT(cuArrayDestroy(a));
  EXPECT_EQ(kLimit, freeMem());
}

// Graph memory is charged at an executable graph's first launch, before the driver allocates.
TEST_F(Limited, GraphMemoryNodesAreCounted) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  auto build = [&](size_t bytes, CUgraphExec* exec) {
    CUgraph g;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphCreate(&g, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS p = {};
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    CUgraphNode alloc, fr;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphAddMemAllocNode(&alloc, g, nullptr, 0, &p));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphAddMemFreeNode(&fr, g, &alloc, 1, p.dptr));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphInstantiateWithFlags(exec, g, 0));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphDestroy(g));
  };
  CUgraphExec big, small;
  build(300 * kMiB, &big);
  build(100 * kMiB, &small);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuGraphLaunch(big, s)) << "a graph that cannot fit is not launched";
  CU_ASSERT(cuGraphLaunch(small, s));
  CU_ASSERT(cuGraphLaunch(small, s));  // charged once per executable graph, not per launch
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(kLimit - 100 * kMiB, freeMem());
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, 200 * kMiB));
  CU_ASSERT(cuGraphExecDestroy(small));
  CU_ASSERT(cuGraphExecDestroy(big));
  EXPECT_EQ(kLimit, freeMem());

  // Captured stream-ordered allocations become graph memory: charged at launch, not at capture.
  CU_ASSERT(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUdeviceptr q = 0;
  CU_ASSERT(cuMemAllocAsync(&q, 200 * kMiB, s));
  EXPECT_EQ(kLimit, freeMem()) << "nothing is allocated while capturing";
  CU_ASSERT(cuMemFreeAsync(q, s));
  CUgraph g;
  CU_ASSERT(cuStreamEndCapture(s, &g));
  CUgraphExec e;
  CU_ASSERT(cuGraphInstantiateWithFlags(&e, g, 0));
  CU_ASSERT(cuMemAlloc(&p, 100 * kMiB));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuGraphLaunch(e, s)) << "200 MiB of graph memory on top of 100 MiB";
  CU_ASSERT(cuMemFree(p));
  CU_ASSERT(cuGraphLaunch(e, s));
  CU_ASSERT(cuStreamSynchronize(s));
  CU_ASSERT(cuGraphExecDestroy(e));
  CU_ASSERT(cuGraphDestroy(g));
  EXPECT_EQ(kLimit, freeMem());
  CU_ASSERT(cuStreamDestroy(s));
}

TEST_F(Limited, EveryRoadIsLimited) {
  // Road 2: cuGetProcAddress at the version cudart uses.
  void* fn = nullptr;
  CUdriverProcAddressQueryResult st;
  CU_ASSERT(cuGetProcAddress("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  ASSERT_NE(nullptr, fn);
  auto viaProc = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(fn);
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, viaProc(&p, kLimit + 1));
  // The per-thread variant asked for is the per-thread variant wrapped.
  void* pt = nullptr;
  CU_ASSERT(cuGetProcAddress("cuMemAllocAsync", &pt, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz"), pt);
  // Road 3: dlsym on a handle to libcuda, as cuBLASLt does.
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, h);
  auto viaDlsym = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(dlsym(h, "cuMemAlloc_v2"));
  ASSERT_NE(nullptr, viaDlsym);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, viaDlsym(&p, kLimit + 1));
  // An unhooked symbol still comes from the driver itself.
  EXPECT_NE(nullptr, dlsym(h, "cuStreamCreate"));
  EXPECT_EQ(nullptr, dlsym(h, "cuNoSuchFunction"));
  dlclose(h);
}

TEST_F(Limited, NvmlReportsTheTenantView) {
  ASSERT_EQ(NVML_SUCCESS, nvmlInit_v2());
  nvmlDevice_t d;
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetHandleByIndex_v2(0, &d));
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAlloc(&p, 100 * kMiB));
  nvmlMemory_t m;
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetMemoryInfo(d, &m));
  EXPECT_EQ(kLimit, m.total);
  EXPECT_EQ(kLimit - 100 * kMiB, m.free);
  EXPECT_EQ(100 * kMiB, m.used);
  CU_ASSERT(cuMemFree(p));
  nvmlShutdown();
}

TEST_F(Unlimited, NothingChangesWithoutALimit) {
  EXPECT_EQ(4096 * kMiB, totalMem());
  CUdeviceptr a = 0;
  CU_ASSERT(cuMemAlloc(&a, 3 * 1024 * kMiB));
  CU_ASSERT(cuMemFree(a));
}

// ---- attacks on the allocation paths (CUSHARE_MEMORY_LIMIT=512MiB, two 4 GiB devices) ----
// Each is judged by the simulated device's own count (deviceUsed), not by the tenant's ledger.
constexpr size_t kAttackLimit = 512 * kMiB;

class Attack : public Ctx {
 protected:
  void SetUp() override {
    Ctx::SetUp();
    base0_ = cushare::test::deviceUsed(0);
    base1_ = cushare::test::deviceUsed(1);
    ASSERT_NE(UINT64_MAX, base0_);
  }
  // What this test holds on device dev, by the device's own count.
  static uint64_t held(int dev, uint64_t base) { return cushare::test::deviceUsed(dev) - base; }
  uint64_t base0_ = 0, base1_ = 0;
};

// Arrays the tenant ledger would count at width x height x depth x element size, while the
// device stores each in tiles: thousands of them must still stop at the limit on the device.
TEST_F(Attack, NarrowArraysStopAtTheLimitOnTheDevice) {
  struct Shape {
    size_t w, h, d;
    unsigned flags;
    unsigned levels;  // 0: a plain array
    bool twoD;        // made with cuArrayCreate
  };
  const Shape shapes[] = {
      {1, 1, 2048, 0, 0, false},                     // 1 x 1 x N: one GOB per slice
      {16384, 1, 1, 0, 0, false},                    // W x 1 x 1: one row padded to a GOB's 8 rows
      {1, 1, 2048, CUDA_ARRAY3D_LAYERED, 0, false},  // 1 x 1, N layers
      {1, 0, 2048, CUDA_ARRAY3D_LAYERED, 0, false},  // 1D layered
      {1, 1, 2048, 0, 12, false},                    // mipmapped 1 x 1 x N
      {16384, 1, 0, 0, 0, true},                     // 2D W x 1
  };
  for (const Shape& sh : shapes) {
    CUDA_ARRAY3D_DESCRIPTOR d = {};
    d.Width = sh.w;
    d.Height = sh.h;
    d.Depth = sh.d;
    d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
    d.NumChannels = 1;
    d.Flags = sh.flags;
    std::vector<CUarray> arrays;
    std::vector<CUmipmappedArray> mips;
    CUresult r = CUDA_SUCCESS;
    for (int i = 0; i < 40000 && r == CUDA_SUCCESS; ++i) {
      if (sh.levels) {
        CUmipmappedArray m;
        if ((r = cuMipmappedArrayCreate(&m, &d, sh.levels)) == CUDA_SUCCESS) mips.push_back(m);
      } else if (sh.twoD) {
        CUDA_ARRAY_DESCRIPTOR d2 = {};
        d2.Width = d.Width;
        d2.Height = d.Height;
        d2.Format = d.Format;
        d2.NumChannels = d.NumChannels;
        CUarray a;
        if ((r = cuArrayCreate(&a, &d2)) == CUDA_SUCCESS) arrays.push_back(a);
      } else {
        CUarray a;
        if ((r = cuArray3DCreate(&a, &d)) == CUDA_SUCCESS) arrays.push_back(a);
      }
    }
    SCOPED_TRACE("shape " + std::to_string(sh.w) + " x " + std::to_string(sh.h) + " x " + std::to_string(sh.d) +
                 " flags " + std::to_string(sh.flags) + " levels " + std::to_string(sh.levels));
    EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, r);
    EXPECT_LE(held(0, base0_), kAttackLimit) << arrays.size() + mips.size() << " arrays";
    EXPECT_GE(held(0, base0_), kAttackLimit / 2) << "the limit, not something else, stopped the loop";
    for (CUarray a : arrays) CU_ASSERT(cuArrayDestroy(a));
    for (CUmipmappedArray m : mips) CU_ASSERT(cuMipmappedArrayDestroy(m));
    EXPECT_EQ(0u, held(0, base0_));
    EXPECT_EQ(kAttackLimit, freeMem());
  }
}

// Tiny allocations take the driver's minimum each: the tenant is charged what the device holds.
TEST_F(Attack, TinyAllocationsAreChargedWhatTheDeviceHolds) {
  std::vector<CUdeviceptr> ptrs(4096);
  for (CUdeviceptr& p : ptrs) CU_ASSERT(cuMemAlloc(&p, 1));
  EXPECT_EQ(held(0, base0_), kAttackLimit - freeMem());
  EXPECT_GE(held(0, base0_), ptrs.size() * 256);
  for (CUdeviceptr p : ptrs) CU_ASSERT(cuMemFree(p));
  EXPECT_EQ(0u, held(0, base0_));
  EXPECT_EQ(kAttackLimit, freeMem());
}

// A memory node two child graphs deep, moved in with CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE: the
// graph is charged at its first launch like a top-level node, and one past the limit never runs.
TEST_F(Attack, MemoryNodesInNestedChildGraphsAreCounted) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  auto nested = [&](size_t bytes, CUgraphExec* exec) {
    CUgraph inner, middle, outer;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphCreate(&inner, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS p = {};
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    CUgraphNode alloc, node;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphAddMemAllocNode(&alloc, inner, nullptr, 0, &p));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphCreate(&middle, 0));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphCreate(&outer, 0));
    CUgraphNodeParams child = {};
    child.type = CU_GRAPH_NODE_TYPE_GRAPH;
    child.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
    child.graph.graph = inner;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphAddNode(&node, middle, nullptr, nullptr, 0, &child));
    child.graph.graph = middle;
    ASSERT_EQ(CUDA_SUCCESS, cuGraphAddNode(&node, outer, nullptr, nullptr, 0, &child));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphInstantiateWithFlags(exec, outer, 0));
    ASSERT_EQ(CUDA_SUCCESS, cuGraphDestroy(outer));
  };
  CUgraphExec big, small;
  nested(3 * 1024 * kMiB, &big);
  nested(100 * kMiB, &small);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuGraphLaunch(big, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(0u, held(0, base0_)) << "the over-limit graph allocated on the device";
  CU_ASSERT(cuGraphLaunch(small, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(100 * kMiB, held(0, base0_));
  EXPECT_EQ(kAttackLimit - 100 * kMiB, freeMem());
  CU_ASSERT(cuGraphExecDestroy(big));
  CU_ASSERT(cuGraphExecDestroy(small));
  EXPECT_EQ(kAttackLimit, freeMem());
  CU_ASSERT(cuStreamDestroy(s));
}

// Conditional nodes (drivers refuse memory nodes in their bodies): the shim walks their bodies
// (cuGraphNodeGetParams) without refusing such graphs, charges the graph's own memory nodes, and a
// body holding a memory node one child graph down is refused by the driver with nothing allocated.
TEST_F(Attack, GraphsWithConditionalNodesAreWalked) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUgraph g;
  CU_ASSERT(cuGraphCreate(&g, 0));
  CUDA_MEM_ALLOC_NODE_PARAMS p = {};
  p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.poolProps.location.id = 0;
  p.bytesize = 100 * kMiB;
  CUgraphNode alloc, cond, node;
  CU_ASSERT(cuGraphAddMemAllocNode(&alloc, g, nullptr, 0, &p));
  CUgraphConditionalHandle handle;
  CU_ASSERT(cuGraphConditionalHandleCreate(&handle, g, ctx_, 1, CU_GRAPH_COND_ASSIGN_DEFAULT));
  CUgraphNodeParams c = {};
  c.type = CU_GRAPH_NODE_TYPE_CONDITIONAL;
  c.conditional.handle = handle;
  c.conditional.type = CU_GRAPH_COND_TYPE_IF;
  c.conditional.size = 1;
  CU_ASSERT(cuGraphAddNode(&cond, g, &alloc, nullptr, 1, &c));
  CU_ASSERT(cuGraphAddEmptyNode(&node, c.conditional.phGraph_out[0], nullptr, 0));
  CUgraphExec exec;
  CU_ASSERT(cuGraphInstantiateWithFlags(&exec, g, 0));
  CU_ASSERT(cuGraphLaunch(exec, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(100 * kMiB, held(0, base0_));
  EXPECT_EQ(kAttackLimit - 100 * kMiB, freeMem());
  CU_ASSERT(cuGraphExecDestroy(exec));
  CU_ASSERT(cuMemFree(p.dptr));
  EXPECT_EQ(kAttackLimit, freeMem());
  // 3 GiB moved into the body, one child graph down.
  CUgraph child;
  CU_ASSERT(cuGraphCreate(&child, 0));
  p.bytesize = 3 * 1024 * kMiB;
  CU_ASSERT(cuGraphAddMemAllocNode(&alloc, child, nullptr, 0, &p));
  CUgraphNodeParams moved = {};
  moved.type = CU_GRAPH_NODE_TYPE_GRAPH;
  moved.graph.graph = child;
  moved.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
  CU_ASSERT(cuGraphAddNode(&node, c.conditional.phGraph_out[0], nullptr, nullptr, 0, &moved));
  EXPECT_NE(CUDA_SUCCESS, cuGraphInstantiateWithFlags(&exec, g, 0));
  EXPECT_EQ(0u, held(0, base0_));
  CU_ASSERT(cuGraphDestroy(g));
  CU_ASSERT(cuStreamDestroy(s));
}

// A pool made on device 1 while device 0's context is current: what it reserves is device 1's.
TEST_F(Attack, PoolMemoryIsChargedToThePoolsDevice) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUmemPoolProps props = {};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 1;
  CUmemoryPool pool;
  CU_ASSERT(cuMemPoolCreate(&pool, &props));
  CUdeviceptr a = 0, b = 0;
  CU_ASSERT(cuMemAllocFromPoolAsync(&a, 400 * kMiB, pool, s));
  EXPECT_EQ(400 * kMiB, held(1, base1_));
  EXPECT_EQ(kAttackLimit, freeMem()) << "device 0's share was charged for device 1's pool";
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocFromPoolAsync(&b, 200 * kMiB, pool, s));
  // Device 1's own context sees the pool's 400 MiB.
  CUcontext c1;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&c1, 1));
  CU_ASSERT(cuCtxSetCurrent(c1));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&b, 200 * kMiB));
  EXPECT_LE(held(1, base1_), kAttackLimit);
  CU_ASSERT(cuCtxSetCurrent(ctx_));
  CU_ASSERT(cuMemFreeAsync(a, s));
  CU_ASSERT(cuStreamSynchronize(s));
  CU_ASSERT(cuMemPoolDestroy(pool));
  EXPECT_EQ(0u, held(1, base1_));
  CU_ASSERT(cuDevicePrimaryCtxRelease(1));
  CU_ASSERT(cuStreamDestroy(s));
}

// Resetting or destroying a context frees its memory: the tenant's charges for it go too, so the
// room is usable again, and the device agrees. Through the current and the first ABIs.
TEST_F(Attack, ContextResetAndDestroyReturnTheCharges) {
  using Reset = CUresult (*)(CUdevice);
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, h);
  const Reset resets[] = {[](CUdevice d) { return cuDevicePrimaryCtxReset(d); },
                          reinterpret_cast<Reset>(dlsym(h, "cuDevicePrimaryCtxReset"))};
  for (Reset reset : resets) {
    ASSERT_NE(nullptr, reset);
    CUdeviceptr p = 0;
    CU_ASSERT(cuMemAlloc(&p, 400 * kMiB));
    CU_ASSERT(reset(0));
    EXPECT_EQ(0u, held(0, base0_));
    CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx_, 0));
    CU_ASSERT(cuCtxSetCurrent(ctx_));
    EXPECT_EQ(kAttackLimit, freeMem());
    CU_ASSERT(cuMemAlloc(&p, 400 * kMiB));  // the room is back
    CU_ASSERT(cuMemFree(p));
  }
  // A created context destroyed with memory in it.
  CUcontext c;
  CU_ASSERT(cuCtxCreate(&c, nullptr, 0, 0));
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAlloc(&p, 400 * kMiB));
  CU_ASSERT(cuCtxDestroy(c));
  EXPECT_EQ(0u, held(0, base0_));
  CU_ASSERT(cuCtxSetCurrent(ctx_));
  EXPECT_EQ(kAttackLimit, freeMem());
  dlclose(h);
}

// The first ABIs (32-bit pointers and sizes) a driver still exports: refused on every road, and
// nothing reaches the device through them.
TEST_F(Attack, LegacyFirstAbisAreRefusedOnEveryRoad) {
  using Alloc1 = CUresult (*)(unsigned int*, unsigned int);
  using Pitch1 = CUresult (*)(unsigned int*, unsigned int*, unsigned int, unsigned int, unsigned int);
  using Array1 = CUresult (*)(CUarray*, const void*);
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, h);
  std::vector<void*> allocs = {dlsym(RTLD_NEXT, "cuMemAlloc"), dlsym(RTLD_DEFAULT, "cuMemAlloc"), dlsym(h, "cuMemAlloc")};
  void* fn = nullptr;
  CUdriverProcAddressQueryResult st;
  CU_ASSERT(cuGetProcAddress("cuMemAlloc", &fn, 2000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  allocs.push_back(fn);
  for (void* a : allocs) {
    ASSERT_NE(nullptr, a);
    for (int i = 0; i < 10; ++i) {
      unsigned int p = 0;
      EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, reinterpret_cast<Alloc1>(a)(&p, 400 * kMiB));
    }
  }
  unsigned int p = 0, pitch = 0;
  CU_ASSERT(cuGetProcAddress("cuMemAllocPitch", &fn, 2000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, reinterpret_cast<Pitch1>(fn)(&p, &pitch, 1 << 20, 400, 4));
  const unsigned desc[6] = {1 << 14, 1 << 14, 0, CU_AD_FORMAT_FLOAT, 4, 0};  // 4 GiB of texels
  CUarray arr;
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, reinterpret_cast<Array1>(dlsym(h, "cuArrayCreate"))(&arr, desc));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, reinterpret_cast<Array1>(dlsym(h, "cuArray3DCreate"))(&arr, desc));
  unsigned int f = 0, t = 0;
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, reinterpret_cast<CUresult (*)(unsigned*, unsigned*)>(dlsym(h, "cuMemGetInfo"))(&f, &t));
  EXPECT_EQ(0u, held(0, base0_));
  dlclose(h);
}

// ---- the driver loaded a second time (issue 16) ----
// A preloaded library is not loaded into a new link-map namespace: a tenant that dlmopen()s the
// driver there would hold a copy the shim never sees. Each attack allocates all it can, in 64 MiB
// steps, through dlsym on the handle dlmopen gave it (the real driver-API sequence); what it holds
// on the device must stay within the limit.
void fillThroughHandle(void* h, std::vector<CUdeviceptr>* got) {
  using Init = CUresult (*)(unsigned);
  using Retain = CUresult (*)(CUcontext*, CUdevice);
  using SetCurrent = CUresult (*)(CUcontext);
  using Alloc = CUresult (*)(CUdeviceptr*, size_t);
  auto init = reinterpret_cast<Init>(dlsym(h, "cuInit"));
  auto retain = reinterpret_cast<Retain>(dlsym(h, "cuDevicePrimaryCtxRetain"));
  auto setCurrent = reinterpret_cast<SetCurrent>(dlsym(h, "cuCtxSetCurrent"));
  auto alloc = reinterpret_cast<Alloc>(dlsym(h, "cuMemAlloc_v2"));
  ASSERT_TRUE(init && retain && setCurrent && alloc) << dlerror();
  CU_ASSERT(init(0));
  CUcontext ctx = nullptr;
  CU_ASSERT(retain(&ctx, 0));
  CU_ASSERT(setCurrent(ctx));
  CUdeviceptr p = 0;
  while (got->size() < 80 && alloc(&p, 64 * kMiB) == CUDA_SUCCESS) got->push_back(p);
}

// Frees through the same handle (the copy that allocated, whichever it is) and unloads it.
void releaseThroughHandle(void* h, const std::vector<CUdeviceptr>& got) {
  auto memFree = reinterpret_cast<CUresult (*)(CUdeviceptr)>(dlsym(h, "cuMemFree_v2"));
  ASSERT_NE(nullptr, memFree);
  for (CUdeviceptr p : got) EXPECT_EQ(CUDA_SUCCESS, memFree(p));
  auto release = reinterpret_cast<CUresult (*)(CUdevice)>(dlsym(h, "cuDevicePrimaryCtxRelease_v2"));
  if (release) release(0);
  dlclose(h);
}

class SecondDriver : public Attack {
 protected:
  void loadAndFill(const std::string& file) {
    void* h = dlmopen(LM_ID_NEWLM, file.c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(nullptr, h) << dlerror();
    std::vector<CUdeviceptr> got;
    fillThroughHandle(h, &got);
    EXPECT_LE(held(0, base0_), kAttackLimit)
        << file << ": a second copy of the driver escaped the limit";
    EXPECT_EQ(kAttackLimit / (64 * kMiB), got.size())
        << file << ": the limit, not the device, stopped it";
    releaseThroughHandle(h, got);
    EXPECT_EQ(0u, held(0, base0_));
  }
};

TEST_F(SecondDriver, DlmopenBySonameStaysWithinTheLimit) { loadAndFill("libcuda.so.1"); }

TEST_F(SecondDriver, DlmopenByAbsolutePathStaysWithinTheLimit) {
  loadAndFill(CUSHARE_SIMGPU_CUDA_PATH);
}

// The driver copied under another name, and reached through a symbolic link of a third name: found
// by what it exports, not by its name.
TEST_F(SecondDriver, DlmopenOfARenamedCopyStaysWithinTheLimit) {
  char dir[] = "/tmp/cushare-renamed-XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(dir));
  const std::string copy = std::string(dir) + "/libnotcuda.so",
                    link = std::string(dir) + "/libother.so";
  ASSERT_EQ(0, std::system(("cp " + std::string(CUSHARE_SIMGPU_CUDA_PATH) + " " + copy).c_str()));
  ASSERT_EQ(0, symlink(copy.c_str(), link.c_str()));
  loadAndFill(copy);
  loadAndFill(link);
  unlink(link.c_str());
  unlink(copy.c_str());
  rmdir(dir);
}

// The same copy reached with a plain dlopen under its other name (base namespace): dlsym on its
// handle answers with the process's own driver too.
TEST_F(SecondDriver, DlopenOfARenamedCopyStaysWithinTheLimit) {
  char dir[] = "/tmp/cushare-renamed-XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(dir));
  const std::string copy = std::string(dir) + "/libnotcuda.so";
  ASSERT_EQ(0, std::system(("cp " + std::string(CUSHARE_SIMGPU_CUDA_PATH) + " " + copy).c_str()));
  void* h = dlopen(copy.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(nullptr, h) << dlerror();
  std::vector<CUdeviceptr> got;
  fillThroughHandle(h, &got);
  EXPECT_LE(held(0, base0_), kAttackLimit);
  releaseThroughHandle(h, got);
  unlink(copy.c_str());
  rmdir(dir);
}

// Any other library loaded into another namespace could bring the driver there, as a dependency
// or later with that namespace's own dlopen (a libcudart does on first use), where its calls bind
// to that copy: refused before anything is mapped (no constructor runs), with a dlerror that says
// why, whether named by path or by a bare name found along this program's RUNPATH (as glibc
// searches for the caller), a driver user or not.
int loadedObjects() {
  int n = 0;
  dl_iterate_phdr([](dl_phdr_info*, size_t, void* count) { return ++*static_cast<int*>(count), 0; },
                  &n);
  return n;
}

TEST_F(SecondDriver, DlmopenOfAnyOtherLibraryIsRefused) {
  const int before = loadedObjects();
  for (const char* file : {CUSHARE_DRIVER_USER_PATH, "libcushare_driver_user.so", "libm.so.6",
                           "libcushare_rtld_next_a.so"}) {
    void* h = dlmopen(LM_ID_NEWLM, file, RTLD_NOW | RTLD_LOCAL);
    const char* err = dlerror();
    EXPECT_EQ(nullptr, h) << file;
    ASSERT_NE(nullptr, err) << file;
    EXPECT_NE(nullptr, std::strstr(err, "loading into another link-map namespace is refused"))
        << err;
    if (auto alloc = h ? reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(
                             dlsym(h, "cushare_test_driver_user_alloc"))
                       : nullptr) {
      CUdeviceptr p = 0;
      for (int i = 0; i < 80 && alloc(&p, 64 * kMiB) == CUDA_SUCCESS; ++i) {
      }
    }
    EXPECT_LE(held(0, base0_), kAttackLimit) << file;
  }
  EXPECT_EQ(before, loadedObjects()) << "something was mapped into another namespace";
}

// The loader's own functions reached through the loader (dlvsym skips the shim's unversioned
// exports; a handle to the C library finds the C library's): the shim's answer instead, so
// glibc's dlsym cannot hand out the driver's cuMemAlloc_v2 and glibc's dlmopen cannot load into
// another namespace.
TEST_F(SecondDriver, TheLoadersOwnFunctionsAreTheShims) {
  using Dlsym = void* (*)(void*, const char*);
  using Dlmopen = void* (*)(Lmid_t, const char*, int);
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_TRUE(libc && cuda);
  for (void* fn :
       {dlvsym(RTLD_DEFAULT, "dlmopen", "GLIBC_2.34"), dlvsym(libc, "dlmopen", "GLIBC_2.34"),
        dlsym(libc, "dlmopen"), dlsym(RTLD_NEXT, "dlmopen")}) {
    ASSERT_NE(nullptr, fn);
    EXPECT_EQ(reinterpret_cast<void*>(&dlmopen), fn);
    EXPECT_EQ(nullptr, reinterpret_cast<Dlmopen>(fn)(LM_ID_NEWLM, "libm.so.6", RTLD_NOW))
        << "glibc's dlmopen";
  }
  EXPECT_EQ(reinterpret_cast<void*>(&dlvsym), dlvsym(RTLD_DEFAULT, "dlvsym", "GLIBC_2.34"));
  EXPECT_EQ(reinterpret_cast<void*>(&dlvsym), dlsym(libc, "dlvsym"));
  for (void* fn : {dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34"),
                   dlvsym(libc, "dlsym", "GLIBC_2.2.5"), dlsym(libc, "dlsym")}) {
    ASSERT_NE(nullptr, fn);
    EXPECT_EQ(reinterpret_cast<void*>(&dlsym), fn);
    auto alloc = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(
        reinterpret_cast<Dlsym>(fn)(cuda, "cuMemAlloc_v2"));
    ASSERT_NE(nullptr, alloc);
    std::vector<CUdeviceptr> got;
    CUdeviceptr p = 0;
    while (got.size() < 80 && alloc(&p, 64 * kMiB) == CUDA_SUCCESS) got.push_back(p);
    EXPECT_LE(held(0, base0_), kAttackLimit)
        << "glibc's dlsym handed out the driver's cuMemAlloc_v2";
    for (CUdeviceptr q : got) CU_ASSERT(cuMemFree(q));
  }
  dlclose(cuda);
  dlclose(libc);
}

// NVML loaded a second time shows the tenant's view, like the process's own.
TEST_F(SecondDriver, DlmopenOfNvmlShowsTheTenantView) {
  void* h = dlmopen(LM_ID_NEWLM, "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(nullptr, h) << dlerror();
  auto init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(h, "nvmlInit_v2"));
  auto byIndex = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(
      dlsym(h, "nvmlDeviceGetHandleByIndex_v2"));
  auto info = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*)>(
      dlsym(h, "nvmlDeviceGetMemoryInfo"));
  ASSERT_TRUE(init && byIndex && info) << dlerror();
  ASSERT_EQ(NVML_SUCCESS, init());
  nvmlDevice_t d;
  ASSERT_EQ(NVML_SUCCESS, byIndex(0, &d));
  nvmlMemory_t m;
  ASSERT_EQ(NVML_SUCCESS, info(d, &m));
  EXPECT_EQ(kAttackLimit, m.total);
  dlclose(h);
}

// dlvsym on the process's own handle to the driver answers the shim's wrapper, as dlsym does.
// glibc's dlvsym finds versioned definitions only, so this runs on a build of simgpu's driver
// whose exports carry a version (shim_driver_test_versioned_driver).
using VersionedDriver = Attack;

TEST_F(VersionedDriver, DlvsymOnTheDriverHandleStaysWithinTheLimit) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, h);
  auto alloc = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(
      dlvsym(h, "cuMemAlloc_v2", "CUSHARE_TEST_1"));
  ASSERT_NE(nullptr, alloc) << dlerror() << " (not the versioned driver?)";
  std::vector<CUdeviceptr> got;
  CUdeviceptr p = 0;
  while (got.size() < 80 && alloc(&p, 64 * kMiB) == CUDA_SUCCESS) got.push_back(p);
  EXPECT_LE(held(0, base0_), kAttackLimit) << "dlvsym handed out the driver's own cuMemAlloc_v2";
  EXPECT_EQ(kAttackLimit / (64 * kMiB), got.size());
  for (CUdeviceptr q : got) CU_ASSERT(cuMemFree(q));
  // Unhooked names and unknown versions keep glibc's answers.
  EXPECT_EQ(dlsym(h, "cuStreamCreate"), dlvsym(h, "cuStreamCreate", "CUSHARE_TEST_1"));
  EXPECT_EQ(nullptr, dlvsym(h, "cuMemAlloc_v2", "NO_SUCH_VERSION"));
  dlclose(h);
}

// ---- shareable VMM memory (same environment as Attack, its own process: what a process exports
// stays charged until it exits) ----
using Shareable = Attack;

CUmemAllocationProp shareableProp() {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// One byte and room for one descriptor (SCM_RIGHTS).
struct FdMessage {
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg = {};
};

// The exporting half of Shareable.ImportedMemoryIsChargedAfterTheExporterExits, run as a child:
// makes 400 MiB, sends an exported descriptor over CHILD_SOCKET, releases its handle and exits.
TEST_F(Attack, ExportChild) {
  const char* sock = std::getenv("CHILD_SOCKET");
  if (!sock) GTEST_SKIP() << "run by Shareable.ImportedMemoryIsChargedAfterTheExporterExits";
  const CUmemAllocationProp prop = shareableProp();
  CUmemGenericAllocationHandle h;
  CU_ASSERT(cuMemCreate(&h, 400 * kMiB, &prop, 0));
  int fd = -1;
  CU_ASSERT(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  FdMessage m;
  cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  ASSERT_EQ(1, sendmsg(std::atoi(sock), &m.msg, 0));
  close(fd);
  CU_ASSERT(cuMemRelease(h));
}

// Another process's exported memory, imported here after its maker released it and exited: the
// device keeps it for the descriptor, so this tenant is charged for it while it is mapped here.
TEST_F(Shareable, ImportedMemoryIsChargedAfterTheExporterExits) {
  int sv[2];
  ASSERT_EQ(0, socketpair(AF_UNIX, SOCK_STREAM, 0, sv));
  const std::string exe = [] {
    char b[4096] = {};
    return std::string(b, readlink("/proc/self/exe", b, sizeof b - 1));
  }();
  const std::string env = "CHILD_SOCKET=" + std::to_string(sv[1]);
  std::vector<std::string> envs{env};
  for (char** e = environ; *e; ++e) envs.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=Attack.ExportChild";
  char* argv[] = {const_cast<char*>(exe.c_str()), filter.data(), nullptr};
  pid_t pid;
  ASSERT_EQ(0, posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()));
  close(sv[1]);
  FdMessage m;
  ASSERT_EQ(1, recvmsg(sv[0], &m.msg, 0));
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m.msg)), sizeof fd);
  int status = 0;
  ASSERT_EQ(pid, waitpid(pid, &status, 0));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the exporting child failed";
  close(sv[0]);
  freeMem();  // lets the device return what no one holds
  EXPECT_EQ(400 * kMiB, held(0, base0_)) << "the descriptor keeps the memory on the device";

  CUmemGenericAllocationHandle h;
  CU_ASSERT(cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUdeviceptr va;
  CU_ASSERT(cuMemAddressReserve(&va, 400 * kMiB, 0, 0, 0));
  CU_ASSERT(cuMemMap(va, 400 * kMiB, 0, h, 0));
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, 200 * kMiB)) << "the imported 400 MiB are not charged";
  EXPECT_LE(held(0, base0_), kAttackLimit);
  CU_ASSERT(cuMemUnmap(va, 400 * kMiB));
  CU_ASSERT(cuMemAddressFree(va, 400 * kMiB));
  CU_ASSERT(cuMemRelease(h));
  EXPECT_EQ(kAttackLimit, freeMem());
  EXPECT_EQ(400 * kMiB, held(0, base0_)) << "the descriptor still keeps it";
  close(fd);
  freeMem();
  EXPECT_EQ(0u, held(0, base0_)) << "the last reference is gone: the device frees it";
}

// Export, then release: the descriptor keeps the memory on the device, so it stays charged. Last
// test of its process: the charges stay until the process exits.
TEST_F(Shareable, ExportedMemoryStaysChargedAfterRelease) {
  const CUmemAllocationProp prop = shareableProp();
  std::vector<int> fds;
  CUresult r = CUDA_SUCCESS;
  for (int i = 0; i < 8 && r == CUDA_SUCCESS; ++i) {
    CUmemGenericAllocationHandle h;
    if ((r = cuMemCreate(&h, 256 * kMiB, &prop, 0)) != CUDA_SUCCESS) break;
    int fd = -1;
    CU_ASSERT(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    fds.push_back(fd);
    CU_ASSERT(cuMemRelease(h));
    EXPECT_LE(held(0, base0_), kAttackLimit);
  }
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, r);
  EXPECT_EQ(2u, fds.size());
  EXPECT_EQ(512 * kMiB, held(0, base0_)) << "released handles whose descriptors live stay on the device";
  for (int fd : fds) close(fd);
  freeMem();
  EXPECT_EQ(0u, held(0, base0_)) << "every descriptor closed: the device frees them";
}

// Runs cuInit with stderr captured: it must fail and say which variable is wrong.
TEST(BadConfig, CuInitFailsNamingTheVariable) {
  const char* bad = std::getenv("EXPECT_BAD_VARIABLE");
  ASSERT_NE(nullptr, bad);
  const std::string var(bad, std::strchr(bad, '=') - bad);
  int fds[2];
  ASSERT_EQ(0, pipe(fds));
  const int saved = dup(2);
  dup2(fds[1], 2);
  const CUresult r = cuInit(0);
  CUdeviceptr p = 0;
  const CUresult a = cuMemAlloc(&p, 1);
  dup2(saved, 2);
  close(fds[1]);
  char buf[4096] = {};
  const ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  EXPECT_NE(CUDA_SUCCESS, r);
  EXPECT_NE(CUDA_SUCCESS, a) << "no allocation may succeed once the configuration was refused";
  ASSERT_GT(n, 0);
  EXPECT_NE(nullptr, std::strstr(buf, var.c_str())) << buf;
  std::fprintf(stderr, "%s", buf);
}

// A tenant ledger that is not ours (wrong magic, or another layout version): the shim refuses it
// and cuInit fails, naming the file, rather than reinterpreting it or running unlimited.
TEST(BadLedger, CuInitFailsNamingTheFile) {
  const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
  const char* tenant = std::getenv("CUSHARE_TENANT");
  const char* kind = std::getenv("BAD_LEDGER");
  ASSERT_TRUE(dir && tenant && kind);
  const std::string path = std::string(dir) + "/" + tenant + ".ledger";
  std::string cmd = "mkdir -p '" + std::string(dir) + "' && chmod 700 '" + dir + "'";
  ASSERT_EQ(0, std::system(cmd.c_str()));
  std::vector<char> bytes(84608, 0);  // a version-2 file's size
  if (std::string(kind) == "magic") {
    std::memcpy(bytes.data(), "NOTALEDG", 8);
  } else {  // right magic, a layout version from the future
    std::memcpy(bytes.data(), "CUSHLDG", 8);
    const uint32_t version = 99;
    std::memcpy(bytes.data() + 8, &version, 4);
  }
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(nullptr, f);
  ASSERT_EQ(bytes.size(), std::fwrite(bytes.data(), 1, bytes.size(), f));
  std::fclose(f);
  chmod(path.c_str(), 0600);
  int fds[2];
  ASSERT_EQ(0, pipe(fds));
  const int saved = dup(2);
  dup2(fds[1], 2);
  const CUresult r = cuInit(0);
  dup2(saved, 2);
  close(fds[1]);
  char buf[4096] = {};
  ASSERT_GT(read(fds[0], buf, sizeof buf - 1), 0);
  close(fds[0]);
  EXPECT_NE(CUDA_SUCCESS, r);
  EXPECT_NE(nullptr, std::strstr(buf, path.c_str())) << buf;
}

}  // namespace

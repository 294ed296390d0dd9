/* cushare's reclaim API for tenant processes that burst into plain memory
 * (docs/memory-elasticity.md, "burst: plain"). libcushare.so (preloaded) exports these two C
 * functions; a process finds them with dlsym(RTLD_DEFAULT, ...) or ctypes.CDLL(None), and does not
 * link against cushare (without the shim they are absent: nothing to give back).
 *
 *   int fd = cushare_reclaim_fd();
 *     An eventfd (close-on-exec, non-blocking) that becomes readable whenever the broker changes
 *     what it asks this tenant to hold on one of the process's devices. Read 8 bytes to rearm it.
 *     Each call returns a new descriptor of the same eventfd (close it when done; call once);
 *     -1 when the process runs without a broker.
 *
 *   int r = cushare_reclaim_target(device, &target, &held);
 *     For CUDA device ordinal `device` of this process: 1 and the most the tenant should hold
 *     there now (target) while a reclaim is asked, 0 when nothing is asked; held is what all the
 *     tenant's processes hold there. -1 for a bad argument or before CUDA is initialised.
 *
 * On a wake-up, free what can be freed until held <= target (PyTorch: torch.cuda.empty_cache()
 * after dropping caches of your own; vLLM: sleep mode; SGLang: release_memory_occupation).
 */
#ifndef CUSHARE_RECLAIM_H
#define CUSHARE_RECLAIM_H
#ifdef __cplusplus
extern "C" {
#endif
int cushare_reclaim_fd(void);
int cushare_reclaim_target(int device, unsigned long long* target, unsigned long long* held);
#ifdef __cplusplus
}
#endif
#endif

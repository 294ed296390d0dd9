// An NVML as an older driver ships it: nvmlDeviceGetMemoryInfo without the _v2 ABI the shim also
// resolves. Built as libnvidia-ml.so.1 in a directory of its own (CMakeLists.txt) and loaded by
// path by stale_dlerror_test.cpp; the functions are never called, only looked up.
extern "C" {
#define CUSHARE_OLD_NVML_EXPORT __attribute__((visibility("default")))
CUSHARE_OLD_NVML_EXPORT int nvmlInit_v2() { return 0; }
CUSHARE_OLD_NVML_EXPORT int nvmlShutdown() { return 0; }
CUSHARE_OLD_NVML_EXPORT int nvmlDeviceGetMemoryInfo(void*, void*) { return 0; }
CUSHARE_OLD_NVML_EXPORT int nvmlDeviceGetUUID(void*, char*, unsigned) { return 0; }
}

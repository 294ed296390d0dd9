/* The generated cuGetProcAddress table (see tools/gen_driver_table.py). C, so the generated file
 * can declare every exported symbol without its prototype. */
#ifndef SIMGPU_PROC_TABLE_H
#define SIMGPU_PROC_TABLE_H
#ifdef __cplusplus
extern "C" {
#endif

struct simgpu_proc_entry {
  const char* name;     /* base name as callers ask for it: "cuMemAlloc" */
  int version;          /* first CUDA version (1000*major + 10*minor) with this ABI */
  int per_thread;       /* 1: the _ptds/_ptsz variant */
  const char* symbol;   /* exported symbol: "cuMemAlloc_v2" */
  void* fn;
};

/* Sorted by (name, version, per_thread). */
extern const struct simgpu_proc_entry simgpu_proc_table[];
extern const unsigned simgpu_proc_table_size;
extern const char* const simgpu_exported_symbols[];
extern const unsigned simgpu_exported_symbols_size;

#ifdef __cplusplus
}
#endif
#endif

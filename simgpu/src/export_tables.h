// The driver's private export tables (cuGetExportTable), which cudart 13 needs before anything
// else works. See export_tables.cpp and docs "Private export tables" in simgpu-facts.md.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "integrity.h"  // IntegrityDevice and integrityHash, the pure part (unit-tested alone)

namespace simgpu {

// Implements cuGetExportTable: *table = the table for id, or CUDA_ERROR_NOT_SUPPORTED (801) for an
// unknown id / CUDA_ERROR_INVALID_VALUE for null args.
CUresult getExportTable(const void** table, const CUuuid* id) noexcept;

// The integrity answer (exposed for unit tests). Inputs are everything the hash mixes.
// (Declared in integrity.h, repeated here as the interface of this file.)
void integrityHash(uint32_t cudart_version, uint64_t unix_seconds, int driver_version, uint64_t pid, uint64_t tid,
                   const void* cudart_interface_table, const void* integrity_table, const void* integrity_fn,
                   const IntegrityDevice* devices, int device_count, uint64_t out[2]) noexcept;

// Optional hook for the context code: call when `ctx` is destroyed or a primary context is reset.
// Drops every context-local-storage entry of ctx and then calls each entry's destroy callback
// (ctx, key, value), as the real driver does, so cudart forgets its per-context state. Not
// needed for cudart's own exit path (it deletes its entries itself).
void destroyContextLocalStorage(CUcontext ctx) noexcept;

}  // namespace simgpu

// simgpu-smi's MIG commands (simgpu_smi_mig.cpp). Each returns the exit status; NVML is initialised.
#pragma once

#include "simgpu/nvml.h"

int smiListWithMig();                            // -L
int smiSetMigMode(int index, const char* mode);  // [-i N] -mig 0|1 (index -1: every GPU)
int smiMig(int argc, char** argv);               // mig ... (the arguments after "mig")

#include <functional>

// Calls f(index, handle) for GPU `index`, or every GPU when index is -1, in NVML's order, until f
// returns non-zero; that value, else 0 (1 when a handle cannot be had).
int forEachGpu(int index, const std::function<int(unsigned, nvmlDevice_t)>& f);

// simgpu-smi's MIG commands (simgpu_smi_mig.cpp). Each returns the exit status; NVML is initialised.
#pragma once

#include "simgpu/nvml.h"

int smiListWithMig();                            // -L
int smiSetMigMode(int index, const char* mode);  // [-i N] -mig 0|1 (index -1: every GPU)
int smiMig(int argc, char** argv);               // mig ... (the arguments after "mig")

// libFuzzer entry: arbitrary bytes as one client connection to the broker, through the same
// framing and validation the broker runs (cushare::rpc::decodeForFuzzing). Built and run by
// scripts/fuzz.sh; the unit tests replay the corpus through the same function with gcc.
#include <cstddef>
#include <cstdint>

#include "rpc/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cushare::rpc::decodeForFuzzing(data, size);
  return 0;  // libFuzzer reserves other values
}

// Fuzzes the pickle reader behind PyTorch Flight Recorder dumps
// (sim/replay/src/unpickle.hpp): any bytes must either be refused with one
// InvalidArgument naming the file and offset, or read as a JSON value that
// writes out (bad UTF-8 replaced). Memo reads share objects; a tree that
// would write a shared value out exponentially often, or a container that
// holds itself, must hit the reader's budget or depth bound, not the
// fuzzer's memory or stack limit.
#include <cstdint>
#include <string_view>

#include "diffcomm/tensor/error.hpp"
#include "unpickle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json value = diffcomm::sim::detail::unpickle(bytes, "fuzz.pkl");
    (void)value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const diffcomm::InvalidArgument&) {
  }
  return 0;
}

// Fuzzes the reader of PyTorch Flight Recorder dumps (sim/torch_flight_dump.hpp),
// what `diffcomm-sim replay DIR` reads from a torch job: any bytes, as the dump
// of rank 0 of a one-rank job (a pickle or JSON file), must either be refused
// with one InvalidArgument naming the file or become a dump whose replay gives
// a verdict without throwing anything else.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "diffcomm/sim/replay.hpp"
#include "diffcomm/sim/torch_flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"

namespace {
// One directory per fuzzing process, holding the one file each input becomes;
// removed when the process exits (libFuzzer ends a timed run with exit()).
struct ScratchDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("diffcomm_fuzz_torch_dump_" + std::to_string(getpid()));
  ScratchDir() { std::filesystem::create_directories(path); }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};
const std::filesystem::path& dir() {
  static const ScratchDir d;
  return d.path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  {
    std::ofstream out(dir() / "nccl_trace_rank_0", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const auto dumps = diffcomm::sim::read_torch_dumps(dir().string());
    (void)diffcomm::sim::replay(dumps);
  } catch (const diffcomm::InvalidArgument&) {
  }
  return 0;
}

// Fuzzes diffcomm-sim's command line: argument vectors assembled from the
// input (a subcommand, flags from a dictionary, values from a table of edge
// cases or raw bytes) run through the real main(). It must return an exit
// code in {0, 1, 2, 3} without crashing; the harness skips vectors that would
// legitimately run for long (valid worlds above 64 ranks, sweeps of more than
// 4 seeds) or write files (--trace other than /dev/null and /dev/full).
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_input.hpp"

int diffcomm_sim_main(int argc, char** argv);

namespace {

const std::vector<std::string> kWords = {"step",         "check",       "sweep",
                                         "tokens",       "foo",         "--ranks",
                                         "--dp",         "--cp",        "--tp",
                                         "--sp",         "--cp-layout", "--encoder-buckets",
                                         "--encoder-cp", "--batch",     "--images-per-sample",
                                         "--hidden",     "--ffn",       "--dtype",
                                         "--seed",       "--images",    "--json",
                                         "--fault",      "--trace",     "--receiver-grad",
                                         "--model",      "--op",        "--seeds",
                                         "--sp-chunks",  "--help",      "--no-such-flag"};
const std::vector<std::string> kValues = {"0",
                                          "1",
                                          "2",
                                          "3",
                                          "4",
                                          "-1",
                                          "18446744073709551615",
                                          "18446744073709551616",
                                          "99999999999",
                                          "1048576",
                                          "2147483648",
                                          "0..1",
                                          "5..3",
                                          "1...2",
                                          "rank:0:at:1",
                                          "rank:1:at:0",
                                          "rank:9:at:2",
                                          "float16",
                                          "bfloat16",
                                          "int8",
                                          "zigzag",
                                          "qwen3vl",
                                          "qwen2.5vl",
                                          "partial",
                                          "all_reduce",
                                          "all_to_all_single",
                                          "/tmp",
                                          "/dev/full",
                                          "/dev/null",
                                          "/nonexistent",
                                          "",
                                          "x"};

class NullBuf : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
  std::streamsize xsputn(const char*, std::streamsize n) override { return n; }
};

std::optional<uint64_t> as_u64(const std::string& s) {
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  try {
    return std::stoull(s);
  } catch (...) {
    return std::nullopt;
  }
}

// Vectors that would run for long or touch the file system.
bool slow_or_writes(const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (const auto v = as_u64(args[i]); v && *v > 64 && *v < 2147483648ull) return true;
    if (args[i] == "--trace" && i + 1 < args.size() && args[i + 1] != "/dev/null" &&
        args[i + 1] != "/dev/full")
      return true;
    if (args[i] == "--trace" && i + 1 == args.size()) return true;
    const auto dots = args[i].find("..");
    if (dots != std::string::npos) {
      const auto lo = as_u64(args[i].substr(0, dots)), hi = as_u64(args[i].substr(dots + 2));
      if (lo && hi && *hi >= *lo && *hi - *lo > 4) return true;
    }
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  static NullBuf null;
  static bool quiet = [] {
    std::cout.rdbuf(&null);
    std::cerr.rdbuf(&null);
    return true;
  }();
  (void)quiet;
  diffcomm::fuzz::Input in(data, size);
  std::vector<std::string> args = {"diffcomm-sim"};
  for (auto n = in.range(0, 12); n > 0 && !in.empty(); --n) {
    switch (in.range(0, 2)) {
      case 0:
        args.push_back(kWords[static_cast<std::size_t>(in.range(0, kWords.size() - 1))]);
        break;
      case 1:
        args.push_back(kValues[static_cast<std::size_t>(in.range(0, kValues.size() - 1))]);
        break;
      default: args.push_back(in.text(24)); break;
    }
  }
  for (const auto& a : args)
    if (a.find('\0') != std::string::npos) return 0;  // not representable in argv
  if (slow_or_writes(args)) return 0;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::cout.clear();
  const int rc = diffcomm_sim_main(static_cast<int>(args.size()), argv.data());
  if (rc < 0 || rc > 3) std::abort();
  return 0;
}

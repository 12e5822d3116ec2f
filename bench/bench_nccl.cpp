// NCCL bandwidth through diffcomm: all_reduce, all_gather (all_gather_single)
// and all_to_all_single on CUDA tensors, one thread per device (world = the
// devices used; 1 on a one-GPU machine: NCCL allows one rank per device),
// each next to the raw NCCL call(s) diffcomm issues, on the same
// communicator, stream and buffers, in the layout of nccl-tests.
//
// Bandwidths follow nccl-tests (doc/PERFORMANCE.md): time t per op is the
// mean over the timed iterations, slowest rank; "size" S is
//   all_reduce  the buffer (count * element size)     busbw = algbw * 2(n-1)/n
//   all_gather  the gathered output (n * per-rank)    busbw = algbw * (n-1)/n
//   all_to_all  a rank's whole send buffer            busbw = algbw * (n-1)/n
// and algbw = S / t (GB/s = 1e9 bytes/s). With one rank busbw is 0: nothing
// crosses a link.
//
// all_to_all_single is measured twice: grouped ncclSend/ncclRecv (the
// general path, uneven splits allowed) and, when the header and library are
// >= 2.28, ncclAlltoAll (a group created with Options::even_all_to_all).
//
// Usage: bench_nccl [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N]
//                   [--devices N] [--dtype float32|bfloat16]
// Exits 0 with a message when there is no CUDA device.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace {

using namespace diffcomm;

struct Config {
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{256} << 20;
  int iters = 20;
  int warmup = 5;
  int devices = 8;
  DType dtype = DType::Float32;
};

// AllReduce is the default path (composed: all_gather, then a reduction in
// rank order on the device, bit-identical to the simulated world);
// AllReduceNative is a group with Options::native_reduction (ncclAllReduce).
enum class Op { AllReduce, AllReduceNative, AllGather, AllToAllP2p, AllToAllNative };

bool is_reduce(Op op) { return op == Op::AllReduce || op == Op::AllReduceNative; }

struct Row {
  Op op;
  int64_t bytes;  // S of nccl-tests
};

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce:
    case Op::AllReduceNative: return "all_reduce";
    case Op::AllGather: return "all_gather";
    case Op::AllToAllP2p:
    case Op::AllToAllNative: return "all_to_all_single";
  }
  return "";
}
const char* path_name(Op op) {
  switch (op) {
    case Op::AllReduce:
      return "default: ncclAllGather + reduction in rank order, bit-identical to the sim; "
             "raw: ncclAllReduce";
    case Op::AllReduceNative: return "native_reduction: ncclAllReduce";
    case Op::AllGather: return "ncclAllGather";
    case Op::AllToAllP2p: return "send/recv group";
    case Op::AllToAllNative: return "ncclAlltoAll";
  }
  return "";
}
double bus_factor(Op op, int n) {
  if (n <= 1) return 0.0;
  return is_reduce(op) ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

int64_t parse_bytes(const char* s) { return std::strtoll(s, nullptr, 10); }

// Runs op once on rank r's buffers.
void issue(Op op, const dist::ProcessGroup& g, const Tensor& in, const Tensor& out) {
  switch (op) {
    case Op::AllReduce:
    case Op::AllReduceNative: dist::all_reduce(g, in); break;
    case Op::AllGather: dist::all_gather_single(g, out, in); break;
    case Op::AllToAllP2p:
    case Op::AllToAllNative: dist::all_to_all_single(g, out, in); break;
  }
}

// The NCCL call(s) diffcomm issues for op, on the group's communicator and
// stream, without diffcomm: the baseline.
void issue_raw(Op op, const dist::ProcessGroup& g, const Tensor& in, const Tensor& out, int n) {
  ncclComm_t comm = nccl::comm(g);
  cudaStream_t stream = nccl::stream(g);
  const ncclDataType_t type = in.dtype() == DType::BFloat16 ? ncclBfloat16 : ncclFloat32;
  auto ok = [](ncclResult_t r, const char* what) {
    if (r != ncclSuccess)
      throw BackendError(std::string("bench_nccl: ") + what + ": " + ncclGetErrorString(r));
  };
  const std::size_t es = element_size(in.dtype());
  switch (op) {
    case Op::AllReduce:
    case Op::AllReduceNative:
      ok(ncclAllReduce(in.data_ptr(), in.data_ptr(), static_cast<std::size_t>(in.numel()), type,
                       ncclSum, comm, stream),
         "ncclAllReduce");
      break;
    case Op::AllGather:
      ok(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(in.numel()), type,
                       comm, stream),
         "ncclAllGather");
      break;
    case Op::AllToAllP2p: {
      const auto block = static_cast<std::size_t>(in.numel() / n);
      ok(ncclGroupStart(), "ncclGroupStart");
      for (int p = 0; p < n; ++p) {
        ok(ncclSend(static_cast<const char*>(in.data_ptr()) + p * block * es, block, type, p, comm,
                    stream),
           "ncclSend");
        ok(ncclRecv(static_cast<char*>(out.data_ptr()) + p * block * es, block, type, p, comm,
                    stream),
           "ncclRecv");
      }
      ok(ncclGroupEnd(), "ncclGroupEnd");
      break;
    }
    case Op::AllToAllNative:
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
      ok(ncclAlltoAll(in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(in.numel() / n), type,
                      comm, stream),
         "ncclAlltoAll");
#endif
      break;
  }
}

// The value element 0 of block b of `out` must hold after one op on inputs
// filled with rank + 1 (all_to_all: block j of rank r holds r + 1).
double expected(Op op, int n, int64_t block) {
  switch (op) {
    case Op::AllReduce:
    case Op::AllReduceNative: return n * (n + 1) / 2.0;
    case Op::AllGather:
    case Op::AllToAllP2p:
    case Op::AllToAllNative: return static_cast<double>(block + 1);
  }
  return 0;
}

}  // namespace

// The command line into cfg; an exit code when the program should stop
// (usage, a bad value), nothing to go on.
std::optional<int> parse_args(int argc, char** argv, Config& cfg) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_nccl: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--min-bytes")
      cfg.min_bytes = parse_bytes(next());
    else if (a == "--max-bytes")
      cfg.max_bytes = parse_bytes(next());
    else if (a == "--iters")
      cfg.iters = std::atoi(next());
    else if (a == "--warmup")
      cfg.warmup = std::atoi(next());
    else if (a == "--devices")
      cfg.devices = std::atoi(next());
    else if (a == "--dtype") {
      const std::string d = next();
      if (d == "float32")
        cfg.dtype = DType::Float32;
      else if (d == "bfloat16")
        cfg.dtype = DType::BFloat16;
      else {
        std::fprintf(stderr, "bench_nccl: --dtype float32|bfloat16\n");
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: bench_nccl [--min-bytes B] [--max-bytes B] [--iters N] [--warmup N] "
                   "[--devices N] [--dtype float32|bfloat16]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (cfg.min_bytes < 1 || cfg.max_bytes < cfg.min_bytes || cfg.iters < 1 || cfg.warmup < 0 ||
      cfg.devices < 1) {
    std::fprintf(stderr, "bench_nccl: bad arguments\n");
    return 2;
  }
  return std::nullopt;
}

// What every rank measured, by row: mean seconds per call through diffcomm
// and through raw NCCL, and whether the checked call came out wrong.
struct Measured {
  std::vector<std::vector<double>> seconds, raw_seconds;
  std::vector<std::vector<char>> bad;
};

// The three communicators' unique ids (plain, even all_to_all, native
// reduction) and the barrier the ranks start each timing at.
struct Communicators {
  ncclUniqueId id, id_even, id_native;
  std::barrier<>& sync;
};

// Rank r's part: one checked call, then the timings, for every row.
void measure_rank(int r, int n, const Config& cfg, const std::vector<Row>& rows,
                  const Communicators& comms, Measured& m) {
  const ncclUniqueId& id = comms.id;
  const ncclUniqueId& id_even = comms.id_even;
  const ncclUniqueId& id_native = comms.id_native;
  std::barrier<>& sync = comms.sync;
  const int64_t es = static_cast<int64_t>(element_size(cfg.dtype));
  auto& seconds = m.seconds;
  auto& raw_seconds = m.raw_seconds;
  auto& bad = m.bad;
  const dist::ProcessGroup world = nccl::init_rank(id, n, r, r);
  nccl::Options even;
  even.even_all_to_all = true;
  const dist::ProcessGroup world_even = nccl::init_rank(id_even, n, r, r, even, "world_even");
  nccl::Options native;
  native.native_reduction = true;
  const dist::ProcessGroup world_native =
      nccl::init_rank(id_native, n, r, r, native, "world_native");
  const Device dev = Device::cuda(r);
  for (std::size_t k = 0; k < rows.size(); ++k) {
    const Op op = rows[k].op;
    const int64_t total = rows[k].bytes / es;  // elements of S
    const dist::ProcessGroup& g = op == Op::AllToAllNative    ? world_even
                                  : op == Op::AllReduceNative ? world_native
                                                              : world;
    Tensor in, out;
    if (is_reduce(op)) {
      in = empty({total}, cfg.dtype, dev);
    } else if (op == Op::AllGather) {
      in = empty({total / n}, cfg.dtype, dev);
      out = empty({total}, cfg.dtype, dev);
    } else {
      in = empty({total}, cfg.dtype, dev);
      out = empty({total}, cfg.dtype, dev);
    }
    // One checked op first: inputs r + 1 everywhere.
    in.fill_(r + 1.0);
    issue(op, g, in, is_reduce(op) ? in : out);
    nccl::synchronize(g);
    const Tensor& res = is_reduce(op) ? in : out;
    const int64_t block = is_reduce(op) ? total : total / n;
    for (int64_t b = 0; b < (is_reduce(op) ? 1 : n); ++b) {
      const double got = res.row_view(b * block, 1).to_vector()[0];
      if (got != expected(op, n, b)) bad[k][static_cast<std::size_t>(r)] = 1;
    }
    // Mean time of cfg.iters calls (after cfg.warmup), every rank
    // starting together, host-timed around the stream like nccl-tests.
    auto time = [&](auto&& call) {
      for (int i = 0; i < cfg.warmup; ++i) call();
      nccl::synchronize(g);
      sync.arrive_and_wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < cfg.iters; ++i) call();
      nccl::synchronize(g);
      const auto t1 = std::chrono::steady_clock::now();
      sync.arrive_and_wait();
      return std::chrono::duration<double>(t1 - t0).count() / cfg.iters;
    };
    seconds[k][static_cast<std::size_t>(r)] = time([&] { issue(op, g, in, out); });
    raw_seconds[k][static_cast<std::size_t>(r)] = time([&] { issue_raw(op, g, in, out, n); });
  }
}

// The nccl-tests style table; false when a checked call came out wrong.
bool print_table(int n, const Config& cfg, const std::vector<Row>& rows, std::size_t per_op,
                 bool native_a2a, const Measured& m) {
  const int64_t es = static_cast<int64_t>(element_size(cfg.dtype));
  const auto& seconds = m.seconds;
  const auto& raw_seconds = m.raw_seconds;
  const auto& bad = m.bad;
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof prop);
  cudaGetDeviceProperties(&prop, 0);
  const int v = nccl::runtime_version();
  std::printf(
      "# diffcomm NCCL bandwidth: world %d (%d x %s), NCCL %d.%d.%d, %s, %d iterations after %d "
      "warm-up\n"
      "# time: mean per call, slowest rank; algbw = size / time; busbw = algbw * 2(n-1)/n "
      "(all_reduce) or (n-1)/n (others), as nccl-tests; 1 rank: busbw 0\n",
      n, n, prop.name, v / 10000, (v / 100) % 100, v % 100, dtype_name(cfg.dtype).c_str(),
      cfg.iters, cfg.warmup);
  bool all_ok = true;
  for (std::size_t k = 0; k < rows.size(); ++k) {
    const Op op = rows[k].op;
    if (k % per_op == 0) {
      std::printf("#\n# %s (%s)\n", op_name(op), path_name(op));
      std::printf("# %12s %12s %8s %6s   %10s %8s %8s %6s   %10s %8s %8s   %8s\n", "", "", "", "",
                  "diffcomm", "", "", "", "raw NCCL", "", "", "");
      std::printf("# %12s %12s %8s %6s   %10s %8s %8s %6s   %10s %8s %8s   %8s\n", "size", "count",
                  "type", "redop", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
                  "overhead");
      std::printf("# %12s %12s %8s %6s   %10s %8s %8s %6s   %10s %8s %8s   %8s\n", "(B)",
                  "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
                  "(%)");
    }
    const double t = *std::max_element(seconds[k].begin(), seconds[k].end());
    const double tr = *std::max_element(raw_seconds[k].begin(), raw_seconds[k].end());
    const auto wrong = std::count_if(bad[k].begin(), bad[k].end(), [](char c) { return c != 0; });
    all_ok = all_ok && wrong == 0;
    const double size = static_cast<double>(rows[k].bytes);
    const double algbw = size / t / 1e9, raw_algbw = size / tr / 1e9;
    std::printf(
        "  %12lld %12lld %8s %6s   %10.1f %8.2f %8.2f %6lld   %10.1f %8.2f %8.2f   %+8.1f\n",
        static_cast<long long>(rows[k].bytes), static_cast<long long>(rows[k].bytes / es),
        dtype_name(cfg.dtype).c_str(), is_reduce(op) ? "sum" : "none", t * 1e6, algbw,
        algbw * bus_factor(op, n), static_cast<long long>(wrong), tr * 1e6, raw_algbw,
        raw_algbw * bus_factor(op, n), (t / tr - 1.0) * 100.0);
  }
  std::printf("# #wrong: ranks whose result was wrong after one checked call (diffcomm path)\n");
  if (!native_a2a)
    std::printf("(ncclAlltoAll not measured: needs NCCL >= 2.28 in the header and the library)\n");
  return all_ok;
}

int main(int argc, char** argv) {
  Config cfg;
  if (const auto code = parse_args(argc, argv, cfg)) return *code;
  const int devices = nccl::device_count();
  if (devices == 0) {
    std::printf("bench_nccl: no CUDA device: %s; skipping\n", nccl::device_status().c_str());
    return 0;
  }
  const int n = std::min(devices, cfg.devices);
  const bool native_a2a = nccl::has_native_gather_scatter_all_to_all();
  const int64_t es = static_cast<int64_t>(element_size(cfg.dtype));

  std::vector<Op> ops = {Op::AllReduce, Op::AllReduceNative, Op::AllGather, Op::AllToAllP2p};
  if (native_a2a) ops.push_back(Op::AllToAllNative);
  std::vector<int64_t> sizes;
  for (int64_t s = cfg.min_bytes; s <= cfg.max_bytes; s *= 4) {
    // Whole elements, divisible into n blocks.
    const int64_t unit = es * n;
    sizes.push_back(std::max(unit, s / unit * unit));
  }
  std::vector<Row> rows;
  for (Op op : ops)
    for (int64_t s : sizes) rows.push_back({op, s});
  Measured m;
  m.seconds.assign(rows.size(), std::vector<double>(static_cast<std::size_t>(n), 0.0));
  m.raw_seconds = m.seconds;
  m.bad.assign(rows.size(), std::vector<char>(static_cast<std::size_t>(n), 0));
  std::barrier sync(n);
  const Communicators comms{nccl::unique_id(), nccl::unique_id(), nccl::unique_id(), sync};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        measure_rank(r, n, cfg, rows, comms, m);
      } catch (const std::exception& e) {
        // Peers may now wait in a collective; nothing more to do than report.
        std::fprintf(stderr, "bench_nccl: rank %d failed: %s\n", r, e.what());
        std::fflush(stderr);
        std::_Exit(1);
      }
    });
  for (auto& t : threads) t.join();
  return print_table(n, cfg, rows, sizes.size(), native_a2a, m) ? 0 : 1;
}

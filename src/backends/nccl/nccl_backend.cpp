// The NCCL backend. The funnel (dist/collectives.cpp) has validated every
// Call; here each primitive maps to the NCCL call(s) it wraps, enqueued on
// the group's stream, with every NCCL and CUDA return code turned into
// BackendError at the boundary. See include/diffcomm/backends/nccl.hpp for
// the contract (streams, ordering, native vs grouped send/recv, deadlines).
//
// Plain C++: NCCL and the CUDA runtime are C APIs, so this file is compiled
// by the host compiler; the only kernels it runs are NCCL's (and, for the
// Avg fallback on NCCL < 2.10, diffcomm's scale). Device memory, the device
// guard and the current stream are diffcomm's (src/cuda/device_memory.hpp):
// while an op runs, the group's stream is the current stream of its device,
// so scratch buffers are allocated and freed in stream order on it.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device_memory.hpp"
#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/cuda.hpp"
#include "diffcomm/dist/backend.hpp"
#include "diffcomm/dist/backend/composed.hpp"
#include "diffcomm/dist/backend/fingerprint.hpp"
#include "diffcomm/dist/backend/layers.hpp"
#include "diffcomm/dist/backend/wait.hpp"
#include "diffcomm/error.hpp"

// ncclGather / ncclScatter / ncclAlltoAll appeared in NCCL 2.28: use them only
// when the header we compile against declares them (here) *and* the library
// loaded at run time is new enough (ncclGetVersion, checked per group).
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define DIFFCOMM_NCCL_HEADER_HAS_2_28 1
#else
#define DIFFCOMM_NCCL_HEADER_HAS_2_28 0
#endif

namespace diffcomm::nccl {
namespace {

using dist::Call;
using dist::OpType;
using dist::ReduceOp;

constexpr int kVersionAvg = NCCL_VERSION(2, 10, 0);     // ncclAvg
constexpr int kVersionNative = NCCL_VERSION(2, 28, 0);  // ncclGather/Scatter/AlltoAll

std::string cuda_text(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
}

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return fmt::format("{} (ncclResult_t {}); last NCCL error: {}", ncclGetErrorString(r),
                     static_cast<int>(r), last != nullptr && *last != '\0' ? last : "(none)");
}

// Checked calls outside a group (factories, free functions).
#define DIFFCOMM_NCCL_PLAIN(expr, what)                                                         \
  do {                                                                                          \
    const ncclResult_t diffcomm_r_ = (expr);                                                    \
    if (diffcomm_r_ != ncclSuccess)                                                             \
      throw BackendError(fmt::format("NCCL error in {}: {} returned {} [{}:{}]", (what), #expr, \
                                     nccl_text(diffcomm_r_, nullptr), __FILE__, __LINE__));     \
  } while (0)

#define DIFFCOMM_CUDA_PLAIN(expr, what)                                                         \
  do {                                                                                          \
    const cudaError_t diffcomm_e_ = (expr);                                                     \
    if (diffcomm_e_ != cudaSuccess)                                                             \
      throw BackendError(fmt::format("CUDA error in {}: {} returned {} [{}:{}]", (what), #expr, \
                                     cuda_text(diffcomm_e_), __FILE__, __LINE__));              \
  } while (0)

// Checked calls inside NcclBackend members: `call` is the Call being served
// (or nullptr), so the message names the op, its number, group and rank.
#define DIFFCOMM_NCCL_CHECK(expr, call)                                                        \
  do {                                                                                         \
    const ncclResult_t diffcomm_r_ = (expr);                                                   \
    if (diffcomm_r_ != ncclSuccess) fail_nccl(diffcomm_r_, #expr, (call), __FILE__, __LINE__); \
  } while (0)

#define DIFFCOMM_CUDA_CHECK(expr, call)                                                        \
  do {                                                                                         \
    const cudaError_t diffcomm_e_ = (expr);                                                    \
    if (diffcomm_e_ != cudaSuccess) fail_cuda(diffcomm_e_, #expr, (call), __FILE__, __LINE__); \
  } while (0)

// Makes a device current for the scope and restores the caller's device on
// return and on exception (one guard for the whole library).
using detail::DeviceGuard;

// A stream shared by a group and the sub-groups split from it (so their ops
// stay in one order per rank); destroyed with the last user when owned.
struct StreamHolder {
  cudaStream_t stream = nullptr;
  bool owned = false;
  int device = 0;
  StreamHolder(cudaStream_t s, bool own, int dev) : stream(s), owned(own), device(dev) {}
  ~StreamHolder() {
    if (!owned || stream == nullptr) return;
    try {
      const DeviceGuard guard(device);
      // Blocks that recorded a use on this stream need not wait for it any
      // more once it is idle, and must not record an event on it later.
      (void)cudaStreamSynchronize(stream);
      detail::device_memory().forget_stream(stream, device);
      (void)cudaStreamDestroy(stream);
    } catch (const Error&) {  // no usable device any more (process exit): nothing to free
    }
  }
  StreamHolder(const StreamHolder&) = delete;
  StreamHolder& operator=(const StreamHolder&) = delete;
};

std::shared_ptr<StreamHolder> owned_stream(int device) {
  const DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  // Non-blocking: no implicit synchronization with the legacy default
  // stream; ordering with the caller's current stream is by events (run()).
  DIFFCOMM_CUDA_PLAIN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                      "nccl: creating the group's stream");
  return std::make_shared<StreamHolder>(s, true, device);
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Float16: return ncclFloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    case DType::UInt8: return ncclUint8;
  }
  return ncclUint8;
}

void validate_members(const std::vector<int>& members, int nranks, const char* what) {
  if (members.empty()) return;
  if (static_cast<int>(members.size()) != nranks)
    throw InvalidArgument(fmt::format("{}: options.members has {} entries for {} ranks", what,
                                      members.size(), nranks));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0)
    throw InvalidArgument(
        fmt::format("{}: options.members holds a negative rank {}", what, sorted.front()));
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw InvalidArgument(fmt::format("{}: options.members lists a rank twice", what));
}

char* at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) +
         elements * static_cast<int64_t>(element_size(t.dtype()));
}
std::size_t count(const Tensor& t) { return static_cast<std::size_t>(t.numel()); }

// Whether ts[s+1] starts where ts[s] ends: one buffer NCCL can take as is.
bool consecutive(const dist::TensorList& ts) {
  for (std::size_t s = 1; s < ts.size(); ++s)
    if (at(ts[s - 1], ts[s - 1].numel()) != static_cast<char*>(ts[s].data_ptr())) return false;
  return true;
}

class NcclBackend final : public dist::Backend {
 public:
  NcclBackend(ncclComm_t comm, bool owns_comm, std::shared_ptr<StreamHolder> stream,
              Options options)
      : comm_(comm),
        owned_(owns_comm),
        stream_(std::move(stream)),
        opts_(std::move(options)),
        timeout_s_(opts_.resolved_timeout_s()) {
    if (opts_.deadline_every < 1)
      throw InvalidArgument(fmt::format("nccl: Options::deadline_every is {}; it must be >= 1",
                                        opts_.deadline_every));
    DIFFCOMM_NCCL_PLAIN(ncclCommCount(comm_, &size_), "nccl: querying the communicator");
    DIFFCOMM_NCCL_PLAIN(ncclCommUserRank(comm_, &rank_), "nccl: querying the communicator");
    DIFFCOMM_NCCL_PLAIN(ncclCommCuDevice(comm_, &device_), "nccl: querying the communicator");
    DIFFCOMM_NCCL_PLAIN(ncclGetVersion(&version_), "nccl: ncclGetVersion");
    validate_members(opts_.members, size_, "nccl");
    members_ = opts_.members;
    if (members_.empty()) {
      members_.resize(static_cast<std::size_t>(size_));
      std::iota(members_.begin(), members_.end(), 0);
    }
    native_ = DIFFCOMM_NCCL_HEADER_HAS_2_28 && opts_.prefer_native && version_ >= kVersionNative;
    const DeviceGuard guard(device_);
    DIFFCOMM_CUDA_PLAIN(cudaEventCreateWithFlags(&ev_before_, cudaEventDisableTiming),
                        "nccl: events");
    const cudaError_t e = cudaEventCreateWithFlags(&ev_after_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      (void)cudaEventDestroy(ev_before_);
      DIFFCOMM_CUDA_PLAIN(e, "nccl: events");
    }
  }

  ~NcclBackend() override {
    try {
      const DeviceGuard guard(device_);
      // Let queued ops finish before the communicator goes away (an aborted
      // communicator's kernels have stopped). Scratch buffers were freed in
      // stream order already; the barrier's buffer is freed here, on the
      // stream, before an owned stream is destroyed.
      (void)cudaStreamSynchronize(stream_->stream);
      (void)cudaEventDestroy(ev_before_);
      (void)cudaEventDestroy(ev_after_);
      for (const InFlight& f : in_flight_) (void)cudaEventDestroy(f.event);
      for (cudaEvent_t e : spare_events_) (void)cudaEventDestroy(e);
      {
        const cuda::StreamGuard on_group_stream(device_, stream());
        barrier_buf_ = Tensor{};
      }
      if (owned_ && !aborted_) (void)ncclCommDestroy(comm_);
      (void)cudaGetLastError();
    } catch (const Error&) {  // no usable device any more (process exit)
    }
  }

  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  // ---- dist::Backend
  std::string backend_name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int global_rank(int r) const override { return members_[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override {
    return (d.is_cuda() && d.index == device_) || (d.is_cpu() && opts_.stage_cpu);
  }

  std::shared_ptr<dist::Backend> split(Call& c, int color, int key) override {
    const DeviceGuard guard(device_);
    const cuda::StreamGuard on_group_stream(device_, stream());
    begin(c);
    // 1. Every member's (color, key, fingerprint), all-gathered on the
    //    device: the new groups' global ranks and a fingerprint check.
    // The member-list word of the shared fingerprint (dist/backend/fingerprint.hpp):
    // it tells new_group from split, as the simulated world and checked
    // mode do.
    constexpr std::size_t kMembersWord = 10;
    const int64_t mine[3] = {color < 0 ? -1 : color, key, dist::fingerprint(c)[kMembersWord]};
    Tensor buf = empty({3 * static_cast<int64_t>(size_)}, DType::Int64, Device::cuda(device_));
    DIFFCOMM_CUDA_CHECK(
        cudaMemcpyAsync(at(buf, 3 * rank_), mine, sizeof mine, cudaMemcpyHostToDevice, stream()),
        &c);
    DIFFCOMM_NCCL_CHECK(
        ncclAllGather(at(buf, 3 * rank_), buf.data_ptr(), 3, ncclInt64, comm_, stream()), &c);
    std::vector<int64_t> all(3 * static_cast<std::size_t>(size_));
    wait(&c);
    DIFFCOMM_CUDA_CHECK(cudaMemcpyAsync(all.data(), buf.data_ptr(), all.size() * sizeof(int64_t),
                                        cudaMemcpyDeviceToHost, stream()),
                        &c);
    DIFFCOMM_CUDA_CHECK(cudaStreamSynchronize(stream()), &c);

    // 2. Every member sees the same table, so every member raises together
    //    (before ncclCommSplit: nobody is left waiting in it).
    std::string differ;
    for (int s = 0; s < size_; ++s)
      if (all[3 * static_cast<std::size_t>(s) + 2] != all[2])
        differ += fmt::format("{}{}", differ.empty() ? "" : ", ", s);
    if (!differ.empty())
      throw CollectiveMismatch(fmt::format(
          "{}: collective mismatch: member(s) {} of the group passed another member list or "
          "split fingerprint than member 0 (this member called {}): member list differs",
          c.where(), differ, c.signature()));

    // 3. The split itself; NCCL orders members by (key, parent rank), as
    //    ProcessGroup::split does.
    ncclComm_t sub = nullptr;
    DIFFCOMM_NCCL_CHECK(
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr), &c);
    if (color < 0) {
      if (sub != nullptr) (void)ncclCommDestroy(sub);
      return nullptr;
    }
    std::vector<std::pair<int64_t, int>> order;  // (key, parent rank)
    for (int s = 0; s < size_; ++s)
      if (all[3 * static_cast<std::size_t>(s)] == color)
        order.emplace_back(all[3 * static_cast<std::size_t>(s) + 1], s);
    std::sort(order.begin(), order.end());
    Options child = opts_;
    child.stream = stream();
    child.members.clear();
    int my_pos = -1;
    for (std::size_t i = 0; i < order.size(); ++i) {
      child.members.push_back(members_[static_cast<std::size_t>(order[i].second)]);
      if (order[i].second == rank_) my_pos = static_cast<int>(i);
    }
    std::shared_ptr<NcclBackend> b;
    try {
      b = std::make_shared<NcclBackend>(sub, /*owns_comm=*/true, stream_, child);
    } catch (...) {
      (void)ncclCommDestroy(sub);
      throw;
    }
    // From here `b` owns `sub` (destroyed with it).
    if (b->rank_ != my_pos || b->size_ != static_cast<int>(order.size()))
      throw BackendError(fmt::format(
          "{} [nccl]: ncclCommSplit made rank {} of {}, but the all-gathered (color, key) "
          "table predicts rank {} of {}",
          c.where(), b->rank_, b->size_, my_pos, order.size()));
    return b;
  }

  void barrier(Call& c) override {
    run(c, [&](Call& d) {
      if (!barrier_buf_.defined()) {
        barrier_buf_ = empty({1}, DType::Int32, Device::cuda(device_));
        DIFFCOMM_CUDA_CHECK(cudaMemsetAsync(barrier_buf_.data_ptr(), 0, sizeof(int32_t), stream()),
                            &d);
      }
      DIFFCOMM_NCCL_CHECK(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1,
                                        ncclInt32, ncclSum, comm_, stream()),
                          &d);
    });
    // A barrier returns once every member has entered: wait for it.
    const DeviceGuard guard(device_);
    wait(&c);
  }

  void all_reduce(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& t = d.outputs[0];
      if (t.numel() == 0) return;
      DIFFCOMM_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                        red_op(d), comm_, stream()),
                          &d);
      finish_avg(d, t);
    });
  }

  void broadcast(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& t = d.outputs[0];
      if (t.numel() == 0) return;
      DIFFCOMM_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                        d.root, comm_, stream()),
                          &d);
    });
  }

  void reduce(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& t = d.outputs[0];
      if (t.numel() == 0) return;
      // recvbuff is only written on the root: the others keep their input.
      DIFFCOMM_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(d.dtype),
                                     red_op(d), d.root, comm_, stream()),
                          &d);
      if (rank_ == d.root) finish_avg(d, t);
    });
  }

  void all_gather(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& in = d.inputs[0];
      if (in.numel() == 0) return;
      if (consecutive(d.outputs)) {
        DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                          nccl_type(d.dtype), comm_, stream()),
                            &d);
        return;
      }
      Tensor tmp = scratch(static_cast<int64_t>(size_) * in.numel(), d.dtype);
      DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), tmp.data_ptr(), count(in),
                                        nccl_type(d.dtype), comm_, stream()),
                          &d);
      for (int s = 0; s < size_; ++s)
        copy_async(d.outputs[static_cast<std::size_t>(s)].data_ptr(), at(tmp, s * in.numel()),
                   in.nbytes(), &d);
      // tmp is freed in stream order on the group's stream, after the op.
    });
  }

  void all_gather_single(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& in = d.inputs[0];
      if (in.numel() == 0) return;
      DIFFCOMM_NCCL_CHECK(ncclAllGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                        nccl_type(d.dtype), comm_, stream()),
                          &d);
    });
  }

  void all_gather_v(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& in = d.inputs[0];
      const Tensor& out = d.outputs[0];
      const int64_t rn = in.row_numel();
      std::vector<int64_t> off(static_cast<std::size_t>(size_) + 1, 0);
      for (int p = 0; p < size_; ++p)
        off[static_cast<std::size_t>(p) + 1] =
            off[static_cast<std::size_t>(p)] + d.output_splits[static_cast<std::size_t>(p)] * rn;
      {
        Group group(this, &d);
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          const auto pi = static_cast<std::size_t>(p);
          DIFFCOMM_NCCL_CHECK(
              ncclSend(in.data_ptr(), count(in), nccl_type(d.dtype), p, comm_, stream()), &d);
          DIFFCOMM_NCCL_CHECK(
              ncclRecv(at(out, off[pi]), static_cast<std::size_t>(off[pi + 1] - off[pi]),
                       nccl_type(d.dtype), p, comm_, stream()),
              &d);
        }
        group.end();
      }
      copy_async(at(out, off[static_cast<std::size_t>(rank_)]), in.data_ptr(), in.nbytes(), &d);
    });
  }

  void gather(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& in = d.inputs[0];
      const bool root = rank_ == d.root;
      if (native_) {
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
        if (in.numel() == 0) return;
        if (!root) {  // recvbuff is not used off the root
          DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), in.data_ptr(), count(in),
                                         nccl_type(d.dtype), d.root, comm_, stream()),
                              &d);
          return;
        }
        if (consecutive(d.outputs)) {
          DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), d.outputs[0].data_ptr(), count(in),
                                         nccl_type(d.dtype), d.root, comm_, stream()),
                              &d);
          return;
        }
        Tensor tmp = scratch(static_cast<int64_t>(size_) * in.numel(), d.dtype);
        DIFFCOMM_NCCL_CHECK(ncclGather(in.data_ptr(), tmp.data_ptr(), count(in), nccl_type(d.dtype),
                                       d.root, comm_, stream()),
                            &d);
        for (int s = 0; s < size_; ++s)
          copy_async(d.outputs[static_cast<std::size_t>(s)].data_ptr(), at(tmp, s * in.numel()),
                     in.nbytes(), &d);
        return;
#endif
      }
      // Grouped point-to-point: every non-root posts its send (zero counts
      // too), the root one receive per peer.
      {
        Group group(this, &d);
        if (root) {
          for (int p = 0; p < size_; ++p)
            if (p != rank_)
              DIFFCOMM_NCCL_CHECK(ncclRecv(d.outputs[static_cast<std::size_t>(p)].data_ptr(),
                                           count(in), nccl_type(d.dtype), p, comm_, stream()),
                                  &d);
        } else {
          DIFFCOMM_NCCL_CHECK(
              ncclSend(in.data_ptr(), count(in), nccl_type(d.dtype), d.root, comm_, stream()), &d);
        }
        group.end();
      }
      if (root)
        copy_async(d.outputs[static_cast<std::size_t>(rank_)].data_ptr(), in.data_ptr(),
                   in.nbytes(), &d);
    });
  }

  void scatter(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& out = d.outputs[0];
      const bool root = rank_ == d.root;
      if (native_) {
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
        if (out.numel() == 0) return;
        if (!root) {  // sendbuff is not used off the root
          DIFFCOMM_NCCL_CHECK(ncclScatter(out.data_ptr(), out.data_ptr(), count(out),
                                          nccl_type(d.dtype), d.root, comm_, stream()),
                              &d);
          return;
        }
        if (consecutive(d.inputs)) {
          DIFFCOMM_NCCL_CHECK(ncclScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                          nccl_type(d.dtype), d.root, comm_, stream()),
                              &d);
          return;
        }
        Tensor tmp = scratch(static_cast<int64_t>(size_) * out.numel(), d.dtype);
        for (int s = 0; s < size_; ++s)
          copy_async(at(tmp, s * out.numel()), d.inputs[static_cast<std::size_t>(s)].data_ptr(),
                     out.nbytes(), &d);
        DIFFCOMM_NCCL_CHECK(ncclScatter(tmp.data_ptr(), out.data_ptr(), count(out),
                                        nccl_type(d.dtype), d.root, comm_, stream()),
                            &d);
        return;
#endif
      }
      {
        Group group(this, &d);
        if (root) {
          for (int p = 0; p < size_; ++p)
            if (p != rank_)
              DIFFCOMM_NCCL_CHECK(ncclSend(d.inputs[static_cast<std::size_t>(p)].data_ptr(),
                                           count(out), nccl_type(d.dtype), p, comm_, stream()),
                                  &d);
        } else {
          DIFFCOMM_NCCL_CHECK(
              ncclRecv(out.data_ptr(), count(out), nccl_type(d.dtype), d.root, comm_, stream()),
              &d);
        }
        group.end();
      }
      if (root)
        copy_async(out.data_ptr(), d.inputs[static_cast<std::size_t>(rank_)].data_ptr(),
                   out.nbytes(), &d);
    });
  }

  void reduce_scatter(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& out = d.outputs[0];
      if (out.numel() == 0) return;
      if (consecutive(d.inputs)) {
        DIFFCOMM_NCCL_CHECK(ncclReduceScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                              nccl_type(d.dtype), red_op(d), comm_, stream()),
                            &d);
      } else {
        Tensor tmp = scratch(static_cast<int64_t>(size_) * out.numel(), d.dtype);
        for (int s = 0; s < size_; ++s)
          copy_async(at(tmp, s * out.numel()), d.inputs[static_cast<std::size_t>(s)].data_ptr(),
                     out.nbytes(), &d);
        DIFFCOMM_NCCL_CHECK(ncclReduceScatter(tmp.data_ptr(), out.data_ptr(), count(out),
                                              nccl_type(d.dtype), red_op(d), comm_, stream()),
                            &d);
      }
      finish_avg(d, out);
    });
  }

  void reduce_scatter_single(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& out = d.outputs[0];
      if (out.numel() == 0) return;
      DIFFCOMM_NCCL_CHECK(ncclReduceScatter(d.inputs[0].data_ptr(), out.data_ptr(), count(out),
                                            nccl_type(d.dtype), red_op(d), comm_, stream()),
                          &d);
      finish_avg(d, out);
    });
  }

  void reduce_scatter_v(Call& c) override {
    run(c, [&](Call& d) {
      // One ncclReduce per destination, all in one group: block p of every
      // member's input is reduced onto member p's output (zero-size blocks
      // are posted too; NCCL skips them on every member alike).
      const Tensor& in = d.inputs[0];
      const Tensor& out = d.outputs[0];
      const int64_t rn = in.row_numel();
      {
        Group group(this, &d);
        int64_t off = 0;
        for (int p = 0; p < size_; ++p) {
          const int64_t n = d.input_splits[static_cast<std::size_t>(p)] * rn;
          void* send = at(in, off);
          // recvbuff is only used on the root; elsewhere pass the send block.
          void* recv = p == rank_ ? out.data_ptr() : send;
          DIFFCOMM_NCCL_CHECK(ncclReduce(send, recv, static_cast<std::size_t>(n),
                                         nccl_type(d.dtype), red_op(d), p, comm_, stream()),
                              &d);
          off += n;
        }
        group.end();
      }
      finish_avg(d, out);
    });
  }

  void all_to_all(Call& c) override {
    run(c, [&](Call& d) {
      {
        Group group(this, &d);
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          const auto pi = static_cast<std::size_t>(p);
          DIFFCOMM_NCCL_CHECK(ncclSend(d.inputs[pi].data_ptr(), count(d.inputs[pi]),
                                       nccl_type(d.dtype), p, comm_, stream()),
                              &d);
          DIFFCOMM_NCCL_CHECK(ncclRecv(d.outputs[pi].data_ptr(), count(d.outputs[pi]),
                                       nccl_type(d.dtype), p, comm_, stream()),
                              &d);
        }
        group.end();
      }
      const auto me = static_cast<std::size_t>(rank_);
      copy_async(d.outputs[me].data_ptr(), d.inputs[me].data_ptr(), d.inputs[me].nbytes(), &d);
    });
  }

  void all_to_all_single(Call& c) override {
    if (opts_.even_all_to_all) {
      // The promise of Options::even_all_to_all, checked before any traffic.
      const int64_t k = c.input_splits.empty() ? 0 : c.input_splits[0];
      auto even = [&](const dist::SplitList& s) {
        return std::all_of(s.begin(), s.end(), [&](int64_t x) { return x == k; });
      };
      if (!even(c.input_splits) || !even(c.output_splits))
        throw InvalidArgument(fmt::format(
            "{} [nccl]: the group promised even all_to_all_single splits "
            "(Options::even_all_to_all) but got input_splits {} and output_splits {}",
            c.where(), fmt::join(c.input_splits, ","), fmt::join(c.output_splits, ",")));
    }
    run(c, [&](Call& d) {
      const Tensor& in = d.inputs[0];
      const Tensor& out = d.outputs[0];
      const int64_t rn = in.row_numel();
#if DIFFCOMM_NCCL_HEADER_HAS_2_28
      if (native_ && opts_.even_all_to_all) {
        const int64_t block = d.input_splits.empty() ? 0 : d.input_splits[0] * rn;
        if (block == 0) return;
        DIFFCOMM_NCCL_CHECK(
            ncclAlltoAll(in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(block),
                         nccl_type(d.dtype), comm_, stream()),
            &d);
        return;
      }
#endif
      int64_t s_off = 0, r_off = 0, s_me = 0, r_me = 0;
      {
        Group group(this, &d);
        for (int p = 0; p < size_; ++p) {
          const auto pi = static_cast<std::size_t>(p);
          const int64_t sc = d.input_splits[pi] * rn, rc = d.output_splits[pi] * rn;
          if (p == rank_) {
            s_me = s_off;
            r_me = r_off;
          } else {
            DIFFCOMM_NCCL_CHECK(ncclSend(at(in, s_off), static_cast<std::size_t>(sc),
                                         nccl_type(d.dtype), p, comm_, stream()),
                                &d);
            DIFFCOMM_NCCL_CHECK(ncclRecv(at(out, r_off), static_cast<std::size_t>(rc),
                                         nccl_type(d.dtype), p, comm_, stream()),
                                &d);
          }
          s_off += sc;
          r_off += rc;
        }
        group.end();
      }
      const auto me = static_cast<std::size_t>(rank_);
      copy_async(at(out, r_me), at(in, s_me),
                 static_cast<std::size_t>(d.input_splits[me] * rn) * element_size(d.dtype), &d);
    });
  }

  void send(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& t = d.inputs[0];
      DIFFCOMM_NCCL_CHECK(
          ncclSend(t.data_ptr(), count(t), nccl_type(d.dtype), d.root, comm_, stream()), &d);
    });
  }

  void recv(Call& c) override {
    run(c, [&](Call& d) {
      const Tensor& t = d.outputs[0];
      DIFFCOMM_NCCL_CHECK(
          ncclRecv(t.data_ptr(), count(t), nccl_type(d.dtype), d.root, comm_, stream()), &d);
    });
  }

  // ---- used by the nccl:: free functions
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_->stream; }
  void set_stream(cudaStream_t s) {
    // The barrier's buffer was allocated on the old stream: free it there
    // while that stream still exists (an owned one may be destroyed below).
    {
      const DeviceGuard guard(device_);
      const cuda::StreamGuard on_group_stream(device_, stream());
      barrier_buf_ = Tensor{};
    }
    stream_ = std::make_shared<StreamHolder>(s, false, device_);
  }
  int device() const { return device_; }
  bool owned() const { return owned_; }
  void synchronize() {
    const DeviceGuard guard(device_);
    wait(nullptr);
  }
  void abort_comm() {
    if (!owned_)
      throw InvalidArgument(
          "nccl::abort: the group's communicator is borrowed (from_comm); diffcomm never aborts "
          "it: call ncclCommAbort yourself");
    const DeviceGuard guard(device_);
    abort_owned();
  }

 private:
  // ncclGroupStart/End for one grouped op; ends the group on every path.
  class Group {
   public:
    Group(NcclBackend* b, const Call* c) : b_(b), c_(c) {
      const ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) b_->fail_nccl(r, "ncclGroupStart()", c_, __FILE__, __LINE__);
    }
    void end() {
      open_ = false;
      const ncclResult_t r = ncclGroupEnd();
      if (r != ncclSuccess) b_->fail_nccl(r, "ncclGroupEnd()", c_, __FILE__, __LINE__);
    }
    ~Group() {
      if (open_) (void)ncclGroupEnd();
    }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;

   private:
    NcclBackend* b_;
    const Call* c_;
    bool open_ = true;
  };

  // "all_reduce #3 on group 'world' (rank 1 of 4) [nccl, global rank 5, cuda:1, owned
  // communicator]"
  std::string context(const Call* c) const {
    return fmt::format("{} [nccl {}, global rank {}, cuda:{}, {} communicator]",
                       c != nullptr ? c->where() : std::string("group operation"), version_,
                       members_[static_cast<std::size_t>(rank_)], device_,
                       owned_ ? "owned" : "borrowed");
  }

  [[noreturn]] void fail_nccl(ncclResult_t r, const char* expr, const Call* c, const char* file,
                              int line) const {
    throw BackendError(fmt::format("NCCL error in {}: {} returned {} [{}:{}]", context(c), expr,
                                   nccl_text(r, aborted_ ? nullptr : comm_), file, line));
  }
  [[noreturn]] void fail_cuda(cudaError_t e, const char* expr, const Call* c, const char* file,
                              int line) const {
    (void)cudaGetLastError();
    throw BackendError(fmt::format("CUDA error in {}: {} returned {} [{}:{}]", context(c), expr,
                                   cuda_text(e), file, line));
  }

  void abort_owned() {
    if (owned_ && !aborted_) {
      aborted_ = true;
      (void)ncclCommAbort(comm_);
    }
  }

  // An asynchronous error NCCL reported on the communicator (network, peer
  // failure, ...): abort what we own, then raise.
  [[noreturn]] void fail_async(ncclResult_t r, const Call* c) {
    const std::string text = nccl_text(r, comm_);
    abort_owned();
    throw BackendError(fmt::format("NCCL asynchronous error in {}: {}; {}", context(c), text,
                                   owned_ ? "the communicator was aborted (ncclCommAbort)"
                                          : "the communicator is borrowed and was not aborted"));
  }

  void check_async(const Call* c) {
    ncclResult_t async = ncclSuccess;
    DIFFCOMM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async), c);
    if (async != ncclSuccess && async != ncclInProgress) fail_async(async, c);
  }

  // Before every op: refuse an aborted communicator, surface asynchronous
  // errors (a host-side read).
  void begin(const Call& c) {
    if (aborted_)
      throw BackendError(
          fmt::format("{}: the communicator was aborted (timeout, asynchronous error or "
                      "nccl::abort); create a new group",
                      context(&c)));
    check_async(&c);
    check_in_flight(&c);
  }

  // A buffer on the group's device, allocated on the group's stream (the
  // current stream while an op runs) and freed there in stream order when the
  // last handle goes: no event bookkeeping, no host synchronization.
  Tensor scratch(int64_t numel, DType dtype) const {
    return empty({numel}, dtype, Device::cuda(device_));
  }

  void copy_async(void* dst, const void* src, std::size_t nbytes, const Call* c) {
    if (nbytes == 0 || dst == src) return;
    DIFFCOMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream()), c);
  }

  bool native_avg() const { return version_ >= kVersionAvg; }
  // The NCCL op of a native reduction. PremulSum's is made for the call
  // (ncclRedOpCreatePreMulSum, the factor in the call's dtype, read by the
  // host at creation) and destroyed once the NCCL call given it has returned
  // (the temporary's lifetime: the full expression of that call).
  class RedOp {
   public:
    RedOp(ncclRedOp_t op, ncclComm_t premul_comm) : op_(op), comm_(premul_comm) {}
    RedOp(const RedOp&) = delete;
    RedOp& operator=(const RedOp&) = delete;
    ~RedOp() {
      if (comm_ != nullptr) (void)ncclRedOpDestroy(op_, comm_);
    }
    operator ncclRedOp_t() const { return op_; }  // NOLINT: used as the op itself

   private:
    ncclRedOp_t op_;
    ncclComm_t comm_;
  };
  RedOp red_op(const Call& d) const {
    switch (d.reduce_op) {
      case ReduceOp::Sum: return RedOp(ncclSum, nullptr);
      case ReduceOp::Avg: return RedOp(native_avg() ? ncclAvg : ncclSum, nullptr);
      case ReduceOp::Product: return RedOp(ncclProd, nullptr);
      case ReduceOp::Min: return RedOp(ncclMin, nullptr);
      case ReduceOp::Max: return RedOp(ncclMax, nullptr);
      case ReduceOp::PremulSum: break;
    }
    const double f = d.reduce_op.factor();
    double f64 = f;
    float f32 = static_cast<float>(f);
    uint16_t f16 = d.dtype == DType::BFloat16 ? bfloat16(f32).bits : float16(f32).bits;
    void* scalar = d.dtype == DType::Float64   ? static_cast<void*>(&f64)
                   : d.dtype == DType::Float32 ? static_cast<void*>(&f32)
                                               : static_cast<void*>(&f16);
    ncclRedOp_t op{};
    DIFFCOMM_NCCL_CHECK(
        ncclRedOpCreatePreMulSum(&op, scalar, nccl_type(d.dtype), ncclScalarHostImmediate, comm_),
        &d);
    return RedOp(op, comm_);
  }
  // NCCL < 2.10 has no ncclAvg: Sum, then a scale by 1/size; diffcomm's
  // scale and copy run on the current stream, which is the group's here.
  void finish_avg(const Call& d, const Tensor& t) {
    if (d.reduce_op != ReduceOp::Avg || native_avg() || t.numel() == 0) return;
    t.detach().copy_(dist::scaled(t, 1.0 / size_));
  }

  static bool same_stream(cudaStream_t a, cudaStream_t b) {
    auto legacy = [](cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; };
    return a == b || (legacy(a) && legacy(b));
  }

  // Waits on the host for the stream through the shared deadline loop
  // (dist/backend/wait.hpp): polls cudaStreamQuery and NCCL's asynchronous
  // error; past Options::timeout_s an owned communicator is aborted and
  // Timeout raised, so no host wait of this backend can hang.
  void wait(const Call* c) {
    dist::wait_with_deadline(
        timeout_s_, [&] { return stream_idle(c); },
        [&](double t) { return expired(c == nullptr ? "synchronize" : c->where(), t); });
  }

  bool stream_idle(const Call* c) {
    const cudaError_t q = cudaStreamQuery(stream());
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) fail_cuda(q, "cudaStreamQuery(stream)", c, __FILE__, __LINE__);
    (void)cudaGetLastError();
    check_async(c);
    return false;
  }

  // The Timeout text of an op that did not complete within t seconds; aborts
  // an owned communicator first (its kernels would otherwise spin forever).
  std::string expired(const std::string& op, double t) {
    abort_owned();
    return fmt::format(
        "timed out after {} s waiting in {} [nccl {}, global rank {}, cuda:{}]; a member returned "
        "early, failed or skipped this call; {}",
        t, op, version_, members_[static_cast<std::size_t>(rank_)], device_,
        owned_ ? "the communicator was aborted (ncclCommAbort) and this group cannot be used any "
                 "more"
               : "the communicator is borrowed and was NOT aborted: abort it (ncclCommAbort) "
                 "before reusing it or its stream");
  }

  // The deadline of ops in flight, without host synchronization: after every
  // Options::deadline_every-th op an event is recorded on the stream; every
  // op first queries the oldest events (cudaEventQuery, non-blocking). The
  // stream runs in order, so a completed event vouches for every op before
  // it; one still pending after timeout_s raises Timeout naming its op.
  struct InFlight {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point since;
    std::string op;  // "all_reduce #3 on group 'tp' (rank 1 of 4)"
  };

  void mark_in_flight(const Call& c) {
    if (++ops_since_mark_ < opts_.deadline_every) return;
    ops_since_mark_ = 0;
    cudaEvent_t e = nullptr;
    if (spare_events_.empty()) {
      DIFFCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), &c);
    } else {
      e = spare_events_.back();
      spare_events_.pop_back();
    }
    in_flight_.push_back({e, std::chrono::steady_clock::now(), c.where()});
    DIFFCOMM_CUDA_CHECK(cudaEventRecord(e, stream()), &c);
  }

  void check_in_flight(const Call* c) {
    while (!in_flight_.empty()) {
      InFlight& f = in_flight_.front();
      const cudaError_t q = cudaEventQuery(f.event);
      if (q == cudaSuccess) {
        spare_events_.push_back(f.event);
        in_flight_.pop_front();
        continue;
      }
      if (q != cudaErrorNotReady)
        fail_cuda(q, "cudaEventQuery(op in flight)", c, __FILE__, __LINE__);
      (void)cudaGetLastError();
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - f.since;
      if (waited.count() > timeout_s_) throw Timeout(expired(f.op, timeout_s_));
      return;
    }
  }

  // A deterministic reduction (dist::ComposedReductions over this backend):
  // its transport steps are this backend's all_to_all_single / all_gather_v
  // and its accumulation is dist::reduce_into on the device, all on the
  // group's stream, ordered with the caller's current stream once around the
  // whole composition.
  void run_composed(Call& c, const std::function<void()>& compose) override {
    const DeviceGuard guard(device_);
    if (on_cpu(c)) return compose();  // steps stage; accumulation on the host
    const auto caller = static_cast<cudaStream_t>(cuda::current_stream(device_));
    const bool order = opts_.order_with_current_stream && !same_stream(caller, stream());
    if (order) {
      DIFFCOMM_CUDA_CHECK(cudaEventRecord(ev_before_, caller), &c);
      DIFFCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream(), ev_before_, 0), &c);
    }
    {
      const cuda::StreamGuard on_group_stream(device_, stream());
      compose();
    }
    if (order) {
      DIFFCOMM_CUDA_CHECK(cudaEventRecord(ev_after_, stream()), &c);
      DIFFCOMM_CUDA_CHECK(cudaStreamWaitEvent(caller, ev_after_, 0), &c);
    }
  }

  // Runs one op: device guard, prologue, the group's stream made current,
  // CPU staging or ordering with the caller's current stream, the body
  // (which enqueues), then an in-flight mark for the deadline.
  template <class F>
  void run(Call& c, F&& body) {
    const DeviceGuard guard(device_);
    begin(c);
    const auto caller = static_cast<cudaStream_t>(cuda::current_stream(device_));
    const cuda::StreamGuard on_group_stream(device_, stream());
    if (on_cpu(c)) {
      staged(c, body);
      return;
    }
    const bool other = !same_stream(caller, stream());
    const bool order = opts_.order_with_current_stream && other;
    if (order) {  // the op waits for what the caller queued on its current stream
      DIFFCOMM_CUDA_CHECK(cudaEventRecord(ev_before_, caller), &c);
      DIFFCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream(), ev_before_, 0), &c);
    }
    if (other && !order) {
      // Unordered: the caller's blocks are used on the group's stream, so
      // their stream-ordered free must wait for it (cuda::record_stream).
      // Ordered, the current stream already waits for the op (below), which
      // covers blocks allocated on it.
      for (const Tensor& t : c.inputs) cuda::record_stream(t, stream());
      for (const Tensor& t : c.outputs) cuda::record_stream(t, stream());
    }
    body(c);
    if (order) {  // later work on the caller's current stream waits for the op
      DIFFCOMM_CUDA_CHECK(cudaEventRecord(ev_after_, stream()), &c);
      DIFFCOMM_CUDA_CHECK(cudaStreamWaitEvent(caller, ev_after_, 0), &c);
    }
    mark_in_flight(c);
  }

  static bool on_cpu(const Call& c) {
    for (const Tensor& t : c.inputs)
      if (t.device().is_cpu()) return true;
    for (const Tensor& t : c.outputs)
      if (t.device().is_cpu()) return true;
    return false;
  }

  // CPU tensors (Options::stage_cpu): copy to the device (outputs too, so
  // elements the op does not write keep their values), run, wait, copy the
  // outputs back. Aliases (in-place ops) share one device copy.
  template <class F>
  void staged(Call& c, F&& body) {
    struct Staged {
      Tensor host, dev;
      bool output;
    };
    std::vector<Staged> map;
    auto stage = [&](const Tensor& h, bool output) -> Tensor {
      for (Staged& s : map)
        if (s.host.data_ptr() == h.data_ptr() && s.host.nbytes() == h.nbytes()) {
          s.output = s.output || output;
          return s.dev;
        }
      Tensor dev = empty(h.shape(), h.dtype(), Device::cuda(device_));
      if (h.nbytes() > 0)
        DIFFCOMM_CUDA_CHECK(cudaMemcpyAsync(dev.data_ptr(), h.data_ptr(), h.nbytes(),
                                            cudaMemcpyHostToDevice, stream()),
                            &c);
      map.push_back({h, dev, output});
      return dev;
    };
    Call d = c;
    for (std::size_t i = 0; i < d.inputs.size(); ++i) d.inputs.set(i, stage(d.inputs[i], false));
    for (std::size_t i = 0; i < d.outputs.size(); ++i) d.outputs.set(i, stage(d.outputs[i], true));
    body(d);
    wait(&c);
    for (const Staged& s : map)
      if (s.output && s.host.nbytes() > 0)
        DIFFCOMM_CUDA_CHECK(cudaMemcpyAsync(s.host.data_ptr(), s.dev.data_ptr(), s.host.nbytes(),
                                            cudaMemcpyDeviceToHost, stream()),
                            &c);
    DIFFCOMM_CUDA_CHECK(cudaStreamSynchronize(stream()), &c);
  }

  ncclComm_t comm_;
  bool owned_;
  bool aborted_ = false;
  std::shared_ptr<StreamHolder> stream_;
  Options opts_;
  int rank_ = 0, size_ = 1, device_ = 0, version_ = 0;
  bool native_ = false;
  std::vector<int> members_;
  cudaEvent_t ev_before_ = nullptr, ev_after_ = nullptr;
  Tensor barrier_buf_;
  double timeout_s_;  // Options::timeout_s, resolved
  int ops_since_mark_ = 0;
  std::deque<InFlight> in_flight_;
  std::vector<cudaEvent_t> spare_events_;
};

NcclBackend& backend_of(const dist::ProcessGroup& group, const char* what) {
  auto* b = dynamic_cast<NcclBackend*>(&dist::transport_of(group.backend()));
  if (b == nullptr)
    throw InvalidArgument(fmt::format("nccl::{}: group '{}' runs on the {} backend, not nccl", what,
                                      group.name(), group.backend().backend_name()));
  return *b;
}

// Builds the backend of a communicator diffcomm just created; destroys the
// communicator when that fails.
std::shared_ptr<NcclBackend> adopt(ncclComm_t comm, std::shared_ptr<StreamHolder> stream,
                                   const Options& options) {
  try {
    return std::make_shared<NcclBackend>(comm, true, std::move(stream), options);
  } catch (...) {
    (void)ncclCommDestroy(comm);
    throw;
  }
}

// The transport under the layers Options ask for (dist::stack_layers); the
// checker's fingerprints travel on a second communicator split from `comm`
// (same members, same order) on the same stream.
std::shared_ptr<dist::Backend> layered(std::shared_ptr<NcclBackend> data, ncclComm_t comm,
                                       const Options& options) {
  auto control = [data, comm, &options]() -> std::shared_ptr<dist::Backend> {
    const DeviceGuard guard(data->device());
    ncclComm_t split = nullptr;
    DIFFCOMM_NCCL_PLAIN(ncclCommSplit(comm, 0, data->rank(), &split, nullptr),
                        "nccl: control communicator for checked mode");
    Options ctl = options;
    ctl.stream = data->stream();
    ctl.members.clear();
    for (int r = 0; r < data->size(); ++r) ctl.members.push_back(data->global_rank(r));
    auto holder = std::make_shared<StreamHolder>(data->stream(), false, data->device());
    return adopt(split, std::move(holder), ctl);
  };
  const Device device = Device::cuda(data->device());
  return dist::stack_layers(std::move(data), options, control, device);
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_status() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return "cudaGetDeviceCount: " + cuda_text(e);
  }
  return n == 0 ? "cudaGetDeviceCount: 0 devices" : "";
}

int runtime_version() {
  int v = 0;
  DIFFCOMM_NCCL_PLAIN(ncclGetVersion(&v), "nccl::runtime_version");
  return v;
}

bool has_native_gather_scatter_all_to_all() {
  return DIFFCOMM_NCCL_HEADER_HAS_2_28 && runtime_version() >= kVersionNative;
}

ncclUniqueId unique_id() {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  DIFFCOMM_NCCL_PLAIN(ncclGetUniqueId(&id), "nccl::unique_id");
  return id;
}

dist::ProcessGroup init_rank(const ncclUniqueId& id, int nranks, int rank, int device,
                             Options options, std::string name) {
  if (nranks < 1) throw InvalidArgument(fmt::format("nccl::init_rank: nranks {} < 1", nranks));
  if (rank < 0 || rank >= nranks)
    throw InvalidArgument(fmt::format("nccl::init_rank: rank {} outside [0, {})", rank, nranks));
  validate_members(options.members, nranks, "nccl::init_rank");
  const int devices = device_count();
  if (device < 0 || device >= devices)
    throw InvalidArgument(
        fmt::format("nccl::init_rank: device {} outside [0, {}){}", device, devices,
                    devices == 0 ? " (no CUDA device: " + device_status() + ")" : ""));
  const std::string what =
      fmt::format("nccl::init_rank (rank {} of {}, cuda:{})", rank, nranks, device);
  const DeviceGuard guard(device);
  std::shared_ptr<StreamHolder> stream =
      options.stream != nullptr ? std::make_shared<StreamHolder>(options.stream, false, device)
                                : owned_stream(device);
  ncclComm_t comm = nullptr;
  DIFFCOMM_NCCL_PLAIN(ncclCommInitRank(&comm, nranks, id, rank), what);
  return dist::ProcessGroup(layered(adopt(comm, std::move(stream), options), comm, options),
                            std::move(name), nullptr);
}

dist::ProcessGroup from_comm(ncclComm_t comm, cudaStream_t stream, Options options,
                             std::string name) {
  if (comm == nullptr) throw InvalidArgument("nccl::from_comm: null communicator");
  int device = 0;
  DIFFCOMM_NCCL_PLAIN(ncclCommCuDevice(comm, &device), "nccl::from_comm");
  options.stream = stream;
  auto holder = std::make_shared<StreamHolder>(stream, false, device);
  auto data = std::make_shared<NcclBackend>(comm, false, std::move(holder), options);
  return dist::ProcessGroup(layered(std::move(data), comm, options), std::move(name), nullptr);
}

ncclComm_t comm(const dist::ProcessGroup& group) { return backend_of(group, "comm").comm(); }
cudaStream_t stream(const dist::ProcessGroup& group) {
  return backend_of(group, "stream").stream();
}
void set_stream(const dist::ProcessGroup& group, cudaStream_t s) {
  backend_of(group, "set_stream").set_stream(s);
}
int device(const dist::ProcessGroup& group) { return backend_of(group, "device").device(); }
bool owns_comm(const dist::ProcessGroup& group) { return backend_of(group, "owns_comm").owned(); }
void synchronize(const dist::ProcessGroup& group) {
  backend_of(group, "synchronize").synchronize();
}
void abort(const dist::ProcessGroup& group) { backend_of(group, "abort").abort_comm(); }

}  // namespace diffcomm::nccl

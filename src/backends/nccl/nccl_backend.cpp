// NcclBackend's op context, errors and deadlines (see nccl_backend.hpp).
// Plain C++: NCCL and the CUDA runtime are C APIs, so this file is compiled
// by the host compiler; the only kernels it runs are NCCL's (and, for the
// Avg fallback on NCCL < 2.10, diffcomm's scale). Device memory, the device
// guard and the current stream are diffcomm's (src/tensor/cuda/device_memory.hpp):
// while an op runs, the group's stream is the current stream of its device,
// so scratch buffers are allocated and freed in stream order on it.
#include "nccl_backend.hpp"

#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "diffcomm/distributed/backend/composed.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/backend/wait.hpp"

namespace diffcomm::nccl::impl {

NcclBackend::NcclBackend(ncclComm_t comm, bool owns_comm, std::shared_ptr<StreamHolder> stream,
                         Options options)
    : comm_(comm),
      owned_(owns_comm),
      stream_(std::move(stream)),
      opts_(std::move(options)),
      timeout_s_(opts_.resolved_timeout_s()) {
  if (opts_.deadline_every < 1)
    raise("nccl",
          fmt::format("Options::deadline_every is {}; it must be >= 1", opts_.deadline_every));
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

NcclBackend::~NcclBackend() {
  // A process forked after the communicator was made holds a copy of it but
  // not the device context: tearing it down there would touch the parent's
  // communicator (CUDA is not usable after fork).
  if (getpid() != created_in_) return;
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

std::shared_ptr<dist::Backend> NcclBackend::split(Call& c, int color, int key) {
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
      cudaMemcpyAsync(at(buf, 3 * rank_), mine, sizeof mine, cudaMemcpyHostToDevice, stream()), &c);
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
    throw CollectiveMismatch(
        c.site(), fmt::format("collective mismatch: member(s) {} of the group passed another "
                              "member list or split fingerprint than member 0 (this member "
                              "called {}): member list differs",
                              differ, c.signature()));

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
    raise<BackendError>(c.where() + " [nccl]",
                        fmt::format("ncclCommSplit made rank {} of {}, but the all-gathered "
                                    "(color, key) table predicts rank {} of {}",
                                    b->rank_, b->size_, my_pos, order.size()));
  return b;
}

void NcclBackend::set_stream(cudaStream_t s) {
  // The barrier's buffer was allocated on the old stream: free it there
  // while that stream still exists (an owned one may be destroyed below).
  {
    const DeviceGuard guard(device_);
    const cuda::StreamGuard on_group_stream(device_, stream());
    barrier_buf_ = Tensor{};
  }
  stream_ = std::make_shared<StreamHolder>(s, false, device_);
}

void NcclBackend::synchronize() {
  const DeviceGuard guard(device_);
  wait(nullptr);
}

void NcclBackend::abort_comm() {
  if (!owned_)
    raise("nccl::abort",
          "the group's communicator is borrowed (from_comm); diffcomm never aborts "
          "it: call ncclCommAbort yourself");
  const DeviceGuard guard(device_);
  abort_owned();
}

std::string NcclBackend::context(const Call* c) const {
  return fmt::format("{} [nccl {}, global rank {}, cuda:{}, {} communicator]",
                     c != nullptr ? c->where() : std::string("group operation"), version_,
                     members_[static_cast<std::size_t>(rank_)], device_,
                     owned_ ? "owned" : "borrowed");
}

void NcclBackend::fail_nccl(ncclResult_t r, const char* expr, const Call* c, const char* file,
                            int line) const {
  throw BackendError(fmt::format("NCCL error in {}: {} returned {} [{}:{}]", context(c), expr,
                                 nccl_text(r, aborted_ ? nullptr : comm_), file, line));
}

void NcclBackend::fail_cuda(cudaError_t e, const char* expr, const Call* c, const char* file,
                            int line) const {
  (void)cudaGetLastError();
  throw BackendError(fmt::format("CUDA error in {}: {} returned {} [{}:{}]", context(c), expr,
                                 cuda_text(e), file, line));
}

void NcclBackend::abort_owned() {
  if (owned_ && !aborted_) {
    aborted_ = true;
    (void)ncclCommAbort(comm_);
  }
}

void NcclBackend::fail_async(ncclResult_t r, const Call* c) {
  const std::string text = nccl_text(r, comm_);
  abort_owned();
  throw BackendError(fmt::format("NCCL asynchronous error in {}: {}; {}", context(c), text,
                                 owned_ ? "the communicator was aborted (ncclCommAbort)"
                                        : "the communicator is borrowed and was not aborted"));
}

void NcclBackend::check_async(const Call* c) {
  ncclResult_t async = ncclSuccess;
  DIFFCOMM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async), c);
  if (async != ncclSuccess && async != ncclInProgress) fail_async(async, c);
}

void NcclBackend::begin(const Call& c) {
  if (aborted_)
    raise<BackendError>(context(&c),
                        "the communicator was aborted (timeout, asynchronous error or "
                        "nccl::abort); create a new group");
  check_async(&c);
  check_in_flight(&c);
}

void NcclBackend::copy_async(void* dst, const void* src, std::size_t nbytes, const Call* c) {
  if (nbytes == 0 || dst == src) return;
  DIFFCOMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream()), c);
}

NcclBackend::RedOp NcclBackend::red_op(const Call& d) const {
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

void NcclBackend::finish_avg(const Call& d, const Tensor& t) {
  if (d.reduce_op != ReduceOp::Avg || native_avg() || t.numel() == 0) return;
  t.detach().copy_(dist::scaled(t, 1.0 / size_));
}

void NcclBackend::wait(const Call* c) {
  dist::wait_with_deadline(
      timeout_s_, [&] { return stream_idle(c); },
      [&](double t) { return expired(c == nullptr ? "synchronize" : c->where(), t); });
}

bool NcclBackend::stream_idle(const Call* c) {
  const cudaError_t q = cudaStreamQuery(stream());
  if (q == cudaSuccess) return true;
  if (q != cudaErrorNotReady) fail_cuda(q, "cudaStreamQuery(stream)", c, __FILE__, __LINE__);
  (void)cudaGetLastError();
  check_async(c);
  return false;
}

std::string NcclBackend::expired(const std::string& op, double t) {
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

void NcclBackend::mark_in_flight(const Call& c) {
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

void NcclBackend::check_in_flight(const Call* c) {
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    const cudaError_t q = cudaEventQuery(f.event);
    if (q == cudaSuccess) {
      spare_events_.push_back(f.event);
      in_flight_.pop_front();
      continue;
    }
    if (q != cudaErrorNotReady) fail_cuda(q, "cudaEventQuery(op in flight)", c, __FILE__, __LINE__);
    (void)cudaGetLastError();
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - f.since;
    if (waited.count() > timeout_s_) throw Timeout(expired(f.op, timeout_s_));
    return;
  }
}

void NcclBackend::run_composed(Call& c, const std::function<void()>& compose) {
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

}  // namespace diffcomm::nccl::impl

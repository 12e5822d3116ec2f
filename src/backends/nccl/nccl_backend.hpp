#pragma once
// NcclBackend: the dist::Backend of one NCCL communicator (the contract:
// include/diffcomm/backends/nccl.hpp). Its primitives are in nccl_ops.cpp;
// the op context (device, stream, ordering, CPU staging), errors and the
// deadlines in nccl_backend.cpp; the public nccl:: functions in nccl.cpp.
#include <unistd.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/tensor/cuda.hpp"
#include "support.hpp"

namespace diffcomm::nccl::impl {

class NcclBackend final : public dist::Backend {
 public:
  NcclBackend(ncclComm_t comm, bool owns_comm, std::shared_ptr<StreamHolder> stream,
              Options options);

  ~NcclBackend() override;

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

  std::shared_ptr<dist::Backend> split(Call& c, int color, int key) override;

  void barrier(Call& c) override;
  void all_reduce(Call& c) override;
  void broadcast(Call& c) override;
  void reduce(Call& c) override;
  void all_gather(Call& c) override;
  void all_gather_single(Call& c) override;
  void all_gather_v(Call& c) override;
  void gather(Call& c) override;
  void scatter(Call& c) override;
  void reduce_scatter(Call& c) override;
  void reduce_scatter_single(Call& c) override;
  void reduce_scatter_v(Call& c) override;
  void all_to_all(Call& c) override;
  void all_to_all_single(Call& c) override;
  void send(Call& c) override;
  void recv(Call& c) override;

  // ---- used by the nccl:: free functions
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_->stream; }
  void set_stream(cudaStream_t s);
  int device() const { return device_; }
  bool owned() const { return owned_; }
  void synchronize();
  void abort_comm();

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
  std::string context(const Call* c) const;

  [[noreturn]] void fail_nccl(ncclResult_t r, const char* expr, const Call* c, const char* file,
                              int line) const;
  [[noreturn]] void fail_cuda(cudaError_t e, const char* expr, const Call* c, const char* file,
                              int line) const;

  void abort_owned();

  // An asynchronous error NCCL reported on the communicator (network, peer
  // failure, ...): abort what we own, then raise.
  [[noreturn]] void fail_async(ncclResult_t r, const Call* c);

  void check_async(const Call* c);

  // Before every op: refuse an aborted communicator, surface asynchronous
  // errors (a host-side read).
  void begin(const Call& c);

  // A buffer on the group's device, allocated on the group's stream (the
  // current stream while an op runs) and freed there in stream order when the
  // last handle goes: no event bookkeeping, no host synchronization.
  Tensor scratch(int64_t numel, DType dtype) const {
    return empty({numel}, dtype, Device::cuda(device_));
  }

  void copy_async(void* dst, const void* src, std::size_t nbytes, const Call* c);

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
  RedOp red_op(const Call& d) const;
  // NCCL < 2.10 has no ncclAvg: Sum, then a scale by 1/size; diffcomm's
  // scale and copy run on the current stream, which is the group's here.
  void finish_avg(const Call& d, const Tensor& t);

  static bool same_stream(cudaStream_t a, cudaStream_t b) {
    auto legacy = [](cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; };
    return a == b || (legacy(a) && legacy(b));
  }

  // Waits on the host for the stream through the shared deadline loop
  // (dist/backend/wait.hpp): polls cudaStreamQuery and NCCL's asynchronous
  // error; past Options::timeout_s an owned communicator is aborted and
  // Timeout raised, so no host wait of this backend can hang.
  void wait(const Call* c);

  bool stream_idle(const Call* c);

  // The Timeout text of an op that did not complete within t seconds; aborts
  // an owned communicator first (its kernels would otherwise spin forever).
  std::string expired(const std::string& op, double t);

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

  void mark_in_flight(const Call& c);

  void check_in_flight(const Call* c);

  // A deterministic reduction (dist::ComposedReductions over this backend):
  // its transport steps are this backend's all_to_all_single / all_gather_v
  // and its accumulation is dist::reduce_into on the device, all on the
  // group's stream, ordered with the caller's current stream once around the
  // whole composition.
  void run_composed(Call& c, const std::function<void()>& compose) override;

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
  pid_t created_in_ = getpid();  // ~NcclBackend does nothing in a forked child
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

}  // namespace diffcomm::nccl::impl

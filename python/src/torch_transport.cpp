// The "torch" transport: a dist::Backend whose primitives are one call each on
// a torch ProcessGroup (gloo on CPU, torch's NCCL on GPU, any other torch
// backend). It lives in the binding because that is where C++ can reach
// torch without linking libtorch: each primitive calls a method of a Python
// object (diffcomm.torch._transport.TorchOps) with diffcomm tensors, which
// lends them to torch through DLPack and issues the torch call with
// async_op=True. The semantics (validation, checked mode, composed
// reductions, aliasing, flight recorder) stay in C++ above this backend, put
// there by dist::stack_layers exactly as for MPI and NCCL; every Work is
// waited for with diffcomm's deadline as torch's timeout.
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "bind.hpp"
#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/backend/layers.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"

namespace diffcomm_python {
namespace {

using dc::dist::Call;

std::vector<Tensor> tensors(const dc::dist::TensorList& list) {
  return std::vector<Tensor>(list.begin(), list.end());
}

class TorchTransport final : public dc::dist::Backend {
 public:
  /// `ops`: a TorchOps over one torch group (its rank, size, global ranks and
  /// devices are read once here).
  TorchTransport(nb::object ops, double timeout_s) : ops_(std::move(ops)), timeout_s_(timeout_s) {
    nb::gil_scoped_acquire gil;
    ops_.attr("timeout_s") = timeout_s;  // the deadline of the waits TorchOps does itself
    rank_ = nb::cast<int>(ops_.attr("rank"));
    members_ = nb::cast<std::vector<int>>(ops_.attr("members"));
    cpu_ = nb::cast<bool>(ops_.attr("cpu"));
    cuda_ = nb::cast<bool>(ops_.attr("cuda"));
    device_ = nb::cast<int>(ops_.attr("device_index"));
  }
  ~TorchTransport() override {
    if (!Py_IsInitialized()) {  // destroyed after the interpreter: nothing to release into
      ops_.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    ops_.reset();
  }

  std::string backend_name() const override { return "torch"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int global_rank(int r) const override { return members_[static_cast<std::size_t>(r)]; }
  bool supports(const dc::Device& d) const override { return d.is_cpu() ? cpu_ : cuda_; }

  std::shared_ptr<dc::dist::Backend> split(Call& c, int color, int key) override {
    nb::object sub;
    {
      nb::gil_scoped_acquire gil;
      sub = guarded(c, [&] { return ops_.attr("split")(color, key); });
    }
    if (sub.is_none()) return nullptr;
    return std::make_shared<TorchTransport>(std::move(sub), timeout_s_);
  }

  void barrier(Call& c) override { issue(c, "barrier"); }
  void all_reduce(Call& c) override { issue(c, "all_reduce", c.outputs[0], op(c)); }
  void broadcast(Call& c) override { issue(c, "broadcast", c.outputs[0], c.root); }
  void reduce(Call& c) override { issue(c, "reduce", c.outputs[0], c.root, op(c)); }
  void all_gather(Call& c) override { issue(c, "all_gather", tensors(c.outputs), c.inputs[0]); }
  void all_gather_single(Call& c) override {
    issue(c, "all_gather_single", c.outputs[0], c.inputs[0]);
  }
  void all_gather_v(Call& c) override {
    issue(c, "all_gather_v", c.outputs[0], c.inputs[0], c.output_splits.to_vector());
  }
  void gather(Call& c) override { issue(c, "gather", tensors(c.outputs), c.inputs[0], c.root); }
  void scatter(Call& c) override { issue(c, "scatter", c.outputs[0], tensors(c.inputs), c.root); }
  void reduce_scatter(Call& c) override {
    issue(c, "reduce_scatter", c.outputs[0], tensors(c.inputs), op(c));
  }
  void reduce_scatter_single(Call& c) override {
    issue(c, "reduce_scatter_single", c.outputs[0], c.inputs[0], op(c));
  }
  void reduce_scatter_v(Call& c) override {
    issue(c, "reduce_scatter_v", c.outputs[0], c.inputs[0], c.input_splits.to_vector(), op(c));
  }
  void all_to_all(Call& c) override {
    issue(c, "all_to_all", tensors(c.outputs), tensors(c.inputs));
  }
  void all_to_all_single(Call& c) override {
    issue(c, "all_to_all_single", c.outputs[0], c.inputs[0], c.output_splits.to_vector(),
          c.input_splits.to_vector());
  }
  void send(Call& c) override { issue(c, "send", c.inputs[0], c.root, c.tag); }
  void recv(Call& c) override { issue(c, "recv", c.outputs[0], c.root, c.tag); }

 private:
  static std::string op(const Call& c) {
    if (c.reduce_op == dc::dist::ReduceOp::PremulSum)
      return "premul_sum:" + std::to_string(c.reduce_op.factor());
    return dc::dist::reduce_op_name(c.reduce_op);
  }

  // Runs f (which calls into Python) with the GIL held; a Python exception
  // becomes BackendError at the call's site, with torch's text.
  template <class F>
  nb::object guarded(const Call& c, F&& f) {
    try {
      return f();
    } catch (nb::python_error& e) {
      // diffcomm's own errors (e.g. raised by TorchOps) keep their class.
      if (e.matches(nb::module_::import_("diffcomm._core").attr("Error"))) throw;
      // The group is unusable now: every other rank is told to dump and
      // report before this job ends (the store's alarm,
      // diffcomm/torch/_job_end.py).
      const bool timed_out = e.matches(PyExc_TimeoutError);
      nb::module_::import_("diffcomm.torch._job_end").attr("note_failure")(c.where(), timed_out);
      if (timed_out) {
        throw dc::Timeout(c.site(), fmt::format("timed out after {} s: {}; a member returned "
                                                "early, failed or skipped this call (the group "
                                                "is unusable now)",
                                                timeout_s_, c.signature()));
      }
      // torch's exception, without the traceback: "RuntimeError: ...".
      const std::string type = nb::cast<std::string>(e.type().attr("__name__"));
      throw dc::BackendError(c.site(),
                             "torch: " + type + ": " + nb::cast<std::string>(nb::str(e.value())));
    }
  }

  // One primitive: the TorchOps method issues the torch call(s) and returns
  // their Works; finish() waits for them with the deadline as torch's
  // timeout (blocked in Work.wait, which releases the GIL: no polling, so a
  // waiting rank leaves the cores to gloo's threads; polling here cost up
  // to 4x on 2 cores). Past the deadline it raises TimeoutError: Timeout.
  template <class... Args>
  void issue(Call& c, const char* method, const Args&... args) {
    nb::gil_scoped_acquire gil;
    nb::object works = guarded(c, [&] { return ops_.attr(method)(args...); });
    guarded(c, [&] { return ops_.attr("finish")(works); });
  }

  nb::object ops_;
  double timeout_s_;
  int rank_ = 0;
  std::vector<int> members_;
  bool cpu_ = false, cuda_ = false;
  int device_ = 0;

 public:
  /// Where checked mode's fingerprints live: CPU for a group that takes CPU
  /// tensors (gloo), else the group's CUDA device.
  dc::Device control_device() const { return cpu_ ? dc::Device::cpu() : dc::Device::cuda(device_); }
};

}  // namespace

void bind_torch_transport(nb::module_& m) {
  auto t = m.def_submodule("torch_transport",
                           "The torch transport: diffcomm's semantics over a torch ProcessGroup.");
  t.def(
      "group",
      [](nb::object ops, nb::object make_control, const std::string& name,
         std::optional<bool> check, bool native_reduction, std::optional<double> timeout_s) {
        dc::dist::Options o;
        o.check = check;
        o.native_reduction = native_reduction;
        o.timeout_s = timeout_s;
        const double deadline = o.resolved_timeout_s();
        auto transport = std::make_shared<TorchTransport>(ops, deadline);
        auto control = [&]() -> std::shared_ptr<dc::dist::Backend> {
          return std::make_shared<TorchTransport>(make_control(), deadline);
        };
        auto backend = dc::dist::stack_layers(transport, o, control, transport->control_device());
        // Options{}: DIFFCOMM_FR_SIZE / DIFFCOMM_FR_DUMP_DIR; dumps named by the torch rank.
        auto recorder = dc::dist::FlightRecorder::for_rank(o, transport->rank(), transport->size());
        return ProcessGroup(std::move(backend), name, nullptr, std::move(recorder));
      },
      "ops"_a, "make_control"_a, "name"_a = "torch", "check"_a = nb::none(),
      "native_reduction"_a = false, "timeout_s"_a = nb::none(),
      "A diffcomm group whose data moves through `ops` (a diffcomm.torch._transport.TorchOps). "
      "make_control() returns the TorchOps of a duplicate torch group for checked mode (called "
      "only when check resolves on). Options as for mpi.world.");
}

}  // namespace diffcomm_python

// diffcomm._core.sim: the threaded simulated world (diffcomm.sim.run), the
// training step, its reference check and the sweep.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <string>
#include <vector>

#include "bind.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/report.hpp"
#include "diffcomm/sim/world.hpp"
#include "threaded_world.hpp"

namespace diffcomm_python {

// ---------------------------------------------------------------- sim
namespace {
ep::StepConfig make_step_config(int dp, int cp, int tp, bool sp, const std::string& layout,
                                int buckets, int encoder_cp, int64_t hidden, int64_t ffn,
                                const std::string& dtype, uint64_t seed,
                                const std::string& receiver_grad) {
  ep::StepConfig cfg;
  cfg.dp = dp;
  if (layout != "contiguous" && layout != "zigzag")
    throw dc::InvalidArgument("cp_layout '" + layout + "': expected contiguous or zigzag");
  cfg.decoder = {cp, tp, sp, layout == "zigzag" ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous};
  cfg.encoder = {buckets, encoder_cp};
  cfg.hidden = hidden;
  cfg.in_features = 16;  // as diffcomm-sim
  cfg.ffn = ffn;
  cfg.dtype = dc::parse_dtype(dtype);
  cfg.seed = seed;
  if (receiver_grad == "partial")
    cfg.receiver_grad = ep::ReceiverGrad::Partial;
  else if (receiver_grad == "replicated-over-tp")
    cfg.receiver_grad = ep::ReceiverGrad::ReplicatedOverTp;
  else if (receiver_grad != "auto")
    throw dc::InvalidArgument("receiver_grad '" + receiver_grad +
                              "': expected auto, partial or replicated-over-tp");
  return cfg;
}
}  // namespace

void bind_sim(nb::module_& m) {
  auto s = m.def_submodule("sim", "The simulated world.");
  s.def("differentiable_ops", &dc::sim::differentiable_ops);
  s.def(
      "check",
      [](const std::string& op, int ranks, uint64_t seed, const std::string& dtype) {
        const auto rep = dc::sim::check_adjoint(op, ranks, seed, dc::parse_dtype(dtype));
        return std::make_pair(dc::sim::to_json(rep), dc::sim::to_text(rep));
      },
      "op"_a, "ranks"_a, "seed"_a, "dtype"_a, release(), "(json, text) of `diffcomm-sim check`.");
  s.def(
      "step",
      [](int dp, int cp, int tp, bool sp, const std::string& layout, int buckets, int ecp,
         int samples, int images_per_sample, int64_t hidden, int64_t ffn, const std::string& dtype,
         uint64_t seed, const std::string& images, const std::string& receiver_grad,
         std::optional<std::pair<int, int>> fault, const std::string& trace) {
        const auto cfg = make_step_config(dp, cp, tp, sp, layout, buckets, ecp, hidden, ffn, dtype,
                                          seed, receiver_grad);
        const auto per_dp =
            dc::sim::step_batches(cfg, ep::load_image_sizes(images), samples, images_per_sample);
        dc::sim::StepRunOptions o;
        if (fault) o.fault = dc::sim::Fault{fault->first, fault->second};
        o.trace_path = trace;
        const auto rep = dc::sim::run_step_report(cfg, per_dp, o);
        return std::make_tuple(dc::sim::to_json(rep), dc::sim::to_text(rep), rep.exit_code());
      },
      "dp"_a, "cp"_a, "tp"_a, "sp"_a, "cp_layout"_a, "buckets"_a, "encoder_cp"_a, "samples"_a,
      "images_per_sample"_a, "hidden"_a, "ffn"_a, "dtype"_a, "seed"_a, "images"_a,
      "receiver_grad"_a, "fault"_a, "trace"_a, release(),
      "(json, text, exit code) of `diffcomm-sim step` (defaults resolved by the caller).");
  s.def(
      "sweep",
      [](int dp, int cp, int tp, bool sp, const std::string& layout, int buckets, int ecp,
         int samples, int images_per_sample, int64_t hidden, int64_t ffn, const std::string& dtype,
         uint64_t first, uint64_t last, const std::string& images,
         const std::string& receiver_grad) {
        const auto cfg = make_step_config(dp, cp, tp, sp, layout, buckets, ecp, hidden, ffn, dtype,
                                          first, receiver_grad);
        const auto rep = dc::sim::run_sweep(cfg, ep::load_image_sizes(images), samples,
                                            images_per_sample, first, last);
        return dc::sim::to_json(rep);
      },
      "dp"_a, "cp"_a, "tp"_a, "sp"_a, "cp_layout"_a, "buckets"_a, "encoder_cp"_a, "samples"_a,
      "images_per_sample"_a, "hidden"_a, "ffn"_a, "dtype"_a, "first"_a, "last"_a, "images"_a,
      "receiver_grad"_a, release());

  nb::class_<dc::threaded::ThreadedWorld>(
      s, "ThreadedWorld",
      "A sim::World whose ranks are OS threads handing a baton (see diffcomm.sim.run).")
      .def(
          "__init__",
          [](dc::threaded::ThreadedWorld* w, int ranks, uint64_t seed, const std::string& schedule,
             std::optional<std::pair<int, int>> fault, bool trace) {
            dc::sim::WorldOptions o;
            o.ranks = ranks;
            o.seed = seed;
            if (schedule == "random")
              o.schedule = dc::sim::Schedule::Random;
            else if (schedule == "round_robin")
              o.schedule = dc::sim::Schedule::RoundRobin;
            else
              throw dc::InvalidArgument("schedule '" + schedule +
                                        "': expected random or round_robin");
            if (fault) o.fault = dc::sim::Fault{fault->first, fault->second};
            o.trace = trace;
            o.stack_size = 64 * 1024;  // proxy fibers only forward calls
            new (w) dc::threaded::ThreadedWorld(o);
          },
          "ranks"_a, "seed"_a = 0, "schedule"_a = "random", "fault"_a = nb::none(),
          "trace"_a = true)
      .def("start", &dc::threaded::ThreadedWorld::start, "rank"_a, release())
      .def("finish", &dc::threaded::ThreadedWorld::finish, "rank"_a, "failure"_a, release())
      .def("run", &dc::threaded::ThreadedWorld::run, release())
      .def("cancel", &dc::threaded::ThreadedWorld::cancel, "why"_a, release())
      .def("size", &dc::threaded::ThreadedWorld::size)
      .def("error_messages", &dc::threaded::ThreadedWorld::error_messages)
      .def("trace_hash",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().trace_hash(); })
      .def("sim_time_us",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().sim_time_us(); })
      .def(
          "stats",
          [](const dc::threaded::ThreadedWorld& w, int r) {
            return stats_dict(w.world().stats(r));
          },
          "rank"_a)
      .def(
          "write_trace",
          [](const dc::threaded::ThreadedWorld& w, const std::string& p) {
            w.world().write_trace(p);
          },
          "path"_a)
      .def("trace_len",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().trace().size(); });
}

}  // namespace diffcomm_python

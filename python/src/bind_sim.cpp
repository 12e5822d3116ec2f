// diffcomm._core.sim: the threaded simulated world (diffcomm.sim.run), the
// training step, its reference check and the sweep.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <string>
#include <vector>

#include "bind.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/rank_process.hpp"
#include "diffcomm/sim/report.hpp"
#include "diffcomm/sim/step_options.hpp"
#include "diffcomm/sim/threaded_world.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm_python {

// ---------------------------------------------------------------- ranks as processes
namespace {
void bind_rank_process(nb::module_& s) {
  s.def(
      "serve_rank_process",
      [](const dc::sim::ThreadedWorld& w, int rank, const dc::dist::ProcessGroup& g, int socket_fd,
         int memory_fd) {
        dc::sim::RankProcessEnd end;
        {
          nb::gil_scoped_release unlocked;
          end = dc::sim::serve_rank_process(w, rank, g, socket_fd, memory_fd);
        }
        return nb::make_tuple(end.reported, end.failure,
                              nb::bytes(end.payload.data(), end.payload.size()));
      },
      "world"_a, "rank"_a, "group"_a, "socket_fd"_a, "memory_fd"_a,
      "World side of a rank process (sim/rank_process.hpp): (reported, failure, payload).");
  s.def("connect_rank_process", &dc::sim::connect_rank_process, "socket_fd"_a, "memory_fd"_a,
        release(), "Rank process side: waits for the start, returns the rank's world group.");
  s.def(
      "finish_rank_process",
      [](int socket_fd, const std::string& failure, nb::bytes payload) {
        std::string bytes(payload.c_str(), payload.size());
        nb::gil_scoped_release unlocked;
        return dc::sim::finish_rank_process(socket_fd, failure, bytes);
      },
      "socket_fd"_a, "failure"_a, "payload"_a,
      "Rank process side: reports the end of the rank function; False if the world has gone.");
}
}  // namespace

// ---------------------------------------------------------------- sim
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
  using dc::sim::StepOptions;
  nb::class_<StepOptions>(s, "StepOptions",
                          "The options of diffcomm-sim step (sim/step_options.hpp); 0 / empty "
                          "means the default. diffcomm.sim.step fills them from keywords.")
      .def(nb::init<>())
      .def_rw("ranks", &StepOptions::ranks)
      .def_rw("dp", &StepOptions::dp)
      .def_rw("cp", &StepOptions::cp)
      .def_rw("tp", &StepOptions::tp)
      .def_rw("sp", &StepOptions::sp)
      .def_rw("sp_chunks", &StepOptions::sp_chunks)
      .def_rw("grad_block_rows", &StepOptions::grad_block_rows)
      .def_rw("ffn_blocks", &StepOptions::ffn_blocks)
      .def_rw("cp_layout", &StepOptions::cp_layout)
      .def_rw("encoder_buckets", &StepOptions::encoder_buckets)
      .def_rw("encoder_cp", &StepOptions::encoder_cp)
      .def_rw("batch", &StepOptions::batch)
      .def_rw("images_per_sample", &StepOptions::images_per_sample)
      .def_rw("hidden", &StepOptions::hidden)
      .def_rw("ffn", &StepOptions::ffn)
      .def_rw("dtype", &StepOptions::dtype)
      .def_rw("seed", &StepOptions::seed)
      .def_rw("images", &StepOptions::images)
      .def_rw("receiver_grad", &StepOptions::receiver_grad)
      .def_rw("model", &StepOptions::model)
      .def("resolved", &StepOptions::resolved,
           "Every default filled in; InvalidArgument naming the option otherwise.");
  s.def(
      "step",
      [](const StepOptions& options, std::optional<std::pair<int, int>> fault,
         const std::string& trace, bool equivalence) {
        const StepOptions o = options.resolved();
        const auto cfg = o.config();
        const auto per_dp = dc::sim::step_batches(cfg, ep::load_image_sizes(o.images), o.batch,
                                                  o.images_per_sample, ep::vision_model(o.model));
        dc::sim::StepRunOptions run;
        if (fault) run.fault = dc::sim::Fault{fault->first, fault->second};
        run.trace_path = trace;
        run.equivalence = equivalence;
        const auto rep = dc::sim::run_step_report(cfg, per_dp, run);
        return std::make_tuple(dc::sim::to_json(rep), dc::sim::to_text(rep), rep.exit_code());
      },
      "options"_a, "fault"_a, "trace"_a, "equivalence"_a = false, release(),
      "(json, text, exit code) of `diffcomm-sim step` (--equivalence with equivalence).");
  s.def(
      "sweep",
      [](const StepOptions& options, uint64_t first, uint64_t last) {
        StepOptions o = options.resolved();
        o.seed = first;
        const auto rep =
            dc::sim::run_sweep(o.config(), ep::load_image_sizes(o.images), o.batch,
                               o.images_per_sample, first, last, {}, ep::vision_model(o.model));
        return dc::sim::to_json(rep);
      },
      "options"_a, "first"_a, "last"_a, release(), "The JSON of `diffcomm-sim sweep`.");

  s.attr("MAX_RANKS") = dc::sim::kMaxRanks;
  nb::class_<dc::sim::ThreadedWorld>(
      s, "ThreadedWorld",
      "A sim::World whose ranks are OS threads handing a baton (see diffcomm.sim.run).")
      .def(
          "__init__",
          [](dc::sim::ThreadedWorld* w, int ranks, uint64_t seed, const std::string& schedule,
             std::optional<std::pair<int, int>> fault, bool trace, bool one_cpu) {
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
            new (w) dc::sim::ThreadedWorld(
                o, one_cpu ? dc::sim::CpuPlacement::OneCpu : dc::sim::CpuPlacement::Os);
          },
          "ranks"_a, "seed"_a = 0, "schedule"_a = "random", "fault"_a = nb::none(),
          "trace"_a = true, "one_cpu"_a = true)
      .def("start", &dc::sim::ThreadedWorld::start, "rank"_a, release())
      .def("finish", &dc::sim::ThreadedWorld::finish, "rank"_a, "failure"_a, release())
      .def("run", &dc::sim::ThreadedWorld::run, release())
      .def("cancel", &dc::sim::ThreadedWorld::cancel, "why"_a, release())
      .def("running_rank", &dc::sim::ThreadedWorld::running_rank, release(),
           "The rank whose thread holds the baton now, or -1.")
      .def("cpu", &dc::sim::ThreadedWorld::cpu,
           "The CPU the world's threads share (one_cpu=True), or -1.")
      .def("size", &dc::sim::ThreadedWorld::size)
      .def("error_messages", &dc::sim::ThreadedWorld::error_messages)
      .def("trace_hash", [](const dc::sim::ThreadedWorld& w) { return w.world().trace_hash(); })
      .def("sim_time_us", [](const dc::sim::ThreadedWorld& w) { return w.world().sim_time_us(); })
      .def(
          "stats",
          [](const dc::sim::ThreadedWorld& w, int r) { return stats_dict(w.world().stats(r)); },
          "rank"_a)
      .def(
          "write_trace",
          [](const dc::sim::ThreadedWorld& w, const std::string& p) { w.world().write_trace(p); },
          "path"_a)
      .def("trace_len", [](const dc::sim::ThreadedWorld& w) { return w.world().trace().size(); });
  bind_rank_process(s);
}

}  // namespace diffcomm_python

// diffcomm._core: process groups, meshes, stats, and the backends (mpi, nccl
// submodules).
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "diffcomm/config.hpp"
#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/tensor/error.hpp"

#if DIFFCOMM_HAVE_MPI
#include <mpi.h>

#include "diffcomm/backends/mpi.hpp"
#endif
#if DIFFCOMM_PYTHON_NCCL
#include "diffcomm/backends/nccl.hpp"
#endif

#include "bind.hpp"

namespace diffcomm_python {

// ---------------------------------------------------------------- misc
namespace {
dc::dist::ReduceOp parse_reduce_op(const std::string& s) {
  using R = dc::dist::ReduceOp;
  if (s == "sum") return R::Sum;
  if (s == "avg") return R::Avg;
  if (s == "product") return R::Product;
  if (s == "min") return R::Min;
  if (s == "max") return R::Max;
  // "premul_sum:<factor>" (the string form of ReduceOp.premul_sum(f)).
  constexpr std::string_view kPremul = "premul_sum:";
  if (s.rfind(kPremul, 0) == 0) {
    const std::string factor = s.substr(kPremul.size());
    char* end = nullptr;
    const double f = std::strtod(factor.c_str(), &end);
    if (!factor.empty() && end != nullptr && *end == '\0') return R::premul_sum(f);
  }
  dc::raise("diffcomm", std::string("unknown reduce op '") + s +
                            "' (sum, avg, product, min, max, premul_sum:<factor>)");
}

// diffcomm.ReduceOp: torch.distributed.ReduceOp's names (SUM, AVG, PRODUCT,
// MIN, MAX, premul_sum(f)); a string ("sum", ...) converts implicitly.
void bind_reduce_op(nb::module_& m) {
  using R = dc::dist::ReduceOp;
  nb::class_<R> r(m, "ReduceOp",
                  "A reduction (dist/reduce_op.hpp): ReduceOp.SUM, AVG, PRODUCT, MIN, MAX, "
                  "ReduceOp.premul_sum(factor), as torch.distributed.ReduceOp. Functions taking "
                  "one also accept 'sum', 'avg', 'product', 'min', 'max'.");
  r.def(
       "__init__", [](R* self, const std::string& name) { new (self) R(parse_reduce_op(name)); },
       "name"_a)
      .def_static("premul_sum", &R::premul_sum, "factor"_a,
                  "factor x sum (torch's _make_nccl_premul_sum). InvalidArgument for a "
                  "non-finite factor.")
      .def_prop_ro("name", [](const R& op) { return dc::dist::reduce_op_name(op); })
      .def_prop_ro("factor", &R::factor)
      .def("__eq__", [](const R& a, const R& b) { return a == b; })
      .def("__hash__", [](const R& op) { return std::hash<std::string>{}(reduce_op_name(op)); })
      .def("__repr__", [](const R& op) { return "diffcomm.ReduceOp(" + reduce_op_name(op) + ")"; });
  // Static properties, not stored instances: an instance in its own type's
  // dict would keep the type alive past the interpreter's teardown.
  r.def_prop_ro_static("SUM", [](nb::handle) { return R(R::Sum); })
      .def_prop_ro_static("AVG", [](nb::handle) { return R(R::Avg); })
      .def_prop_ro_static("PRODUCT", [](nb::handle) { return R(R::Product); })
      .def_prop_ro_static("MIN", [](nb::handle) { return R(R::Min); })
      .def_prop_ro_static("MAX", [](nb::handle) { return R(R::Max); });
  nb::implicitly_convertible<std::string, R>();
}
}  // namespace

namespace {
nb::dict op_stats_dict(const dc::dist::OpStats& s) {
  nb::dict d;
  d["calls"] = s.calls;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  return d;
}
}  // namespace

nb::dict stats_dict(const dc::dist::Stats& stats) {
  nb::dict out;
  out["total"] = op_stats_dict(stats.total());
  nb::list entries;
  for (const auto& [key, s] : stats.entries()) {
    nb::dict e = op_stats_dict(s);
    e["group"] = key.first;
    e["op"] = key.second;
    entries.append(e);
  }
  out["entries"] = entries;
  return out;
}

#if DIFFCOMM_HAVE_MPI
std::unique_ptr<dc::mpi::Environment> g_mpi_env;
#endif

void bind_dist(nb::module_& m) {
  bind_reduce_op(m);
  nb::class_<dc::dist::FlightRecorder>(
      m, "FlightRecorder",
      "A rank's flight recorder (dist/flight_recorder.hpp): its last calls, shared by every group "
      "of the rank.")
      .def_prop_ro("capacity", &dc::dist::FlightRecorder::capacity, "Ring size (entries).")
      .def_prop_ro("dump_dir", &dc::dist::FlightRecorder::dump_dir,
                   "Where errors dump ('' = nowhere): DIFFCOMM_FR_DUMP_DIR.")
      .def("dump",
           nb::overload_cast<const std::string&>(&dc::dist::FlightRecorder::dump, nb::const_),
           "dir"_a,
           "Writes this rank's dump as dir/rank-<global rank>.json (flight_dump.hpp's schema); "
           "returns its path. Never communicates. Raises InvalidArgument when it cannot write, "
           "and for a simulated world's recorder (its dump could not be replayed: str() gives its "
           "text).")
      .def("__str__", nb::overload_cast<>(&dc::dist::FlightRecorder::dump, nb::const_),
           "The newest 64 records, one line each.");
  m.def("dump_flight_recorders_on_error", &dc::dist::FlightRecorder::dump_all_on_error,
        "Every live production recorder with a dump directory writes its dump; the package's "
        "sys.excepthook calls it for a rank ending on an uncaught exception.");

  nb::class_<ProcessGroup>(m, "ProcessGroup",
                           "A diffcomm process group (ranks in every call are group-local).")
      .def("rank", &ProcessGroup::rank, "This process's (thread's) rank in the group.")
      .def("size", &ProcessGroup::size)
      .def("global_rank", &ProcessGroup::global_rank, "group_rank"_a,
           "Global rank of the member with group-local rank group_rank.")
      .def("members", &ProcessGroup::members, "Global ranks of all members, in group order.")
      .def(
          "group_rank",
          [](const ProcessGroup& g, int global) {
            const auto m = g.members();
            for (std::size_t i = 0; i < m.size(); ++i)
              if (m[i] == global) return static_cast<int>(i);
            dc::raise("diffcomm", std::string("global rank ") + std::to_string(global) +
                                      " is not a member of group '" + g.name() + "'");
          },
          "global_rank"_a, "Group-local rank of a member given its global rank.")
      .def("flight_recorder", &ProcessGroup::flight_recorder, nb::rv_policy::reference_internal,
           "This rank's flight recorder (shared by all its groups).")
      .def_prop_ro("name", &ProcessGroup::name)
      .def_prop_ro("backend_name", [](const ProcessGroup& g) { return g.backend().backend_name(); })
      .def(
          "stats", [](const ProcessGroup& g) { return stats_dict(g.stats()); },
          "Traffic counters of this rank: {'total': {...}, 'entries': [...]}.")
      .def(
          "new_group",
          [](const ProcessGroup& g, const std::vector<int>& ranks, std::string name) {
            return g.new_group(ranks, std::move(name));
          },
          "ranks"_a, "name"_a = "", release(),
          "Collective: the sub-group of the given group-local ranks (None on non-members).")
      .def(
          "split",
          [](const ProcessGroup& g, int color, int key, const std::vector<int64_t>& fingerprint,
             std::string name) { return g.split(color, key, fingerprint, std::move(name)); },
          "color"_a, "key"_a, "fingerprint"_a, "name"_a, release(),
          "Collective, MPI_Comm_split semantics.")
      .def(
          "barrier", [](const ProcessGroup& g) { dc::dist::barrier(g); }, release())
      .def(
          "send",
          [](const ProcessGroup& g, const dc::Tensor& t, int dst, int tag) {
            dc::dist::send(g, t, dst, tag);
          },
          "tensor"_a, "dst"_a, "tag"_a = 0, release(),
          "Sends tensor to group-local rank dst; blocks until a matching recv takes it "
          "(dist::send: rendezvous, no buffering).")
      .def(
          "recv",
          [](const ProcessGroup& g, const dc::Tensor& t, int src, int tag) {
            dc::dist::recv(g, t, src, tag);
          },
          "tensor"_a, "src"_a, "tag"_a = 0, release(),
          "Receives into tensor (in place; same shape and dtype as sent) from group-local rank "
          "src (dist::recv).")
      .def(
          "all_reduce_",
          [](const ProcessGroup& g, const dc::Tensor& t, const dc::dist::ReduceOp& op) {
            dc::dist::all_reduce(g, t, op);
          },
          "tensor"_a, "op"_a, release(),
          "Reduces tensor over the members, in place (dist::all_reduce; not differentiable).")
      .def(
          "broadcast_",
          [](const ProcessGroup& g, const dc::Tensor& t, int src) {
            dc::dist::broadcast(g, t, src);
          },
          "tensor"_a, "src"_a, release(),
          "Overwrites tensor with group-local rank src's, in place (dist::broadcast; not "
          "differentiable).")
      .def(
          "backward_pending", [](const ProcessGroup& g) { g.cohort()->backward_pending(); },
          release(),
          "Runs, with zero cotangents, the backward of every differentiable collective of this "
          "rank that has not run yet (the participation of a rank whose loss reaches none of "
          "them; diffcomm.grad/backward do it for the collectives they meet).")
      .def_prop_ro(
          "_cohort_id",
          [](const ProcessGroup& g) { return reinterpret_cast<std::uintptr_t>(g.cohort().get()); },
          "Identifies this rank's cohort (shared by all its groups): diffcomm.torch keys its "
          "pending bridges by it.")
      .def("__repr__", [](const ProcessGroup& g) {
        return "diffcomm.ProcessGroup(name='" + g.name() + "', rank=" + std::to_string(g.rank()) +
               ", size=" + std::to_string(g.size()) + ", backend='" + g.backend().backend_name() +
               "')";
      });

  nb::class_<dc::dist::DeviceMesh>(m, "DeviceMesh",
                                   "Ranks laid out on named dims, row-major, last dim fastest.")
      .def(nb::init<ProcessGroup, dc::dist::DeviceMesh::Dims>(), "world"_a, "dims"_a, release())
      .def("size", &dc::dist::DeviceMesh::size, "dim"_a)
      .def("coordinate", &dc::dist::DeviceMesh::coordinate, "dim"_a)
      .def(
          "group",
          [](dc::dist::DeviceMesh& mesh, const nb::object& dims) -> ProcessGroup {
            if (nb::isinstance<nb::str>(dims)) return mesh.group(nb::cast<std::string>(dims));
            auto names = nb::cast<std::vector<std::string>>(dims);
            nb::gil_scoped_release unlock;
            return mesh.group(names);
          },
          "dims"_a,
          "The group along one dim (a str) or several dims (a list, created on first use: "
          "collective).")
      .def("rank_of", &dc::dist::DeviceMesh::rank_of, "coords"_a)
      .def_prop_ro("dims", &dc::dist::DeviceMesh::dims)
      .def_prop_ro("world", &dc::dist::DeviceMesh::world);
}

void bind_backends(nb::module_& m) {
  m.attr("HAVE_MPI") = bool(DIFFCOMM_HAVE_MPI);
  m.attr("HAVE_NCCL") = bool(DIFFCOMM_PYTHON_NCCL);  // diffcomm's own NCCL backend, linked in
  m.attr("HAVE_CUDA") = bool(DIFFCOMM_HAVE_CUDA);
  m.attr("__version__") = DIFFCOMM_VERSION;
#if DIFFCOMM_HAVE_MPI
  auto mpi = m.def_submodule("mpi", "The Open MPI backend.");
  mpi.def(
      "init",
      [] {
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (!initialized && !g_mpi_env)
          g_mpi_env = std::make_unique<dc::mpi::Environment>(nullptr, nullptr);
      },
      "MPI_Init_thread unless MPI is already initialised (e.g. by mpi4py).");
  mpi.def(
      "initialized",
      [] {
        int initialized = 0;
        MPI_Initialized(&initialized);
        return initialized != 0;
      },
      "Whether MPI_Init has run in this process (by diffcomm or mpi4py).");
  mpi.def(
      "world_rank",
      [] {
        int rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        return rank;
      },
      "This process's rank in MPI_COMM_WORLD (MPI must be initialised).");
  mpi.def(
      "world_size",
      [] {
        int size = 0;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        return size;
      },
      "The size of MPI_COMM_WORLD (MPI must be initialised).");
  mpi.def(
      "finalized",
      [] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        return finalized != 0;
      },
      "Whether MPI_Finalize has run in this process (MPI cannot be initialised again).");
  mpi.def(
      "finalize", [] { g_mpi_env.reset(); },
      "MPI_Finalize if diffcomm initialised MPI (not when mpi4py did). After a Timeout it ends "
      "the job with MPI_Abort instead (see abort_if_timed_out).");
  mpi.def(
      "abort", [](int code) { dc::mpi::abort(code); }, "code"_a = 1,
      "MPI_Abort(MPI_COMM_WORLD, code): ends every process of the job; never returns.");
  mpi.def("timed_out", &dc::mpi::timed_out,
          "Whether a call of this process (any group, group creation included) raised Timeout.");
  mpi.def(
      "end_job", [](int code, const std::string& why) { dc::mpi::end_job(code, why); }, "code"_a,
      "why"_a,
      "Ends the job so that every process reports first: tells the others out of band (a peer "
      "waiting in a call raises Timeout or RankFailure naming this rank and `why`), waits up to "
      "3 s for every process to report, then the lowest-numbered one calls MPI_Abort(code). "
      "Never returns. See mpi::end_job in include/diffcomm/backends/mpi.hpp.");
  mpi.def("at_exit", &dc::mpi::at_exit, nb::call_guard<nb::gil_scoped_release>(),
          "At interpreter exit (before MPI_Finalize): after a Timeout ends the job (end_job); "
          "otherwise meets the other processes, and if one fails meanwhile dumps this "
          "process's flight recorders and joins end_job. See mpi::at_exit.");
  mpi.def("abort_if_timed_out", &dc::mpi::abort_if_timed_out,
          "After a Timeout: prints which call timed out and ends the job with MPI_Abort (code "
          "124), since MPI_Finalize could wait for the calls in flight forever; else returns. "
          "diffcomm.torch registers it to run at interpreter exit.");
  // dist::Options as keyword arguments: check (None: DIFFCOMM_CHECK, else on
  // in Debug builds), native_reduction, timeout_s (None: DIFFCOMM_TIMEOUT,
  // else 600 s).
  auto options = [](std::optional<bool> check, bool native_reduction,
                    std::optional<double> timeout_s) {
    dc::dist::Options o;
    o.check = check;
    o.native_reduction = native_reduction;
    o.timeout_s = timeout_s;
    return o;
  };
  mpi.def(
      "world",
      [options](std::optional<bool> check, bool native_reduction, std::optional<double> timeout_s) {
        return dc::mpi::world(options(check, native_reduction, timeout_s));
      },
      "check"_a = nb::none(), "native_reduction"_a = false, "timeout_s"_a = nb::none(),
      "The group of MPI_COMM_WORLD (borrowed). check: cross-rank fingerprint checks (None: "
      "DIFFCOMM_CHECK, else on in Debug builds); native_reduction: MPI's own reductions (faster, "
      "not bit-identical to the simulated world); timeout_s: deadline of every wait (None: "
      "DIFFCOMM_TIMEOUT, else 600).");
  mpi.def(
      "from_comm_address",
      [options](uintptr_t address, const std::string& name, std::optional<bool> check,
                bool native_reduction, std::optional<double> timeout_s) {
        return dc::mpi::from_comm(*reinterpret_cast<MPI_Comm*>(address), name,
                                  options(check, native_reduction, timeout_s));
      },
      "address"_a, "name"_a = "mpi", "check"_a = nb::none(), "native_reduction"_a = false,
      "timeout_s"_a = nb::none(),
      "A group over a caller's communicator given the address of its MPI_Comm handle "
      "(mpi4py: MPI._addressof(comm)); borrowed, never freed by diffcomm.");
#endif
#if DIFFCOMM_PYTHON_NCCL
  auto nccl = m.def_submodule("nccl", "The NCCL backend (CUDA tensors).");
  nccl.def("device_count", &dc::nccl::device_count);
  nccl.def("unique_id", [] {
    const ncclUniqueId id = dc::nccl::unique_id();
    return nb::bytes(id.internal, sizeof(id.internal));
  });
  nccl.def(
      "init_rank",
      [](nb::bytes id_bytes, int nranks, int rank, int device, uintptr_t stream) {
        ncclUniqueId id;
        if (id_bytes.size() != sizeof(id.internal))
          dc::raise("nccl.init_rank", "the unique id must have 128 bytes");
        std::memcpy(id.internal, id_bytes.c_str(), sizeof(id.internal));
        dc::nccl::Options o;
        o.stream = reinterpret_cast<cudaStream_t>(stream);
        nb::gil_scoped_release unlock;
        return dc::nccl::init_rank(id, nranks, rank, device, o);
      },
      "unique_id"_a, "nranks"_a, "rank"_a, "device"_a, "stream"_a = 0);
  nccl.def("set_stream", [](const ProcessGroup& g, uintptr_t stream) {
    dc::nccl::set_stream(g, reinterpret_cast<cudaStream_t>(stream));
  });
  nccl.def("abort", &dc::nccl::abort, "group"_a, release(),
           "ncclCommAbort on the group's (owned) communicator: every later call on it raises "
           "BackendError. InvalidArgument for a borrowed communicator.");
#endif
}

}  // namespace diffcomm_python

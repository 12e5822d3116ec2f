// The Open MPI backend. The funnel (dist/collectives.cpp) has validated every
// Call; here each primitive maps to the non-blocking MPI call it wraps
// (issue), then waits for it with the shared deadline loop (complete), so a
// peer that never arrives gives Timeout instead of a hang. The reductions here
// are MPI's native ones; dist::stack_layers (dist/backend/layers.hpp) puts the
// deterministic composition (ComposedReductions) and checked mode over this
// transport as Options ask. MPI's error codes become BackendError at every
// boundary. The collectives built from per-peer messages (the ring all-reduce,
// the exchanges behind gathers, scatters and all-to-alls) are in
// peer_algorithms.cpp; the helpers both files use in mpi_util.hpp.
#include <fmt/format.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/backend/block_layout.hpp"
#include "diffcomm/distributed/backend/composed.hpp"
#include "diffcomm/distributed/backend/layers.hpp"
#include "diffcomm/distributed/backend/wait.hpp"
#include "diffcomm/tensor/error.hpp"
#include "job_end.hpp"
#include "mpi_util.hpp"
#include "peer_algorithms.hpp"
#include "timeouts.hpp"

namespace diffcomm::mpi {
namespace {

using dist::Call;
using dist::OpType;
using dist::ReduceOp;

using detail::Block;
using detail::Blocks;
using detail::bytes;
using detail::check_plain;
using detail::each_byte_chunk;
using detail::each_chunk;
using detail::elem;
using detail::g_max_count;
using detail::mpi_op;
using detail::mpi_type;
using detail::Requests;

void finish_avg(const Call& c, Tensor t) {
  if (c.reduce_op == ReduceOp::Avg) t.copy_(dist::scaled(t, 1.0 / c.group_size));
}

// The native path's PremulSum input: factor x t (a new tensor), else t.
Tensor premultiplied(const Call& c, const Tensor& t) {
  if (c.reduce_op != ReduceOp::PremulSum) return t;
  return dist::scaled(t, c.reduce_op.factor());
}

// A step of group creation, completed with the deadline like every call.
void wait_setup(MPI_Request& req, const std::string& what, const std::string& name, int rank,
                int size, double timeout_s) {
  dist::wait_with_deadline(
      timeout_s,
      [&] {
        int flag = 0;
        check_plain(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), what.c_str());
        return flag != 0;
      },
      [&](double t) {
        const std::string where =
            fmt::format("{} creating group '{}' (rank {} of {})", what, name, rank, size);
        detail::note_timeout(where);
        return fmt::format(
            "timed out after {} s waiting in {}: creating a group is collective over its "
            "communicator, and a member is late at startup, failed or never created it",
            t, where);
      });
}

// A duplicate of `comm`, made with the deadline like every step of group
// creation.
MPI_Comm duplicate(MPI_Comm comm, const std::string& name, double timeout_s) {
  int rank = 0, size = 1;
  check_plain(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_plain(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  check_plain(MPI_Comm_idup(comm, &dup, &req), "MPI_Comm_idup");
  wait_setup(req, "MPI_Comm_idup (diffcomm's own communicator)", name, rank, size, timeout_s);
  check_plain(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return dup;
}

class MpiBackend final : public dist::Backend {
 public:
  // `name` names the group in a timeout while it is being created.
  MpiBackend(MPI_Comm comm, bool owned, const dist::Options& options, const std::string& name)
      : comm_(comm), owned_(owned), options_(options), timeout_s_(options.resolved_timeout_s()) {
    detail::watch_for_fork();
    check_plain(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_plain(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_plain(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    MPI_Group mine, world;
    check_plain(MPI_Comm_group(comm_, &mine), "MPI_Comm_group");
    check_plain(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
    std::vector<int> local(static_cast<std::size_t>(size_));
    std::iota(local.begin(), local.end(), 0);
    members_.resize(local.size());
    check_plain(MPI_Group_translate_ranks(mine, size_, local.data(), world, members_.data()),
                "MPI_Group_translate_ranks");
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    coll_ = duplicate(comm_, name, timeout_s_);
    peers_ = detail::Peers(coll_, rank_, size_, timeout_s_);
  }
  ~MpiBackend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || in_forked_child()) return;  // nothing to free, or the parent's
    MPI_Comm_free(&coll_);
    if (owned_) MPI_Comm_free(&comm_);
  }

  std::string backend_name() const override { return "mpi"; }
  // A group kept past MPI_Finalize (destroy_process_group, mpi::Environment's
  // end) or used in a forked child: Open MPI would abort the whole job on its
  // first MPI call ("called after MPI_FINALIZE"). Refused before numbering.
  void check_caller(const Call& call) const override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !in_forked_child()) return;
    ErrorSite site = call.site();
    site.call.reset();
    site.backend = "mpi";
    throw BackendError(std::move(site),
                       finalized ? "MPI was finalised (destroy_process_group or the end of "
                                   "mpi::Environment): this group cannot be used any more"
                                 : "this process was forked from the one that set MPI up: the "
                                   "parent's groups cannot be used in a child");
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int global_rank(int r) const override { return members_[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override { return d.is_cpu(); }
  // all_to_all_single and all_gather_v below skip their own-block memcpy on
  // Call::own_block_placed (the deterministic reductions' steps).
  bool skips_own_block() const override { return true; }

  std::shared_ptr<dist::Backend> split(Call& c, int color, int key) override {
    // MPI_Comm_split blocks: meet in a non-blocking barrier with the deadline
    // first, so a member that never calls gives Timeout, not a hang.
    Requests reqs;
    DIFFCOMM_MPI_CHECK(MPI_Ibarrier(comm_, reqs.add()), c);
    wait(c, reqs);
    MPI_Comm sub = MPI_COMM_NULL;
    DIFFCOMM_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), c);
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiBackend>(sub, /*owned=*/true, options_,
                                        fmt::format("a sub-group split in {}", c.where()));
  }

  void barrier(Call& c) override {
    Requests reqs;
    DIFFCOMM_MPI_CHECK(MPI_Ibarrier(comm_, reqs.add()), c);
    wait(c, reqs);
  }

  void all_reduce(Call& c) override {
    const Tensor& t = c.outputs[0];
    if (c.reduce_op == ReduceOp::PremulSum) Tensor(t).copy_(premultiplied(c, t));
    if (peers_.use_ring(t)) {
      peers_.ring_all_reduce(c, t);
      finish_avg(c, t);
      return;
    }
    Requests reqs;
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, elem(t, off), count, mpi_type(c.dtype),
                                        mpi_op(c.dtype, c.reduce_op), comm_, reqs.add()),
                         c);
    });
    wait(c, reqs);
    finish_avg(c, t);
  }

  void broadcast(Call& c) override {
    const Tensor& t = c.outputs[0];
    Requests reqs;
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Ibcast(elem(t, off), count, mpi_type(c.dtype), c.root, comm_, reqs.add()), c);
    });
    wait(c, reqs);
  }

  void reduce(Call& c) override {
    const Tensor& t = c.outputs[0];
    const bool me = rank_ == c.root;
    // Off the root the tensor is only read: premultiply a copy.
    const Tensor send = premultiplied(c, t);
    if (me && c.reduce_op == ReduceOp::PremulSum) Tensor(t).copy_(send);
    Requests reqs;
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Ireduce(me ? MPI_IN_PLACE : elem(send, off), me ? elem(t, off) : nullptr, count,
                      mpi_type(c.dtype), mpi_op(c.dtype, c.reduce_op), c.root, comm_, reqs.add()),
          c);
    });
    wait(c, reqs);
    if (me) finish_avg(c, t);
  }

  void all_gather(Call& c) override {
    // Gather into one contiguous buffer, then into the separate outputs.
    const Tensor& in = c.inputs[0];
    Tensor tmp = empty({static_cast<int64_t>(size_) * in.numel()}, in.dtype());
    peers_.gather_fixed(c, in, tmp);
    for (int s = 0; s < size_; ++s)
      c.outputs.writable(static_cast<std::size_t>(s))
          .copy_(tmp.row_view(s * in.numel(), in.numel()));
  }

  void all_gather_single(Call& c) override { peers_.gather_fixed(c, c.inputs[0], c.outputs[0]); }

  void all_gather_v(Call& c) override {
    // Per-peer messages, as gather_fixed (and no int-count limit to check).
    const Tensor& in = c.inputs[0];
    const Tensor& out = c.outputs[0];
    const auto blocks = dist::BlockLayout::of(c.output_splits, in.row_numel());
    const int64_t es = static_cast<int64_t>(element_size(c.dtype));
    const auto me = static_cast<std::size_t>(rank_);
    Blocks sends, recvs;
    peers_.each_peer([&](int to, int from) {
      const auto f = static_cast<std::size_t>(from);
      sends.push_back({to, static_cast<const char*>(in.data_ptr()), in.numel() * es});
      recvs.push_back({from, bytes(out) + blocks.offset(f) * es, blocks.length(f) * es});
    });
    peers_.exchange(c, sends, recvs, [&] {
      if (!c.own_block_placed)
        std::memcpy(bytes(out) + blocks.offset(me) * es, in.data_ptr(),
                    static_cast<std::size_t>(blocks.length(me) * es));
    });
  }

  void gather(Call& c) override {
    const Tensor& in = c.inputs[0];
    const bool me = rank_ == c.root;
    Tensor tmp = me ? empty({static_cast<int64_t>(size_) * in.numel()}, in.dtype()) : Tensor{};
    if (in.numel() <= g_max_count && static_cast<int64_t>(size_) * in.numel() <= g_max_count) {
      Requests reqs;
      DIFFCOMM_MPI_CHECK(MPI_Igather(in.data_ptr(), static_cast<int>(in.numel()), mpi_type(c.dtype),
                                     me ? tmp.data_ptr() : nullptr, static_cast<int>(in.numel()),
                                     mpi_type(c.dtype), c.root, comm_, reqs.add()),
                         c);
      wait(c, reqs);
    } else {
      const int64_t nb = static_cast<int64_t>(in.nbytes());
      Blocks sends, recvs;
      if (me) {
        for (int p = 0; p < size_; ++p)
          if (p == rank_)
            std::memcpy(bytes(tmp) + p * nb, in.data_ptr(), static_cast<std::size_t>(nb));
          else
            recvs.push_back({p, bytes(tmp) + p * nb, nb});
      } else {
        sends.push_back({c.root, static_cast<const char*>(in.data_ptr()), nb});
      }
      peers_.exchange(c, sends, recvs);
    }
    if (me)
      for (int s = 0; s < size_; ++s)
        c.outputs.writable(static_cast<std::size_t>(s))
            .copy_(tmp.row_view(s * in.numel(), in.numel()));
  }

  void scatter(Call& c) override {
    const Tensor& out = c.outputs[0];
    const bool me = rank_ == c.root;
    Tensor tmp;
    if (me) {
      tmp = empty({static_cast<int64_t>(size_) * out.numel()}, out.dtype());
      for (int s = 0; s < size_; ++s)
        tmp.row_view(s * out.numel(), out.numel())
            .copy_(c.inputs[static_cast<std::size_t>(s)].view_as_shape({out.numel()}));
    }
    if (static_cast<int64_t>(size_) * out.numel() <= g_max_count) {
      Requests reqs;
      DIFFCOMM_MPI_CHECK(
          MPI_Iscatter(me ? tmp.data_ptr() : nullptr, static_cast<int>(out.numel()),
                       mpi_type(c.dtype), out.data_ptr(), static_cast<int>(out.numel()),
                       mpi_type(c.dtype), c.root, comm_, reqs.add()),
          c);
      wait(c, reqs);
      return;
    }
    const int64_t nb = static_cast<int64_t>(out.nbytes());
    Blocks sends, recvs;
    if (me) {
      for (int p = 0; p < size_; ++p)
        if (p == rank_)
          std::memcpy(out.data_ptr(), bytes(tmp) + p * nb, static_cast<std::size_t>(nb));
        else
          sends.push_back({p, bytes(tmp) + p * nb, nb});
    } else {
      recvs.push_back({c.root, bytes(out), nb});
    }
    peers_.exchange(c, sends, recvs);
  }

  void reduce_scatter(Call& c) override {
    const Tensor& out = c.outputs[0];
    Tensor tmp = empty({static_cast<int64_t>(size_) * out.numel()}, out.dtype());
    for (int s = 0; s < size_; ++s)
      tmp.row_view(s * out.numel(), out.numel())
          .copy_(c.inputs[static_cast<std::size_t>(s)].view_as_shape({out.numel()}));
    reduce_blocks(c, tmp, out,
                  dist::BlockLayout::uniform(static_cast<std::size_t>(size_), out.numel()));
  }

  void reduce_scatter_single(Call& c) override {
    const Tensor& out = c.outputs[0];
    reduce_blocks(c, c.inputs[0], out,
                  dist::BlockLayout::uniform(static_cast<std::size_t>(size_), out.numel()));
  }

  void reduce_scatter_v(Call& c) override {
    reduce_blocks(c, c.inputs[0], c.outputs[0],
                  dist::BlockLayout::of(c.input_splits, c.inputs[0].row_numel()));
  }

  void all_to_all(Call& c) override {
    Blocks sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) continue;
      sends.push_back({p, static_cast<const char*>(c.inputs[pi].data_ptr()),
                       static_cast<int64_t>(c.inputs[pi].nbytes())});
      recvs.push_back({p, bytes(c.outputs[pi]), static_cast<int64_t>(c.outputs[pi].nbytes())});
    }
    const auto me = static_cast<std::size_t>(rank_);
    peers_.exchange(c, sends, recvs, [&] { c.outputs.writable(me).copy_(c.inputs[me]); });
  }

  void all_to_all_single(Call& c) override {
    const Tensor& in = c.inputs[0];
    const Tensor& out = c.outputs[0];
    // Per-peer non-blocking messages, never MPI_Alltoallv: whether a call
    // fits MPI_Alltoallv's int counts depends on every member's splits, which
    // no member knows alone, and members taking different paths would never
    // match. (Open MPI's own Ialltoallv sends the same per-peer messages.)
    const int64_t row_bytes = in.row_numel() * static_cast<int64_t>(element_size(c.dtype));
    const auto send = dist::BlockLayout::of(c.input_splits, row_bytes);
    const auto recv = dist::BlockLayout::of(c.output_splits, row_bytes);
    Blocks sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) continue;
      sends.push_back({p, bytes(in) + send.offset(pi), send.length(pi)});
      recvs.push_back({p, bytes(out) + recv.offset(pi), recv.length(pi)});
    }
    const auto me = static_cast<std::size_t>(rank_);
    peers_.exchange(c, sends, recvs, [&] {
      if (!c.own_block_placed)
        std::memcpy(bytes(out) + recv.offset(me), bytes(in) + send.offset(me),
                    static_cast<std::size_t>(send.length(me)));
    });
  }

  void send(Call& c) override {
    const Tensor& t = c.inputs[0];
    Requests reqs;
    each_byte_chunk(static_cast<int64_t>(t.nbytes()), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Isend(bytes(t) + off, count, MPI_BYTE, c.root, c.tag, comm_, reqs.add()), c);
    });
    wait(c, reqs);
  }

  void recv(Call& c) override {
    const Tensor& t = c.outputs[0];
    std::vector<int> expected;
    Requests reqs;
    each_byte_chunk(static_cast<int64_t>(t.nbytes()), [&](int64_t off, int count) {
      expected.push_back(count);
      DIFFCOMM_MPI_CHECK(
          MPI_Irecv(bytes(t) + off, count, MPI_BYTE, c.root, c.tag, comm_, reqs.add()), c);
    });
    std::vector<MPI_Status> statuses(reqs.reqs.size());
    wait(c, reqs, statuses.data());
    // A shorter message than the buffer would leave stale bytes: refuse it
    // (a longer one already failed with MPI_ERR_TRUNCATE -> BackendError).
    for (std::size_t i = 0; i < statuses.size(); ++i) {
      int got = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &got);
      if (got != expected[i])
        throw CollectiveMismatch(
            c.site(), fmt::format("collective mismatch: received {} bytes from rank {} but the "
                                  "buffer {} holds {} (shape or dtype differs from the sender's)",
                                  got, c.root, t.str(), expected[i]));
    }
  }

 private:
  // Completes an issued call within this group's deadline.
  void wait(const Call& c, Requests& r, MPI_Status* statuses = MPI_STATUSES_IGNORE) {
    detail::wait(c, timeout_s_, r, statuses);
  }

  static bool fits(const std::vector<int64_t>& v) {
    for (int64_t x : v)
      if (x > g_max_count) return false;
    return true;
  }
  static std::vector<int> to_int(const std::vector<int64_t>& v) {
    return std::vector<int>(v.begin(), v.end());
  }

  // Reduce block p of `in` (blocks.length(p) elements, in order) onto member
  // p's out.
  void reduce_blocks(Call& c, const Tensor& in_given, const Tensor& out,
                     const dist::BlockLayout& blocks) {
    const Tensor in = premultiplied(c, in_given);
    const std::vector<int64_t> counts = blocks.lengths();
    if (fits(counts) && blocks.total() <= g_max_count) {
      auto ic = to_int(counts);
      Requests reqs;
      DIFFCOMM_MPI_CHECK(
          MPI_Ireduce_scatter(in.data_ptr(), out.data_ptr(), ic.data(), mpi_type(c.dtype),
                              mpi_op(c.dtype, c.reduce_op), comm_, reqs.add()),
          c);
      wait(c, reqs);
    } else {
      // Large counts: one chunked reduce per destination.
      for (int p = 0; p < size_; ++p) {
        const int64_t at = blocks.offset(static_cast<std::size_t>(p));
        const int64_t n = blocks.length(static_cast<std::size_t>(p));
        const bool me = p == rank_;
        if (me)
          std::memcpy(out.data_ptr(), elem(in, at),
                      static_cast<std::size_t>(n) * element_size(c.dtype));
        Requests reqs;
        each_chunk(n, [&](int64_t off, int count) {
          DIFFCOMM_MPI_CHECK(MPI_Ireduce(me ? MPI_IN_PLACE : elem(in, at + off),
                                         me ? elem(out, off) : nullptr, count, mpi_type(c.dtype),
                                         mpi_op(c.dtype, c.reduce_op), p, comm_, reqs.add()),
                             c);
        });
        wait(c, reqs);
      }
    }
    finish_avg(c, out);
  }

  MPI_Comm comm_;
  // diffcomm's own messages (collectives built from Isend/Irecv) travel on a
  // duplicate of comm_: another context, so no user send/recv on comm_,
  // whatever its tag, can match them.
  MPI_Comm coll_ = MPI_COMM_NULL;
  bool owned_;
  dist::Options options_;
  double timeout_s_;
  int rank_ = 0, size_ = 1;
  std::vector<int> members_;
  detail::Peers peers_;  // the per-peer algorithms, on coll_
};

void require_initialised(const char* what) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) raise<BackendError>(what, "MPI is not initialised (create an mpi::Environment first)");
}

}  // namespace

Environment::Environment(int* argc, char*** argv) {
  detail::watch_for_fork();
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    check_plain(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    owns_ = true;
  }
}

Environment::~Environment() {
  if (in_forked_child()) return;  // the parent's MPI: not ours to end
  at_exit();  // after a Timeout, ends the job: MPI_Finalize would wait on the calls in flight
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

namespace {

// Every member must agree on checked mode: a checked member exchanges a
// fingerprint before each call and an unchecked one does not, so a mix
// would pair fingerprints with data (DIFFCOMM_CHECK not exported to a remote
// node, say). One flag per member, exchanged with the deadline.
void agree_on_checking(MPI_Comm comm, bool check, const std::string& name, double timeout_s) {
  int rank = 0, size = 1;
  check_plain(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_plain(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const int mine = check ? 1 : 0;
  std::vector<int> all(static_cast<std::size_t>(size));
  MPI_Request req = MPI_REQUEST_NULL;
  check_plain(MPI_Iallgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, comm, &req),
              "MPI_Iallgather");
  wait_setup(req, "MPI_Iallgather (checked-mode flags)", name, rank, size, timeout_s);
  std::vector<int> on, off;
  for (int r = 0; r < size; ++r) (all[static_cast<std::size_t>(r)] ? on : off).push_back(r);
  if (!on.empty() && !off.empty())
    throw BackendError(fmt::format(
        "mpi group '{}' (rank {} of {}): checked mode differs across ranks: ranks [{}] check, "
        "ranks [{}] do not; set Options::check or DIFFCOMM_CHECK the same on every rank "
        "(mpirun -x DIFFCOMM_CHECK exports it to remote nodes)",
        name, rank, size, fmt::join(on, ","), fmt::join(off, ",")));
}

// The transport under the layers Options ask for (dist::stack_layers); the
// checker's control backend is a duplicate of the communicator. Collective
// over `comm`, with the deadline: a member late at startup gives Timeout,
// never a hang.
std::shared_ptr<dist::Backend> make_backend(MPI_Comm comm, const std::string& name,
                                            const dist::Options& options) {
  auto data = std::make_shared<MpiBackend>(comm, /*owned=*/false, options, name);
  const double timeout_s = options.resolved_timeout_s();
  agree_on_checking(comm, options.resolved_check(), name, timeout_s);
  auto control = [&]() -> std::shared_ptr<dist::Backend> {
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    check_plain(MPI_Comm_idup(comm, &dup, &req), "MPI_Comm_idup");
    wait_setup(req, "MPI_Comm_idup (checked-mode control communicator)", name, data->rank(),
               data->size(), timeout_s);
    return std::make_shared<MpiBackend>(dup, /*owned=*/true, options, name);
  };
  return dist::stack_layers(data, options, control, Device::cpu());
}

// The rank's flight recorder (Options' size and dump directory), named by
// its rank in MPI_COMM_WORLD: dumps are DIR/rank-<world rank>.json.
std::shared_ptr<dist::FlightRecorder> make_recorder(const dist::Options& options) {
  int rank = 0;
  int size = 0;
  check_plain(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_plain(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return dist::FlightRecorder::for_rank(options, rank, size);
}
}  // namespace

dist::ProcessGroup world(const dist::Options& options) {
  require_initialised("mpi::world");
  auto recorder = make_recorder(options);
  auto backend = make_backend(MPI_COMM_WORLD, "world", options);
  // The first world of the process opens the alarm channel (job_end.hpp):
  // every process makes it, so every process takes part.
  detail::open_alarm_channel(recorder, options.resolved_timeout_s(), [](double timeout_s) {
    return duplicate(MPI_COMM_WORLD, "world", timeout_s);
  });
  return dist::ProcessGroup(std::move(backend), "world", nullptr, std::move(recorder));
}

dist::ProcessGroup from_comm(MPI_Comm comm, std::string name, const dist::Options& options) {
  require_initialised("mpi::from_comm");
  if (comm == MPI_COMM_NULL) raise("mpi::from_comm", "MPI_COMM_NULL");
  auto recorder = make_recorder(options);
  auto backend = make_backend(comm, name, options);
  return dist::ProcessGroup(std::move(backend), std::move(name), nullptr, std::move(recorder));
}

int64_t max_count() { return g_max_count; }
void set_max_count(int64_t count) {
  if (count < 1 || count > INT_MAX)
    raise("mpi::set_max_count", fmt::format("{} outside [1, INT_MAX]", count));
  g_max_count = count;
}

}  // namespace diffcomm::mpi

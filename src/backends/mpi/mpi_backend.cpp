// The Open MPI backend. The funnel (dist/collectives.cpp) has validated every
// Call; here each primitive maps to the non-blocking MPI call it wraps
// (issue), then waits for it with the shared deadline loop (complete), so a
// peer that never arrives gives Timeout instead of a hang. The reductions here
// are MPI's native ones; dist::stack_layers (dist/backend/layers.hpp) puts the
// deterministic composition (ComposedReductions) and checked mode over this
// transport as Options ask. MPI's error codes become BackendError at every
// boundary.
#include <fmt/format.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/dist/backend.hpp"
#include "diffcomm/dist/backend/block_layout.hpp"
#include "diffcomm/dist/backend/composed.hpp"
#include "diffcomm/dist/backend/layers.hpp"
#include "diffcomm/dist/backend/wait.hpp"
#include "diffcomm/error.hpp"
#include "timeouts.hpp"

namespace diffcomm::mpi {
namespace {

using dist::Call;
using dist::OpType;
using dist::ReduceOp;

int64_t g_max_count = INT_MAX;

void note_call_timeout(const Call& c) { detail::note_timeout(c.where()); }

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

// The checked-call boundary with MPI: every call goes through here.
#define DIFFCOMM_MPI_CHECK(expr, call)                                                             \
  do {                                                                                             \
    const int diffcomm_rc_ = (expr);                                                               \
    if (diffcomm_rc_ != MPI_SUCCESS)                                                               \
      throw BackendError(fmt::format("MPI error in {} ({}): {} (code {}) [{}:{}]", (call).where(), \
                                     #expr, mpi_error_string(diffcomm_rc_), diffcomm_rc_,          \
                                     __FILE__, __LINE__));                                         \
  } while (0)

void check_plain(int rc, const char* what) {
  if (rc != MPI_SUCCESS)
    throw BackendError(
        fmt::format("MPI error in {}: {} (code {})", what, mpi_error_string(rc), rc));
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::BFloat16:
    case DType::Float16: return MPI_UINT16_T;  // moved as bits; reduced by user ops
    case DType::Int32: return MPI_INT32_T;
    case DType::Int64: return MPI_INT64_T;
    case DType::UInt8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

// ---- user-defined ops for the 16-bit floats: each combine in float32
template <class T, ReduceOp::Kind Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    float r = 0;
    if constexpr (Op == ReduceOp::Sum) r = x + y;
    if constexpr (Op == ReduceOp::Product) r = x * y;
    if constexpr (Op == ReduceOp::Min) r = std::min(x, y);
    if constexpr (Op == ReduceOp::Max) r = std::max(x, y);
    b[i] = T(r);
  }
}

template <class T>
MPI_Op make_half_op(ReduceOp op) {
  MPI_User_function* fn = nullptr;
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
    case ReduceOp::PremulSum: fn = &half_op<T, ReduceOp::Sum>; break;
    case ReduceOp::Product: fn = &half_op<T, ReduceOp::Product>; break;
    case ReduceOp::Min: fn = &half_op<T, ReduceOp::Min>; break;
    case ReduceOp::Max: fn = &half_op<T, ReduceOp::Max>; break;
  }
  MPI_Op result;
  check_plain(MPI_Op_create(fn, /*commute=*/1, &result), "MPI_Op_create");
  return result;
}

// Native reductions: PremulSum is a Sum of inputs the caller pre-multiplied
// (premultiplied() below), as NCCL's PreMulSum.
MPI_Op mpi_op(DType d, ReduceOp op) {
  if (op == ReduceOp::PremulSum) op = ReduceOp::Sum;
  if (d == DType::BFloat16 || d == DType::Float16) {
    // Created once per process (MPI state is per process, not per rank of a
    // simulated world) and kept until MPI_Finalize.
    static MPI_Op ops[2][5] = {};
    static bool made[2][5] = {};
    const int k = d == DType::BFloat16 ? 0 : 1, o = static_cast<int>(op);
    if (!made[k][o]) {
      ops[k][o] = k == 0 ? make_half_op<bfloat16>(op) : make_half_op<float16>(op);
      made[k][o] = true;
    }
    return ops[k][o];
  }
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::PremulSum:
    case ReduceOp::Avg: return MPI_SUM;
    case ReduceOp::Product: return MPI_PROD;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Max: return MPI_MAX;
  }
  return MPI_SUM;
}

char* bytes(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }

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
  }
  ~MpiBackend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&coll_);
    if (owned_) MPI_Comm_free(&comm_);
  }

  std::string backend_name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int global_rank(int r) const override { return members_[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override { return d.is_cpu(); }

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
    if (use_ring(t)) {
      ring_all_reduce(c, t);
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
    gather_fixed(c, in, tmp);
    for (int s = 0; s < size_; ++s)
      c.outputs.writable(static_cast<std::size_t>(s))
          .copy_(tmp.row_view(s * in.numel(), in.numel()));
  }

  void all_gather_single(Call& c) override { gather_fixed(c, c.inputs[0], c.outputs[0]); }

  void all_gather_v(Call& c) override {
    // Per-peer messages, as gather_fixed (and no int-count limit to check).
    const Tensor& in = c.inputs[0];
    const Tensor& out = c.outputs[0];
    const auto blocks = dist::BlockLayout::of(c.output_splits, in.row_numel());
    const int64_t es = static_cast<int64_t>(element_size(c.dtype));
    const auto me = static_cast<std::size_t>(rank_);
    std::memcpy(bytes(out) + blocks.offset(me) * es, in.data_ptr(),
                static_cast<std::size_t>(blocks.length(me) * es));
    std::vector<Block> sends, recvs;
    each_peer([&](int to, int from) {
      const auto f = static_cast<std::size_t>(from);
      sends.push_back({to, static_cast<const char*>(in.data_ptr()), in.numel() * es});
      recvs.push_back({from, bytes(out) + blocks.offset(f) * es, blocks.length(f) * es});
    });
    exchange(c, sends, recvs);
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
      std::vector<Block> sends, recvs;
      if (me) {
        for (int p = 0; p < size_; ++p)
          if (p == rank_)
            std::memcpy(bytes(tmp) + p * nb, in.data_ptr(), static_cast<std::size_t>(nb));
          else
            recvs.push_back({p, bytes(tmp) + p * nb, nb});
      } else {
        sends.push_back({c.root, static_cast<const char*>(in.data_ptr()), nb});
      }
      exchange(c, sends, recvs);
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
    std::vector<Block> sends, recvs;
    if (me) {
      for (int p = 0; p < size_; ++p)
        if (p == rank_)
          std::memcpy(out.data_ptr(), bytes(tmp) + p * nb, static_cast<std::size_t>(nb));
        else
          sends.push_back({p, bytes(tmp) + p * nb, nb});
    } else {
      recvs.push_back({c.root, bytes(out), nb});
    }
    exchange(c, sends, recvs);
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
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) {
        c.outputs.writable(pi).copy_(c.inputs[pi]);
        continue;
      }
      sends.push_back({p, static_cast<const char*>(c.inputs[pi].data_ptr()),
                       static_cast<int64_t>(c.inputs[pi].nbytes())});
      recvs.push_back({p, bytes(c.outputs[pi]), static_cast<int64_t>(c.outputs[pi].nbytes())});
    }
    exchange(c, sends, recvs);
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
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_)
        std::memcpy(bytes(out) + recv.offset(pi), bytes(in) + send.offset(pi),
                    static_cast<std::size_t>(send.length(pi)));
      else {
        sends.push_back({p, bytes(in) + send.offset(pi), send.length(pi)});
        recvs.push_back({p, bytes(out) + recv.offset(pi), recv.length(pi)});
      }
    }
    exchange(c, sends, recvs);
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
  // The requests of one issued call.
  struct Requests {
    std::vector<MPI_Request> reqs;
    MPI_Request* add() {
      reqs.push_back(MPI_REQUEST_NULL);
      return &reqs.back();
    }
  };
  // Completes an issued call within the deadline (the shared wait loop).
  void wait(const Call& c, Requests& r, MPI_Status* statuses = MPI_STATUSES_IGNORE) {
    if (r.reqs.empty()) return;
    dist::wait_until_done(
        c, timeout_s_,
        [&] {
          int flag = 0;
          DIFFCOMM_MPI_CHECK(
              MPI_Testall(static_cast<int>(r.reqs.size()), r.reqs.data(), &flag, statuses), c);
          return flag != 0;
        },
        &note_call_timeout);
  }

  struct Block {
    int peer;
    const char* data;
    int64_t nbytes;
  };
  static constexpr int kTag = 0x5d1c;  // tag of diffcomm's own messages (on coll_)

  // The peers in pairwise order: step i sends to rank+i and receives from
  // rank-i, so the members do not all send to member 0 first.
  template <class F>
  void each_peer(F&& f) const {
    for (int i = 1; i < size_; ++i) f((rank_ + i) % size_, (rank_ - i + size_) % size_);
  }

  static bool fits(const std::vector<int64_t>& v) {
    for (int64_t x : v)
      if (x > g_max_count) return false;
    return true;
  }
  static std::vector<int> to_int(const std::vector<int64_t>& v) {
    return std::vector<int>(v.begin(), v.end());
  }
  static void* elem(const Tensor& t, int64_t off) {
    return bytes(t) + off * static_cast<int64_t>(element_size(t.dtype()));
  }

  template <class F>
  static void each_chunk(int64_t count, F&& f) {
    if (count == 0) return f(0, 0);  // zero-size calls still synchronise the members
    for (int64_t off = 0; off < count; off += g_max_count)
      f(off, static_cast<int>(std::min(g_max_count, count - off)));
  }
  template <class F>
  static void each_byte_chunk(int64_t nbytes, F&& f) {
    each_chunk(nbytes, f);
  }

  // Per-peer MPI_Isend/Irecv, never MPI_Iallgather: Open MPI's non-blocking
  // collectives (libnbc) ran 2.1x its blocking MPI_Allgather at 64 KiB on
  // np 2, while per-peer messages run at the blocking call's speed
  // (bench/RESULTS.md, "MPI at raw speed").
  void gather_fixed(const Call& c, const Tensor& in, const Tensor& out) {
    const int64_t nb = static_cast<int64_t>(in.nbytes());
    std::memcpy(bytes(out) + rank_ * nb, in.data_ptr(), static_cast<std::size_t>(nb));
    std::vector<Block> sends, recvs;
    each_peer([&](int to, int from) {
      sends.push_back({to, static_cast<const char*>(in.data_ptr()), nb});
      recvs.push_back({from, bytes(out) + from * nb, nb});
    });
    exchange(c, sends, recvs);
  }

  // Where the ring beat MPI_Iallreduce (bench/RESULTS.md, "MPI at raw
  // speed"): on two members at every size (64 KiB: 1.03x raw MPI_Allreduce
  // against 1.7-2.0x), on more only for large tensors (np 4: 16 MiB 1.00x
  // against 1.17x, but 64 KiB 1.3-1.4x against 0.8-0.9x: its 2(N-1)
  // dependent steps cost more than libnbc's schedule there).
  bool use_ring(const Tensor& t) const {
    constexpr std::size_t kRingFrom = std::size_t{8} << 20;  // bytes, more than two members
    if (size_ < 2 || t.numel() < size_) return false;
    return size_ == 2 || t.nbytes() >= kRingFrom;
  }

  // Ring all-reduce over Isend/Irecv (reduce-scatter, then all-gather of
  // the reduced blocks), not MPI_Iallreduce (libnbc, slower than the
  // blocking call). Block k is combined along the ring by MPI_Reduce_local
  // with the same MPI op; every member receives the one reduced copy, so
  // all agree bit for bit (the order is the ring's: native reductions are
  // algorithm-ordered, docs/semantics.md).
  void ring_all_reduce(const Call& c, const Tensor& t) {
    const int64_t n = t.numel(), es = static_cast<int64_t>(element_size(c.dtype));
    auto at = [&](int k) { return n * k / size_; };  // block k: [at(k), at(k+1))
    auto len = [&](int k) { return at(k + 1) - at(k); };
    const int right = (rank_ + 1) % size_, left = (rank_ - 1 + size_) % size_;
    auto block = [&](int s) { return ((s % size_) + size_) % size_; };
    Tensor scratch = empty({n / size_ + 1}, t.dtype());
    for (int s = 0; s < size_ - 1; ++s) {  // reduce-scatter
      const int out = block(rank_ - s), in = block(rank_ - s - 1);
      exchange(c, {{right, static_cast<const char*>(elem(t, at(out))), len(out) * es}},
               {{left, bytes(scratch), len(in) * es}});
      each_chunk(len(in), [&](int64_t off, int count) {
        DIFFCOMM_MPI_CHECK(MPI_Reduce_local(elem(scratch, off), elem(t, at(in) + off), count,
                                            mpi_type(c.dtype), mpi_op(c.dtype, c.reduce_op)),
                           c);
      });
    }
    for (int s = 0; s < size_ - 1; ++s) {  // all-gather of the reduced blocks
      const int out = block(rank_ + 1 - s), in = block(rank_ - s);
      exchange(c, {{right, static_cast<const char*>(elem(t, at(out))), len(out) * es}},
               {{left, static_cast<const char*>(elem(t, at(in))), len(in) * es}});
    }
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

  // Per-peer non-blocking messages in chunks of at most max_count bytes.
  void exchange(const Call& c, const std::vector<Block>& sends, const std::vector<Block>& recvs) {
    Requests reqs;
    for (const Block& b : recvs)
      each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
        if (count == 0) return;
        DIFFCOMM_MPI_CHECK(MPI_Irecv(const_cast<char*>(b.data) + off, count, MPI_BYTE, b.peer, kTag,
                                     coll_, reqs.add()),
                           c);
      });
    for (const Block& b : sends)
      each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
        if (count == 0) return;
        DIFFCOMM_MPI_CHECK(
            MPI_Isend(b.data + off, count, MPI_BYTE, b.peer, kTag, coll_, reqs.add()), c);
      });
    wait(c, reqs);
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
};

void require_initialised(const char* what) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init)
    throw BackendError(
        fmt::format("{}: MPI is not initialised (create an mpi::Environment first)", what));
}

}  // namespace

Environment::Environment(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    check_plain(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    owns_ = true;
  }
}

Environment::~Environment() {
  abort_if_timed_out();  // MPI_Finalize would wait on the calls in flight
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
  return dist::ProcessGroup(make_backend(MPI_COMM_WORLD, "world", options), "world", nullptr,
                            std::move(recorder));
}

dist::ProcessGroup from_comm(MPI_Comm comm, std::string name, const dist::Options& options) {
  require_initialised("mpi::from_comm");
  if (comm == MPI_COMM_NULL) throw InvalidArgument("mpi::from_comm: MPI_COMM_NULL");
  auto recorder = make_recorder(options);
  auto backend = make_backend(comm, name, options);
  return dist::ProcessGroup(std::move(backend), std::move(name), nullptr, std::move(recorder));
}

int64_t max_count() { return g_max_count; }
void set_max_count(int64_t count) {
  if (count < 1 || count > INT_MAX)
    throw InvalidArgument(fmt::format("mpi::set_max_count: {} outside [1, INT_MAX]", count));
  g_max_count = count;
}

}  // namespace diffcomm::mpi

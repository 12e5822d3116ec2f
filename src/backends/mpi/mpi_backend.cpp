// The Open MPI backend. The funnel (dist/collectives.cpp) has validated every
// Call; here each primitive maps to the MPI call it wraps, with MPI's error
// codes turned into BackendError at every boundary.
#include <fmt/format.h>

#include <climits>
#include <cstring>
#include <numeric>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/dist/backend.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/ops.hpp"

namespace diffcomm::mpi {
namespace {

using dist::Call;
using dist::OpType;
using dist::ReduceOp;

int64_t g_max_count = INT_MAX;

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
template <class T, ReduceOp Op>
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
    case ReduceOp::Avg: fn = &half_op<T, ReduceOp::Sum>; break;
    case ReduceOp::Product: fn = &half_op<T, ReduceOp::Product>; break;
    case ReduceOp::Min: fn = &half_op<T, ReduceOp::Min>; break;
    case ReduceOp::Max: fn = &half_op<T, ReduceOp::Max>; break;
  }
  MPI_Op result;
  check_plain(MPI_Op_create(fn, /*commute=*/1, &result), "MPI_Op_create");
  return result;
}

MPI_Op mpi_op(DType d, ReduceOp op) {
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
    case ReduceOp::Avg: return MPI_SUM;
    case ReduceOp::Product: return MPI_PROD;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Max: return MPI_MAX;
  }
  return MPI_SUM;
}

char* bytes(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }

void finish_avg(const Call& c, Tensor t) {
  if (c.reduce_op == ReduceOp::Avg) t.copy_(scale(t.detach(), 1.0 / c.group_size));
}

class MpiBackend final : public dist::Backend {
 public:
  MpiBackend(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
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
  }
  ~MpiBackend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

  std::string backend_name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int global_rank(int r) const override { return members_[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override { return d.is_cpu(); }

  std::shared_ptr<dist::Backend> split(Call& c, int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    DIFFCOMM_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), c);
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiBackend>(sub, /*owned=*/true);
  }

  void barrier(Call& c) override { DIFFCOMM_MPI_CHECK(MPI_Barrier(comm_), c); }

  void all_reduce(Call& c) override {
    const Tensor& t = c.outputs[0];
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, elem(t, off), count, mpi_type(c.dtype),
                                       mpi_op(c.dtype, c.reduce_op), comm_),
                         c);
    });
    finish_avg(c, t);
  }

  void broadcast(Call& c) override {
    const Tensor& t = c.outputs[0];
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(MPI_Bcast(elem(t, off), count, mpi_type(c.dtype), c.root, comm_), c);
    });
  }

  void reduce(Call& c) override {
    const Tensor& t = c.outputs[0];
    const bool me = rank_ == c.root;
    each_chunk(t.numel(), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Reduce(me ? MPI_IN_PLACE : elem(t, off), me ? elem(t, off) : nullptr, count,
                     mpi_type(c.dtype), mpi_op(c.dtype, c.reduce_op), c.root, comm_),
          c);
    });
    if (me) finish_avg(c, t);
  }

  void all_gather(Call& c) override {
    // Gather into one contiguous buffer, then into the separate outputs.
    const Tensor& in = c.inputs[0];
    Tensor tmp = empty({static_cast<int64_t>(size_) * in.numel()}, in.dtype());
    gather_fixed(c, in, tmp);
    for (int s = 0; s < size_; ++s)
      c.outputs[static_cast<std::size_t>(s)].copy_(tmp.row_view(s * in.numel(), in.numel()));
  }

  void all_gather_single(Call& c) override { gather_fixed(c, c.inputs[0], c.outputs[0]); }

  void all_gather_v(Call& c) override {
    const Tensor& in = c.inputs[0];
    const Tensor& out = c.outputs[0];
    const int64_t rn = in.row_numel();
    std::vector<int64_t> counts, displs;
    int64_t at = 0;
    for (int64_t rows : c.output_splits) {
      counts.push_back(rows * rn);
      displs.push_back(at);
      at += rows * rn;
    }
    if (fits(counts) && fits(displs)) {
      auto ic = to_int(counts), id = to_int(displs);
      DIFFCOMM_MPI_CHECK(
          MPI_Allgatherv(in.numel() ? in.data_ptr() : nullptr, static_cast<int>(in.numel()),
                         mpi_type(c.dtype), out.data_ptr(), ic.data(), id.data(), mpi_type(c.dtype),
                         comm_),
          c);
      return;
    }
    // Large counts: every member sends its block to every other member.
    const int64_t es = static_cast<int64_t>(element_size(c.dtype));
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) {
        std::memcpy(bytes(out) + displs[pi] * es, in.data_ptr(),
                    static_cast<std::size_t>(counts[pi] * es));
        continue;
      }
      sends.push_back({p, static_cast<const char*>(in.data_ptr()), in.numel() * es});
      recvs.push_back({p, bytes(out) + displs[pi] * es, counts[pi] * es});
    }
    exchange(c, sends, recvs);
  }

  void gather(Call& c) override {
    const Tensor& in = c.inputs[0];
    const bool me = rank_ == c.root;
    Tensor tmp = me ? empty({static_cast<int64_t>(size_) * in.numel()}, in.dtype()) : Tensor{};
    if (in.numel() <= g_max_count && static_cast<int64_t>(size_) * in.numel() <= g_max_count) {
      DIFFCOMM_MPI_CHECK(MPI_Gather(in.data_ptr(), static_cast<int>(in.numel()), mpi_type(c.dtype),
                                    me ? tmp.data_ptr() : nullptr, static_cast<int>(in.numel()),
                                    mpi_type(c.dtype), c.root, comm_),
                         c);
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
        c.outputs[static_cast<std::size_t>(s)].copy_(tmp.row_view(s * in.numel(), in.numel()));
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
      DIFFCOMM_MPI_CHECK(
          MPI_Scatter(me ? tmp.data_ptr() : nullptr, static_cast<int>(out.numel()),
                      mpi_type(c.dtype), out.data_ptr(), static_cast<int>(out.numel()),
                      mpi_type(c.dtype), c.root, comm_),
          c);
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
    reduce_blocks(c, tmp, out, std::vector<int64_t>(static_cast<std::size_t>(size_), out.numel()));
  }

  void reduce_scatter_single(Call& c) override {
    const Tensor& out = c.outputs[0];
    reduce_blocks(c, c.inputs[0], out,
                  std::vector<int64_t>(static_cast<std::size_t>(size_), out.numel()));
  }

  void reduce_scatter_v(Call& c) override {
    std::vector<int64_t> counts;
    for (int64_t rows : c.input_splits) counts.push_back(rows * c.inputs[0].row_numel());
    reduce_blocks(c, c.inputs[0], c.outputs[0], counts);
  }

  void all_to_all(Call& c) override {
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) {
        c.outputs[pi].copy_(c.inputs[pi]);
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
    const int64_t rn = in.row_numel();
    const auto n = static_cast<std::size_t>(size_);
    // Fast path: int counts and displacements in a buffer the backend keeps
    // (no allocation per call; the fixed cost matters at small sizes).
    counts_.resize(4 * n);
    int* isc = counts_.data();
    int* isd = isc + n;
    int* irc = isd + n;
    int* ird = irc + n;
    bool small = true;
    int64_t s_at = 0, r_at = 0;
    for (std::size_t p = 0; p < n; ++p) {
      const int64_t sc = c.input_splits[p] * rn, rc = c.output_splits[p] * rn;
      if (sc > g_max_count || s_at > g_max_count || rc > g_max_count || r_at > g_max_count) {
        small = false;
        break;
      }
      isc[p] = static_cast<int>(sc);
      isd[p] = static_cast<int>(s_at);
      irc[p] = static_cast<int>(rc);
      ird[p] = static_cast<int>(r_at);
      s_at += sc;
      r_at += rc;
    }
    if (small) {
      // Zero-size buffers may have any address; MPI ignores them.
      DIFFCOMM_MPI_CHECK(MPI_Alltoallv(in.data_ptr(), isc, isd, mpi_type(c.dtype), out.data_ptr(),
                                       irc, ird, mpi_type(c.dtype), comm_),
                         c);
      return;
    }
    std::vector<int64_t> sc, sd, rc, rd;
    s_at = r_at = 0;
    for (std::size_t p = 0; p < n; ++p) {
      sc.push_back(c.input_splits[p] * rn);
      sd.push_back(s_at);
      s_at += sc.back();
      rc.push_back(c.output_splits[p] * rn);
      rd.push_back(r_at);
      r_at += rc.back();
    }
    const int64_t es = static_cast<int64_t>(element_size(c.dtype));
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      const auto pi = static_cast<std::size_t>(p);
      if (p == rank_) {
        std::memcpy(bytes(out) + rd[pi] * es, bytes(in) + sd[pi] * es,
                    static_cast<std::size_t>(sc[pi] * es));
        continue;
      }
      sends.push_back({p, bytes(in) + sd[pi] * es, sc[pi] * es});
      recvs.push_back({p, bytes(out) + rd[pi] * es, rc[pi] * es});
    }
    exchange(c, sends, recvs);
  }

  void send(Call& c) override {
    const Tensor& t = c.inputs[0];
    each_byte_chunk(static_cast<int64_t>(t.nbytes()), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(MPI_Send(bytes(t) + off, count, MPI_BYTE, c.root, c.tag, comm_), c);
    });
  }

  void recv(Call& c) override {
    const Tensor& t = c.outputs[0];
    each_byte_chunk(static_cast<int64_t>(t.nbytes()), [&](int64_t off, int count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Recv(bytes(t) + off, count, MPI_BYTE, c.root, c.tag, comm_, MPI_STATUS_IGNORE), c);
    });
  }

 private:
  struct Block {
    int peer;
    const char* data;
    int64_t nbytes;
  };
  static constexpr int kTag = 0x5d1c;  // tag of diffcomm's own point-to-point traffic

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

  void gather_fixed(const Call& c, const Tensor& in, const Tensor& out) {
    if (in.numel() <= g_max_count && static_cast<int64_t>(size_) * in.numel() <= g_max_count) {
      DIFFCOMM_MPI_CHECK(
          MPI_Allgather(in.data_ptr(), static_cast<int>(in.numel()), mpi_type(c.dtype),
                        out.data_ptr(), static_cast<int>(in.numel()), mpi_type(c.dtype), comm_),
          c);
      return;
    }
    const int64_t nb = static_cast<int64_t>(in.nbytes());
    std::vector<Block> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) {
        std::memcpy(bytes(out) + p * nb, in.data_ptr(), static_cast<std::size_t>(nb));
        continue;
      }
      sends.push_back({p, static_cast<const char*>(in.data_ptr()), nb});
      recvs.push_back({p, bytes(out) + p * nb, nb});
    }
    exchange(c, sends, recvs);
  }

  // Reduce block p of `in` (counts[p] elements, in order) onto member p's out.
  void reduce_blocks(Call& c, const Tensor& in, const Tensor& out,
                     const std::vector<int64_t>& counts) {
    if (fits(counts) && std::accumulate(counts.begin(), counts.end(), int64_t{0}) <= g_max_count) {
      auto ic = to_int(counts);
      DIFFCOMM_MPI_CHECK(MPI_Reduce_scatter(in.data_ptr(), out.data_ptr(), ic.data(),
                                            mpi_type(c.dtype), mpi_op(c.dtype, c.reduce_op), comm_),
                         c);
    } else {
      // Large counts: one chunked reduce per destination.
      int64_t at = 0;
      for (int p = 0; p < size_; ++p) {
        const int64_t n = counts[static_cast<std::size_t>(p)];
        const bool me = p == rank_;
        if (me)
          std::memcpy(out.data_ptr(), elem(in, at),
                      static_cast<std::size_t>(n) * element_size(c.dtype));
        each_chunk(n, [&](int64_t off, int count) {
          DIFFCOMM_MPI_CHECK(
              MPI_Reduce(me ? MPI_IN_PLACE : elem(in, at + off), me ? elem(out, off) : nullptr,
                         count, mpi_type(c.dtype), mpi_op(c.dtype, c.reduce_op), p, comm_),
              c);
        });
        at += n;
      }
    }
    finish_avg(c, out);
  }

  // Per-peer non-blocking messages in chunks of at most max_count bytes.
  void exchange(const Call& c, const std::vector<Block>& sends, const std::vector<Block>& recvs) {
    std::vector<MPI_Request> reqs;
    for (const Block& b : recvs)
      each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
        if (count == 0) return;
        reqs.emplace_back();
        DIFFCOMM_MPI_CHECK(MPI_Irecv(const_cast<char*>(b.data) + off, count, MPI_BYTE, b.peer, kTag,
                                     comm_, &reqs.back()),
                           c);
      });
    for (const Block& b : sends)
      each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
        if (count == 0) return;
        reqs.emplace_back();
        DIFFCOMM_MPI_CHECK(
            MPI_Isend(b.data + off, count, MPI_BYTE, b.peer, kTag, comm_, &reqs.back()), c);
      });
    DIFFCOMM_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE),
                       c);
  }

  MPI_Comm comm_;
  bool owned_;
  std::vector<int> counts_;  // scratch for all_to_all_single's counts
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
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

dist::ProcessGroup world() {
  require_initialised("mpi::world");
  return dist::ProcessGroup(std::make_shared<MpiBackend>(MPI_COMM_WORLD, false), "world", nullptr);
}

dist::ProcessGroup from_comm(MPI_Comm comm, std::string name) {
  require_initialised("mpi::from_comm");
  if (comm == MPI_COMM_NULL) throw InvalidArgument("mpi::from_comm: MPI_COMM_NULL");
  return dist::ProcessGroup(std::make_shared<MpiBackend>(comm, false), std::move(name), nullptr);
}

int64_t max_count() { return g_max_count; }
void set_max_count(int64_t count) {
  if (count < 1 || count > INT_MAX)
    throw InvalidArgument(fmt::format("mpi::set_max_count: {} outside [1, INT_MAX]", count));
  g_max_count = count;
}

}  // namespace diffcomm::mpi

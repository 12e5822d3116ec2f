// The per-peer algorithms of the MPI backend (see peer_algorithms.hpp): the
// ring all-reduce and the exchange of blocks, over MPI_Isend/MPI_Irecv on the
// group's own communicator.
#include "peer_algorithms.hpp"

#include <cstring>

#include "mpi_util.hpp"

namespace diffcomm::mpi::detail {
namespace {
constexpr int kTag = 0x5d1c;  // tag of diffcomm's own messages (on the backend's coll_)
}  // namespace

// Per-peer MPI_Isend/Irecv, never MPI_Iallgather: Open MPI's non-blocking
// collectives (libnbc) ran 2.1x its blocking MPI_Allgather at 64 KiB on
// np 2, while per-peer messages run at the blocking call's speed
// (bench/RESULTS.md, "MPI at raw speed").
void Peers::gather_fixed(const dist::Call& c, const Tensor& in, const Tensor& out) const {
  const int64_t nb = static_cast<int64_t>(in.nbytes());
  Blocks sends, recvs;
  each_peer([&](int to, int from) {
    sends.push_back({to, static_cast<const char*>(in.data_ptr()), nb});
    recvs.push_back({from, bytes(out) + from * nb, nb});
  });
  exchange(c, sends, recvs, [&] {
    std::memcpy(bytes(out) + rank_ * nb, in.data_ptr(), static_cast<std::size_t>(nb));
  });
}

// Where the ring beat MPI_Iallreduce (bench/RESULTS.md, "MPI at raw
// speed" and "the ring from 256 KiB"): on two members at every size (64 KiB:
// 1.03x raw MPI_Allreduce against 1.7-2.0x); on more from 256 KiB (np 4:
// 256 KiB 0.88-1.07x against 1.00-1.24x, 1 MiB 0.79-1.01x against
// 1.22-1.42x), not below (64 KiB 1.02-1.34x against 0.81-0.93x: its 2(N-1)
// dependent steps cost more than libnbc's schedule there).
bool Peers::use_ring(const Tensor& t) const {
  constexpr std::size_t kRingFrom = std::size_t{256} << 10;  // bytes, more than two members
  if (size_ < 2 || t.numel() < size_) return false;
  return size_ == 2 || t.nbytes() >= kRingFrom;
}

// Ring all-reduce over Isend/Irecv (reduce-scatter, then all-gather of
// the reduced blocks), not MPI_Iallreduce (libnbc, slower than the
// blocking call). Block k is combined along the ring by MPI_Reduce_local
// with the same MPI op; every member receives the one reduced copy, so
// all agree bit for bit (the order is the ring's: native reductions are
// algorithm-ordered, docs/semantics.md).
void Peers::ring_all_reduce(const dist::Call& c, const Tensor& t) const {
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

Requests Peers::post(const dist::Call& c, const Blocks& sends, const Blocks& recvs) const {
  Requests reqs;
  for (const Block& b : recvs)
    each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
      if (count == 0) return;
      DIFFCOMM_MPI_CHECK(MPI_Irecv(const_cast<char*>(b.data) + off, count, MPI_BYTE, b.peer, kTag,
                                   comm_, reqs.add()),
                         c);
    });
  for (const Block& b : sends)
    each_byte_chunk(b.nbytes, [&](int64_t off, int count) {
      if (count == 0) return;
      DIFFCOMM_MPI_CHECK(MPI_Isend(b.data + off, count, MPI_BYTE, b.peer, kTag, comm_, reqs.add()),
                         c);
    });
  return reqs;
}

void Peers::complete(const dist::Call& c, Requests& reqs) const { wait(c, timeout_s_, reqs); }

}  // namespace diffcomm::mpi::detail

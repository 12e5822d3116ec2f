#pragma once
// What mpi_backend.cpp and peer_algorithms.cpp share: the checked-call
// boundary with MPI, the MPI datatype and op of a call, chunking to MPI's int
// counts and completing issued requests with the deadline. One copy here, so
// every MPI call of the backend fails, chunks and waits the same way.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <boost/container/small_vector.hpp>
#include <cstddef>
#include <cstdint>
#include <string>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::mpi::detail {

// The chunk limit of every MPI count (mpi::max_count()).
extern int64_t g_max_count;

std::string mpi_error_string(int code);

// The checked-call boundary with MPI: every call goes through here.
#define DIFFCOMM_MPI_CHECK(expr, call)                                                             \
  do {                                                                                             \
    const int diffcomm_rc_ = (expr);                                                               \
    if (diffcomm_rc_ != MPI_SUCCESS)                                                               \
      throw BackendError(fmt::format("MPI error in {} ({}): {} (code {}) [{}:{}]", (call).where(), \
                                     #expr,                                                        \
                                     ::diffcomm::mpi::detail::mpi_error_string(diffcomm_rc_),      \
                                     diffcomm_rc_, __FILE__, __LINE__));                           \
  } while (0)

void check_plain(int rc, const char* what);

MPI_Datatype mpi_type(DType d);
MPI_Op mpi_op(DType d, dist::ReduceOp op);

inline char* bytes(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }
inline void* elem(const Tensor& t, int64_t off) {
  return bytes(t) + off * static_cast<int64_t>(element_size(t.dtype()));
}

template <class F>
void each_chunk(int64_t count, F&& f) {
  if (count == 0) return f(0, 0);  // zero-size calls still synchronise the members
  for (int64_t off = 0; off < count; off += g_max_count)
    f(off, static_cast<int>(std::min(g_max_count, count - off)));
}
template <class F>
void each_byte_chunk(int64_t nbytes, F&& f) {
  each_chunk(nbytes, f);
}

// Peers whose messages an exchange keeps inline (groups of up to 9
// members), so the common call allocates nothing on the heap for them.
inline constexpr std::size_t kInlinePeers = 8;

// The requests of one issued call: a send and a receive per peer inline.
struct Requests {
  boost::container::small_vector<MPI_Request, 2 * kInlinePeers> reqs;
  MPI_Request* add() {
    reqs.push_back(MPI_REQUEST_NULL);
    return &reqs.back();
  }
};

// Completes an issued call within the deadline (the shared wait loop).
void wait(const dist::Call& c, double timeout_s, Requests& r,
          MPI_Status* statuses = MPI_STATUSES_IGNORE);

}  // namespace diffcomm::mpi::detail

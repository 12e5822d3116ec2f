// The MPI helpers both mpi_backend.cpp and peer_algorithms.cpp call (see
// mpi_util.hpp), with the user ops that reduce the 16-bit floats.
#include "mpi_util.hpp"

#include <climits>

#include "diffcomm/distributed/backend/wait.hpp"
#include "job_end.hpp"
#include "timeouts.hpp"

namespace diffcomm::mpi::detail {

using dist::Call;
using dist::ReduceOp;

int64_t g_max_count = INT_MAX;

namespace {

void note_call_timeout(const Call& c) { note_timeout(c.where()); }

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

}  // namespace

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

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

// Native reductions: PremulSum is a Sum of inputs the caller pre-multiplied
// (premultiplied() in mpi_backend.cpp), as NCCL's PreMulSum.
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

void wait(const Call& c, double timeout_s, Requests& r, MPI_Status* statuses) {
  if (r.reqs.empty()) return;
  uint32_t polls = 0;
  dist::wait_until_done(
      c, timeout_s,
      [&] {
        int flag = 0;
        DIFFCOMM_MPI_CHECK(
            MPI_Testall(static_cast<int>(r.reqs.size()), r.reqs.data(), &flag, statuses), c);
        // A peer's alarm (it timed out or ends the job) ends this wait too:
        // looked at on the first poll and every 64th, so a call that
        // completes at once pays one MPI_Test.
        if (!flag && polls++ % 64 == 0) check_alarm(c);
        return flag != 0;
      },
      &note_call_timeout);
}

}  // namespace diffcomm::mpi::detail

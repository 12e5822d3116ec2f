#pragma once
// What every file of the NCCL backend shares: error texts and the checked-call
// macros, the device guard, the stream a group and its sub-groups share, the
// dtype map and buffer arithmetic. Internal to src/backends/nccl/.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/tensor/error.hpp"
#include "tensor/cuda/device_memory.hpp"

// ncclGather / ncclScatter / ncclAlltoAll appeared in NCCL 2.28: use them only
// when the header we compile against declares them (here) *and* the library
// loaded at run time is new enough (ncclGetVersion, checked per group).
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define DIFFCOMM_NCCL_HEADER_HAS_2_28 1
#else
#define DIFFCOMM_NCCL_HEADER_HAS_2_28 0
#endif

namespace diffcomm::nccl::impl {

using dist::Call;
using dist::OpType;
using dist::ReduceOp;

constexpr int kVersionAvg = NCCL_VERSION(2, 10, 0);     // ncclAvg
constexpr int kVersionNative = NCCL_VERSION(2, 28, 0);  // ncclGather/Scatter/AlltoAll

inline std::string cuda_text(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
}

inline std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return fmt::format("{} (ncclResult_t {}); last NCCL error: {}", ncclGetErrorString(r),
                     static_cast<int>(r), last != nullptr && *last != '\0' ? last : "(none)");
}

// Checked calls outside a group (factories, free functions).
#define DIFFCOMM_NCCL_PLAIN(expr, what)                                                         \
  do {                                                                                          \
    const ncclResult_t diffcomm_r_ = (expr);                                                    \
    if (diffcomm_r_ != ncclSuccess)                                                             \
      throw BackendError(fmt::format("NCCL error in {}: {} returned {} [{}:{}]", (what), #expr, \
                                     nccl_text(diffcomm_r_, nullptr), __FILE__, __LINE__));     \
  } while (0)

#define DIFFCOMM_CUDA_PLAIN(expr, what)                                                         \
  do {                                                                                          \
    const cudaError_t diffcomm_e_ = (expr);                                                     \
    if (diffcomm_e_ != cudaSuccess)                                                             \
      throw BackendError(fmt::format("CUDA error in {}: {} returned {} [{}:{}]", (what), #expr, \
                                     cuda_text(diffcomm_e_), __FILE__, __LINE__));              \
  } while (0)

// Checked calls inside NcclBackend members: `call` is the Call being served
// (or nullptr), so the message names the op, its number, group and rank.
#define DIFFCOMM_NCCL_CHECK(expr, call)                                                        \
  do {                                                                                         \
    const ncclResult_t diffcomm_r_ = (expr);                                                   \
    if (diffcomm_r_ != ncclSuccess) fail_nccl(diffcomm_r_, #expr, (call), __FILE__, __LINE__); \
  } while (0)

#define DIFFCOMM_CUDA_CHECK(expr, call)                                                        \
  do {                                                                                         \
    const cudaError_t diffcomm_e_ = (expr);                                                    \
    if (diffcomm_e_ != cudaSuccess) fail_cuda(diffcomm_e_, #expr, (call), __FILE__, __LINE__); \
  } while (0)

// Makes a device current for the scope and restores the caller's device on
// return and on exception (one guard for the whole library).
using diffcomm::detail::DeviceGuard;

// A stream shared by a group and the sub-groups split from it (so their ops
// stay in one order per rank); destroyed with the last user when owned.
struct StreamHolder {
  cudaStream_t stream = nullptr;
  bool owned = false;
  int device = 0;
  StreamHolder(cudaStream_t s, bool own, int dev) : stream(s), owned(own), device(dev) {}
  ~StreamHolder() {
    if (!owned || stream == nullptr) return;
    try {
      const DeviceGuard guard(device);
      // Blocks that recorded a use on this stream need not wait for it any
      // more once it is idle, and must not record an event on it later.
      (void)cudaStreamSynchronize(stream);
      detail::device_memory().forget_stream(stream, device);
      (void)cudaStreamDestroy(stream);
    } catch (const Error&) {  // no usable device any more (process exit): nothing to free
    }
  }
  StreamHolder(const StreamHolder&) = delete;
  StreamHolder& operator=(const StreamHolder&) = delete;
};

inline std::shared_ptr<StreamHolder> owned_stream(int device) {
  const DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  // Non-blocking: no implicit synchronization with the legacy default
  // stream; ordering with the caller's current stream is by events (run()).
  DIFFCOMM_CUDA_PLAIN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                      "nccl: creating the group's stream");
  return std::make_shared<StreamHolder>(s, true, device);
}

inline ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Float16: return ncclFloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    case DType::UInt8: return ncclUint8;
  }
  return ncclUint8;
}

inline void validate_members(const std::vector<int>& members, int nranks, const char* what) {
  if (members.empty()) return;
  if (static_cast<int>(members.size()) != nranks)
    raise(what, fmt::format("options.members has {} entries for {} ranks", members.size(), nranks));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0)
    raise(what, fmt::format("options.members holds a negative rank {}", sorted.front()));
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    raise(what, "options.members lists a rank twice");
}

inline char* at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) +
         elements * static_cast<int64_t>(element_size(t.dtype()));
}
inline std::size_t count(const Tensor& t) { return static_cast<std::size_t>(t.numel()); }

// Whether ts[s+1] starts where ts[s] ends: one buffer NCCL can take as is.
inline bool consecutive(const dist::TensorList& ts) {
  for (std::size_t s = 1; s < ts.size(); ++s)
    if (at(ts[s - 1], ts[s - 1].numel()) != static_cast<char*>(ts[s].data_ptr())) return false;
  return true;
}

}  // namespace diffcomm::nccl::impl

#pragma once
// diffcomm::cuda — how diffcomm uses a CUDA device: where its device memory
// comes from, which stream its own kernels and copies run on, and how that is
// ordered with a trainer's streams. Part of diffcomm::core; declared in every
// build (streams are `void*` here, a cudaStream_t) and meaningful when
// DIFFCOMM_HAVE_CUDA is on.
//
// Memory
//  - Every CUDA tensor diffcomm allocates (empty/zeros/..., collective
//    outputs, staging and scratch buffers) comes from the process's
//    Allocator: by default a stream-ordered pool per device
//    (cudaMemPoolCreate + cudaMallocFromPoolAsync / cudaFreeAsync, release
//    threshold "never", so freed memory is reused without returning it to
//    the driver). Allocation and free never synchronize the device or the
//    host in the steady state. A device without memory-pool support
//    (cudaDevAttrMemoryPoolsSupported == 0) falls back to cudaMalloc/cudaFree,
//    which do synchronize.
//  - A block is allocated on the device's current stream (below) and freed
//    in stream order on that same stream when its last tensor goes away: the
//    free waits for the work queued on that stream, not for the device. When
//    a block was also used on other streams (record_stream), the free first
//    makes the allocation stream wait for those streams with events (the
//    torch recordStream rule). Collectives need no record_stream for blocks
//    of the current stream: the current stream waits for them (below).
//    Consequence: a stream made current with StreamGuard must outlive the
//    tensors allocated while it was current (as with torch).
//  - A trainer can plug in its own allocator (set_allocator), e.g. torch's
//    caching allocator (torch.cuda.caching_allocator_alloc/_delete) from the
//    Python package, so diffcomm's buffers count against the trainer's memory
//    budget and reuse its cache.
//
// Streams and ordering (the rule)
//  - diffcomm's kernels and copies outside a collective (fill, add, scale,
//    copy_: what autograd runs) go to the *current stream* of the tensor's
//    device: per host thread and device, the legacy default stream unless set
//    with set_current_stream or StreamGuard (torch's current-stream model).
//  - A collective on an nccl group runs on the group's stream; its scratch
//    and staging buffers, its kernels and copies go there too. When the
//    caller's current stream is a different stream, the collective orders
//    itself with events, never with a device synchronization: the group's
//    stream waits for an event recorded on the current stream before the op,
//    and the current stream waits for an event recorded on the group's stream
//    after it (nccl::Options::order_with_current_stream, on by default).
//  - So the cheapest setup for a trainer that lends its stream
//    (nccl::from_comm(comm, stream)) is to make that stream current as well
//    (StreamGuard guard(device, stream)): then every diffcomm kernel, copy and
//    collective runs on the trainer's stream and no event is needed.
//  - Host<->device copies: host to device is cudaMemcpyAsync on the current
//    stream and returns without waiting when the host memory is pageable (the
//    driver has staged it); from pinned host memory it waits for the copy,
//    because the caller may reuse the host buffer on return. Device to host
//    waits for the current stream (the caller reads the host buffer next).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::cuda {

/// A source of device memory, stream-ordered. Implementations must be
/// thread-safe. Errors: throw diffcomm::Error (BackendError for a failed
/// allocation).
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// nbytes (> 0) of memory on CUDA device `device`, usable by work queued on
  /// `stream` (a cudaStream_t; nullptr is the legacy default stream) from now
  /// on. The device is current when this is called.
  virtual void* allocate(std::size_t nbytes, int device, void* stream) = 0;
  /// Returns a block from allocate(); `stream` is the stream it was allocated
  /// on, which diffcomm has already made wait for every other stream that used
  /// the block. The memory may be reused once the work queued on `stream` so
  /// far has completed (cudaFreeAsync semantics), not before. The device is
  /// current when this is called. Must not throw.
  virtual void deallocate(void* ptr, std::size_t nbytes, int device, void* stream) noexcept = 0;
  /// A short name for messages and memory_stats() ("diffcomm stream-ordered pool").
  virtual std::string name() const = 0;
};

/// Makes `allocator` the source of every later CUDA allocation of the
/// process; nullptr restores diffcomm's default pool. Blocks already
/// allocated go back to the allocator they came from. Thread-safe.
void set_allocator(std::shared_ptr<Allocator> allocator);

/// The allocator later allocations come from (the default pool unless
/// set_allocator chose another). Throws InvalidArgument in a build without
/// CUDA.
std::shared_ptr<Allocator> allocator();

/// The current stream of `device` on this host thread: where diffcomm's
/// kernels and copies outside collectives run and where new blocks are
/// allocated. nullptr (the legacy default stream) unless set.
void* current_stream(int device);

/// Sets this thread's current stream of `device` (nullptr: the legacy
/// default stream). Borrowed: the caller keeps the stream alive while it is
/// current and while tensors allocated on it live. Throws InvalidArgument
/// for a negative device.
void set_current_stream(int device, void* stream);

/// Makes `stream` the current stream of `device` for a scope and restores
/// the previous one on exit (return or exception).
class StreamGuard {
 public:
  /// Makes `stream` current for `device` on this thread.
  StreamGuard(int device, void* stream);
  /// Restores the stream that was current before.
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  void* previous_;
};

/// Declares that `t`'s memory is used by work on `stream` (a stream other
/// than the one it was allocated on): when the block is freed, its
/// allocation stream first waits for the work queued on `stream` up to that
/// point (torch's Tensor.record_stream). No effect for CPU tensors and for
/// memory diffcomm did not allocate (from_blob, DLPack). `stream` must still
/// exist when the block is freed (streams diffcomm owns are forgotten when
/// they are destroyed). Thread-safe.
void record_stream(const Tensor& t, void* stream);

/// Counters of the process's CUDA allocations made through diffcomm.
struct MemoryStats {
  std::string allocator;                ///< name() of the current allocator
  std::int64_t allocations = 0;         ///< blocks allocated so far
  std::int64_t frees = 0;               ///< blocks returned so far
  std::int64_t cross_stream_frees = 0;  ///< frees that waited on other streams (events)
  std::int64_t bytes_in_use = 0;        ///< bytes of blocks allocated and not yet freed
  std::int64_t peak_bytes_in_use = 0;   ///< maximum of bytes_in_use so far
};

/// The counters above (all devices together). Thread-safe.
MemoryStats memory_stats();

}  // namespace diffcomm::cuda

#pragma once
// The host-side policy behind diffcomm's use of CUDA devices, written against
// a small DeviceApi so that a CPU unit test can drive it with a fake
// (tests/tensor/test_device_memory.cpp) and the CUDA build with the real runtime
// (src/tensor/cuda/device_ops.cu):
//  - DeviceGuard: makes a device current for a scope and restores the
//    caller's device on return and on exception (c10::cuda::CUDAGuard);
//  - DeviceMemory: the bookkeeping of every block diffcomm allocates
//    (allocator it came from, size, device, allocation stream, other streams
//    that used it) and the stream-ordered free (events from the other
//    streams, then Allocator::deallocate on the allocation stream);
//  - the per-thread current stream of each device.
// Plain C++: compiled in every build (device_ops_none.cpp supplies a
// DeviceApi that refuses everything when CUDA is off).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "diffcomm/tensor/cuda.hpp"

namespace diffcomm::detail {

/// The CUDA runtime calls the policy needs. Streams and events are opaque
/// (cudaStream_t / cudaEvent_t). Every call but destroy_event throws
/// diffcomm::Error on failure.
class DeviceApi {
 public:
  virtual ~DeviceApi() = default;
  /// cudaGetDevice.
  virtual int current_device() = 0;
  /// cudaSetDevice.
  virtual void set_device(int device) = 0;
  /// cudaEventCreateWithFlags(cudaEventDisableTiming) on the current device.
  virtual void* create_event() = 0;
  /// cudaEventRecord(event, stream).
  virtual void record_event(void* event, void* stream) = 0;
  /// cudaStreamWaitEvent(stream, event).
  virtual void stream_wait_event(void* stream, void* event) = 0;
  /// cudaEventDestroy (no throw; pending waits stay valid).
  virtual void destroy_event(void* event) noexcept = 0;
};

/// Makes `device` current for the scope (only when it is not already) and
/// restores the previous device on destruction, also during unwinding. A
/// failure to read or set the device raises from the constructor; the
/// destructor never throws.
class DeviceGuard {
 public:
  /// Makes `device` current through `api`.
  DeviceGuard(DeviceApi& api, int device);
  /// Same, through the process's DeviceApi (device_api()).
  explicit DeviceGuard(int device);
  /// Restores the device that was current before.
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  /// The device that was current when the guard was made.
  int previous() const { return previous_; }

 private:
  DeviceApi& api_;
  int previous_;
  bool switched_ = false;
};

/// Bookkeeping and stream-ordered freeing of the blocks of one process.
/// Thread-safe.
class DeviceMemory {
 public:
  /// `api` outlives this object; `fallback` is the allocator used when none
  /// was set (nullptr: allocate() throws InvalidArgument, as without CUDA).
  DeviceMemory(DeviceApi& api, std::shared_ptr<cuda::Allocator> fallback);

  /// Chooses the allocator of later allocations (nullptr: the fallback).
  void set_allocator(std::shared_ptr<cuda::Allocator> allocator);
  /// The allocator of later allocations.
  std::shared_ptr<cuda::Allocator> allocator() const;

  /// A block of nbytes on `device`, allocated on `stream` with `device`
  /// current (DeviceGuard). nbytes 0 is rounded up to 1 (distinct address).
  void* allocate(std::size_t nbytes, int device, void* stream);
  /// Declares a use of the block containing `ptr` by `stream`, a stream of
  /// CUDA device `stream_device`; ignored for addresses this object did not
  /// hand out and for the allocation stream itself.
  void record_use(const void* ptr, void* stream, int stream_device);
  /// Frees the block `ptr` (a value allocate returned): each other stream
  /// that used it records an event (with that stream's device current) that
  /// the allocation stream waits on, then the block goes back to its allocator
  /// on the allocation stream. Unknown pointers are ignored. Never throws (a
  /// failing CUDA call leaves the block to its allocator without the wait;
  /// the failure is counted in stats as a free all the same).
  void deallocate(void* ptr) noexcept;
  /// Drops `stream` from every block's list of other streams: call it once
  /// the work queued on `stream` has completed and before the stream is
  /// destroyed (an event cannot be recorded on a destroyed stream).
  void forget_stream(void* stream, int stream_device);
  /// Counters (see cuda::MemoryStats).
  cuda::MemoryStats stats() const;

 private:
  struct Block {
    std::size_t nbytes = 0;
    int device = 0;
    void* stream = nullptr;
    std::vector<std::pair<void*, int>> other_streams;  // (stream, its device)
    std::shared_ptr<cuda::Allocator> allocator;
  };

  DeviceApi& api_;
  std::shared_ptr<cuda::Allocator> fallback_;
  mutable std::mutex mu_;
  std::shared_ptr<cuda::Allocator> chosen_;
  std::map<std::uintptr_t, Block> blocks_;  // by start address
  cuda::MemoryStats stats_;
};

/// The process's DeviceApi: the CUDA runtime (device_ops.cu) or, without
/// CUDA, one whose calls raise InvalidArgument (device_ops_none.cpp).
DeviceApi& device_api();
/// The default allocator: the stream-ordered pool (device_ops.cu), or
/// nullptr without CUDA.
std::shared_ptr<cuda::Allocator> default_allocator();
/// The process's DeviceMemory over device_api() and default_allocator().
DeviceMemory& device_memory();

}  // namespace diffcomm::detail

#pragma once
// Tensor: a handle to shared, contiguous, row-major storage on one device,
// plus the autograd metadata that makes it a node of a graph.
//
// diffcomm is not a tensor library. The tensor exists so that collectives and
// their adjoints have something to move: dtype, shape, device, zero-copy row
// views (dim 0) and borrowed memory (from_blob, DLPack) are what matter.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "diffcomm/tensor/dtype.hpp"

struct DLManagedTensor;  // <dlpack/dlpack.h>

namespace diffcomm {

using Shape = std::vector<int64_t>;

/// Where a tensor's bytes live.
struct Device {
  enum class Type : uint8_t { CPU, CUDA };
  Type type = Type::CPU;
  int index = 0;  ///< CUDA ordinal; 0 for CPU.

  static Device cpu() { return {}; }
  static Device cuda(int index) { return {Type::CUDA, index}; }
  bool is_cpu() const { return type == Type::CPU; }
  bool is_cuda() const { return type == Type::CUDA; }
  friend bool operator==(const Device&, const Device&) = default;
  std::string str() const;  ///< "cpu" or "cuda:k"
};

/// A block of bytes, owned (allocated by diffcomm) or borrowed (freed by the
/// caller's deleter). Shared by every tensor that views it.
class Storage {
 public:
  using Deleter = std::function<void(void*)>;
  Storage(void* data, std::size_t nbytes, Device device, Deleter deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  /// Allocates nbytes on device (CPU: 64-byte aligned, from the host block
  /// cache above 64 KiB, see HostCacheStats; CUDA: cudaMalloc).
  /// Throws InvalidArgument for CUDA when built without CUDA.
  static std::shared_ptr<Storage> allocate(std::size_t nbytes, Device device);

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  const Device& device() const { return device_; }
  /// Bumped by every in-place write (fill_, copy_, a collective's outputs),
  /// as torch's version counter: a node that saved a tensor for backward
  /// compares it (SavedTensor in autograd.hpp). Writes through data_ptr()
  /// or a DLPack peer are not seen.
  uint64_t version() const { return version_; }
  void bump_version() { ++version_; }

 private:
  uint64_t version_ = 0;
  void* data_;
  std::size_t nbytes_;
  Device device_;
  Deleter deleter_;
};

class Node;
struct TensorImpl;

/// A handle to a tensor. Copying the handle shares data *and* autograd state
/// (like torch.Tensor). A default-constructed Tensor is undefined.
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  DType dtype() const;
  const Device& device() const;
  const Shape& shape() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  /// Size of dimension d (negative d counts from the end). Throws
  /// InvalidArgument when out of range.
  int64_t size(int64_t d) const;  // inline below
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype()); }
  /// Elements per row (product of dims 1..); 1 for 0-d and 1-d tensors.
  int64_t row_numel() const;  // inline below

  /// Address of the first element (the storage plus this view's offset).
  void* data_ptr() const;
  /// Typed pointer; throws InvalidArgument when T does not match dtype().
  template <class T>
  T* data() const;

  /// Zero-copy view of rows [start, start + length) along dim 0. Not recorded
  /// by autograd (use diffcomm::narrow for the differentiable form).
  /// Throws InvalidArgument when out of range or on a 0-d tensor.
  Tensor row_view(int64_t start, int64_t length) const;
  /// Zero-copy view with another shape of the same numel (no autograd).
  Tensor view_as_shape(Shape shape) const;
  /// A new handle to the same data with no autograd history.
  Tensor detach() const;
  /// A deep copy of the data (no autograd history).
  Tensor copy_data() const;
  /// Fills every element with value, converted to dtype(). Returns *this.
  /// An in-place write: bumps the storage's version.
  Tensor& fill_(double value);
  /// Copies src's elements into this tensor (same dtype and numel; any
  /// devices). An in-place write: bumps the storage's version.
  Tensor& copy_(const Tensor& src);
  /// The storage's version (see Storage::version); 0 when undefined.
  uint64_t version() const;
  /// Marks an in-place write done through data_ptr() (as the collectives'
  /// outputs are): bumps the storage's version.
  void bump_version() const;
  /// The single element of a 1-element tensor, converted to double (CPU only).
  double item() const;
  /// All elements converted to double (copies from CUDA when needed).
  std::vector<double> to_vector() const;
  /// Copy of this tensor on device (same handle if already there).
  Tensor to(Device device) const;

  // ---- autograd ----
  bool requires_grad() const;  // inline below
  /// Marks a leaf as requiring a gradient. Throws InvalidArgument on an
  /// integer dtype or on a non-leaf.
  Tensor& set_requires_grad(bool value = true);
  /// The accumulated gradient of a leaf (undefined until backward).
  Tensor grad() const;
  void set_grad(Tensor g);
  /// The node that produced this tensor (null for leaves).
  std::shared_ptr<Node> grad_fn() const;
  int output_nr() const;
  bool is_leaf() const { return grad_fn() == nullptr; }

  const std::shared_ptr<TensorImpl>& impl() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }
  std::string str() const;  ///< "float32[3, 4] on cpu"

 private:
  const TensorImpl& checked_impl() const;  // throws InvalidArgument when undefined
  [[noreturn]] void throw_bad_dim(int64_t d) const;
  std::shared_ptr<TensorImpl> impl_;
};

/// The state behind a Tensor handle. Exposed for autograd and backends.
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::size_t offset_bytes = 0;
  Shape shape;
  DType dtype = DType::Float32;
  // autograd
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
  int output_nr = 0;
  // The AccumulateGrad of a leaf, kept for the leaf's lifetime (it refers
  // back to the leaf weakly, so there is no cycle): re-creating it on every
  // forward cost three allocations per leaf per step.
  std::shared_ptr<Node> grad_accumulator;
};

namespace detail {
[[noreturn]] void throw_undefined_tensor();
}  // namespace detail

/// Number of elements of a shape (1 for {}).
inline int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The hot accessors are inline: they are called per op (and were per element
// in loops) on every collective and autograd path, and an out-of-line call
// each cost more than the access.
inline const TensorImpl& Tensor::checked_impl() const {
  if (impl_ == nullptr) [[unlikely]]
    detail::throw_undefined_tensor();
  return *impl_;
}
inline DType Tensor::dtype() const { return checked_impl().dtype; }
inline const Device& Tensor::device() const { return checked_impl().storage->device(); }
inline const Shape& Tensor::shape() const { return checked_impl().shape; }
inline int64_t Tensor::numel() const { return shape_numel(checked_impl().shape); }
inline void* Tensor::data_ptr() const {
  const TensorImpl& impl = checked_impl();
  return static_cast<char*>(impl.storage->data()) + impl.offset_bytes;
}
inline int64_t Tensor::size(int64_t d) const {
  const Shape& s = checked_impl().shape;
  const auto n = static_cast<int64_t>(s.size());
  const int64_t i = d < 0 ? d + n : d;
  if (i < 0 || i >= n) [[unlikely]]
    throw_bad_dim(d);
  return s[static_cast<std::size_t>(i)];
}
inline int64_t Tensor::row_numel() const {
  const Shape& s = checked_impl().shape;
  int64_t n = 1;
  for (std::size_t i = 1; i < s.size(); ++i) n *= s[i];
  return n;
}
inline bool Tensor::requires_grad() const {
  const TensorImpl& impl = checked_impl();
  return impl.requires_grad || impl.grad_fn != nullptr;
}

template <class T>
T* Tensor::data() const {
  if (dtype() != dtype_of<T>()) throw_dtype_mismatch("Tensor::data", dtype_of<T>(), dtype());
  return static_cast<T*>(data_ptr());
}

std::string shape_str(const Shape& shape);

/// The most bytes one tensor may hold: 2^48 (256 TiB), more than any
/// machine's memory and than the 48-bit virtual address space of today's
/// x86-64 and ARM64 processes. A larger request is a bad size, not an
/// allocation to attempt.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 48;

/// Bytes of a tensor of `shape` and `dtype` (numel x element size), computed
/// without overflow. Throws InvalidArgument naming `what` (e.g. "empty",
/// "nn::all_to_all_single output") on a negative dim or when the count
/// overflows or exceeds kMaxTensorBytes.
uint64_t checked_nbytes(const Shape& shape, DType dtype, const std::string& what);

// ---- the host block cache ----
/// Bytes the host block cache may hold before a miss releases anything.
inline constexpr uint64_t kHostCacheKeepOnMiss = uint64_t{32} << 20;  // 32 MiB

/// CPU storages above 64 KiB come from a process-wide cache: a freed block
/// keeps its pages and is reused by the next request of its size class
/// (four classes per power of two), as torch's CUDA caching allocator does,
/// so a loop allocating the same outputs and scratch each step does not pay
/// first-touch page faults every call. At most DIFFCOMM_HOST_CACHE_MB MiB
/// (read at the first large allocation; default 1024, 0: no cache; another
/// value throws InvalidArgument) are held; beyond that, blocks go back to
/// the kernel. While more than kHostCacheKeepOnMiss bytes are cached, a miss
/// (a size no cached block has) first releases the blocks freed longest ago,
/// at least as many bytes as it asks for: when the sizes in use change, the
/// cache does not keep pages nobody asks for (what glibc's heap and a plain
/// free list do). Smaller storages use a per-thread cache inside the tensor.
struct HostCacheStats {
  uint64_t cached_bytes = 0;  ///< held for reuse now
  uint64_t hits = 0;          ///< requests served from the cache
  uint64_t misses = 0;        ///< requests that mapped a new block
  uint64_t released = 0;      ///< cached blocks given back to the kernel
  uint64_t limit_bytes = 0;   ///< DIFFCOMM_HOST_CACHE_MB in bytes
};
HostCacheStats host_cache_stats();
/// Frees every cached block (torch.cuda.empty_cache's counterpart); blocks
/// in use are not affected.
void empty_host_cache();
/// Frees the cached blocks freed longest ago until at most `keep_bytes`
/// remain cached (e.g. after a phase whose sizes will not come back).
void trim_host_cache(uint64_t keep_bytes);

// ---- factories ----
/// Uninitialised tensor. Throws InvalidArgument on a negative dim or a size
/// over kMaxTensorBytes (see checked_nbytes), before allocating.
Tensor empty(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::Float32,
            Device device = Device::cpu());
Tensor zeros_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
/// 1-d tensor [start, start+step, ...) with ceil((end-start)/step) elements.
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::Float32);
/// Tensor of shape from values (row-major), converted to dtype. Throws
/// InvalidArgument when values.size() != numel(shape).
Tensor from_vector(const std::vector<double>& values, const Shape& shape,
                   DType dtype = DType::Float64);

/// Wraps caller memory without copying. deleter (may be empty) runs when the
/// last tensor viewing the memory goes away. The memory must be contiguous
/// row-major and stay valid until then.
Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device = Device::cpu(),
                 Storage::Deleter deleter = {});

/// Zero-copy import of a DLPack tensor (DLPack 0.6 DLManagedTensor). Takes
/// ownership: the producer's deleter runs when the last view goes away.
/// Throws InvalidArgument for non-contiguous strides, unsupported dtypes or
/// devices (kDLCPU and kDLCUDA only), a negative ndim or dim, a null shape
/// or data pointer, or more than 2^63 bytes; on a throw the caller keeps ownership
/// (the deleter has not run).
Tensor from_dlpack(DLManagedTensor* managed);
/// Zero-copy export; the returned tensor keeps this tensor's storage alive
/// until its deleter is called by the consumer.
DLManagedTensor* to_dlpack(const Tensor& t);

/// A seeded random generator. There is no global RNG: each rank owns one, so
/// draws are reproducible per (seed, rank) whatever the interleaving.
/// Uses fixed algorithms (mt19937_64 with a 53-bit uniform; Philox4x32-10
/// with a ziggurat for normals), so the same seed gives the same numbers with
/// any standard library.
class Generator {
 public:
  explicit Generator(uint64_t seed);
  uint64_t next_u64();
  double uniform();  ///< in [0, 1)
  /// Standard normal: a ziggurat over a Philox4x32-10 stream keyed by the
  /// seed (its own counter, independent of next_u64/uniform's mt19937_64).
  /// Seeded and reproducible; the values changed when this replaced
  /// Box-Muller over mt19937_64 (10x faster, see bench/RESULTS.md).
  double normal();
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
  struct State;
  std::shared_ptr<State> state_;
};

/// Uniform in [low, high). bfloat16/float16 are drawn in double, then rounded.
Tensor rand_uniform(const Shape& shape, Generator& gen, double low = 0.0, double high = 1.0,
                    DType dtype = DType::Float32);
/// Normal(mean, std).
Tensor rand_normal(const Shape& shape, Generator& gen, double mean = 0.0, double std = 1.0,
                   DType dtype = DType::Float32);

}  // namespace diffcomm

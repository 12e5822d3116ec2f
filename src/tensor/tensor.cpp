#include "diffcomm/tensor/tensor.hpp"

#include <fmt/format.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <numbers>
#include <optional>
#include <random>

#include "diffcomm/tensor/error.hpp"
#include "host_cache.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm {

// ---------------------------------------------------------------- dtype
std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int32,
                  DType::Int64, DType::UInt8})
    if (dtype_name(d) == name) return d;
  raise("parse_dtype",
        fmt::format("unknown dtype '{}' (expected float32, float64, bfloat16, float16, int32, "
                    "int64 or uint8)",
                    name));
}

bool is_floating(DType dtype) {
  return dtype == DType::Float32 || dtype == DType::Float64 || dtype == DType::BFloat16 ||
         dtype == DType::Float16;
}

void throw_dtype_mismatch(const char* where, DType expected, DType got) {
  raise(where, fmt::format("expected dtype {}, got {}", dtype_name(expected), dtype_name(got)));
}

uint16_t float16::from_float(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u)
    return static_cast<uint16_t>(sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Subnormal (or zero) half: count units of 2^-24; the scaling is exact and
    // nearbyint rounds half to even in the default rounding mode.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t h = (abs >> 13) - (112u << 10);  // rebias exponent 127 -> 15
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // nearest even; may carry
  return static_cast<uint16_t>(sign | h);
}

float float16::to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---------------------------------------------------------------- device, storage
std::string Device::str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }

Storage::Storage(void* data, std::size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (deleter_) deleter_(data_);
}

namespace {
// Storages up to this size carry their bytes in the shared_ptr block.
constexpr std::size_t kInlineMax = 64 * 1024;

// A per-thread cache of freed inline-storage and TensorImpl blocks. Why: a
// 2 KiB tensor block is above glibc's per-thread cache (tcache: requests up
// to 1032 B), so freeing it took the coalescing slow path (~1 100
// instructions per free, malloc_consolidate included), the largest single
// cost of a small fwd+bwd step; below that, a list pop/push here is still a
// fraction of tcache's path with its checks. Blocks are kept per size class
// (64-byte steps to 1 KiB, then 4 per power of two, the
// allocation rounded up to its class) in intrusive free lists, at most
// kCacheBytes per thread; beyond that they go back to the heap. Per thread,
// not per rank: the simulated world runs every rank's fiber on one thread
// (they share it, with no order-dependent effect: a block is bytes to be
// overwritten), Python's simulated world one thread per rank (each its own
// cache, no locks). A block freed on another thread joins that thread's cache;
// blocks are plain operator new memory, so any thread may reuse or free them.
// Off under AddressSanitizer, which must see every free to catch a
// use-after-free.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUseBlockCache = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUseBlockCache = false;
#else
constexpr bool kUseBlockCache = true;
#endif
#else
constexpr bool kUseBlockCache = true;
#endif
constexpr std::size_t kCacheMaxBytes = 128 * 1024;  // above every inline block
constexpr std::size_t kSmallMax = 1024;             // 64-byte steps up to here
// 16 classes of 64 B up to 1 KiB, then 4 per power of two: (1, 2], (2, 4],
// ... (64, 128] KiB.
constexpr int kCacheClasses = 16 + 4 * 7;
constexpr std::size_t kCacheBytes = 1024 * 1024;  // cached bytes per thread, at most

struct FreeBlock {
  FreeBlock* next;
};
// Trivially destructible and constant-initialised: no TLS guard on access,
// and still usable (disabled) after the reaper below has run at thread exit.
struct BlockCache {
  FreeBlock* head[kCacheClasses];
  std::size_t bytes;
  bool armed;     // the reaper is registered for this thread
  bool disabled;  // the thread is exiting: free straight to the heap
};
constinit thread_local BlockCache t_cache{};

// Returns the cached blocks to the heap when the thread exits.
struct CacheReaper {
  void arm() {}
  ~CacheReaper() {
    for (FreeBlock*& h : t_cache.head)
      while (h != nullptr) {
        FreeBlock* next = h->next;
        ::operator delete(static_cast<void*>(h));
        h = next;
      }
    t_cache.bytes = 0;
    t_cache.disabled = true;
  }
};
thread_local CacheReaper t_reaper;

// Size class of a request n in [1, kCacheMaxBytes]: 64-byte steps up to
// 1 KiB; above, with 2^(b-1) < n <= 2^b, steps of 2^(b-3), so the rounding
// wastes < 25 %.
struct SizeClass {
  int index;
  std::size_t bytes;  // n rounded up to the class
};
SizeClass size_class(std::size_t n) {
  if (n <= kSmallMax) {
    const std::size_t steps = (n + 63) >> 6;  // 1..16
    return {static_cast<int>(steps) - 1, steps << 6};
  }
  const int b = static_cast<int>(std::bit_width(n - 1));
  const std::size_t bytes = detail::class_bytes(n);
  const auto steps = static_cast<int>(bytes >> (b - 3));  // 5..8
  return {16 + (b - 11) * 4 + steps - 5, bytes};
}
bool cacheable(std::size_t n) { return kUseBlockCache && n > 0 && n <= kCacheMaxBytes; }

void* block_allocate(std::size_t n) {
  if (!cacheable(n)) return ::operator new(n);
  const SizeClass c = size_class(n);
  FreeBlock*& head = t_cache.head[c.index];
  if (FreeBlock* b = head) {
    head = b->next;
    t_cache.bytes -= c.bytes;
    return b;
  }
  return ::operator new(c.bytes);
}

void block_free(void* p, std::size_t n) noexcept {
  if (cacheable(n)) {
    const SizeClass c = size_class(n);
    if (!t_cache.disabled && t_cache.bytes + c.bytes <= kCacheBytes) {
      if (!t_cache.armed) {
        t_reaper.arm();  // registers the exit drain (first use constructs it)
        t_cache.armed = true;
      }
      FreeBlock*& head = t_cache.head[c.index];
      head = ::new (p) FreeBlock{head};
      t_cache.bytes += c.bytes;
      return;
    }
  }
  ::operator delete(p);
}

// Allocator for std::allocate_shared that over-allocates the control block
// by `extra` bytes and reports the 64-byte-aligned address inside that tail
// through `*data` before the Storage is constructed (allocate_shared
// allocates, then constructs from the forwarded arguments, which are read
// then: `data` is passed by reference). The block comes from (and returns
// to) the per-thread cache above; deallocate is called on a copy of this
// allocator, so it knows the block's size.
template <class T>
struct InlineAlloc {
  using value_type = T;
  std::size_t extra;
  void** data;
  InlineAlloc(std::size_t e, void** d) : extra(e), data(d) {}
  template <class U>
  InlineAlloc(const InlineAlloc<U>& o) : extra(o.extra), data(o.data) {}  // NOLINT
  T* allocate(std::size_t n) {
    const std::size_t head = n * sizeof(T);
    char* raw = static_cast<char*>(block_allocate(head + extra));
    const auto tail = reinterpret_cast<std::uintptr_t>(raw + head);
    *data = reinterpret_cast<void*>((tail + 63) & ~std::uintptr_t{63});
    return reinterpret_cast<T*>(raw);
  }
  void deallocate(T* p, std::size_t n) noexcept { block_free(p, n * sizeof(T) + extra); }
  template <class U>
  bool operator==(const InlineAlloc<U>& o) const {
    return extra == o.extra;
  }
};
// std::allocate_shared allocator for TensorImpl: the block cache above.
template <class T>
struct CachedAlloc {
  using value_type = T;
  CachedAlloc() = default;
  template <class U>
  CachedAlloc(const CachedAlloc<U>&) {}  // NOLINT
  T* allocate(std::size_t n) { return static_cast<T*>(block_allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { block_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const CachedAlloc<U>&) const {
    return true;
  }
};

// A new, empty TensorImpl (handle state and control block in one cached block).
std::shared_ptr<TensorImpl> new_impl() {
  return std::allocate_shared<TensorImpl>(CachedAlloc<TensorImpl>());
}
}  // namespace

std::shared_ptr<Storage> Storage::allocate(std::size_t nbytes, Device device) {
  if (device.is_cuda()) {
    void* p = detail::cuda_malloc(nbytes, device.index);
    const int idx = device.index;
    return std::make_shared<Storage>(p, nbytes, device,
                                     [idx](void* ptr) { detail::cuda_free(ptr, idx); });
  }
  // 64-byte alignment keeps SIMD loads aligned. Aligned operator new goes
  // through glibc's memalign path (a search and a split per call, ~15 % of a
  // small fwd+bwd step); plain malloc keeps its per-thread cache fast path, so
  // over-allocate by the alignment. A zero-byte request still gets a
  // distinct, valid address.
  constexpr std::size_t kAlign = 64;
  // (256: room for the shared_ptr block that precedes inline bytes.)
  if (nbytes > std::numeric_limits<std::size_t>::max() - kAlign - 256) throw std::bad_alloc();
  if (nbytes <= kInlineMax) {
    // Small: the bytes follow the Storage in the shared_ptr's own block, one
    // allocation instead of two (a tensor of a small fwd+bwd step is mostly
    // allocator work). The bytes go with the last owner of the block (a
    // weak_ptr<Storage> would hold them too; none is taken).
    void* data = nullptr;
    return std::allocate_shared<Storage>(InlineAlloc<Storage>(nbytes + kAlign, &data), data, nbytes,
                                         device, Deleter());
  }
  // Large: the process-wide block cache (host_cache.hpp), 64-byte aligned.
  std::size_t capacity = 0;
  void* p = nullptr;
  try {
    p = detail::host_allocate(nbytes, &capacity);
  } catch (const std::bad_alloc&) {
    // Named, so that a rank's report says what ran out (a bare
    // std::bad_alloc said nothing); the message is built outside the handler.
    p = nullptr;
  }
  if (p == nullptr)
    throw OutOfMemory(fmt::format(
        "diffcomm: cannot allocate {} bytes ({:.3g} GiB) of host memory for a tensor: out of "
        "memory",
        nbytes, static_cast<double>(nbytes) / double(std::size_t{1} << 30)));
  return std::make_shared<Storage>(p, nbytes, device,
                                   [capacity](void* ptr) { detail::host_free(ptr, capacity); });
}

// ---------------------------------------------------------------- shapes
std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

uint64_t checked_nbytes(const Shape& shape, DType dtype, const std::string& what) {
  uint64_t bytes = element_size(dtype);
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) raise(what, fmt::format("negative dim in shape {}", shape_str(shape)));
    zero = zero || d == 0;
  }
  if (zero) return 0;
  for (int64_t d : shape) {
    const auto u = static_cast<uint64_t>(d);
    if (bytes > kMaxTensorBytes / u)
      raise(what, fmt::format("shape {} of {} needs more than {} bytes (2^48), the most one tensor "
                              "may hold",
                              shape_str(shape), dtype_name(dtype), kMaxTensorBytes));
    bytes *= u;
  }
  return bytes;
}

// ---------------------------------------------------------------- tensor
namespace {
const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  if (!impl) detail::throw_undefined_tensor();
  return *impl;
}
}  // namespace

void detail::throw_undefined_tensor() { raise("Tensor", "use of an undefined tensor"); }

void Tensor::throw_bad_dim(int64_t d) const {
  raise("Tensor::size", fmt::format("dim {} out of range for {}", d, str()));
}

Tensor Tensor::row_view(int64_t start, int64_t length) const {
  const auto& impl = checked(impl_);
  if (impl.shape.empty()) raise("row_view", "a 0-d tensor has no rows");
  const int64_t rows = impl.shape[0];
  if (start < 0 || length < 0 || start + length > rows)
    raise("row_view", fmt::format("rows [{}, {}) out of range for {} ({} rows)", start,
                                  start + length, str(), rows));
  auto v = new_impl();
  v->storage = impl.storage;
  v->dtype = impl.dtype;
  v->shape = impl.shape;
  v->shape[0] = length;
  v->offset_bytes =
      impl.offset_bytes + static_cast<std::size_t>(start * row_numel()) * element_size(impl.dtype);
  return Tensor(v);
}

Tensor Tensor::view_as_shape(Shape shape) const {
  const auto& impl = checked(impl_);
  for (int64_t d : shape)
    if (d < 0) raise("reshape", fmt::format("negative dim in {}", shape_str(shape)));
  if (shape_numel(shape) != numel())
    raise("reshape", fmt::format("cannot view {} as {} ({} vs {} elements)", str(),
                                 shape_str(shape), numel(), shape_numel(shape)));
  auto v = new_impl();
  v->storage = impl.storage;
  v->dtype = impl.dtype;
  v->shape = std::move(shape);
  v->offset_bytes = impl.offset_bytes;
  return Tensor(v);
}

Tensor Tensor::detach() const {
  const auto& impl = checked(impl_);
  auto v = new_impl();
  v->storage = impl.storage;
  v->dtype = impl.dtype;
  v->shape = impl.shape;
  v->offset_bytes = impl.offset_bytes;
  return Tensor(v);
}

Tensor Tensor::copy_data() const {
  Tensor out = empty(shape(), dtype(), device());
  out.copy_(*this);
  return out;
}

uint64_t Tensor::version() const { return defined() ? impl_->storage->version() : 0; }
void Tensor::bump_version() const {
  if (defined()) impl_->storage->bump_version();
}

Tensor& Tensor::fill_(double value) {
  bump_version();
  if (device().is_cuda()) {
    detail::cuda_fill(*this, value);
    return *this;
  }
  dispatch_dtype(dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = static_cast<T>(static_cast<compute_t<T>>(value));
    T* p = static_cast<T*>(data_ptr());
    const int64_t n = numel();
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  if (src.dtype() != dtype()) throw_dtype_mismatch("Tensor::copy_", dtype(), src.dtype());
  if (src.numel() != numel())
    raise("Tensor::copy_", fmt::format("{} elements into {} elements ({} <- {})", src.numel(),
                                       numel(), str(), src.str()));
  bump_version();
  if (nbytes() == 0 || src.data_ptr() == data_ptr()) return *this;
  if (device().is_cpu() && src.device().is_cpu())
    std::memmove(data_ptr(), src.data_ptr(), nbytes());
  else
    detail::cuda_memcpy(data_ptr(), device(), src.data_ptr(), src.device(), nbytes());
  return *this;
}

double Tensor::item() const {
  if (numel() != 1)
    raise("Tensor::item", fmt::format("needs 1 element, {} has {}", str(), numel()));
  return to_vector()[0];
}

std::vector<double> Tensor::to_vector() const {
  Tensor host = to(Device::cpu());
  std::vector<double> out(static_cast<std::size_t>(numel()));
  dispatch_dtype(dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* p = static_cast<const T*>(host.data_ptr());
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<double>(static_cast<compute_t<T>>(p[i]));
  });
  return out;
}

Tensor Tensor::to(Device target) const {
  if (device() == target) return *this;
  Tensor out = empty(shape(), dtype(), target);
  out.copy_(*this);
  return out;
}

Tensor Tensor::grad() const { return checked(impl_).grad; }
void Tensor::set_grad(Tensor g) {
  checked(impl_);
  impl_->grad = std::move(g);
}
std::shared_ptr<Node> Tensor::grad_fn() const { return checked(impl_).grad_fn; }
int Tensor::output_nr() const { return checked(impl_).output_nr; }

std::string Tensor::str() const {
  if (!impl_) return "undefined";
  return fmt::format("{}{} on {}", dtype_name(dtype()), shape_str(shape()), device().str());
}

// ---------------------------------------------------------------- factories
Tensor empty(const Shape& shape, DType dtype, Device device) {
  // The common case without building checked_nbytes' `what` string: dims
  // that are all positive with a small product (a zero, a negative or a big
  // dim goes to the full check, which says what is wrong).
  uint64_t nbytes = element_size(dtype);
  bool plain = true;
  for (int64_t d : shape) {
    plain = plain && d > 0 && d <= (int64_t{1} << 24) && nbytes <= (uint64_t{1} << 24);
    nbytes *= plain ? static_cast<uint64_t>(d) : 1;
  }
  if (!plain) nbytes = checked_nbytes(shape, dtype, "empty");
  auto impl = new_impl();
  impl->storage = Storage::allocate(static_cast<std::size_t>(nbytes), device);
  impl->shape = shape;
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }

Tensor arange(double start, double end, double step, DType dtype) {
  if (step == 0.0) raise("arange", "step must be non-zero");
  const double n = std::ceil((end - start) / step);
  const int64_t count = n > 0 ? static_cast<int64_t>(n) : 0;
  std::vector<double> v(static_cast<std::size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    v[static_cast<std::size_t>(i)] = start + step * static_cast<double>(i);
  return from_vector(v, {count}, dtype);
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    raise("from_vector", fmt::format("{} values for shape {} ({} elements)", values.size(),
                                     shape_str(shape), shape_numel(shape)));
  Tensor t = empty(shape, dtype);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i)
      p[i] = static_cast<T>(static_cast<compute_t<T>>(values[i]));
  });
  return t;
}

Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                 Storage::Deleter deleter) {
  const uint64_t nbytes = checked_nbytes(shape, dtype, "from_blob");
  auto impl = new_impl();
  impl->storage =
      std::make_shared<Storage>(data, static_cast<std::size_t>(nbytes), device, std::move(deleter));
  impl->shape = shape;
  impl->dtype = dtype;
  return Tensor(impl);
}

// ---------------------------------------------------------------- random
namespace {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11; the Random123 / cuRAND / JAX generator): 128 random bits per
// (key, counter), no state beyond the counter, ten cheap rounds. One block
// is a chain of ten dependent multiplies, so kLanes consecutive counters are
// computed side by side (the lanes are independent: the compiler interleaves
// or vectorizes them), filling out[2 * kLanes] 64-bit words.
constexpr int kPhiloxLanes = 8;
void philox4x32_10(uint64_t counter, const std::array<uint32_t, 2>& key,
                   std::array<uint64_t, 2 * kPhiloxLanes>& out) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int l = 0; l < kPhiloxLanes; ++l) {
    const uint64_t c = counter + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(c);
    c1[l] = static_cast<uint32_t>(c >> 32);
    c2[l] = 0;
    c3[l] = 0;
  }
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    for (int l = 0; l < kPhiloxLanes; ++l) {
      const uint64_t p0 = uint64_t{kM0} * c0[l], p1 = uint64_t{kM1} * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p1);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += kW0;
    k1 += kW1;
  }
  for (int l = 0; l < kPhiloxLanes; ++l) {
    out[static_cast<std::size_t>(2 * l)] = uint64_t{c0[l]} | uint64_t{c1[l]} << 32;
    out[static_cast<std::size_t>(2 * l + 1)] = uint64_t{c2[l]} | uint64_t{c3[l]} << 32;
  }
}

// Marsaglia & Tsang's ziggurat for the standard normal (J. Stat. Softw. 5(8),
// 2000), 256 layers, in double: ~99 % of draws are one multiply and one
// compare, instead of a log, a sqrt and a sincos per pair (Box-Muller).
struct Ziggurat {
  static constexpr int kLayers = 256;
  static constexpr double kR = 3.6541528853610088;  // start of the tail
  static constexpr double kV = 4.92867323399e-3;    // area of each layer
  std::array<double, kLayers + 1> x{};              // layer right edges, x[256] = 0
  std::array<double, kLayers + 1> f{};              // exp(-x^2/2) at them
  Ziggurat() {
    auto pdf = [](double t) { return std::exp(-0.5 * t * t); };
    x[0] = kV / pdf(kR);  // the base layer: rectangle [0, r] x [0, f(r)] plus the tail
    x[1] = kR;
    for (int i = 1; i < kLayers - 1; ++i)
      x[i + 1] = std::sqrt(-2.0 * std::log(kV / x[i] + pdf(x[i])));
    x[kLayers] = 0.0;
    for (int i = 0; i <= kLayers; ++i) f[i] = pdf(x[i]);
  }
};

const Ziggurat& ziggurat() {
  static const Ziggurat z;  // read-only after construction: shared by every rank
  return z;
}

}  // namespace

struct Generator::State {
  // Seeded on first use: seeding a Mersenne Twister fills 312 words, which
  // dominated the training step's many short normal() streams (one per
  // positional row) that never read it.
  std::optional<std::mt19937_64> engine;
  uint64_t engine_seed = 0;
  // normal(): Philox keyed by the seed, one counter per generator (block
  // number); `buf` holds the words of kPhiloxLanes blocks, used in order.
  std::array<uint32_t, 2> key{};
  uint64_t counter = 0;
  std::array<uint64_t, 2 * kPhiloxLanes> buf{};
  std::size_t next = buf.size();
  uint64_t next_normal_bits() {
    if (next == buf.size()) {
      philox4x32_10(counter, key, buf);
      counter += kPhiloxLanes;
      next = 0;
    }
    return buf[next++];
  }
  double normal_uniform() {  // in (0, 1]: safe under log
    return (static_cast<double>(next_normal_bits() >> 11) + 1.0) * 0x1.0p-53;
  }
};

Generator::Generator(uint64_t seed) : seed_(seed), state_(std::make_shared<State>()) {
  state_->engine_seed = seed;
  state_->key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
}

uint64_t Generator::next_u64() {
  if (!state_->engine) state_->engine.emplace(state_->engine_seed);
  return (*state_->engine)();
}

double Generator::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Generator::normal() {
  // Bits 0-7 pick the layer, bit 8 the sign, bits 11-63 the position in the
  // layer: disjoint bits, so the layer and the value are independent.
  const Ziggurat& z = ziggurat();
  State& st = *state_;
  for (;;) {
    const uint64_t bits = st.next_normal_bits();
    const auto i = static_cast<std::size_t>(bits & 0xFF);
    const double sign = (bits & 0x100) != 0 ? -1.0 : 1.0;
    const double u = static_cast<double>(bits >> 11) * 0x1.0p-53;  // [0, 1)
    const double t = u * z.x[i];
    if (t < z.x[i + 1]) return sign * t;  // inside the layer's rectangle core
    if (i == 0) {
      // The tail beyond r (Marsaglia 1964).
      for (;;) {
        const double a = -std::log(st.normal_uniform()) / Ziggurat::kR;
        const double b = -std::log(st.normal_uniform());
        if (b + b > a * a) return sign * (Ziggurat::kR + a);
      }
    }
    // The wedge between the rectangle and the curve.
    const double v = st.normal_uniform();
    if (z.f[i + 1] + v * (z.f[i] - z.f[i + 1]) < std::exp(-0.5 * t * t)) return sign * t;
  }
}

Tensor rand_uniform(const Shape& shape, Generator& gen, double low, double high, DType dtype) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (double& x : v) x = low + (high - low) * gen.uniform();
  return from_vector(v, shape, dtype);
}

Tensor rand_normal(const Shape& shape, Generator& gen, double mean, double std, DType dtype) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (double& x : v) x = mean + std * gen.normal();
  return from_vector(v, shape, dtype);
}

}  // namespace diffcomm

// CUDA storage, copies and the arithmetic autograd and the backends need on
// CUDA tensors (fill, add, scale, the deterministic reduction), on the CUDA
// runtime. Every kernel and copy runs on a stream (the device's current
// stream, or the one passed), memory comes from a stream-ordered pool, and
// nothing synchronizes the device (see include/diffcomm/tensor/cuda.hpp). Every
// call is checked; failures raise BackendError with CUDA's own text.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "tensor/cuda/device_memory.hpp"
#include "tensor/cuda/device_ops.hpp"
#include "tensor/cuda/reduce_semantics.hpp"

namespace diffcomm::detail {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    // (std::string rather than fmt: nvcc rejects fmt's consteval format checks)
    throw BackendError(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err) +
                       " (" + cudaGetErrorName(err) + ")");
  }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// ---------------------------------------------------------------- runtime
class CudaApi final : public DeviceApi {
 public:
  int current_device() override {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  }
  void set_device(int device) override { check(cudaSetDevice(device), "cudaSetDevice"); }
  void* create_event() override {
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return ev;
  }
  void record_event(void* event, void* stream) override {
    check(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)), "cudaEventRecord");
  }
  void stream_wait_event(void* stream, void* event) override {
    check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0),
          "cudaStreamWaitEvent");
  }
  void destroy_event(void* event) noexcept override {
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
};

// The default allocator: one memory pool per device, created on first use
// with a release threshold of "never" (freed blocks stay in the pool for
// reuse, as in a caching allocator), allocations and frees ordered on the
// caller's stream. Devices without memory-pool support use cudaMalloc/cudaFree.
class PoolAllocator final : public cuda::Allocator {
 public:
  void* allocate(std::size_t nbytes, int device, void* stream) override {
    void* p = nullptr;
    if (cudaMemPool_t pool = pool_of(device); pool != nullptr)
      check(cudaMallocFromPoolAsync(&p, nbytes, pool, as_stream(stream)),
            "cudaMallocFromPoolAsync (diffcomm's stream-ordered pool)");
    else
      check(cudaMalloc(&p, nbytes), "cudaMalloc (device without memory pools)");
    return p;
  }
  void deallocate(void* ptr, std::size_t, int device, void* stream) noexcept override {
    cudaError_t e = cudaSuccess;
    if (has_pool(device))
      e = cudaFreeAsync(ptr, as_stream(stream));
    else
      e = cudaFree(ptr);
    if (e != cudaSuccess) (void)cudaGetLastError();  // e.g. the context is gone at exit
  }
  std::string name() const override {
    return "diffcomm stream-ordered pool (cudaMallocFromPoolAsync)";
  }

 private:
  struct PerDevice {
    bool probed = false;
    cudaMemPool_t pool = nullptr;
  };

  bool has_pool(int device) {
    const std::lock_guard lock(mu_);
    return device >= 0 && static_cast<std::size_t>(device) < devices_.size() &&
           devices_[static_cast<std::size_t>(device)].pool != nullptr;
  }

  // The device's pool (created on first use), or nullptr without pool support.
  cudaMemPool_t pool_of(int device) {
    const std::lock_guard lock(mu_);
    if (static_cast<std::size_t>(device) >= devices_.size())
      devices_.resize(static_cast<std::size_t>(device) + 1);
    PerDevice& d = devices_[static_cast<std::size_t>(device)];
    if (d.probed) return d.pool;
    int supported = 0;
    check(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device),
          "cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported)");
    if (supported != 0) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.handleTypes = cudaMemHandleTypeNone;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaMemPool_t pool = nullptr;
      check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
      std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
      const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      if (e != cudaSuccess) {
        (void)cudaMemPoolDestroy(pool);
        check(e, "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
      }
      d.pool = pool;  // lives as long as the process (blocks may be freed at exit)
    }
    d.probed = true;
    return d.pool;
  }

  std::mutex mu_;
  std::vector<PerDevice> devices_;
};

// ---------------------------------------------------------------- kernels
// Device storage type of each DType (16-bit floats as raw bits, converted
// by reduce_semantics.hpp exactly as the CPU types do).
template <class F>
void dispatch_device(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); break;
    case DType::Float64: f(double{}); break;
    case DType::BFloat16: f(rs::Bf16Bits{}); break;
    case DType::Float16: f(rs::F16Bits{}); break;
    case DType::Int32: f(int32_t{}); break;
    case DType::Int64: f(int64_t{}); break;
    case DType::UInt8: f(uint8_t{}); break;
  }
}

constexpr int kThreads = 256;
unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < (1 << 20) ? b : (1 << 20));  // grid-stride beyond
}

template <class T>
__global__ void fill_kernel(T* p, int64_t n, T v) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = v;
}

// out = a + alpha * b, in the accumulator type, rounded once per operation.
template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n,
                           typename rs::Traits<T>::Acc alpha) {
  using Tr = rs::Traits<T>;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = Tr::store(rs::add_rn(Tr::load(a[i]), rs::mul_rn(alpha, Tr::load(b[i]))));
}

template <class T>
__global__ void scale_kernel(T* out, const T* x, int64_t n, typename rs::Traits<T>::Acc alpha) {
  using Tr = rs::Traits<T>;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = Tr::store(rs::mul_rn(alpha, Tr::load(x[i])));
}

// Input pointers of a reduction: up to kInline by value (kernel parameter
// space), beyond that a table in device memory.
constexpr int kInline = 32;
template <class T>
struct ReduceArgs {
  const T* inline_inputs[kInline];
  const T* const* table;
  int k;
  rs::Op op;
  double factor;  // PremulSum's
  T* out;
  int64_t n;
};

template <class T>
__global__ void reduce_kernel(ReduceArgs<T> a) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const T v = rs::reduce_element<T>(
        a.op, a.k,
        [&](int j) {
          const T* p = a.k <= kInline ? a.inline_inputs[j] : a.table[j];
          return p[i];
        },
        a.factor);
    a.out[i] = v;
  }
}

// The accumulator-typed value of a double (what the CPU ops compute with).
template <class T>
typename rs::Traits<T>::Acc acc_value(double v) {
  return static_cast<typename rs::Traits<T>::Acc>(v);
}

void check_launch(const char* what) { check(cudaGetLastError(), what); }

void* stream_of(const Tensor& t) { return cuda::current_stream(t.device().index); }

bool is_pinned_host(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

}  // namespace

DeviceApi& device_api() {
  static CudaApi* const api = new CudaApi();  // never destroyed (used at exit)
  return *api;
}

std::shared_ptr<cuda::Allocator> default_allocator() {
  static const std::shared_ptr<cuda::Allocator> pool = std::make_shared<PoolAllocator>();
  return pool;
}

bool cuda_available() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e == cudaSuccess && n > 0;
}

void* cuda_malloc(std::size_t nbytes, int device) {
  // Asking for a device this process does not have (none at all, or an
  // ordinal out of range) is a bad argument, as in a build without CUDA.
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) (void)cudaGetLastError();
  if (e != cudaSuccess || device < 0 || device >= count) {
    const std::string why =
        e != cudaSuccess ? std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")"
                         : std::to_string(count) + " CUDA device(s)";
    throw InvalidArgument("cuda:" + std::to_string(device) + " is not available: " + why);
  }
  return device_memory().allocate(nbytes, device, cuda::current_stream(device));
}

void cuda_free(void* ptr, int /*device: the block records it*/) noexcept {
  device_memory().deallocate(ptr);
}

void cuda_memcpy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                 std::size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    const int dd = dst_device.index, sd = src_device.index;
    const DeviceGuard guard(dd);
    void* stream = cuda::current_stream(dd);
    if (sd != dd) {
      // Wait for the source's producer (its device's current stream), and
      // keep the source block alive until the copy has read it.
      DeviceApi& api = device_api();
      void* ev = nullptr;
      {
        const DeviceGuard on_src(sd);
        ev = api.create_event();
        try {
          api.record_event(ev, cuda::current_stream(sd));
        } catch (...) {
          api.destroy_event(ev);
          throw;
        }
      }
      try {
        api.stream_wait_event(stream, ev);
      } catch (...) {
        api.destroy_event(ev);
        throw;
      }
      api.destroy_event(ev);
      device_memory().record_use(src, stream, dd);
    }
    check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, as_stream(stream)),
          "cudaMemcpyAsync (device to device)");
    return;
  }
  if (dst_device.is_cuda()) {  // host to device
    const DeviceGuard guard(dst_device.index);
    const cudaStream_t stream = as_stream(cuda::current_stream(dst_device.index));
    check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (host to device)");
    // Pageable memory has been staged by the driver when the call returns;
    // pinned memory is read by the copy itself: wait before the caller may
    // reuse it.
    if (is_pinned_host(src)) check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return;
  }
  // device to host: the caller reads the host buffer next.
  const DeviceGuard guard(src_device.index);
  const cudaStream_t stream = as_stream(cuda::current_stream(src_device.index));
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (device to host)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

void cuda_fill(const Tensor& t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  const DeviceGuard guard(t.device().index);
  dispatch_device(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T v = rs::Traits<T>::store(acc_value<T>(value));
    fill_kernel<T><<<blocks_for(n), kThreads, 0, as_stream(stream_of(t))>>>(
        static_cast<T*>(t.data_ptr()), n, v);
  });
  check_launch("fill kernel");
}

void cuda_add(const Tensor& out, const Tensor& a, const Tensor& b, double alpha_b) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const DeviceGuard guard(out.device().index);
  dispatch_device(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<blocks_for(n), kThreads, 0, as_stream(stream_of(out))>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()),
        static_cast<const T*>(b.data_ptr()), n, acc_value<T>(alpha_b));
  });
  check_launch("add kernel");
}

void cuda_scale(const Tensor& out, const Tensor& x, double alpha) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const DeviceGuard guard(out.device().index);
  dispatch_device(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<blocks_for(n), kThreads, 0, as_stream(stream_of(out))>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), n,
        acc_value<T>(alpha));
  });
  check_launch("scale kernel");
}

void reduce_into_device(const Tensor& out, const std::vector<Tensor>& inputs, int op, double factor,
                        void* stream) {
  if (inputs.empty()) raise("reduce_into_device", "no inputs");
  if (!out.device().is_cuda())
    raise("reduce_into_device", std::string("output ") + out.str() + " is not a CUDA tensor");
  for (const Tensor& t : inputs)
    if (t.dtype() != out.dtype() || t.numel() != out.numel() || t.device() != out.device())
      raise("reduce_into_device",
            std::string("input ") + t.str() + " does not match output " + out.str());
  if (op < static_cast<int>(rs::Op::Sum) || op > static_cast<int>(rs::Op::PremulSum))
    raise("reduce_into_device", std::string("unknown reduce op ") + std::to_string(op));
  if ((op == static_cast<int>(rs::Op::Avg) || op == static_cast<int>(rs::Op::PremulSum)) &&
      !is_floating(out.dtype()))
    raise("reduce_into_device",
          std::string(op == static_cast<int>(rs::Op::Avg) ? "avg" : "premul_sum") +
              " is undefined for " + dtype_name(out.dtype()));
  if (inputs.size() > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    raise("reduce_into_device", "too many inputs");
  const int64_t n = out.numel();
  if (n == 0) return;
  const int device = out.device().index;
  const int k = static_cast<int>(inputs.size());
  const DeviceGuard guard(device);
  dispatch_device(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    ReduceArgs<T> args{};
    args.k = k;
    args.op = static_cast<rs::Op>(op);
    args.factor = factor;
    args.out = static_cast<T*>(out.data_ptr());
    args.n = n;
    void* table = nullptr;
    if (k <= kInline) {
      for (int j = 0; j < k; ++j)
        args.inline_inputs[j] =
            static_cast<const T*>(inputs[static_cast<std::size_t>(j)].data_ptr());
    } else {
      // A table of input pointers on the device, from the pool on `stream`,
      // freed on `stream` after the kernel (stream order: no wait).
      std::vector<const T*> host(static_cast<std::size_t>(k));
      for (int j = 0; j < k; ++j)
        host[static_cast<std::size_t>(j)] =
            static_cast<const T*>(inputs[static_cast<std::size_t>(j)].data_ptr());
      const std::size_t bytes = host.size() * sizeof(const T*);
      table = device_memory().allocate(bytes, device, stream);
      // From pageable memory: staged by the driver before the call returns.
      const cudaError_t e =
          cudaMemcpyAsync(table, host.data(), bytes, cudaMemcpyHostToDevice, as_stream(stream));
      if (e != cudaSuccess) {
        device_memory().deallocate(table);
        check(e, "cudaMemcpyAsync (reduce_into_device input table)");
      }
      args.table = static_cast<const T* const*>(table);
    }
    reduce_kernel<T><<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(args);
    const cudaError_t e = cudaGetLastError();
    if (table != nullptr) device_memory().deallocate(table);
    check(e, "reduce kernel");
  });
}

}  // namespace diffcomm::detail

// CUDA storage and the arithmetic autograd needs on CUDA tensors (fill, add
// for gradient accumulation, scale), on the CUDA runtime and thrust.
// Every call is checked; failures raise BackendError with CUDA's own text.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>
#include <thrust/transform.h>

#include <string>

#include "detail/device_ops.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::detail {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    // (std::string rather than fmt: nvcc rejects fmt's consteval format checks)
    throw BackendError(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err) +
                       " (" + std::to_string(static_cast<int>(err)) + ")");
}

// Device-side element types for each DType.
template <class F>
void dispatch_device(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); break;
    case DType::Float64: f(double{}); break;
    case DType::BFloat16: f(__nv_bfloat16{}); break;
    case DType::Float16: f(__half{}); break;
    case DType::Int32: f(int32_t{}); break;
    case DType::Int64: f(int64_t{}); break;
    case DType::UInt8: f(uint8_t{}); break;
  }
}

template <class T>
__host__ __device__ float to_f(T v) {
  return static_cast<float>(v);
}

template <class T>
struct Axpby {
  double alpha;
  __host__ __device__ T operator()(T a, T b) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)
      return T(static_cast<float>(a) + static_cast<float>(alpha) * static_cast<float>(b));
    else
      return static_cast<T>(a + static_cast<T>(alpha) * b);
  }
};

template <class T>
struct Scale {
  double alpha;
  __host__ __device__ T operator()(T x) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)
      return T(static_cast<float>(alpha) * static_cast<float>(x));
    else
      return static_cast<T>(static_cast<T>(alpha) * x);
  }
};

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

}  // namespace

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
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
  set_device(device);
  void* p = nullptr;
  check(cudaMalloc(&p, nbytes == 0 ? 1 : nbytes), "cudaMalloc");
  return p;
}

void cuda_free(void* ptr, int device) noexcept {
  cudaSetDevice(device);
  cudaFree(ptr);
}

void cuda_memcpy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                 std::size_t nbytes) {
  if (dst_device.is_cuda())
    set_device(dst_device.index);
  else if (src_device.is_cuda())
    set_device(src_device.index);
  check(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault), "cudaMemcpy");
}

void cuda_fill(const Tensor& t, double value) {
  set_device(t.device().index);
  dispatch_device(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.data_ptr());
    T v;
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>)
      v = T(static_cast<float>(value));
    else
      v = static_cast<T>(value);
    thrust::fill(thrust::device, p, p + t.numel(), v);
  });
  check(cudaGetLastError(), "fill kernel");
}

void cuda_add(const Tensor& out, const Tensor& a, const Tensor& b, double alpha_b) {
  set_device(out.device().index);
  dispatch_device(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    thrust::transform(thrust::device, pa, pa + out.numel(), pb, po, Axpby<T>{alpha_b});
  });
  check(cudaGetLastError(), "add kernel");
}

void cuda_scale(const Tensor& out, const Tensor& x, double alpha) {
  set_device(out.device().index);
  dispatch_device(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    thrust::transform(thrust::device, px, px + out.numel(), po, Scale<T>{alpha});
  });
  check(cudaGetLastError(), "scale kernel");
}

}  // namespace diffcomm::detail

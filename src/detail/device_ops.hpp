#pragma once
// Device memory primitives behind Storage and the few kernels autograd needs
// on CUDA. Implemented in src/cuda/device_ops.cu with the CUDA runtime and
// thrust when diffcomm is built with CUDA; otherwise in
// src/cuda/device_ops_none.cpp, where every entry raises InvalidArgument.
#include <cstddef>

#include "diffcomm/tensor.hpp"

namespace diffcomm::detail {

bool cuda_available();
void* cuda_malloc(std::size_t nbytes, int device);
void cuda_free(void* ptr, int device) noexcept;
/// Copies nbytes between any two devices (host<->device, device<->device).
void cuda_memcpy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                 std::size_t nbytes);
/// Elementwise kernels on CUDA tensors (same dtype, same numel).
void cuda_fill(const Tensor& t, double value);
void cuda_add(const Tensor& out, const Tensor& a, const Tensor& b, double alpha_b);
void cuda_scale(const Tensor& out, const Tensor& x, double alpha);

}  // namespace diffcomm::detail

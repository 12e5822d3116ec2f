#pragma once
// Device memory primitives behind Storage and the few kernels autograd (and
// the backends) need on CUDA. Implemented in src/tensor/cuda/device_ops.cu with the
// CUDA runtime when diffcomm is built with CUDA; otherwise in
// src/tensor/cuda/device_ops_none.cpp, where every entry raises InvalidArgument.
//
// Streams (the rule of include/diffcomm/tensor/cuda.hpp): every call below runs on
// the current stream of the tensor's device (cuda::current_stream), except
// reduce_into_device, which takes its stream. Memory comes from the
// process's cuda::Allocator (a stream-ordered pool by default) on the
// current stream and is freed on that stream. No call synchronizes the
// device; cuda_memcpy to host waits for the current stream only.
#include <cstddef>
#include <vector>

#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::detail {

/// Whether a CUDA device can be used (never throws).
bool cuda_available();
/// nbytes on CUDA device `device` from the process's allocator, on the
/// device's current stream. Throws InvalidArgument for a device that does
/// not exist (or without CUDA), BackendError when the allocation fails.
void* cuda_malloc(std::size_t nbytes, int device);
/// Returns a cuda_malloc block in stream order (see DeviceMemory::deallocate).
void cuda_free(void* ptr, int device) noexcept;
/// Copies nbytes between any two devices (host<->device, device<->device),
/// on the current stream of the CUDA side (the destination's when both are
/// CUDA, after waiting for the source device's current stream with an
/// event). Returns once the host side may be reused or read (see the header
/// comment of cuda.hpp).
void cuda_memcpy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                 std::size_t nbytes);
/// Elementwise kernels on CUDA tensors (same dtype, same numel), on the
/// current stream of their device.
void cuda_fill(const Tensor& t, double value);
/// out = a + alpha_b * b.
void cuda_add(const Tensor& out, const Tensor& a, const Tensor& b, double alpha_b);
/// out = alpha * x.
void cuda_scale(const Tensor& out, const Tensor& x, double alpha);

/// dist::reduce_into on CUDA tensors, bit for bit: out[i] = inputs[0][i] op
/// inputs[1][i] op ... in list order; bfloat16/float16 accumulate in float32
/// and round once; Avg is the sum, one division by inputs.size(), one
/// rounding; Max/Min propagate NaN; integer Sum/Product wrap around (the
/// full rule: src/tensor/cuda/reduce_semantics.hpp). One kernel on `stream` (a
/// cudaStream_t; nullptr is the legacy default stream), no host
/// synchronization; out may be one of the inputs (the same address), not a
/// partial overlap. Every tensor on the same CUDA device, same dtype and
/// numel. The reduction is given as dist::ReduceOp's kind number (`op`: the
/// numbering of src/tensor/cuda/reduce_semantics.hpp, checked in src/distributed/reduce.cpp)
/// and PremulSum's factor, so this (tensor) layer does not depend on dist.
/// Throws InvalidArgument for an empty list, a mismatched tensor, Avg or
/// PremulSum on an integer dtype (the caller, dist::reduce_into, refuses
/// those first with the op's name) or a build without CUDA; BackendError when
/// CUDA fails.
void reduce_into_device(const Tensor& out, const std::vector<Tensor>& inputs, int op, double factor,
                        void* stream);

}  // namespace diffcomm::detail

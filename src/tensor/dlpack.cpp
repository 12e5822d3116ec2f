// DLPack interop: how trainer buffers (PyTorch, JAX, CuPy) enter diffcomm
// without a copy, and how ours leave.
#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <memory>

#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

DType from_dl_dtype(const DLDataType& t) {
  if (t.lanes != 1) raise("from_dlpack", fmt::format("vector lanes {} unsupported", t.lanes));
  if (t.code == kDLFloat && t.bits == 32) return DType::Float32;
  if (t.code == kDLFloat && t.bits == 64) return DType::Float64;
  if (t.code == kDLFloat && t.bits == 16) return DType::Float16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::BFloat16;
  if (t.code == kDLInt && t.bits == 32) return DType::Int32;
  if (t.code == kDLInt && t.bits == 64) return DType::Int64;
  if (t.code == kDLUInt && t.bits == 8) return DType::UInt8;
  raise("from_dlpack",
        fmt::format("unsupported dtype (code {}, bits {})", int(t.code), int(t.bits)));
}

DLDataType to_dl_dtype(DType d) {
  DLDataType t{};
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(element_size(d) * 8);
  switch (d) {
    case DType::Float32:
    case DType::Float64:
    case DType::Float16: t.code = kDLFloat; break;
    case DType::BFloat16: t.code = kDLBfloat; break;
    case DType::Int32:
    case DType::Int64: t.code = kDLInt; break;
    case DType::UInt8: t.code = kDLUInt; break;
  }
  return t;
}

// Owns what an exported DLManagedTensor points at: the tensor (keeping the
// storage alive) and the shape/strides arrays.
struct ExportCtx {
  Tensor tensor;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLManagedTensor managed{};
};

}  // namespace

Tensor from_dlpack(DLManagedTensor* managed) {
  if (managed == nullptr) raise("from_dlpack", "null DLManagedTensor");
  const DLTensor& t = managed->dl_tensor;
  Device device;
  if (t.device.device_type == kDLCPU) {
    device = Device::cpu();
  } else if (t.device.device_type == kDLCUDA) {
    device = Device::cuda(t.device.device_id);
  } else {
    raise("from_dlpack",
          fmt::format("device type {} unsupported (CPU and CUDA only)", int(t.device.device_type)));
  }
  const DType dtype = from_dl_dtype(t.dtype);
  // Everything below reads t.shape[0..ndim) and sizes a view of t.data: an
  // ndim or shape no producer can have is refused before it is used.
  if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr))
    raise("from_dlpack", fmt::format("ndim {} with shape {}", t.ndim, t.shape ? "set" : "null"));
  Shape shape(t.shape, t.shape + t.ndim);
  int64_t bytes = static_cast<int64_t>(element_size(dtype));
  for (int d = 0; d < t.ndim; ++d)
    if (shape[d] < 0 || __builtin_mul_overflow(bytes, shape[d], &bytes))
      raise("from_dlpack", fmt::format("dim {} has size {} (shape must be "
                                       "non-negative, at most 2^63 bytes in all)",
                                       d, shape[d]));
  if (t.data == nullptr && bytes > 0) raise("from_dlpack", "null data for a non-empty tensor");
  if (t.strides != nullptr) {
    // Accept only compact row-major strides (dims of size 1 may carry any stride).
    int64_t expected = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && t.strides[d] != expected)
        raise("from_dlpack",
              fmt::format("non-contiguous tensor (dim {} has stride {}, expected {}); call "
                          ".contiguous() before exporting",
                          d, t.strides[d], expected));
      expected *= shape[d];
    }
  }
  void* data = static_cast<char*>(t.data) + t.byte_offset;
  return from_blob(data, shape, dtype, device, [managed](void*) {
    if (managed->deleter) managed->deleter(managed);
  });
}

DLManagedTensor* to_dlpack(const Tensor& tensor) {
  // Owned by a unique_ptr until handed to the consumer, so a throw below
  // (e.g. an undefined tensor) does not leak it.
  auto owner = std::make_unique<ExportCtx>();
  ExportCtx* ctx = owner.get();
  ctx->tensor = tensor.detach();
  ctx->shape = tensor.shape();
  ctx->strides.assign(ctx->shape.size(), 1);
  for (int d = static_cast<int>(ctx->shape.size()) - 2; d >= 0; --d)
    ctx->strides[d] = ctx->strides[d + 1] * ctx->shape[d + 1];
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = tensor.data_ptr();
  t.device.device_type = tensor.device().is_cpu() ? kDLCPU : kDLCUDA;
  t.device.device_id = tensor.device().index;
  t.ndim = static_cast<int32_t>(ctx->shape.size());
  t.dtype = to_dl_dtype(tensor.dtype());
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = [](DLManagedTensor* self) {
    delete static_cast<ExportCtx*>(self->manager_ctx);
  };
  return &owner.release()->managed;
}

}  // namespace diffcomm

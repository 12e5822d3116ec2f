// Fuzzes DLPack import: a DLManagedTensor with fuzzed dtype, device, ndim,
// shape, strides and byte offset over a buffer exactly as large as a
// compact tensor of that shape needs. from_dlpack must either refuse with
// InvalidArgument or give a tensor whose elements all lie in the buffer, and
// the producer's deleter must run exactly once when the tensor is dropped.
#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fuzz_input.hpp"

namespace {
int deleted = 0;
void count_delete(DLManagedTensor*) { ++deleted; }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  diffcomm::fuzz::Input in(data, size);
  DLManagedTensor m{};
  DLTensor& t = m.dl_tensor;
  // Only CPU memory can be pointed at here (and an out-of-range enum value
  // would be the harness's own undefined behaviour).
  if (!in.flag() && in.range(0, 20) != kDLCPU) return 0;
  t.device.device_type = kDLCPU;
  t.dtype.code = static_cast<uint8_t>(in.range(0, 6));
  t.dtype.bits = static_cast<uint8_t>(in.flag() ? 8 * (1 << in.range(0, 3)) : in.range(0, 255));
  t.dtype.lanes = static_cast<uint16_t>(in.flag() ? 1 : in.range(0, 4));
  t.ndim =
      static_cast<int32_t>(in.flag() ? in.range(0, 4) : in.range(-3, 8));  // <= 8 entries below
  std::vector<int64_t> shape(8), strides(8);
  for (auto& d : shape) d = in.flag() ? in.range(0, 6) : in.any();
  const bool with_strides = in.flag();
  for (auto& s : strides) s = in.flag() ? in.range(0, 64) : in.any();
  t.shape = t.ndim > 0 ? shape.data() : nullptr;
  t.strides = with_strides && t.ndim > 0 ? strides.data() : nullptr;
  t.byte_offset = static_cast<uint64_t>(in.range(0, 2)) * 8;
  // The buffer a compact tensor of this shape needs.
  uint64_t elems = 1;
  bool negative = t.ndim < 0, large = false;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t n = shape[static_cast<std::size_t>(d)];
    negative |= n < 0;
    large |= n > 64;
    if (n >= 0 && n <= 64) elems *= static_cast<uint64_t>(n);
  }
  // A producer's buffer always matches its shape (DLPack cannot say
  // otherwise): shapes too large for a test buffer are skipped; a negative
  // ndim or dim goes on with an empty buffer, and from_dlpack must refuse it.
  if ((large || elems > (1u << 16)) && !negative) return 0;
  const bool honest = !negative;
  std::vector<uint8_t> buffer(honest ? elems * 8 + t.byte_offset : 0);
  t.data = buffer.data();
  m.deleter = count_delete;
  deleted = 0;
  try {
    diffcomm::Tensor x = diffcomm::from_dlpack(&m);
    if (!honest) std::abort();  // accepted a negative ndim or dim
    if (x.numel() != static_cast<int64_t>(elems)) std::abort();
    volatile double sink = 0;
    for (double v : x.to_vector()) sink = sink + v;  // reads every element (ASan checks bounds)
  } catch (const diffcomm::InvalidArgument&) {
    return 0;
  }
  if (deleted != 1) std::abort();
  return 0;
}

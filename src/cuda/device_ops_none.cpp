// Device entry points of a build without CUDA: every CUDA request is refused
// with a clear error, and nothing else in the library changes.
#include <fmt/format.h>

#include "detail/device_ops.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw InvalidArgument(fmt::format(
      "{}: this diffcomm was built without CUDA (DIFFCOMM_HAVE_CUDA is off); CUDA tensors are "
      "unavailable",
      what));
}
}  // namespace

bool cuda_available() { return false; }
void* cuda_malloc(std::size_t, int) { no_cuda("cuda_malloc"); }
void cuda_free(void*, int) noexcept {}
void cuda_memcpy(void*, const Device&, const void*, const Device&, std::size_t) {
  no_cuda("copy to/from CUDA");
}
void cuda_fill(const Tensor&, double) { no_cuda("fill_ on CUDA"); }
void cuda_add(const Tensor&, const Tensor&, const Tensor&, double) { no_cuda("add on CUDA"); }
void cuda_scale(const Tensor&, const Tensor&, double) { no_cuda("scale on CUDA"); }

}  // namespace diffcomm::detail

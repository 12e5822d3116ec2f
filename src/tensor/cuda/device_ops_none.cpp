// Device entry points of a build without CUDA: every CUDA request is refused
// with a clear error, and nothing else in the library changes.
#include <fmt/format.h>

#include "diffcomm/tensor/error.hpp"
#include "tensor/cuda/device_memory.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  raise(what,
        "this diffcomm was built without CUDA (DIFFCOMM_HAVE_CUDA is off); CUDA tensors are "
        "unavailable");
}

// Never reached through diffcomm (no CUDA tensor can exist), but defined so
// that DeviceGuard and DeviceMemory link and refuse clearly.
class NoCudaApi final : public DeviceApi {
 public:
  int current_device() override { no_cuda("cudaGetDevice"); }
  void set_device(int) override { no_cuda("cudaSetDevice"); }
  void* create_event() override { no_cuda("cudaEventCreate"); }
  void record_event(void*, void*) override { no_cuda("cudaEventRecord"); }
  void stream_wait_event(void*, void*) override { no_cuda("cudaStreamWaitEvent"); }
  void destroy_event(void*) noexcept override {}
};
}  // namespace

DeviceApi& device_api() {
  static NoCudaApi api;
  return api;
}
std::shared_ptr<cuda::Allocator> default_allocator() { return nullptr; }

bool cuda_available() { return false; }
void* cuda_malloc(std::size_t, int) { no_cuda("cuda_malloc"); }
void cuda_free(void*, int) noexcept {}
void cuda_memcpy(void*, const Device&, const void*, const Device&, std::size_t) {
  no_cuda("copy to/from CUDA");
}
void cuda_fill(const Tensor&, double) { no_cuda("fill_ on CUDA"); }
void cuda_add(const Tensor&, const Tensor&, const Tensor&, double) { no_cuda("add on CUDA"); }
void cuda_scale(const Tensor&, const Tensor&, double) { no_cuda("scale on CUDA"); }
void reduce_into_device(const Tensor&, const std::vector<Tensor>&, int, double, void*) {
  no_cuda("reduce_into_device");
}

}  // namespace diffcomm::detail

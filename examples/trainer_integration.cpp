// Trainer integration: a training framework already has an NCCL communicator
// and a CUDA stream; diffcomm borrows both (nccl::from_comm), runs a
// differentiable all_reduce forward and backward on CUDA tensors enqueued on
// the trainer's stream, and leaves communicator and stream to the trainer,
// which keeps using and finally destroys them.
//
// Here the process stands in for one rank of a data-parallel trainer (world
// of 1; under a launcher each process would hold one rank, the unique id
// coming from rank 0 as usual). Without a CUDA device it says so and exits 0.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

// The trainer's own error checks (diffcomm checks its calls itself).
#define TRAINER_CUDA(x)                                                             \
  do {                                                                              \
    const cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "trainer: %s failed: %s\n", #x, cudaGetErrorString(e_)); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)
#define TRAINER_NCCL(x)                                                             \
  do {                                                                              \
    const ncclResult_t r_ = (x);                                                    \
    if (r_ != ncclSuccess) {                                                        \
      std::fprintf(stderr, "trainer: %s failed: %s\n", #x, ncclGetErrorString(r_)); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

int main() {
  using namespace diffcomm;
  if (nccl::device_count() == 0) {
    std::printf("trainer_integration: no CUDA device (%s); skipping\n",
                nccl::device_status().c_str());
    return 0;
  }

  // ---- the trainer's side: its communicator and its (non-blocking) stream
  const int device = 0, nranks = 1, rank = 0;
  TRAINER_CUDA(cudaSetDevice(device));
  ncclUniqueId id;
  TRAINER_NCCL(ncclGetUniqueId(&id));
  ncclComm_t comm = nullptr;
  TRAINER_NCCL(ncclCommInitRank(&comm, nranks, id, rank));
  cudaStream_t stream = nullptr;
  TRAINER_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A trainer buffer (say, a bucket of gradients), handed over without a copy.
  const std::vector<float> host = {1, 2, 3, 4, 5, 6};
  float* bucket = nullptr;
  TRAINER_CUDA(cudaMalloc(&bucket, host.size() * sizeof(float)));
  TRAINER_CUDA(
      cudaMemcpy(bucket, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));

  bool ok = true;
  try {
    // ---- diffcomm borrows the communicator and the stream: every op below
    // is enqueued on `stream`; diffcomm never destroys or aborts either.
    const dist::ProcessGroup dp = nccl::from_comm(comm, stream, {}, "dp");
    Tensor x = from_blob(bucket, {2, 3}, DType::Float32,
                         Device::cuda(device));  // no deleter: trainer frees
    x.set_requires_grad();

    // Forward: y = mean over ranks of x (ncclAllReduce with ncclAvg).
    Tensor y = nn::all_reduce(x, dp, dist::ReduceOp::Avg);
    // Backward against an upstream gradient of ones: the adjoint is again an
    // all_reduce(Avg), enqueued on the same stream.
    const Tensor upstream = ones({2, 3}, DType::Float32, Device::cuda(device));
    const std::vector<Tensor> dx = grad({y}, {x}, {upstream});
    nccl::synchronize(dp);  // the trainer would rather keep going on `stream`

    const std::vector<double> yv = y.to_vector(), gv = dx[0].to_vector();
    for (std::size_t i = 0; i < host.size(); ++i) {
      // Every rank holds the same bucket here, so the mean is the bucket.
      ok = ok && yv[i] == host[i] && gv[i] == 1.0;
    }
    std::printf("trainer_integration: group '%s', rank %d of %d on cuda:%d, borrowed=%s\n",
                dp.name().c_str(), dp.rank(), dp.size(), nccl::device(dp),
                nccl::owns_comm(dp) ? "no" : "yes");
    std::printf("  y  = all_reduce(x, avg) = [%g %g %g %g %g %g]\n", yv[0], yv[1], yv[2], yv[3],
                yv[4], yv[5]);
    std::printf("  dx = all_reduce(1, avg) = [%g %g %g %g %g %g]\n", gv[0], gv[1], gv[2], gv[3],
                gv[4], gv[5]);
  } catch (const diffcomm::Error& e) {
    std::fprintf(stderr, "trainer_integration: %s\n", e.what());
    ok = false;
  }

  // ---- the group is gone; the trainer's communicator and stream still work.
  TRAINER_NCCL(ncclAllReduce(bucket, bucket, host.size(), ncclFloat32, ncclSum, comm, stream));
  TRAINER_CUDA(cudaStreamSynchronize(stream));
  TRAINER_CUDA(cudaFree(bucket));
  TRAINER_NCCL(ncclCommDestroy(comm));
  TRAINER_CUDA(cudaStreamDestroy(stream));
  std::printf("trainer_integration: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

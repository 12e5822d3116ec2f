// The public nccl:: functions (include/diffcomm/backends/nccl.hpp): device
// queries, the factories that build a group's backend and its layers, and
// the accessors of a group's communicator and stream.
#include <memory>
#include <string>

#include "diffcomm/distributed/backend/forwarding.hpp"
#include "diffcomm/distributed/backend/layers.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/group.hpp"
#include "nccl_backend.hpp"

namespace diffcomm::nccl {

// The backend's internals (support.hpp's macros name them unqualified).
using namespace impl;  // NOLINT(google-build-using-namespace)

namespace {

NcclBackend& backend_of(const dist::ProcessGroup& group, const char* what) {
  auto* b = dynamic_cast<NcclBackend*>(&dist::transport_of(group.backend()));
  if (b == nullptr)
    raise(fmt::format("nccl::{}", what), fmt::format("group '{}' runs on the {} backend, not nccl",
                                                     group.name(), group.backend().backend_name()));
  return *b;
}

// Builds the backend of a communicator diffcomm just created; destroys the
// communicator when that fails.
std::shared_ptr<NcclBackend> adopt(ncclComm_t comm, std::shared_ptr<StreamHolder> stream,
                                   const Options& options) {
  try {
    return std::make_shared<NcclBackend>(comm, true, std::move(stream), options);
  } catch (...) {
    (void)ncclCommDestroy(comm);
    throw;
  }
}

// The transport under the layers Options ask for (dist::stack_layers); the
// checker's fingerprints travel on a second communicator split from `comm`
// (same members, same order) on the same stream.
std::shared_ptr<dist::Backend> layered(std::shared_ptr<NcclBackend> data, ncclComm_t comm,
                                       const Options& options) {
  auto control = [data, comm, &options]() -> std::shared_ptr<dist::Backend> {
    const DeviceGuard guard(data->device());
    ncclComm_t split = nullptr;
    DIFFCOMM_NCCL_PLAIN(ncclCommSplit(comm, 0, data->rank(), &split, nullptr),
                        "nccl: control communicator for checked mode");
    Options ctl = options;
    ctl.stream = data->stream();
    ctl.members.clear();
    for (int r = 0; r < data->size(); ++r) ctl.members.push_back(data->global_rank(r));
    auto holder = std::make_shared<StreamHolder>(data->stream(), false, data->device());
    return adopt(split, std::move(holder), ctl);
  };
  const Device device = Device::cuda(data->device());
  return dist::stack_layers(std::move(data), options, control, device);
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_status() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return "cudaGetDeviceCount: " + cuda_text(e);
  }
  return n == 0 ? "cudaGetDeviceCount: 0 devices" : "";
}

int runtime_version() {
  int v = 0;
  DIFFCOMM_NCCL_PLAIN(ncclGetVersion(&v), "nccl::runtime_version");
  return v;
}

bool has_native_gather_scatter_all_to_all() {
  return DIFFCOMM_NCCL_HEADER_HAS_2_28 && runtime_version() >= kVersionNative;
}

ncclUniqueId unique_id() {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  DIFFCOMM_NCCL_PLAIN(ncclGetUniqueId(&id), "nccl::unique_id");
  return id;
}

dist::ProcessGroup init_rank(const ncclUniqueId& id, int nranks, int rank, int device,
                             Options options, std::string name) {
  if (nranks < 1) raise("nccl::init_rank", fmt::format("nranks {} < 1", nranks));
  if (rank < 0 || rank >= nranks)
    raise("nccl::init_rank", fmt::format("rank {} outside [0, {})", rank, nranks));
  validate_members(options.members, nranks, "nccl::init_rank");
  const int devices = device_count();
  if (device < 0 || device >= devices)
    raise("nccl::init_rank",
          fmt::format("device {} outside [0, {}){}", device, devices,
                      devices == 0 ? " (no CUDA device: " + device_status() + ")" : ""));
  const std::string what =
      fmt::format("nccl::init_rank (rank {} of {}, cuda:{})", rank, nranks, device);
  const DeviceGuard guard(device);
  std::shared_ptr<StreamHolder> stream =
      options.stream != nullptr ? std::make_shared<StreamHolder>(options.stream, false, device)
                                : owned_stream(device);
  ncclComm_t comm = nullptr;
  DIFFCOMM_NCCL_PLAIN(ncclCommInitRank(&comm, nranks, id, rank), what);
  // Dumps are named by the rank in this communicator (rank-<rank>.json).
  return dist::ProcessGroup(layered(adopt(comm, std::move(stream), options), comm, options),
                            std::move(name), nullptr,
                            dist::FlightRecorder::for_rank(options, rank, nranks));
}

dist::ProcessGroup from_comm(ncclComm_t comm, cudaStream_t stream, Options options,
                             std::string name) {
  if (comm == nullptr) raise("nccl::from_comm", "null communicator");
  int device = 0;
  DIFFCOMM_NCCL_PLAIN(ncclCommCuDevice(comm, &device), "nccl::from_comm");
  options.stream = stream;
  auto holder = std::make_shared<StreamHolder>(stream, false, device);
  auto data = std::make_shared<NcclBackend>(comm, false, std::move(holder), options);
  int rank = 0;
  int nranks = 0;
  DIFFCOMM_NCCL_PLAIN(ncclCommUserRank(comm, &rank), "nccl::from_comm");
  DIFFCOMM_NCCL_PLAIN(ncclCommCount(comm, &nranks), "nccl::from_comm");
  return dist::ProcessGroup(layered(std::move(data), comm, options), std::move(name), nullptr,
                            dist::FlightRecorder::for_rank(options, rank, nranks));
}

ncclComm_t comm(const dist::ProcessGroup& group) { return backend_of(group, "comm").comm(); }
cudaStream_t stream(const dist::ProcessGroup& group) {
  return backend_of(group, "stream").stream();
}
void set_stream(const dist::ProcessGroup& group, cudaStream_t s) {
  backend_of(group, "set_stream").set_stream(s);
}
int device(const dist::ProcessGroup& group) { return backend_of(group, "device").device(); }
bool owns_comm(const dist::ProcessGroup& group) { return backend_of(group, "owns_comm").owned(); }
void synchronize(const dist::ProcessGroup& group) {
  backend_of(group, "synchronize").synchronize();
}
void abort(const dist::ProcessGroup& group) { backend_of(group, "abort").abort_comm(); }

}  // namespace diffcomm::nccl

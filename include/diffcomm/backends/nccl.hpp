#pragma once
// diffcomm::nccl — the dist::Backend on NVIDIA NCCL for CUDA tensors: the
// production GPU backend. Built when CUDA and NCCL are found
// (DIFFCOMM_HAVE_NCCL in "diffcomm/config.hpp"); link diffcomm::nccl.
//
// Communicators
//  - init_rank(): a new, owned communicator from an ncclUniqueId the caller
//    distributes (ncclCommInitRank); init_over_mpi() distributes the id over
//    MPI when diffcomm::mpi is built.
//  - from_comm(): wraps a trainer's existing ncclComm_t and cudaStream_t,
//    borrowed: diffcomm never destroys, finalizes or aborts a borrowed
//    communicator and never destroys a borrowed stream.
//  - ProcessGroup::new_group / split: ncclCommSplit (owned sub-communicators
//    sharing the parent's stream). The members' global ranks are learned from
//    a small all-gather of (color, key, fingerprint) over the parent before
//    the split, which also checks that every member passed the same
//    fingerprint (CollectiveMismatch otherwise, on every member).
//
// Streams, devices and memory (the general rule: diffcomm/tensor/cuda.hpp)
//  - Every op is enqueued on the group's stream (stream(group); set_stream()
//    changes it) and returns without waiting for the GPU: no host
//    synchronization on the hot path. Exceptions, documented per function:
//    barrier(), split (new_group), CPU tensors (Options::stage_cpu) and
//    synchronize(), which wait for the stream (with the deadline).
//  - While an op runs, the group's stream is the current stream of the
//    group's device (cuda::StreamGuard): its scratch and staging buffers come
//    from diffcomm's stream-ordered pool on that stream and go back to it in
//    stream order right after the op is enqueued; its copies and kernels
//    (list staging, the Avg fallback) run there too.
//  - Ordering with the caller, by events only (never a device sync): with
//    Options::order_with_current_stream (the default), when the caller's
//    current stream of the device (cuda::current_stream, the legacy default
//    stream unless set; diffcomm's own tensor kernels, e.g. autograd's, run
//    there) is not the group's stream, each op first makes the group's
//    stream wait for an event recorded on the current stream, and afterwards
//    makes the current stream wait for an event recorded on the group's
//    stream (so freeing a buffer allocated on the current stream waits for
//    the op too; with the option off, the buffers are marked as used on the
//    group's stream instead, cuda::record_stream). A buffer allocated on a
//    third stream is the caller's to order (cuda::record_stream). When the
//    current stream is the group's stream (a trainer that lends its stream
//    to from_comm and makes it current with cuda::StreamGuard) no event is
//    used at all. Work the caller queues on any other stream is not waited
//    for: make the current or the group's stream wait on it
//    (cudaStreamWaitEvent) before calling.
//  - Buffers: inputs must stay valid and unmodified, outputs untouched, until
//    the op has completed on the stream (as with raw NCCL).
//
// Ops (ranks group-local, semantics of dist/collectives.hpp)
//  - native: all_reduce (ncclAllReduce), broadcast (ncclBroadcast), reduce
//    (ncclReduce), all_gather / all_gather_single (ncclAllGather),
//    reduce_scatter / reduce_scatter_single (ncclReduceScatter), send / recv
//    (ncclSend / ncclRecv; tags are not matched: messages between two
//    members arrive in the order they were posted); Avg is ncclAvg (NCCL >=
//    2.10; older runtimes: Sum, then a scale), bfloat16 is ncclBfloat16.
//  - grouped ncclSend/ncclRecv (ncclGroupStart/End), every peer posted, zero
//    counts included: all_gather_v, all_to_all, all_to_all_single, and
//    gather / scatter when the NCCL library loaded at run time is older than
//    2.28 (or Options::prefer_native is off); from 2.28 on gather and scatter
//    are ncclGather / ncclScatter, and all_to_all_single with even splits is
//    ncclAlltoAll when Options::even_all_to_all promises it.
//  - reduce_scatter_v: one ncclReduce per destination inside one group.
//  - barrier: a one-element ncclAllReduce, then a wait for the stream.
//  - List forms whose tensors are consecutive in one buffer are passed to
//    NCCL as is; otherwise a staging buffer and device-to-device copies on
//    the group's stream are used.
//  - Reductions are NCCL's: unlike sim and mpi, the order in which
//    contributions are combined is NCCL's choice (not group-rank order), so
//    floating-point results are not bit-reproducible across world sizes or
//    algorithms, and 16-bit floats may be combined in their own precision.
//    Avg on floating dtypes is NCCL's PreMulSum: every contribution is
//    multiplied by 1/size (rounded to the dtype) before the sum, which is
//    exact when size is a power of two and may differ from sum/size in the
//    last bits otherwise (integer Avg is refused by the funnel).
//
// Errors
//  - Every NCCL and CUDA call is checked: a failure raises BackendError with
//    the op, its call number, the group, the rank (group-local and global),
//    the device, the call that failed, ncclGetErrorString / cudaGetErrorString
//    and ncclGetLastError.
//  - Every op first polls ncclCommGetAsyncError (a host-side read, no
//    synchronization) and raises BackendError when NCCL has reported an
//    asynchronous error; an owned communicator is then aborted.
//  - Deadlines (Options::timeout_s, on by default): every host wait goes
//    through the shared deadline loop (dist/backend/wait.hpp), polling
//    cudaStreamQuery and ncclCommGetAsyncError; ops in flight are checked
//    at each later op without synchronizing (Options::deadline_every).
//    Past the deadline an owned communicator is aborted and Timeout is
//    raised, naming the op, instead of hanging.
//  - After an abort (timeout, async error or abort()), every op on the
//    group raises BackendError.
//
// Threads and devices: a group (and its sub-groups) is used from one host
// thread at a time, like an ncclComm_t; several groups on several devices may
// be driven by one thread each (one process, one thread per GPU). Driving
// several ranks of one communicator from a single thread is not supported
// (each op is its own NCCL group). NCCL refuses two ranks of one
// communicator on one device ("Duplicate GPU detected"): a world needs one
// device per rank. Every entry point that touches the device (ops, the
// factories, synchronize, abort, destruction) makes the group's device
// current with a guard that restores the caller's device on return and on
// exception.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/config.hpp"
#include "diffcomm/distributed/backend/options.hpp"
#include "diffcomm/distributed/group.hpp"

#if DIFFCOMM_HAVE_MPI
#include <mpi.h>
#endif

namespace diffcomm::nccl {

/// How a group behaves; copied into the group (and into its sub-groups).
/// The fields of dist::Options (dist/backend/options.hpp) mean what they mean
/// for every production backend:
///  - check: checked mode, a fingerprint exchange on a second communicator
///    (split from this one) before every call; CollectiveMismatch on every
///    member when they disagree.
///  - native_reduction: ncclAllReduce / ncclReduce / ncclReduceScatter
///    (faster; NOT bit-identical to the simulated world: NCCL's ring/tree
///    order and per-hop rounding of 16-bit types). Default: diffcomm's
///    deterministic composition (dist::ComposedReductions) — grouped
///    send/recv of the blocks, then reduce_into on the device in group-rank
///    order.
///  - timeout_s: the deadline of every wait, on by default (600 s, or
///    DIFFCOMM_TIMEOUT): host waits (barrier, split, CPU staging,
///    synchronize) and ops in flight (see deadline_every). Past it an owned
///    communicator is aborted (ncclCommAbort) and Timeout is raised; a
///    borrowed one is never aborted (the message says so).
struct Options : dist::Options {
  /// Stream of every op. Null: init_rank creates and owns a non-blocking
  /// stream (cudaStreamNonBlocking: no implicit synchronization with the
  /// legacy default stream; ordering is by events, see the header comment).
  /// Non-null: borrowed (the caller keeps it valid while the group lives and
  /// destroys it). from_comm takes its stream as an argument and ignores this
  /// field.
  cudaStream_t stream = nullptr;
  /// Accept CPU tensors: they are copied to the group's device, the op runs
  /// there and the outputs are copied back before the call returns (it
  /// synchronizes with the host). Off: CPU tensors are refused with
  /// InvalidArgument by the dist:: funnel, as torch's NCCL backend does.
  bool stage_cpu = false;
  /// Order every op with the caller's current stream of the device
  /// (cuda::current_stream) in both directions, by events, when that is not
  /// the group's stream (see the header comment). Turn off only when the
  /// caller orders every input and output itself.
  bool order_with_current_stream = true;
  /// Use ncclGather / ncclScatter / ncclAlltoAll where the header and the
  /// NCCL library loaded at run time (ncclGetVersion) are >= 2.28. Off:
  /// always the grouped ncclSend/ncclRecv forms. Must be equal on every
  /// member (and every member must load the same NCCL version).
  bool prefer_native = true;
  /// A promise that every all_to_all_single on this group uses even splits
  /// (every block of every member has the same number of rows, as in MoE
  /// with a fixed capacity), so that it can run as one ncclAlltoAll. The
  /// choice between ncclAlltoAll and grouped send/recv must be the same on
  /// every member, and evenness cannot be decided locally (one member's
  /// splits may be even while another's are not), hence a promise. A call
  /// with uneven splits then raises InvalidArgument on the member that sees
  /// them before it communicates (its peers wait until their deadline,
  /// Options::timeout_s, turns that into Timeout). Must be equal on every member.
  bool even_all_to_all = false;
  /// The deadline of ops in flight, without synchronizing: after every
  /// deadline_every-th op an event is recorded on the group's stream, and
  /// every op first queries the oldest pending events (cudaEventQuery, a
  /// host-side read). An op still running timeout_s after it was enqueued
  /// raises Timeout at the group's next op or wait, naming it. The stream is
  /// in order, so a larger value (fewer events) still bounds every op, only
  /// later. Must be >= 1 (InvalidArgument where the group is created).
  int deadline_every = 1;
  /// Global ranks of the members, in group-rank order (size == nranks,
  /// distinct, >= 0). Empty: global rank == rank in the communicator (for
  /// from_comm: ncclCommUserRank). init_over_mpi fills it with the ranks in
  /// MPI_COMM_WORLD.
  std::vector<int> members;
};

/// Number of CUDA devices this process can use; 0 when there is none or when
/// the CUDA runtime or driver cannot be initialised (never throws).
int device_count();

/// Why device_count() is 0 ("cudaGetDeviceCount: no CUDA-capable device is
/// detected (cudaErrorNoDevice)"), or "" when devices exist. For skip
/// messages.
std::string device_status();

/// NCCL_VERSION_CODE of the NCCL library loaded at run time (ncclGetVersion),
/// e.g. 22809 for 2.28.9; compare with NCCL_VERSION(2, 28, 0). Throws
/// BackendError when the call fails.
int runtime_version();

/// Whether this build and the loaded NCCL library both provide ncclGather,
/// ncclScatter and ncclAlltoAll (header and ncclGetVersion >= 2.28).
bool has_native_gather_scatter_all_to_all();

/// A fresh ncclUniqueId (ncclGetUniqueId). Call it on one rank and give the
/// 128 bytes to every rank of the communicator (MPI, a file, a TCP store...).
/// Throws BackendError.
ncclUniqueId unique_id();

/// Creates this rank's member of a new communicator of nranks ranks on CUDA
/// device `device` (ncclCommInitRank), owned by the returned group: destroyed
/// (ncclCommDestroy, after waiting for its stream) when the last handle to
/// the group and its sub-groups goes away. Collective: blocks until all
/// nranks ranks have called it with the same id (no timeout: the deadline
/// covers ops and waits, not initialisation).
/// Throws InvalidArgument for nranks < 1, rank outside [0, nranks), device
/// outside [0, device_count()) or bad options.members; BackendError when NCCL
/// or CUDA fails.
dist::ProcessGroup init_rank(const ncclUniqueId& id, int nranks, int rank, int device,
                             Options options = {}, std::string name = "world");

/// Wraps an existing communicator and stream without owning them (a
/// trainer's): ops are enqueued on `stream` (nullptr: the default stream),
/// the device is ncclCommCuDevice(comm), the rank and size come from the
/// communicator. diffcomm never destroys, finalizes or aborts `comm` (not
/// even past a deadline) nor destroys `stream`; sub-groups made from the
/// group are new communicators (ncclCommSplit) that diffcomm owns. The
/// caller keeps comm and stream valid while any handle to the group lives.
/// options.stream is ignored. Throws InvalidArgument for a null comm or bad
/// options.members; BackendError when querying the communicator fails.
dist::ProcessGroup from_comm(ncclComm_t comm, cudaStream_t stream, Options options = {},
                             std::string name = "nccl");

#if DIFFCOMM_HAVE_MPI
/// init_rank over MPI: rank 0 of `comm` creates the unique id and MPI_Bcasts
/// it; ranks and size are those of `comm`; members are the MPI_COMM_WORLD
/// ranks (options.members is overwritten). device < 0: the rank's index among
/// the ranks of its node (MPI_Comm_split_type SHARED) modulo device_count().
/// Collective over comm. Requires MPI to be initialised (BackendError
/// otherwise); MPI failures raise BackendError.
dist::ProcessGroup init_over_mpi(MPI_Comm comm = MPI_COMM_WORLD, int device = -1,
                                 Options options = {}, std::string name = "world");
#endif

/// The communicator of an nccl group (owned or borrowed). Throws
/// InvalidArgument when the group is not an nccl group.
ncclComm_t comm(const dist::ProcessGroup& group);
/// The stream the group's ops are enqueued on. Throws InvalidArgument when
/// the group is not an nccl group.
cudaStream_t stream(const dist::ProcessGroup& group);
/// Enqueues the group's next ops on `stream` (borrowed: the caller keeps it
/// valid). Work already queued on the previous stream is not waited for
/// here: order it yourself (synchronize() first, or an event). Affects this
/// group only, not its existing sub-groups. Throws InvalidArgument when the
/// group is not an nccl group.
void set_stream(const dist::ProcessGroup& group, cudaStream_t stream);
/// CUDA device of the group's communicator. Throws InvalidArgument when the
/// group is not an nccl group.
int device(const dist::ProcessGroup& group);
/// Whether diffcomm owns (and will destroy) the group's communicator.
bool owns_comm(const dist::ProcessGroup& group);
/// Waits on the host until every op enqueued on the group's stream has
/// completed, with the deadline (Options::timeout_s). Throws BackendError on
/// a CUDA error or an asynchronous NCCL error, Timeout past the deadline
/// (an owned communicator is aborted first), InvalidArgument when the group
/// is not an nccl group.
void synchronize(const dist::ProcessGroup& group);
/// Aborts the group's owned communicator (ncclCommAbort): pending ops are
/// cancelled and every later op on the group raises BackendError. For
/// recovering from a failure the application detected itself. Throws
/// InvalidArgument for a borrowed communicator (abort it yourself) or a
/// group that is not an nccl group.
void abort(const dist::ProcessGroup& group);

}  // namespace diffcomm::nccl

"""Differentiable collectives and the encoder-parallel exchange on torch tensors.

Every op here runs diffcomm's own C++ op on the torch tensors' storage
(borrowed through DLPack, no copy) and returns torch tensors that share
diffcomm's output storage (no copy). Autograd goes through ONE generic bridge,
``_Bridge``: its forward runs the diffcomm op on diffcomm tensors, recording
diffcomm's autograd graph; its backward calls ``diffcomm::grad`` on that
graph, so the adjoints (exact, with diffcomm's Max/Min/Product gradients and
gather conventions) are the C++ ones, written once.

Backends: ``init_process_group("mpi")`` (CPU tensors over MPI_COMM_WORLD, or
``comm=`` an mpi4py communicator), ``init_process_group("nccl", group=pg)``
(CUDA tensors; an own communicator from a unique id broadcast over the torch
ProcessGroup ``pg``, on torch's current stream; only in builds with NCCL), or
any rank of ``diffcomm.sim.run`` (``group=None`` is then that rank's world).

Conventions (differences from torch.distributed.nn.functional):

* ``src``/``dst`` are **global** ranks, as in torch: ranks of the group the
  backend was created from (MPI_COMM_WORLD, the mpi4py communicator, the
  simulated world). ``group_src``/``group_dst`` are group-local ranks. Give
  exactly one.
* In-place forms where the semantics allow: ``all_reduce_`` and
  ``broadcast_`` overwrite their tensor as torch.distributed.all_reduce and
  broadcast do (same values, bit for bit, as the out-of-place ops, no output
  buffer). They are not differentiable: a tensor requiring grad raises
  InvalidArgument unless grad mode is off (torch.no_grad()). Each counts as
  an in-place write in torch's version counter.
* The other ops return new tensors; there are no output arguments (torch's
  ``reduce_scatter(output, input_list)``, ``all_to_all(output_list,
  input_list)`` and ``all_to_all_single(output, input, ...)`` take outputs
  first; here ``reduce_scatter(input_list)``, ``all_to_all(input_list,
  output_shapes=None)``, ``all_to_all_single(input, output_split_sizes,
  input_split_sizes)``).
* ``reduce`` returns zeros on ranks other than dst (torch leaves them
  unspecified); ``gather`` returns zeros on ranks other than dst.
* ``op`` accepts ``torch.distributed.ReduceOp`` values or the strings
  ``"sum" "avg" "product" "min" "max"``. Max/Min/Product have their true
  gradients (all_reduce, reduce); torch's autograd functions apply the forward
  op to the gradients instead.
* Gathers take ``grad="partial"`` (the adjoint, default) or ``"replicated"``
  (receivers are replicas with complete gradients: keep own slice).
* Extra ops not in torch: ``all_gather_single`` (torch's
  all_gather_into_tensor), ``all_gather_v``, ``reduce_scatter_single``
  (reduce_scatter_tensor), ``reduce_scatter_v``, ``copy_to_tp_region``,
  ``canonical_all_reduce`` (a sum with the same bits for every world size), and
  the exchange: ``route_features``, ``unpack_records``, ``merge_into_decoder``.
* Inputs must be contiguous (``InvalidArgument`` otherwise: diffcomm borrows
  storage and never copies silently); incoming gradients are made contiguous.
* Every member must call every op, and, as in torch.distributed.nn, inputs
  must agree across ranks on requires_grad so every rank runs the backward
  collective. ``backward(loss)`` (instead of ``loss.backward()``) runs the
  backward of every collective of the rank, whatever its loss reaches
  (diffcomm's participation rule, docs/semantics.md).
* Tensors an op saves for backward are saved through torch: a torch in-place
  write to one afterwards raises torch's "modified by an inplace operation".
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence

import torch

from .. import _context, _core, _participation
from . import _exit_dump, _job_end, _mpi_job
from .._core import InvalidArgument
from .._core import nn as _nn
from ._args import group_or_default, reduce_op, root_rank, split_sizes, premul_sum
from ._bridge import apply, apply_one, from_diffcomm, to_diffcomm
from ._exchange import Record, merge_into_decoder, route_features, unpack_records
from ._in_place import all_reduce_, broadcast_
from ._work import Work, finish

__all__ = [
    "init_process_group", "destroy_process_group", "abort", "get_world", "get_rank",
    "get_world_size",
    "new_group", "to_diffcomm", "from_diffcomm", "premul_sum",
    "backward", "backward_pending", "discard_pending",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_v",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_v",
    "all_to_all", "all_to_all_single", "copy_to_tp_region", "all_reduce_", "broadcast_",
    "canonical_all_reduce", "canonical_sum", "Record", "route_features", "unpack_records", "merge_into_decoder", "Work",
]


# ----------------------------------------------------------------- groups
def init_process_group(backend: str = "mpi", *, comm: Any = None, group: Any = None,
                       device: Optional[int] = None, check: Optional[bool] = None,
                       native_reduction: bool = False,
                       timeout_s: Optional[float] = None) -> _core.ProcessGroup:
    """Creates this process's diffcomm world group and makes it the default
    (``group=None``).

    * ``"torch"``: the data moves through a torch ProcessGroup, ``group=`` (default:
      torch's default group; call ``torch.distributed.init_process_group`` first,
      e.g. ``"gloo"`` under torchrun). Each primitive is one torch.distributed
      call; diffcomm's checks, deterministic reductions and deadlines sit on
      top as on MPI (results bit-identical to the simulated world). Checked
      mode's fingerprints travel on a duplicate torch group.
    * ``"mpi"``: MPI_COMM_WORLD (MPI is initialised unless it already is, e.g.
      by mpi4py), or ``comm=`` an mpi4py communicator (borrowed, never freed).
    * ``"nccl"``: CUDA tensors over torch's own NCCL group ``group=`` (default:
      torch's default group, which must be an NCCL group): the torch transport,
      so diffcomm loads no NCCL library of its own and creates no second
      communicator. (An extension built with ``DIFFCOMM_PYTHON_NCCL=ON`` links
      diffcomm's own NCCL backend instead: rank 0 of ``group`` creates an NCCL
      unique id broadcast over it, on torch's current stream of ``device``.)

    Options of "torch" and "mpi" (``dist::Options``): ``check`` cross-rank
    fingerprint checks (None: ``DIFFCOMM_CHECK``, else **on**: a call whose
    ranks disagree on op, shape, dtype, root or splits raises
    CollectiveMismatch on every rank instead of moving wrong data. Its cost,
    one small fingerprint exchange per call, is measured in bench/RESULTS.md:
    tens of microseconds per call over MPI, one more gloo round trip over the
    torch transport, lost in the noise from 1 MiB; ``check=False`` or
    ``DIFFCOMM_CHECK=0`` for a job already known to be consistent),
    ``native_reduction`` the transport's own reductions (faster, not
    bit-identical to the simulated world), ``timeout_s`` the deadline of every
    wait (None: ``DIFFCOMM_TIMEOUT``, else 600 s; expiry raises
    ``diffcomm.Timeout``).

    Under ``"mpi"``, an uncaught exception on any rank ends the whole job with
    MPI_Abort after the traceback (the others would otherwise wait for their
    deadline; torchrun ends a job the same way), and interpreter exit after a
    Timeout does too; ``DIFFCOMM_ABORT_ON_EXCEPTION=0`` turns the first off
    (see ``diffcomm._mpi_job``).

    A world whose size differs from the launcher's (``WORLD_SIZE``, set by
    torchrun) raises BackendError instead of running unrelated one-rank jobs:
    e.g. ``"mpi"`` in processes torchrun started (each an MPI singleton).
    """
    if check is None and "DIFFCOMM_CHECK" not in os.environ:
        check = True  # the Python package's default (the C++ default is on in Debug builds)
    if backend == "torch" or (backend == "nccl" and not _core.HAVE_NCCL):
        pg = _torch_world(backend, group, check, native_reduction, timeout_s)
    elif backend == "mpi":
        if not _core.HAVE_MPI:
            raise _core.BackendError(
                "init_process_group('mpi'): this diffcomm was built without MPI (the wheel, "
                "scripts/build-wheel, carries none): install from source where Open MPI is "
                "(pip install ./python, docs/python.md), or use backend='torch' over torch's "
                "gloo or NCCL group")
        if comm is not None:
            from mpi4py import MPI  # noqa: PLC0415

            pg = _core.mpi.from_comm_address(MPI._addressof(comm), "mpi", check=check,
                                             native_reduction=native_reduction,
                                             timeout_s=timeout_s)
        else:
            if _core.mpi.finalized():
                raise _core.BackendError(
                    "init_process_group('mpi'): MPI was finalised in this process "
                    "(destroy_process_group finalises the MPI diffcomm initialised) and MPI "
                    "cannot be initialised twice; keep the group for the whole job, or use "
                    "init_process_group('torch'), which can be created again")
            _core.mpi.init()
            pg = _core.mpi.world(check=check, native_reduction=native_reduction,
                                 timeout_s=timeout_s)
            _check_launcher(pg, "mpi")
        _mpi_job.install_hooks()
    elif backend == "nccl":  # diffcomm's own NCCL backend (DIFFCOMM_PYTHON_NCCL builds)
        import torch.distributed as dist  # noqa: PLC0415

        tgroup = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(tgroup), dist.get_world_size(tgroup)
        box = [_core.nccl.unique_id() if rank == 0 else None]
        src = dist.get_global_rank(tgroup, 0) if tgroup is not dist.group.WORLD else 0
        dist.broadcast_object_list(box, src=src, group=tgroup)
        dev = torch.cuda.current_device() if device is None else device
        stream = torch.cuda.current_stream(dev).cuda_stream
        pg = _core.nccl.init_rank(box[0], size, rank, dev, stream)
    else:
        raise InvalidArgument(
            f"init_process_group: unknown backend {backend!r} (torch, mpi, nccl); for gloo, "
            f"call torch.distributed.init_process_group('gloo') and then "
            f"init_process_group('torch')")
    _exit_dump.install_hook()  # after _mpi_job's: the dump is written before MPI_Abort
    _context.set_process_group(pg)
    return pg


def _torch_world(backend: str, group: Any, check: Optional[bool], native_reduction: bool,
                 timeout_s: Optional[float]) -> _core.ProcessGroup:
    """diffcomm over a torch ProcessGroup (the torch transport); "nccl": the
    group must be one of torch's NCCL groups (torch's own communicator and
    NCCL library: diffcomm loads none of its own)."""
    import torch.distributed as dist  # noqa: PLC0415

    from ._transport import TorchOps  # noqa: PLC0415

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument(
            f"init_process_group({backend!r}): torch.distributed is not initialised: call "
            f"torch.distributed.init_process_group('gloo') (or 'nccl') first; under torchrun "
            f"the environment gives it the rank and world size")
    tgroup = group if group is not None else dist.group.WORLD
    if backend == "nccl" and dist.get_backend(tgroup) != "nccl":
        raise InvalidArgument(
            f"init_process_group('nccl'): diffcomm runs over torch's NCCL group, but the group "
            f"is {dist.get_backend(tgroup)!r}; call torch.distributed.init_process_group('nccl') "
            f"or pass group= an NCCL group (or use 'torch' for any torch group)")
    ops = TorchOps(group)
    pg = _core.torch_transport.group(ops, ops.duplicate, "world", check=check,
                                     native_reduction=native_reduction, timeout_s=timeout_s)
    if group is None:
        _check_launcher(pg, backend)
        _job_end.install(pg)
    return pg


def _check_launcher(pg: _core.ProcessGroup, backend: str) -> None:
    """Refuses a world whose size is not the launcher's (WORLD_SIZE)."""
    import os  # noqa: PLC0415

    launched = os.environ.get("WORLD_SIZE")
    if launched is None or not launched.isdigit() or int(launched) == pg.size():
        return
    hint = (" (each process is an MPI singleton: it was not started by mpirun); under torchrun "
            "use torch.distributed.init_process_group('gloo') and then "
            "diffcomm.torch.init_process_group('torch')") if backend == "mpi" else ""
    raise _core.BackendError(
        f"init_process_group({backend!r}): the launcher started WORLD_SIZE={launched} processes "
        f"but the {backend} world has {pg.size()} rank(s){hint}")


def abort(group: Optional[_core.ProcessGroup] = None, code: int = 1) -> None:
    """Ends communication for good, for a program that wants to stop now
    (after a Timeout, say) rather than wait for peers.

    * MPI group: ``MPI_Abort(MPI_COMM_WORLD, code)``: every process of the job
      ends, this one included; never returns. (MPI cannot abort one
      communicator alone.)
    * NCCL group (owned): ``ncclCommAbort`` on its communicator; the process
      goes on and every later call on the group raises ``BackendError``.
      InvalidArgument for a communicator borrowed from the caller.
    * Simulated group: InvalidArgument (a simulated world never waits; raise
      from the rank function instead).

    ``group=None`` is the default group.
    """
    g = group_or_default(group)
    backend = g.backend_name
    if backend == "mpi":
        _core.mpi.abort(code)
    elif backend == "nccl":
        _core.nccl.abort(g)
    else:
        raise InvalidArgument(f"diffcomm.torch.abort: a {backend!r} group cannot be aborted "
                              f"(only mpi and nccl groups); raise from the rank function instead")


def destroy_process_group() -> None:
    """Forgets the default group (and finalises MPI if diffcomm initialised it)."""
    _context.set_process_group(None)
    _participation.discard_all()
    if _core.HAVE_MPI:
        _core.mpi.finalize()


def get_world() -> _core.ProcessGroup:
    """The default group: this simulated rank's world, else the process's."""
    return _context.default_group()


def get_rank(group: Optional[_core.ProcessGroup] = None) -> int:
    return group_or_default(group).rank()


def get_world_size(group: Optional[_core.ProcessGroup] = None) -> int:
    return group_or_default(group).size()


def new_group(ranks: Sequence[int], group: Optional[_core.ProcessGroup] = None,
              name: str = "") -> Optional[_core.ProcessGroup]:
    """Collective over ``group``: the sub-group of the given **global** ranks
    (torch.distributed.new_group); None on non-members."""
    g = group_or_default(group)
    return g.new_group([g.group_rank(r) for r in ranks], name)


# ----------------------------------------------------------------- backward
def backward(tensors: Any, grad_tensors: Any = None, retain_graph: Optional[bool] = None,
             group: Optional[_core.ProcessGroup] = None) -> None:
    """``torch.autograd.backward`` under diffcomm's participation rule: besides
    ``tensors``, every differentiable diffcomm collective of this rank whose
    backward has not run yet becomes a root with a zero gradient, so every
    rank runs the backward of every collective it took part in, whatever its
    own loss reaches, and in the same order (torch's engine runs ready nodes
    by descending sequence number: reverse forward order). World 2, x = 1:
    ``y1 = all_reduce(x)``, ``y2 = all_reduce(2 * x)``, rank 0's loss
    ``y1.sum()``, rank 1's ``y2.sum()``: ``backward(loss)`` gives dx = 3 on
    both ranks, where ``loss.backward()`` raises CollectiveMismatch
    ("forward call differs").

    ``tensors``/``grad_tensors`` as torch's (None: ones for one-element
    roots); ``[]`` for a rank with no loss term. ``group``: any group of
    this rank (default: the default group); the pending collectives are the
    rank's, over all its groups. With ``retain_graph`` they stay pending and
    run again in the next pass (on every rank alike). Pending outputs are held
    until their backward runs (``discard_pending`` forgets them). The order
    holds when this rank's bridges run on one device (torch runs each
    device's nodes in its own thread). Raises InvalidArgument when
    grad_tensors and tensors differ in length.
    """
    cohort = group_or_default(group)._cohort_id
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if grad_tensors is None:
        grads: List[Optional[torch.Tensor]] = [None] * len(roots)
    else:
        grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
    if len(grads) != len(roots):
        raise InvalidArgument(f"diffcomm.torch.backward: {len(roots)} tensors but "
                              f"{len(grads)} grad_tensors")
    entries = _participation.pending(cohort)
    for _, outputs in entries:
        for y in outputs:
            roots.append(y)
            grads.append(torch.zeros_like(y))
    if not roots:
        return
    try:
        torch.autograd.backward(roots, grads, retain_graph=retain_graph)
    finally:
        if retain_graph:
            _participation.restore(cohort, entries)


def backward_pending(group: Optional[_core.ProcessGroup] = None) -> None:
    """The participation of a rank with no loss term: ``backward([])``."""
    backward([], group=group)


def discard_pending(group: Optional[_core.ProcessGroup] = None) -> None:
    """Forgets this rank's pending collectives without running their backward
    (an evaluation step on tensors that require grad). Every rank of the
    groups concerned must do the same, or backward calls no longer pair."""
    _participation.discard(group_or_default(group)._cohort_id)


# ----------------------------------------------------------------- the 13 ops
def all_reduce(tensor: torch.Tensor, op: Any = "sum",
               group: Optional[_core.ProcessGroup] = None, *,
               async_op: bool = False) -> Any:
    """y = reduce over members of tensor. Sum/Avg: adjoint all_reduce.
    Max/Min: gradient to the extremum holders, split among ties.
    Product: dx_r = G * prod_{s != r} x_s."""
    g, o = group_or_default(group), reduce_op(op)
    out = apply_one(lambda t: _nn.all_reduce(t, g, o), tensor, op="all_reduce", group=g)
    return finish(out, async_op, "all_reduce")


def broadcast(tensor: torch.Tensor, src: Optional[int] = None,
              group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
              group_src: Optional[int] = None) -> Any:
    """y = tensor of src on every rank; dx = sum of the gradients on src, zeros elsewhere."""
    g = group_or_default(group)
    s = root_rank(g, src, group_src, "src", "broadcast")
    out = apply_one(lambda t: _nn.broadcast(t, s, g), tensor, op="broadcast", group=g)
    return finish(out, async_op, "broadcast")


def reduce(tensor: torch.Tensor, dst: Optional[int] = None, op: Any = "sum",
           group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
           group_dst: Optional[int] = None) -> Any:
    """y = reduce of tensor on dst; zeros on other ranks. dx: dst's gradient on every rank."""
    g, o = group_or_default(group), reduce_op(op)
    d = root_rank(g, dst, group_dst, "dst", "reduce")
    out = apply_one(lambda t: _nn.reduce(t, d, g, o), tensor, op="reduce", group=g)
    return finish(out, async_op, "reduce")


def all_gather(tensor: torch.Tensor, group: Optional[_core.ProcessGroup] = None, *,
               async_op: bool = False,
               grad: str = "partial") -> Any:
    """y[s] = tensor of member s. Backward: one reduce_scatter (partial) or own slice (replicated)."""
    g = group_or_default(group)
    out = apply(lambda i: list(_nn.all_gather(i[0], g, grad)), tensor, op="all_gather", group=g)
    return finish(out, async_op, "all_gather")


def all_gather_single(tensor: torch.Tensor, group: Optional[_core.ProcessGroup] = None, *,
                      async_op: bool = False,
                      grad: str = "partial") -> Any:
    """Rows of every member concatenated along dim 0 (torch's all_gather_into_tensor)."""
    g = group_or_default(group)
    out = apply_one(lambda t: _nn.all_gather_single(t, g, grad), tensor,
                    op="all_gather_single", group=g)
    return finish(out, async_op, "all_gather_single")


def all_gather_v(tensor: torch.Tensor, output_split_sizes: Sequence[int],
                 group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
                 grad: str = "partial") -> Any:
    """Concatenation of the members' tensors, member s having output_split_sizes[s] rows."""
    g = group_or_default(group)
    splits = split_sizes(output_split_sizes, "output_split_sizes", "all_gather_v")
    out = apply_one(lambda t: _nn.all_gather_v(t, splits, g, grad), tensor,
                    op="all_gather_v", group=g)
    return finish(out, async_op, "all_gather_v")


def gather(tensor: torch.Tensor, dst: Optional[int] = None,
           group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
           group_dst: Optional[int] = None) -> Any:
    """On dst y[s] = tensor of member s; zeros elsewhere. dst defaults to group rank 0 as in torch."""
    g = group_or_default(group)
    d = root_rank(g, dst, group_dst if (group_dst is not None or dst is not None) else 0, "dst",
                  "gather")
    out = apply(lambda i: list(_nn.gather(i[0], d, g)), tensor, op="gather", group=g)
    return finish(out, async_op, "gather")


def scatter(tensors: Sequence[torch.Tensor], src: Optional[int] = None,
            group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
            group_src: Optional[int] = None) -> Any:
    """y = tensors[rank] of src. Every rank passes size() tensors of the output shape
    (values ignored off src). src defaults to group rank 0."""
    g = group_or_default(group)
    s = root_rank(g, src, group_src if (group_src is not None or src is not None) else 0, "src",
                  "scatter")
    out = apply(lambda i: [_nn.scatter(list(i), s, g)], *tensors, op="scatter", group=g)[0]
    return finish(out, async_op, "scatter")


def reduce_scatter(input_list: Sequence[torch.Tensor], op: Any = "sum",
                   group: Optional[_core.ProcessGroup] = None, *,
                   async_op: bool = False) -> Any:
    """y = reduce over members s of input_list[rank] of s (no output argument)."""
    g, o = group_or_default(group), reduce_op(op)
    out = apply(lambda i: [_nn.reduce_scatter(list(i), g, o)], *input_list,
                op="reduce_scatter", group=g)[0]
    return finish(out, async_op, "reduce_scatter")


def reduce_scatter_single(tensor: torch.Tensor, op: Any = "sum",
                          group: Optional[_core.ProcessGroup] = None, *,
                          async_op: bool = False) -> Any:
    """[size*R, ...] -> [R, ...] (torch's reduce_scatter_tensor)."""
    g, o = group_or_default(group), reduce_op(op)
    out = apply_one(lambda t: _nn.reduce_scatter_single(t, g, o), tensor,
                    op="reduce_scatter_single", group=g)
    return finish(out, async_op, "reduce_scatter_single")


def reduce_scatter_v(tensor: torch.Tensor, input_split_sizes: Sequence[int], op: Any = "sum",
                     group: Optional[_core.ProcessGroup] = None, *,
                     async_op: bool = False) -> Any:
    """[sum(input_split_sizes), ...] -> [input_split_sizes[rank], ...]."""
    g, o = group_or_default(group), reduce_op(op)
    splits = split_sizes(input_split_sizes, "input_split_sizes", "reduce_scatter_v")
    out = apply_one(lambda t: _nn.reduce_scatter_v(t, splits, g, o), tensor,
                    op="reduce_scatter_v", group=g)
    return finish(out, async_op, "reduce_scatter_v")


def all_to_all(input_tensor_list: Sequence[torch.Tensor],
               group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
               output_shapes: Optional[Sequence[Sequence[int]]] = None) -> Any:
    """y[s] = input_tensor_list[rank] of member s. output_shapes[s]: shape of y[s]
    (default: the shape of input_tensor_list[s] here)."""
    g = group_or_default(group)
    shapes = [list(s) for s in output_shapes] if output_shapes is not None else []
    out = apply(lambda i: list(_nn.all_to_all(list(i), g, shapes)), *input_tensor_list,
                op="all_to_all", group=g)
    return finish(out, async_op, "all_to_all")


def all_to_all_single(input: torch.Tensor, output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[_core.ProcessGroup] = None, *,
                      async_op: bool = False) -> Any:
    """Rows routed by splits (None: even). Backward: splits swapped; dx has input's shape."""
    g = group_or_default(group)
    out = split_sizes(output_split_sizes, "output_split_sizes", "all_to_all_single")
    inp = split_sizes(input_split_sizes, "input_split_sizes", "all_to_all_single")
    out = apply_one(lambda t: _nn.all_to_all_single(t, out, inp, g), input,
                    op="all_to_all_single", group=g)
    return finish(out, async_op, "all_to_all_single")


def copy_to_tp_region(tensor: torch.Tensor,
                      group: Optional[_core.ProcessGroup] = None, *,
                      async_op: bool = False) -> Any:
    """Megatron's copy to the TP region: identity forward, all_reduce of the gradient."""
    g = group_or_default(group)
    out = apply_one(lambda t: _nn.copy_to_tp_region(t, g), tensor,
                    op="copy_to_tp_region", group=g)
    return finish(out, async_op, "copy_to_tp_region")


def canonical_all_reduce(chunks: torch.Tensor, op: Any = "sum",
                         group: Optional[_core.ProcessGroup] = None, *,
                         async_op: bool = False) -> Any:
    """The sum of every member's chunks with the same bits for every world size.

    ``chunks`` ``[k, ...]`` holds this rank's partials for the logical chunks
    ``[rank*k, (rank+1)*k)`` of ``C = k * world size`` (e.g. the gradient of
    each of its micro-batches). The result ``[...]``, on every rank, is
    ``canonical_sum(all C chunks, op)``: each element added over the chunks in
    one fixed tree, so 1, 2, 4 or 8 ranks holding the same C chunks give the
    same bits. ``op``: ``"sum"`` or ``"avg"`` (the sum times 1/C; floating
    dtypes). Members first exchange k, the chunk shape, dtype and op: a member
    that differs gives ``CollectiveMismatch`` on every rank. Backward: every
    local chunk gets ``all_reduce(grad)`` (times 1/C for avg). Semantics, cost
    and the tree: ``include/diffcomm/nn/canonical_all_reduce.hpp``; how to use
    it for data-parallel gradients: docs/python.md."""
    g, o = group_or_default(group), reduce_op(op)
    out = apply_one(lambda t: _nn.canonical_all_reduce(t, g, o), chunks,
                    op="canonical_all_reduce", group=g)
    return finish(out, async_op, "canonical_all_reduce")


def canonical_sum(chunks: torch.Tensor, op: Any = "sum") -> torch.Tensor:
    """``canonical_all_reduce``'s result computed on one process from all C
    chunks ``[C, ...] -> [...]`` (``op`` ``"sum"`` or ``"avg"``): the
    single-rank reference, bit for bit. Not differentiable (the result does
    not require grad); needs no process group."""
    if not isinstance(chunks, torch.Tensor):
        raise InvalidArgument(f"canonical_sum: chunks must be a torch.Tensor, got "
                              f"{type(chunks).__name__} (torch.stack a list first)")
    d = to_diffcomm(chunks.detach())
    return from_diffcomm(_nn.canonical_sum(d, reduce_op(op)))

"""The c10d backend ``"diffcomm_sim"``: unmodified torch.distributed code in the simulated world.

``diffcomm.sim.run(n, fn, torch_distributed=True)`` calls ``rank_session`` in
every rank thread: torch.distributed is initialised there with this backend
(default group = the rank's simulated world) before ``fn`` runs, and destroyed
after. Every collective of a ``SimProcessGroup`` runs on the calling rank's
diffcomm group, so torch code gets the world's guarantees: one rank runs at a
time, seeded interleaving, ``CollectiveMismatch`` / ``Deadlock`` on every rank
instead of silence or a hang.

Why a Python ProcessGroup: the extension links no libtorch (one wheel serves
every torch), and c10d accepts a ``torch.distributed.ProcessGroup`` subclass
written in Python whose methods it calls by name (``allreduce``,
``all_gather_single`` for ``_allgather_base``, ...), as torch's own threaded
test group does. Tensors cross to diffcomm through DLPack (no input copy); the
result is copied into c10d's in-place output. Collectives run when called; the
returned Work is already complete, so ``async_op=True`` + ``wait()`` works.

Imported lazily (by ``sim.run(torch_distributed=True)`` only): it needs torch >= 2.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import _core


def require_torch() -> None:
    """Raises InvalidArgument naming the torch version this backend needs."""
    major = int(torch.__version__.split(".")[0])
    if major < 2 or not torch.distributed.is_available():
        raise _core.InvalidArgument(
            f"diffcomm.sim.run(torch_distributed=True) needs torch >= 2.0 with torch.distributed "
            f"(this is torch {torch.__version__}): c10d accepts Python process groups from 2.0 on")


require_torch()  # here, before anything below needs torch 2 (importing this module on 1.x raises)

import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d as _c10d  # noqa: E402
# The capsule, not the tensor: nanobind then skips torch's Python __dlpack__
# (about 4 us of a call's plumbing here).
from torch.utils.dlpack import to_dlpack as _to_dlpack  # noqa: E402

from .. import nn as _nn  # noqa: E402

BACKEND = "diffcomm_sim"

#: Per rank thread: the diffcomm world group, torch's c10d world state, and the
#: diffcomm sub-groups made by the new_group hook for the creator to pick up.
_local = threading.local()
_install_lock = threading.Lock()
_install_count = 0
_saved: Dict[str, Any] = {}


# ------------------------------------------------------------- op plumbing
def _dc(t: torch.Tensor) -> "_core.Tensor":
    """t as a flat diffcomm tensor sharing its storage (a copy only when t is
    not contiguous: DLPack lends dense row-major memory only)."""
    t = t.detach()
    return _core.from_dlpack(_to_dlpack((t if t.is_contiguous() else t.contiguous()).view(-1)))


def _into(out: torch.Tensor, result: "_core.Tensor") -> None:
    """c10d's in-place output: copies diffcomm's result into ``out``. (Flat
    views where possible: ``view(shape)`` costs several microseconds a call.)"""
    y = _core.to_torch(result)
    if out.is_contiguous():
        out.view(-1).copy_(y.view(-1))
    else:
        out.copy_(y.view(out.shape))


_OPS: Dict[Any, str] = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.PRODUCT: "product", dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max"}


def _reduce_op(op: Any, what: str) -> "_core.ReduceOp":
    """diffcomm's ReduceOp for c10d's (opts.reduceOp); PREMUL_SUM keeps its factor."""
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is not None:
        return _core.ReduceOp(name)
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, (int, float)):
            return _core.ReduceOp.premul_sum(float(factor))
        raise NotImplementedError(f"diffcomm_sim: {what} with PREMUL_SUM by a tensor factor")
    raise NotImplementedError(f"diffcomm_sim: {what} with reduce op {kind} (diffcomm has "
                              "SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)")


def _done(result: Any) -> "dist.Work":
    """A completed Work (the collective already ran): wait() returns at once."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _as_torch_call(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Puts the torch.distributed call in front of the world's report on the
    raising rank: the report names diffcomm's ops (an all_gather_into_tensor
    runs as all_gather_single), the user wrote torch's."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: "SimProcessGroup", *args: Any, **kwargs: Any) -> Any:
            calls = getattr(_local, "torch_calls", None)
            me = self._members[self._group_rank]
            where = f"torch.distributed.{name} on the group of global ranks {self._members}"
            if calls is not None:
                calls[me] = where
            try:
                self._p2p.run()  # posted sends/recvs come first, as issued
                result = method(self, *args, **kwargs)
            except (_core.CollectiveMismatch, _core.Deadlock) as e:
                # (the entry stays: the other ranks' reports list this call too)
                raise type(e)(f"{where} (group rank {self._group_rank}): {e}"
                              f"{_pending_torch_calls(calls, e)}") from None
            if calls is not None:
                calls.pop(me, None)
            return result
        return call
    return wrap


def _pending_torch_calls(calls: Optional[Dict[int, str]], error: Exception) -> str:
    """For a Deadlock: every rank's pending torch.distributed call, by global
    rank (the world's own report above names diffcomm's ops)."""
    if calls is None or not isinstance(error, _core.Deadlock) or _local.world_group is None:
        return ""
    lines = [f"  rank {r}: {calls.get(r, 'no torch.distributed call (finished or elsewhere)')}"
             for r in range(_local.world_group.size())]
    return "\npending torch.distributed calls:\n" + "\n".join(lines)


def _unsupported(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"diffcomm_sim: torch.distributed.{op} is not supported by the simulated world's c10d "
        f"backend")


class _P2PQueue:
    """One rank's posted sends and receives on one group.

    diffcomm's send/recv are rendezvous calls (a send returns when the recv
    took it), while c10d's isend/irecv return at once and complete on wait().
    So a posted op runs when the rank waits on any of its Works or calls a
    collective on the group, together with everything posted before it, in
    one order every rank agrees on: by peer pair (pairs of group-local ranks
    in ascending order), within a pair the lower rank's sends then its
    receives, the higher rank's receives then its sends, each direction in
    posting order (torch's non-overtaking rule). Every pattern of posted ops
    whose waits come after all the posts (batch_isend_irecv, rings, halo
    exchanges) completes; one that waits on a send before posting the receive
    its peer waits for (safe only with a buffering transport like gloo's) is
    reported as Deadlock, as it would hang on an unbuffered one (NCCL)."""

    def __init__(self, owner: "SimProcessGroup", rank: int):
        # The owner, not its diffcomm group: the group is released (set to
        # None) when the rank ends, and a second reference here would keep it.
        self._owner, self._rank = owner, rank
        self._posted: List[Tuple[str, torch.Tensor, int, int]] = []

    def post(self, kind: str, tensors: List[torch.Tensor], peer: int, tag: int) -> "dist.Work":
        if len(tensors) != 1:
            raise NotImplementedError(f"diffcomm_sim: {kind} of {len(tensors)} tensors "
                                      f"(the simulated world has one CPU tensor per rank)")
        if peer == self._rank:
            raise ValueError(f"diffcomm_sim: {kind} to or from itself (group rank {peer})")
        self._posted.append((kind, tensors[0], peer, tag))
        return _P2PWork(self, tensors)

    def run(self) -> None:
        posted, self._posted = self._posted, []
        me, group = self._rank, self._owner._group

        def order(i: int) -> Tuple[int, int, int, int]:
            kind, _, peer, _ = posted[i]
            first = "send" if me < peer else "recv"  # the lower rank sends first
            return (min(me, peer), max(me, peer), 0 if kind == first else 1, i)

        for i in sorted(range(len(posted)), key=order):
            kind, t, peer, tag = posted[i]
            if kind == "send":
                group.send(_dc(t), peer, tag)
            elif t.is_contiguous():
                group.recv(_dc(t), peer, tag)  # in place, through DLPack
            else:
                buf = t.contiguous()
                group.recv(_dc(buf), peer, tag)
                t.copy_(buf)


class _P2PWork(dist.Work):
    """A posted send/recv: wait() runs this rank's posted ops (_P2PQueue)."""

    def __init__(self, queue: _P2PQueue, tensors: List[torch.Tensor]):
        super().__init__()
        self._queue, self._tensors = queue, tensors

    def wait(self, timeout: Any = None) -> bool:
        self._queue.run()
        return True

    def is_completed(self) -> bool:
        return not self._queue._posted

    def result(self) -> List[torch.Tensor]:
        return self._tensors


# ------------------------------------------------------------ the group
class SimProcessGroup(dist.ProcessGroup):
    """One rank's view of a c10d group whose collectives run on a diffcomm group.

    c10d passes group-local roots (opts.rootRank), as diffcomm's ops take them.
    Lists of tensors: c10d's multi-device form; the simulated world has one
    CPU tensor per rank per call, so each list entry is one collective."""

    def __init__(self, rank: int, size: int, group: "_core.ProcessGroup"):
        super().__init__(rank, size)
        self._group = group
        self._members = group.members()
        self._group_rank = rank  # for __repr__, also after the world ended
        self._p2p = _P2PQueue(self, rank)

    @property
    def group_name(self) -> str:
        """c10d's name of the group, which the functional collectives resolve
        groups by; a Python group's C++ name is not set (as in torch's threaded
        group), so it comes from this rank's c10d state."""
        name = _c10d._world.pg_names.get(self)
        if name is not None:
            self._c10d_name = name
            return name
        # destroy_process_group(group) drops the name before it asks for it
        # (to unregister it): the name the group had.
        return getattr(self, "_c10d_name", "")

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    def _get_backend(self, device: Any) -> "SimProcessGroup":
        """c10d asks a group for its per-device backend object (e.g.
        batch_isend_irecv, for ``supports_coalescing``); this group is its own
        backend on the CPU (no coalescing: posted ops run on wait, in order)."""
        if torch.device(device).type != "cpu":
            raise NotImplementedError(f"diffcomm_sim: tensors on {device} (CPU tensors only)")
        return self

    def __repr__(self) -> str:
        return f"SimProcessGroup(group rank {self._group_rank} of global ranks {self._members})"

    # --- reductions
    @_as_torch_call("all_reduce")
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> "dist.Work":
        op = _reduce_op(opts.reduceOp, "all_reduce")
        for t in tensors:
            _into(t, _nn.all_reduce(_dc(t), self._group, op))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> "dist.Work":
        return self.allreduce(tensors, opts)

    @_as_torch_call("reduce")
    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> "dist.Work":
        op = _reduce_op(opts.reduceOp, "reduce")
        for t in tensors:
            y = _nn.reduce(_dc(t), opts.rootRank, self._group, op)
            if self.rank() == opts.rootRank:  # c10d leaves non-root tensors as they are
                _into(t, y)
        return _done(tensors)

    @_as_torch_call("broadcast")
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> "dist.Work":
        for t in tensors:
            _into(t, _nn.broadcast(_dc(t), opts.rootRank, self._group))
        return _done(tensors)

    @_as_torch_call("barrier")
    def barrier(self, opts: Any = None) -> "dist.Work":
        self._group.barrier()
        return _done(None)

    # --- gathers
    @_as_torch_call("all_gather")
    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> "dist.Work":
        for outs, x in zip(outputs, inputs):
            sizes = [o.numel() for o in outs]
            if all(s == x.numel() for s in sizes):
                ys = _nn.all_gather(_dc(x), self._group)
            else:  # uneven all_gather: the world checks the sizes agree across ranks
                flat = _nn.all_gather_v(_dc(x), sizes, self._group)
                ys = _split_rows(flat, sizes)
            for o, y in zip(outs, ys):
                _into(o, y)
        return _done(outputs)

    @_as_torch_call("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> "dist.Work":
        _into(output, _nn.all_gather_single(_dc(input), self._group))
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor],
                                        opts: Any = None) -> "dist.Work":
        for o, x in zip(outputs, inputs):
            self.all_gather_single(o, x, opts)
        return _done(outputs)

    @_as_torch_call("gather")
    def gather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: Any = None) -> "dist.Work":
        ys = _nn.gather(_dc(inputs[0]), opts.rootRank, self._group)
        if self.rank() == opts.rootRank:
            for o, y in zip(outputs[0], ys):
                _into(o, y)
        return _done(outputs)

    @_as_torch_call("scatter")
    def scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                opts: Any = None) -> "dist.Work":
        out = outputs[0]
        # diffcomm's scatter takes size() tensors on every rank (values used on src only).
        xs = [_dc(x) for x in inputs[0]] if inputs and inputs[0] else \
            [_dc(torch.empty_like(out))] * self.size()
        _into(out, _nn.scatter(xs, opts.rootRank, self._group))
        return _done(outputs)

    # --- reduce-scatters
    @_as_torch_call("reduce_scatter")
    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts: Any = None) -> "dist.Work":
        op = _reduce_op(opts.reduceOp, "reduce_scatter")
        for out, xs in zip(outputs, inputs):
            sizes = [x.numel() for x in xs]
            if all(n == sizes[0] for n in sizes):
                _into(out, _nn.reduce_scatter([_dc(x) for x in xs], self._group, op))
            else:  # uneven (gloo runs it): one flat reduce_scatter_v, blocks by entry
                flat = torch.cat([x.detach().reshape(-1) for x in xs])
                _into(out, _nn.reduce_scatter_v(_dc(flat), sizes, self._group, op))
        return _done(outputs)

    @_as_torch_call("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> "dist.Work":
        op = _reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        _into(output, _nn.reduce_scatter_single(_dc(input), self._group, op))
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor],
                                        opts: Any = None) -> "dist.Work":
        for o, x in zip(outputs, inputs):
            self.reduce_scatter_single(o, x, opts)
        return _done(outputs)

    # --- all-to-all
    @_as_torch_call("all_to_all_single")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]],
                          input_split_sizes: Optional[List[int]], opts: Any = None) -> "dist.Work":
        """Rows (dim 0) routed by the splits; empty splits mean equal parts, as in torch."""
        n = self.size()
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        width = math.prod(input.shape[1:])
        x = _core.from_dlpack(_to_dlpack(input.detach().contiguous().reshape(input.shape[0],
                                                                             width)))
        y = _nn.all_to_all_single(x, outs, ins, self._group)
        _into(output, y)
        return _done([output])

    @_as_torch_call("all_to_all")
    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts: Any = None) -> "dist.Work":
        ys = _nn.all_to_all([_dc(x) for x in inputs], self._group,
                            [[o.numel()] for o in outputs])
        for o, y in zip(outputs, ys):
            _into(o, y)
        return _done(outputs)

    # --- point to point: posted, run when waited on (see _P2PQueue)
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> "dist.Work":
        return self._p2p.post("send", tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> "dist.Work":
        return self._p2p.post("recv", tensors, src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> "dist.Work":
        raise _unsupported("recv (any source)")


def _split_rows(flat: "_core.Tensor", sizes: Sequence[int]) -> List["_core.Tensor"]:
    """Consecutive pieces of a flat diffcomm tensor (zero-copy narrows)."""
    pieces, start = [], 0
    for s in sizes:
        pieces.append(_core.narrow(flat, start, s))
        start += s
    return pieces


# ------------------------------------------------- per-rank c10d world state
class _RankTable(dict):
    """One rank thread's group-keyed c10d table (``pg_map``, ``pg_group_ranks``),
    which names the one way a rank thread reaches a group it never made: state
    shared between rank threads (megatron-core keeps its groups in module
    globals, so every rank thread reads the groups the last one stored). Raised
    instead of torch's "not initialized in the world group map"."""

    def __contains__(self, group: object) -> bool:
        found = super().__contains__(group)
        if not found:
            _refuse_foreign(group)
        return found

    def get(self, group: Any, default: Any = None) -> Any:
        if not super().__contains__(group):
            _refuse_foreign(group)
        return super().get(group, default)


def _refuse_foreign(group: object) -> None:
    """InvalidArgument when `group` is a SimProcessGroup another rank thread made."""
    world = getattr(_local, "world_group", None)
    if not isinstance(group, SimProcessGroup) or world is None or group._group is None:
        return
    me, owner = world.global_rank(world.rank()), group._members[group._group_rank]
    if me != owner:
        raise _core.InvalidArgument(
            f"diffcomm_sim: rank {me}'s thread uses the process group of global ranks "
            f"{group._members} that rank {owner}'s thread made: rank threads share module "
            f"globals (a library that keeps its groups in globals, as megatron-core's "
            f"parallel_state does, hands every rank the last rank's groups); run with "
            f"isolation='process' (the default), where each rank has its own")


class _RankWorld(_c10d._World):
    """One rank's c10d state. torch's ``_World`` keeps most of its fields in
    module globals (``_pg_map``, ``_pg_names``, ``_group_count``, ...) even
    though they are read through an instance; this subclass keeps them in the
    instance, so each rank thread has its own default group, group names and
    group-rank maps. The fields below are every global-backed property of
    ``_World`` (torch 2.0-2.15); the per-instance ones (coalescing state,
    flight-recorder hooks, comms) are inherited as they are."""

    def __init__(self) -> None:
        super().__init__()
        self._rank_state: Dict[str, Any] = {
            "pg_map": _RankTable(), "pg_names": {}, "pg_group_ranks": _RankTable(),
            "pg_backend_config": {},
            "tags_to_pg": {}, "pg_to_tag": {}}
        self._rank_group_count = 0

    pg_map = property(lambda self: self._rank_state["pg_map"])
    pg_names = property(lambda self: self._rank_state["pg_names"])
    pg_group_ranks = property(lambda self: self._rank_state["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._rank_state["pg_backend_config"])
    tags_to_pg = property(lambda self: self._rank_state["tags_to_pg"])
    pg_to_tag = property(lambda self: self._rank_state["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._rank_group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._rank_group_count = value


class _PerThreadWorld:
    """Stands in for ``distributed_c10d._world`` while simulated ranks run.

    c10d keeps its default group, group names, group ranks and tags in one
    process-global ``_World`` object, read through the module attribute
    ``_world`` on every call. Our ranks are threads of one process, so each
    needs its own: every attribute access is forwarded to the calling
    thread's ``_RankWorld`` (a fresh one per rank thread, made by
    rank_session) or, on any other thread, to the ``_World`` that was there
    before, so code outside the simulation sees torch unchanged. (torch's
    threaded test group swaps ``_world`` too, for a per-thread copy of its
    fields.) The C++ group-name registry, which the functional collectives
    resolve groups by, is made per-thread with torch's
    ``_set_thread_isolation_mode``.
    """

    def __init__(self, fallback: Any):
        object.__setattr__(self, "_fallback", fallback)

    def _target(self) -> Any:
        world = getattr(_local, "c10d_world", None)
        return world if world is not None else object.__getattribute__(self, "_fallback")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
    """Wraps c10d's ``_new_process_group_helper`` to make diffcomm sub-groups.

    c10d calls the backend's creator on the members of a new group only, but
    diffcomm's ``new_group`` is a collective of the parent group (every rank
    calls it, as torch requires of ``dist.new_group`` too). So every rank
    thread of a simulated world makes the diffcomm sub-group here, before
    c10d's member check, and the members' creator picks it up."""
    helper = _saved["helper"]
    world = getattr(_local, "world_group", None)
    names = ("group_size", "group_rank", "global_ranks_in_group", "backend")
    bound = dict(zip(names, args), **kwargs)
    ranks = bound.get("global_ranks_in_group") or []
    if world is not None and ranks:
        # Every group of a simulated world is simulated: one asked for with
        # another backend (megatron-core makes gloo groups for its CPU-side
        # calls) would wait for its peers in a store rendezvous, outside the
        # world's view, where one rank at a time never completes it.
        if len(args) > 3:
            args = args[:3] + (BACKEND,) + args[4:]
        else:
            kwargs["backend"] = BACKEND
        sub = world.new_group(sorted(ranks))
        if sub is not None:
            _local.pending[tuple(sorted(ranks))] = sub
    return helper(*args, **kwargs)


def _create(opts: Any, backend_options: Any) -> SimProcessGroup:
    """The backend's creator (c10d's extended API: it passes the global ranks)."""
    world = getattr(_local, "world_group", None)
    if world is None:
        raise _core.InvalidArgument(
            f"torch.distributed backend '{BACKEND}' works only inside "
            "diffcomm.sim.run(..., torch_distributed=True)")
    ranks = tuple(sorted(opts.global_ranks_in_group))
    # [] is the default group: the world; a new_group's came from the hook.
    group = _local.pending.pop(ranks) if ranks else world
    pg = SimProcessGroup(opts.group_rank, opts.group_size, group)
    _local.made.append(pg)
    return pg


def _import_before_ranks() -> None:
    """Imports, on the calling thread, torch modules whose functions take
    ``group=group.WORLD`` as a default argument, evaluated at import: imported
    first by a rank thread, they would bind that rank's default group into
    every rank's calls (the others then fail with "not initialized in the world
    group map"). Imported here, outside the ranks, the default is None: each
    rank's own default group."""
    for module in ("torch.distributed.nn.functional",):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def _install() -> None:
    """Process-wide setup, once for any number of concurrent runs (counted)."""
    global _install_count
    with _install_lock:
        if _install_count == 0:
            _import_before_ranks()
            if BACKEND.upper() not in dist.Backend._plugins:
                dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                              devices=["cpu"])
            _saved["excepthook"] = sys.excepthook  # init_process_group wraps it per rank
            _saved["world"] = _c10d._world
            _saved["helper"] = _c10d._new_process_group_helper
            _c10d._world = _PerThreadWorld(_c10d._world)
            _c10d._new_process_group_helper = _new_process_group_helper
            torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _install_count += 1


def _uninstall() -> None:
    global _install_count
    with _install_lock:
        _install_count -= 1
        if _install_count == 0:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            _c10d._new_process_group_helper = _saved.pop("helper")
            _c10d._world = _saved.pop("world")
            sys.excepthook = _saved.pop("excepthook")


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The backend and the per-thread c10d state, for the duration of one run."""
    require_torch()
    _check_barrier_env()
    _install()
    try:
        yield
    finally:
        _uninstall()


def rank_session(rank: int, group: "_core.ProcessGroup", fn: Callable[[], Any],
                 torch_calls: Optional[Dict[int, str]] = None) -> Any:
    """In a rank thread: init torch.distributed on this rank's simulated world,
    run fn, destroy the process group (also when fn raises). ``torch_calls``:
    the run's table of each rank's torch.distributed call in progress (for
    Deadlock reports), shared by the rank threads."""
    _local.world_group = group
    _local.torch_calls = torch_calls
    _local.pending = {}
    _local.made = []
    _local.c10d_world = _RankWorld()
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=group.size(),
                                store=dist.HashStore())
        try:
            return fn()
        finally:
            dist.destroy_process_group()
    finally:
        # torch may keep a group alive past destroy_process_group (DeviceMesh's
        # cache, the per-thread C++ name registry of an ended thread); the
        # diffcomm groups must not outlive the world, so the groups let go of them.
        for pg in _local.made:
            pg._group = None
        _local.world_group = None
        _local.torch_calls = None
        _local.pending = {}
        _local.made = []
        _local.c10d_world = None


def _check_barrier_env() -> None:
    if _c10d._is_barrier_after_init() == 1:
        # A store-based barrier blocks the rank holding the baton, outside the
        # world's view: the other ranks could never arrive (a hang, not a report).
        raise _core.InvalidArgument(
            "diffcomm.sim.run(torch_distributed=True): unset TORCH_DIST_INIT_BARRIER (=1 makes "
            "init_process_group/new_group wait in a store barrier, which the simulated world, "
            "one rank at a time, can never complete)")


def run(sim_run: Callable[[Callable[[int, Any], Any]], Any],
        fn: Callable[[int, "_core.ProcessGroup"], Any], isolation: str = "thread",
        world_size: int = 0) -> Any:
    """``sim.run(..., torch_distributed=True)``: ``sim_run(body)`` is the plain
    run with the caller's options; every rank's body is fn inside a torch.distributed
    session on its simulated world (a process session in isolation="process")."""
    if isolation == "process":
        from . import _c10d_processes  # noqa: PLC0415 (it imports this module)

        return _c10d_processes.run(sim_run, fn, world_size)
    torch_calls: Dict[int, str] = {}
    with installed():
        return sim_run(lambda rank, group: rank_session(rank, group, lambda: fn(rank, group),
                                                        torch_calls))

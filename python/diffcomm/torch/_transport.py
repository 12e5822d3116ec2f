"""The torch transport's primitives (``init_process_group("torch")``).

``TorchOps`` is what diffcomm's C++ ``TorchTransport`` (python/src/torch_transport.cpp)
calls for each primitive of a torch ProcessGroup: one torch.distributed call
with ``async_op=True`` on the diffcomm tensors' storage (lent through DLPack,
no copy), returning its Works, which C++ waits for within diffcomm's
deadline. No semantics live here: validation, checked mode, the
deterministic reductions (composed from ``all_to_all_single`` and
``all_gather_v`` unless ``native_reduction``), aliasing and the flight
recorder are diffcomm's C++, above this transport, as for MPI and NCCL.
Every Work is waited for in ``finish`` with diffcomm's deadline as torch's
timeout.
Ranks given to these methods are group-local; torch calls take global ranks.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _core

_SLACK_S = 0.05

_OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _t(x: _core.Tensor) -> torch.Tensor:
    return _core.to_torch(x)


def _reduce_op(op: str) -> Any:
    """torch's ReduceOp for diffcomm's op name; Avg and PremulSum only where
    torch has them for every backend it supports them on (else BackendError:
    native_reduction=False composes them)."""
    if op in _OPS:
        return _OPS[op]
    if op == "avg" and hasattr(dist.ReduceOp, "AVG"):
        return dist.ReduceOp.AVG
    raise _core.BackendError(f"torch transport: native reduction {op!r} is not a torch ReduceOp "
                             f"every torch backend has; use native_reduction=False")


class _Unpack:
    """A Work whose result is copied from a packed buffer into its outputs."""

    def __init__(self, work: Any, packed: torch.Tensor, outs: List[torch.Tensor]):
        self.work, self.packed, self.outs = work, packed, outs

    def wait(self, timeout: datetime.timedelta) -> None:
        self.work.wait(timeout)
        at = 0
        for o in self.outs:
            o.view(-1).copy_(self.packed[at:at + o.numel()])
            at += o.numel()


class TorchOps:
    """diffcomm's transport primitives on one torch ProcessGroup."""

    def __init__(self, group: Optional[Any] = None, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.members: List[int] = list(dist.get_process_group_ranks(self.group)) \
            if hasattr(dist, "get_process_group_ranks") and self.group is not dist.group.WORLD \
            else list(range(dist.get_world_size(self.group)))
        name = dist.get_backend(self.group)
        self.cpu = name != "nccl"
        self.cuda = name == "nccl"
        self.device_index = torch.cuda.current_device() if self.cuda and name == "nccl" else 0

    # ---------------------------------------------------------- waiting
    def finish(self, works: List[Any]) -> None:
        """Waits for the Works of one primitive within the deadline, blocked
        in torch's Work.wait(timeout) (no polling: a waiting rank leaves the
        cores to the transport's threads). Raises TimeoutError past the
        deadline (C++ turns it into diffcomm.Timeout naming the call) and
        torch's own error otherwise."""
        end = time.monotonic() + self.timeout_s
        for w in works:
            left = max(end - time.monotonic(), 0.001)
            try:
                w.wait(datetime.timedelta(seconds=left))
            except RuntimeError:
                # torch's timed wait works in whole milliseconds and may give
                # up a little before `end`: an error within _SLACK of the
                # deadline is the deadline.
                if time.monotonic() >= end - _SLACK_S:
                    raise TimeoutError(f"not complete within {self.timeout_s} s") from None
                raise

    def _g(self, group_rank: int) -> int:
        return self.members[group_rank]

    # ---------------------------------------------------------- primitives
    def barrier(self) -> List[Any]:
        return [dist.barrier(group=self.group, async_op=True)]

    def all_reduce(self, t, op: str) -> List[Any]:
        return [dist.all_reduce(_t(t), _reduce_op(op), group=self.group, async_op=True)]

    def broadcast(self, t, root: int) -> List[Any]:
        return [dist.broadcast(_t(t), self._g(root), group=self.group, async_op=True)]

    def reduce(self, t, root: int, op: str) -> List[Any]:
        return [dist.reduce(_t(t), self._g(root), _reduce_op(op), group=self.group,
                            async_op=True)]

    # An empty all_gather moves nothing and is skipped: torch 1.13's gloo
    # divides by the element count there (SIGFPE). Every member's input has
    # the same size in these fixed-size forms, so all of them skip it.
    def all_gather(self, outs, inp) -> List[Any]:
        src = _t(inp)
        if src.numel() == 0:
            return []
        return [dist.all_gather([_t(o) for o in outs], src, group=self.group, async_op=True)]

    def all_gather_single(self, out, inp) -> List[Any]:
        # The list form on views of the output's blocks: every torch backend has it.
        src = _t(inp).reshape(-1)
        if src.numel() == 0:
            return []
        flat, k = _t(out).view(-1), src.numel()
        views = [flat[r * k:(r + 1) * k] for r in range(len(self.members))]
        return [dist.all_gather(views, src, group=self.group, async_op=True)]

    def all_gather_v(self, out, inp, splits: Sequence[int]) -> List[Any]:
        # Even blocks (a composed all_reduce's usual case): all_gather into
        # views. Uneven: no torch collective gathers them, so all_to_all_single
        # of the input repeated once per member (n copies of a block).
        if len(set(splits)) <= 1:
            return self.all_gather_single(out, inp)
        src = _t(inp)
        n = len(self.members)
        rows = src.shape[0] if src.dim() > 0 else 1
        return [dist.all_to_all_single(_t(out), src.repeat((n,) + (1,) * (src.dim() - 1)),
                                       list(splits), [rows] * n, group=self.group,
                                       async_op=True)]

    def gather(self, outs, inp, root: int) -> List[Any]:
        lst = [_t(o) for o in outs] if self.rank == root else None
        return [dist.gather(_t(inp), lst, self._g(root), group=self.group, async_op=True)]

    def scatter(self, out, ins, root: int) -> List[Any]:
        lst = [_t(i) for i in ins] if self.rank == root else None
        return [dist.scatter(_t(out), lst, self._g(root), group=self.group, async_op=True)]

    def reduce_scatter(self, out, ins, op: str) -> List[Any]:
        return [dist.reduce_scatter(_t(out), [_t(i) for i in ins], _reduce_op(op),
                                    group=self.group, async_op=True)]

    def reduce_scatter_single(self, out, inp, op: str) -> List[Any]:
        return [dist.reduce_scatter_tensor(_t(out), _t(inp), _reduce_op(op), group=self.group,
                                           async_op=True)]

    def reduce_scatter_v(self, out, inp, splits: Sequence[int], op: str) -> List[Any]:
        raise _core.BackendError("torch transport: torch has no uneven reduce_scatter; use "
                                 "native_reduction=False (diffcomm composes it)")

    def all_to_all(self, outs, ins) -> List[Any]:
        # gloo has no list all_to_all: one all_to_all_single of the packed
        # blocks, unpacked in finish().
        o, i = [_t(x) for x in outs], [_t(x) for x in ins]
        packed_in = torch.cat([x.reshape(-1) for x in i]) if i else torch.empty(0)
        packed_out = torch.empty(sum(x.numel() for x in o), dtype=packed_in.dtype,
                                 device=packed_in.device)
        work = dist.all_to_all_single(packed_out, packed_in, [x.numel() for x in o],
                                      [x.numel() for x in i], group=self.group, async_op=True)
        return [_Unpack(work, packed_out, o)]

    def all_to_all_single(self, out, inp, out_splits: Sequence[int],
                          in_splits: Sequence[int]) -> List[Any]:
        return [dist.all_to_all_single(_t(out), _t(inp), list(out_splits), list(in_splits),
                                       group=self.group, async_op=True)]

    def send(self, t, peer: int, tag: int) -> List[Any]:
        return [dist.isend(_t(t), self._g(peer), group=self.group, tag=tag)]

    def recv(self, t, peer: int, tag: int) -> List[Any]:
        return [dist.irecv(_t(t), self._g(peer), group=self.group, tag=tag)]

    # ---------------------------------------------------------- groups
    def split(self, color: int, key: int) -> Optional["TorchOps"]:
        """ProcessGroup::split over torch: every member's (color, key) is
        all-gathered, then torch's new_group for each color in ascending
        order, members ordered by (key, rank). torch's new_group must be
        called by every process of its default group, so the parent must be
        the default group unless torch has use_local_synchronization."""
        n = len(self.members)
        mine = torch.tensor([color, key], dtype=torch.int64)
        table = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(table, mine, group=self.group)
        entries = [(int(t[0]), int(t[1]), r) for r, t in enumerate(table)]
        colors = sorted({c for c, _, _ in entries if c >= 0})
        members_of = {c: [self.members[r] for _, r in sorted((k, r) for cc, k, r in entries
                                                             if cc == c)] for c in colors}
        if not self._spans_world():
            return TorchOps(_local_new_group(members_of[color]), self.timeout_s) \
                if color >= 0 else None
        # Every process calls torch's new_group for every color, in one order.
        groups = {c: dist.new_group(members_of[c]) for c in colors}
        return TorchOps(groups[color], self.timeout_s) if color >= 0 else None

    def duplicate(self) -> "TorchOps":
        """A second torch group over the same members (checked mode's control)."""
        new = dist.new_group if self._spans_world() else _local_new_group
        return TorchOps(new(self.members), self.timeout_s)

    def _spans_world(self) -> bool:
        """Whether the group holds every process of torch's default group: then
        all of them take part in torch's new_group, as it requires."""
        return self.group is dist.group.WORLD or len(self.members) == dist.get_world_size()


def _local_new_group(ranks: List[int]) -> Any:
    try:
        return dist.new_group(ranks, use_local_synchronization=True)
    except TypeError:
        raise _core.BackendError(
            "torch transport: splitting a group that is not torch's default group needs "
            "torch.distributed.new_group(use_local_synchronization=True) (torch >= 2.1); split "
            "from the default group instead") from None

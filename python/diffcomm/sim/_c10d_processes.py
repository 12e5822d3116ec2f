"""The c10d backend ``"diffcomm_sim"`` in rank processes (``isolation="process"``).

Each rank process initialises torch.distributed as under a launcher, with its
own c10d state: no per-thread stand-ins (those are for rank threads, in
_c10d_backend.py, which holds the process group itself and the hook that
makes diffcomm sub-groups). What the rank processes share is one table, in
shared memory, of each rank's torch.distributed call in progress, for the
Deadlock report.
"""
from __future__ import annotations

import mmap
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import _core
from ._c10d_backend import (BACKEND, _check_barrier_env, _create, _local,
                            _new_process_group_helper, _saved, require_torch)


class SharedCalls:
    """The run's table of each rank's torch.distributed call in progress, in
    memory the rank processes share (an anonymous shared mapping made before
    the fork), so a Deadlock report lists every rank's call in process
    isolation too. A dict's get / setitem / pop, by global rank."""

    SLOT = 512  # bytes per rank: a length, then the text (cut to fit)

    def __init__(self, world_size: int):
        self._n = world_size
        self._map = mmap.mmap(-1, max(1, world_size) * self.SLOT)

    def __setitem__(self, rank: int, text: str) -> None:
        data = text.encode()[:self.SLOT - 2]
        at = rank * self.SLOT
        self._map[at + 2:at + 2 + len(data)] = data
        self._map[at:at + 2] = len(data).to_bytes(2, "little")

    def get(self, rank: int, default: str) -> str:
        at = rank * self.SLOT
        n = int.from_bytes(self._map[at:at + 2], "little") if 0 <= rank < self._n else 0
        return self._map[at + 2:at + 2 + n].decode(errors="replace") if n else default

    def pop(self, rank: int, default: Any = None) -> Any:
        if 0 <= rank < self._n:
            self._map[rank * self.SLOT:rank * self.SLOT + 2] = b"\0\0"
        return default

    def close(self) -> None:
        self._map.close()


def process_session(rank: int, group: "_core.ProcessGroup", fn: Callable[[], Any],
                    torch_calls: SharedCalls) -> Any:
    """In a rank process (isolation="process"): torch.distributed as under a
    launcher, with this process's own c10d state (no per-thread stand-ins):
    the backend registered, the new_group hook set (diffcomm's new_group is
    a collective of the parent group), then init_process_group, fn,
    destroy_process_group."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    if "helper" not in _saved:
        _saved["helper"] = _c10d._new_process_group_helper
        _c10d._new_process_group_helper = _new_process_group_helper
    _local.world_group = group
    _local.torch_calls = torch_calls
    _local.pending = {}
    _local.made = []
    dist.init_process_group(BACKEND, rank=rank, world_size=group.size(), store=dist.HashStore())
    try:
        return fn()
    finally:
        dist.destroy_process_group()



def run(sim_run: Callable[[Callable[[int, Any], Any]], Any],
        fn: Callable[[int, "_core.ProcessGroup"], Any], world_size: int) -> Any:
    """``sim.run(..., torch_distributed=True, isolation="process")``: every
    rank's body is fn inside a process session on its simulated world."""
    require_torch()
    _check_barrier_env()
    calls = SharedCalls(world_size)
    try:
        return sim_run(lambda rank, group: process_session(
            rank, group, lambda: fn(rank, group), calls))
    finally:
        calls.close()

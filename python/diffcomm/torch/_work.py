"""diffcomm.torch's ``async_op=True``: a ``Work`` handle as torch.distributed returns.

diffcomm's collectives return when their result is ready (the simulated world, MPI and the torch
transport complete the call before returning; NCCL calls are ordered on the current stream, as
torch's are after ``wait()``), so the Work is complete when it is handed out: ``wait()`` returns
True at once and ``result()`` holds the outputs. Code written for torch's asynchronous calls
(issue, compute, ``wait()``) runs unchanged; it overlaps nothing.
"""
from typing import Any, List, Optional

import torch


class Work:
    """The handle of one completed diffcomm.torch collective (torch.distributed.Work's methods)."""

    def __init__(self, outputs: List[torch.Tensor], op: str):
        self._outputs = outputs
        self._op = op

    def wait(self, timeout: Optional[Any] = None) -> bool:  # noqa: ARG002 (complete already)
        """True: the collective has completed (it did before this Work was returned)."""
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> List[torch.Tensor]:
        """The collective's outputs as a list (one tensor for the single-output ops)."""
        return list(self._outputs)

    def get_future(self) -> "torch.futures.Future":
        """A completed torch Future holding result()."""
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.result())
        return fut

    def __repr__(self) -> str:
        return f"diffcomm.torch.Work({self._op}, completed)"


def finish(value: Any, async_op: bool, op: str) -> Any:
    """What an op returns: its value, or with async_op a completed Work holding it."""
    if not async_op:
        return value
    outputs = list(value) if isinstance(value, (tuple, list)) else [value]
    return Work(outputs, op)

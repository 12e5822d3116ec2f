"""The NCCL backend (CUDA tensors)."""

import diffcomm._core


def device_count() -> int: ...

def unique_id() -> bytes: ...

def init_rank(unique_id: bytes, nranks: int, rank: int, device: int, stream: int = 0) -> diffcomm._core.ProcessGroup: ...

def set_stream(arg0: diffcomm._core.ProcessGroup, arg1: int, /) -> None: ...

def abort(group: diffcomm._core.ProcessGroup) -> None:
    """
    ncclCommAbort on the group's (owned) communicator: every later call on it raises BackendError. InvalidArgument for a borrowed communicator.
    """

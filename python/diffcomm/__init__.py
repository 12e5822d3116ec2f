"""diffcomm: differentiable collectives and the encoder-parallel feature exchange.

Submodules:
  diffcomm.torch             differentiable ops on torch tensors (MPI, NCCL, or a simulated rank)
  diffcomm.sim               the seeded simulated world: run(world_size, fn, seed=...), step/check/sweep
  diffcomm.encoder_parallel  the planner, token rules and exchange on diffcomm tensors
  diffcomm.nn                the differentiable collectives on diffcomm tensors

Errors: every exception diffcomm raises derives from diffcomm.Error, a RuntimeError
(InvalidArgument, also a ValueError; CollectiveMismatch; Deadlock; RankFailure; Timeout, also a
TimeoutError; BackendError; ResourceExhausted, also a MemoryError).
"""
from . import _core
from ._core import (
    HAVE_CUDA,
    HAVE_MPI,
    HAVE_NCCL,
    BackendError,
    CollectiveMismatch,
    Deadlock,
    DeviceMesh,
    Error,
    InvalidArgument,
    ProcessGroup,
    RankFailure,
    ReduceOp,
    ResourceExhausted,
    Tensor,
    Timeout,
    __version__,
    backward,
    empty_host_cache,
    from_dlpack,
    grad,
    host_cache_stats,
    to_numpy,
    to_torch,
)
from . import encoder_parallel, nn


def _skip_own_frames() -> None:
    """A collective's caller (flight recorder, Deadlock reports) is the first
    Python frame outside diffcomm's and torch's packages: the user's line, not
    a wrapper's. torch's directory is found without importing torch.
    DIFFCOMM_CALL_SITES=0 records no callers (the frame walk's cost: bench/RESULTS.md)."""
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415

    prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    spec = importlib.util.find_spec("torch")
    for location in (spec.submodule_search_locations or []) if spec else []:
        prefixes.append(os.path.abspath(location) + os.sep)
    _core._set_caller_skip(prefixes, os.environ.get("DIFFCOMM_CALL_SITES", "1") != "0")


_skip_own_frames()

# diffcomm.sim and diffcomm.torch are imported on first use (``import diffcomm`` then
# ``diffcomm.sim.run``), as torch does with its submodules: diffcomm.torch imports torch, which
# ``import diffcomm`` alone should not pay for.
_LAZY_SUBMODULES = ("sim", "torch")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib  # noqa: PLC0415

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'diffcomm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "HAVE_CUDA",
    "HAVE_MPI",
    "HAVE_NCCL",
    "BackendError",
    "CollectiveMismatch",
    "Deadlock",
    "DeviceMesh",
    "Error",
    "InvalidArgument",
    "ProcessGroup",
    "Timeout",
    "RankFailure",
    "ReduceOp",
    "ResourceExhausted",
    "Tensor",
    "__version__",
    "backward",
    "empty_host_cache",
    "encoder_parallel",
    "from_dlpack",
    "grad",
    "host_cache_stats",
    "nn",
    "to_numpy",
    "to_torch",
]

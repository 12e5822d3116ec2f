"""``diffcomm.sim.run(..., cuda="cpu")``: CUDA calls land on the CPU, in each rank process.

Trainer code often hard-codes CUDA (megatron-core allocates its buffers
with ``device=torch.cuda.current_device()`` and times with CUDA events). In
a rank process (isolation="process" only: the patch is the process's own
and dies with it) this makes:

* ``torch.cuda``: ``is_available`` True, ``device_count`` 1,
  ``current_device`` 0, ``set_device`` / ``synchronize`` / ``empty_cache`` /
  ``init`` no-ops, ``device(i)`` a no-op context, ``Stream`` / ``Event`` /
  ``current_stream`` / ``default_stream`` / ``stream(s)`` stand-ins whose
  waits and records return at once (one stream: everything is already in
  order), ``manual_seed`` / ``manual_seed_all`` / ``seed`` /
  ``get_rng_state`` / ``set_rng_state`` / ``initial_seed`` the CPU generator's
  (torch's default generator is the rank's generator for "CUDA" draws too),
  ``memory_allocated`` and friends 0, ``get_device_name`` "cpu (diffcomm.sim
  cuda='cpu')", ``get_device_capability`` (9, 0), ``nvtx`` range calls no-ops;
* torch's factories (``torch.empty``, ``zeros``, ``ones``, ``full``, ``rand``,
  ``randn``, ``arange``, ``tensor``, the ``*_like`` forms, ...; ``_FACTORIES``
  below) and ``Tensor.new_*`` called with a CUDA ``device=`` (``"cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")`` or a bare device index): the CPU;
  ``Tensor.to("cuda")`` stays on the CPU, ``Tensor.cuda()``,
  ``Module.cuda()`` and ``Tensor.pin_memory()`` return their object. Patched
  functions, not a TorchFunctionMode: modes do not reach the backward pass,
  where megatron-core allocates too.

Not covered: factories called through other names (``torch.ops.aten``),
tensors still say ``device.type == "cpu"`` and ``is_cuda`` False
(code that asserts CUDA tensors fails, naming the assertion); CUDA graphs,
``torch.cuda.amp`` beyond what torch's CPU autocast does, custom CUDA
kernels, NCCL-only c10d calls, ``pin_memory`` (a no-op copy on CPU-only torch).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Optional

import torch

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


#: torch's functions that take a device (factories), patched to take the CPU
#: for a CUDA device.
_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
              "linspace", "logspace", "eye", "tensor", "as_tensor", "empty_like", "zeros_like",
              "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
              "empty_strided")
#: Tensor methods that take a device.
_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _on_cpu(f: Callable[..., Any]) -> Callable[..., Any]:
    """f with a CUDA ``device=`` argument replaced by the CPU."""
    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return f(*args, **kwargs)
    return call


def _to(original: Callable[..., Any]) -> Callable[..., Any]:
    """Tensor.to with a CUDA target (positional or device=) going to the CPU."""
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args and _is_cuda(args[0]):
            args = (_CPU,) + tuple(args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return original(self, *args, **kwargs)
    return to


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any):
    """Tensor.cuda: the tensor itself, on the CPU."""
    return self


def _patch_devices() -> None:
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _on_cpu(getattr(torch, name)))
    for name in _METHODS:
        setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
    torch.Tensor.to = _to(torch.Tensor.to)
    torch.Tensor.cuda = _cuda
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, device=None: self


class _Stream:
    """A CUDA stream stand-in: one in-order stream, nothing to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any):
        self.device = _CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Optional["_Event"] = None) -> "_Event":
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Event:
    """A CUDA event stand-in: recorded and complete at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return 0.0


_STREAM = _Stream()


def _nothing() -> Callable[..., None]:
    """A new do-nothing function (one object per patched name: torch._dynamo,
    imported later, refuses one function object under two torch.cuda names)."""
    def nothing(*_: Any, **__: Any) -> None:
        return None
    return nothing


def _zero() -> Callable[..., int]:
    def zero(*_: Any, **__: Any) -> int:
        return 0
    return zero


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(state)


def _stand_ins() -> Dict[str, Any]:
    """torch.cuda's attributes as they read in a rank process with cuda='cpu'."""
    return {
        "is_available": lambda: True, "is_initialized": lambda: True, "init": _nothing(),
        "_lazy_init": _nothing(), "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": _nothing(), "synchronize": _nothing(), "empty_cache": _nothing(),
        "device": lambda *_a, **_k: contextlib.nullcontext(),
        "Stream": _Stream, "Event": _Event, "current_stream": lambda *_a, **_k: _STREAM,
        "default_stream": lambda *_a, **_k: _STREAM, "stream": lambda s=None: contextlib.nullcontext(s),
        "set_stream": _nothing(),
        "manual_seed": lambda seed: torch.manual_seed(seed) and None,
        "manual_seed_all": lambda seed: torch.manual_seed(seed) and None,
        "seed": lambda: torch.seed() and None, "seed_all": lambda: torch.seed() and None,
        "initial_seed": lambda: torch.initial_seed(),
        "get_rng_state": _cpu_rng_state, "set_rng_state": _set_cpu_rng_state,
        "get_rng_state_all": lambda: [torch.get_rng_state()],
        "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
        "memory_allocated": _zero(), "max_memory_allocated": _zero(), "memory_reserved": _zero(),
        "max_memory_reserved": _zero(), "reset_peak_memory_stats": _nothing(),
        "get_device_name": lambda *_a: "cpu (diffcomm.sim cuda='cpu')",
        "get_device_capability": lambda *_a: (9, 0),
    }


def install() -> None:
    """Patches torch.cuda and the device arguments in this (rank) process;
    never undone (the process ends with fn)."""
    _patch_devices()
    for name, value in _stand_ins().items():
        setattr(torch.cuda, name, value)
    nvtx = getattr(torch.cuda, "nvtx", None)
    if nvtx is not None:
        for name in ("range_push", "range_pop", "mark"):
            setattr(nvtx, name, _nothing())
        nvtx.range = lambda *_a, **_k: contextlib.nullcontext()


def wrap(fn: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """fn with torch.cuda on the CPU around it (called in the rank process)."""
    @functools.wraps(fn)
    def on_cpu(rank: int, group: Any) -> Any:
        install()
        return fn(rank, group)
    return on_cpu

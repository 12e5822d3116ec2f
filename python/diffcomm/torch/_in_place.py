"""diffcomm.torch's in-place forms, ``all_reduce_`` and ``broadcast_``: the
semantics of torch.distributed.all_reduce and broadcast (the tensor is
overwritten; no output buffer), the values of the out-of-place ops bit for
bit, not differentiable."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _core
from .._core import InvalidArgument
from ._args import group_or_default, op_site, reduce_op, root_rank
from ._bridge import refused, to_diffcomm
from ._work import finish


def _in_place(name: str, tensor: torch.Tensor, g: _core.ProcessGroup) -> _core.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"diffcomm.torch.{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.requires_grad and torch.is_grad_enabled():
        raise InvalidArgument(
            f"{op_site(name, g)}: the tensor requires grad and in-place collectives are not "
            f"differentiable; use {name[:-1]} (a new tensor, differentiable) or call it under "
            "torch.no_grad()")
    try:
        return to_diffcomm(tensor)
    except (InvalidArgument, RuntimeError) as e:
        raise refused(e, name, g) from None


# torch >= 2.1 counts a write with this; resolved once (a getattr that fails
# raises and catches an AttributeError, 0.3 us per call on torch 1.13).
_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)


def _bump_version(tensor: torch.Tensor) -> None:
    """Counts the write as torch's in-place ops do, so a tensor torch saved for
    backward and then overwritten here fails backward with torch's "modified
    by an inplace operation" instead of giving a wrong gradient (a write
    through DLPack is invisible to torch)."""
    if tensor.is_inference():  # no version counter (and torch 1.13 refuses the copy_ below)
        return
    if _increment_version is not None:
        _increment_version(tensor)
    else:  # torch < 2.1: copy_ onto itself moves no bytes but is an in-place op
        # No torch.no_grad() needed (it costs more than the copy_): _in_place
        # refused a tensor requiring grad while grad mode is on, so either
        # grad mode is off or the tensor records nothing.
        tensor.copy_(tensor)


def all_reduce_(tensor: torch.Tensor, op: Any = "sum",
                group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False) -> Any:
    """In place: tensor = reduce over members of tensor, as torch.distributed.all_reduce;
    returns tensor. Not differentiable: InvalidArgument if tensor requires grad
    while grad mode is on. The same values, bit for bit, as all_reduce."""
    g, o = group_or_default(group), reduce_op(op)
    g.all_reduce_(_in_place("all_reduce_", tensor, g), o)
    _bump_version(tensor)
    return finish(tensor, async_op, "all_reduce_")


def broadcast_(tensor: torch.Tensor, src: Optional[int] = None,
               group: Optional[_core.ProcessGroup] = None, *, async_op: bool = False,
               group_src: Optional[int] = None) -> Any:
    """In place: tensor = src's tensor on every member, as torch.distributed.broadcast;
    returns tensor. Not differentiable (as all_reduce_)."""
    g = group_or_default(group)
    s = root_rank(g, src, group_src, "src", "broadcast_")
    g.broadcast_(_in_place("broadcast_", tensor, g), s)
    _bump_version(tensor)
    return finish(tensor, async_op, "broadcast_")


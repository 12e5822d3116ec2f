"""diffcomm.torch's argument conversions: the group (``group=None``: the
default group), roots given as global or group-local ranks, reduce ops given
as names or torch.distributed.ReduceOp, and the ``op_site`` of error messages."""
from __future__ import annotations

import operator
from typing import Any, List, Optional

from .. import _context, _core
from .._core import InvalidArgument


def group_or_default(group: Optional[_core.ProcessGroup]) -> _core.ProcessGroup:
    if group is None:
        return _context.default_group()
    if not isinstance(group, _core.ProcessGroup):
        raise TypeError(f"diffcomm.torch: group must be a diffcomm ProcessGroup (from "
                        f"init_process_group or new_group) or None, got {type(group).__name__}")
    return group


_OPS = {"sum": "sum", "avg": "avg", "product": "product", "min": "min", "max": "max",
        "prod": "product", "mean": "avg"}


def premul_sum(factor: float) -> _core.ReduceOp:
    """The PREMUL_SUM reduce op (torch/NCCL): factor * sum of the inputs; its
    adjoint is the same scaled adjoint. Pass it as ``op=``."""
    return _core.ReduceOp.premul_sum(float(factor))


_OP_OF_NAME = {name: _core.ReduceOp(kind) for name, kind in _OPS.items()}


def reduce_op(op: Any) -> _core.ReduceOp:
    """diffcomm.ReduceOp from a diffcomm.ReduceOp, a torch.distributed.ReduceOp
    or a name ("sum", "avg", "product"/"prod", "min", "max", "mean")."""
    if isinstance(op, _core.ReduceOp):
        return op
    known = _OP_OF_NAME.get(op) if isinstance(op, str) else None
    if known is not None:  # the common case, a lower-case name: no new object
        return known
    if isinstance(op, str):
        key = op.lower()
    elif type(op) in (int, bool):  # torch 2's enum compares equal to ints: refuse them
        key = ""
    else:  # torch.distributed.ReduceOp (its repr differs between torch versions)
        key = ""
        import torch.distributed as tdist  # noqa: PLC0415

        for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
            value = getattr(tdist.ReduceOp, name, None)
            try:
                if value is not None and op == value:
                    key = name.lower()
                    break
            except TypeError:
                pass
    if key not in _OPS:
        raise InvalidArgument(f"diffcomm.torch: unknown reduce op {op!r} (sum, avg, product, "
                              "min, max, diffcomm.ReduceOp or torch.distributed.ReduceOp)")
    return _core.ReduceOp(_OPS[key])


def split_sizes(value: Any, name: str, op: str) -> List[int]:
    """A list of row counts from a sequence of ints (None: [], the even split). A tensor is
    refused by name: it is what torch's output-first ``all_to_all_single(output, input)``
    passes here, and ``list(tensor)`` would hand the binding 0-d tensors."""
    if value is None:
        return []
    if hasattr(value, "dim") and hasattr(value, "dtype"):  # a tensor, without importing torch
        raise TypeError(f"diffcomm.torch.{op}: {name} must be a sequence of ints, got a tensor "
                        f"(diffcomm.torch.{op}(input, output_split_sizes, input_split_sizes, "
                        "group) returns its output; torch.distributed's form takes (output, "
                        "input, ...) first)")
    try:
        splits = list(value)
    except TypeError:
        raise TypeError(f"diffcomm.torch.{op}: {name} must be a sequence of ints, got "
                        f"{type(value).__name__}") from None
    for s in splits:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"diffcomm.torch.{op}: {name} must be a sequence of ints, got "
                            f"an element {s!r} ({type(s).__name__})")
    return splits


def op_site(op: str, g: _core.ProcessGroup) -> str:
    return f"diffcomm.torch.{op} on group '{g.name}' (rank {g.rank()} of {g.size()})"


def root_rank(g: _core.ProcessGroup, rank: Optional[int], group_rank: Optional[int], what: str,
          op: str) -> int:
    """The group-local root from a global rank or a group-local one (exactly one)."""
    if rank is not None and group_rank is not None:
        raise InvalidArgument(f"{op_site(op, g)}: give {what} (global) or group_{what}, not both")
    if rank is None and group_rank is None:
        raise InvalidArgument(f"{op_site(op, g)}: {what} (global rank) or group_{what} is required")
    name, value = (what, rank) if rank is not None else (f"group_{what}", group_rank)
    try:  # ints and numpy integers; not bools, floats or strings
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{op_site(op, g)}: {name} must be an int, got {value!r}") from None
    if not -2**31 <= value < 2**31:
        raise InvalidArgument(f"{op_site(op, g)}: {name}={value} is not a rank")
    if rank is None:
        return value  # the op checks it against the group's size
    try:
        return g.group_rank(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"{op_site(op, g)}: {e}") from None


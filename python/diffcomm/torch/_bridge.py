"""The bridge between torch tensors and diffcomm's: DLPack views both ways,
and ``_Bridge``, the one torch.autograd.Function through which every
differentiable op of diffcomm.torch runs (see diffcomm.torch's docstring)."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable
from torch.utils.dlpack import from_dlpack as _public_from_dlpack
from torch.utils.dlpack import to_dlpack as _to_dlpack

# For a capsule, torch.utils.dlpack.from_dlpack (1.13 and 2.x) calls this very
# function after a hasattr(capsule, "__dlpack__") that fails: 0.1-0.2 us per
# call saved. The public one where a torch lacks it.
_from_dlpack = getattr(torch._C, "_from_dlpack", _public_from_dlpack)

from .. import _core, _participation
from .._core import InvalidArgument
from ._args import op_site


_NEGATED_VIEW = ("diffcomm.torch: the tensor is a lazily negated view (is_neg()); call "
                 ".resolve_neg() first")
# torch's to_dlpack says "Cannot pack tensors on meta" (a BufferError in torch 2, a RuntimeError
# in 1.13); this says what to do.
_META = ("the tensor is on the meta device and has no data to communicate: materialise it "
         "first (e.g. module.to_empty(device=...))")


def to_diffcomm(t: torch.Tensor, requires_grad: bool = False) -> _core.Tensor:
    """A diffcomm Tensor sharing ``t``'s storage (DLPack, no copy). Raises
    InvalidArgument for non-contiguous tensors and for lazily negated views
    (is_neg())."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"diffcomm.torch: expected a torch.Tensor, got {type(t).__name__}")
    # (A conjugated view is complex, which diffcomm refuses by dtype.)
    if t.is_neg():  # DLPack would export the memory without the sign
        raise InvalidArgument(_NEGATED_VIEW)
    if t.is_meta:
        raise InvalidArgument(_META)
    # A capsule from torch.utils.dlpack, not the __dlpack__ protocol: 0.3-1 us
    # instead of 2-3 us per tensor (bench/RESULTS.md, the bridge's pieces).
    return _core.from_dlpack(_to_dlpack(t.detach() if t.requires_grad else t), requires_grad)


def from_diffcomm(t: _core.Tensor) -> torch.Tensor:
    """A torch.Tensor sharing the diffcomm tensor's storage (no copy)."""
    return _from_dlpack(_core.to_dlpack(t))


class _Bridge(torch.autograd.Function):
    """The one bridge between torch autograd and diffcomm autograd.

    forward(run, cohort, where, *xs): xs become diffcomm leaves (requires_grad where
    torch needs their gradient), ``run`` applies diffcomm ops to them and
    returns diffcomm tensors, recorded in diffcomm's graph. That graph is
    handed off to torch: it leaves diffcomm's cohort (a bridge with
    collectives registers its outputs as pending for ``backward`` instead),
    and the tensors it saved for backward are saved through torch too, so a
    torch in-place write to one raises torch's "modified by an inplace
    operation". backward: diffcomm::grad of those outputs w.r.t. those
    leaves, with torch's output gradients.
    """

    @staticmethod
    def forward(ctx, run: Callable[[List[_core.Tensor]], List[_core.Tensor]],
                cohort: Optional[int], where: Tuple[str, Optional[_core.ProcessGroup]],
                *xs: torch.Tensor):
        ins = _borrow(xs, ctx.needs_input_grad[3:], *where)
        outs = run(ins)
        saved, collectives = _core.hand_off(outs)
        ctx.dc_inputs = ins
        ctx.dc_outputs = outs
        result = tuple(from_diffcomm(o) for o in outs)
        frozen = [r for r, o in zip(result, outs) if not o.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        ctx.save_for_backward(*_torch_peers(saved, list(zip(ins, xs)) + list(zip(outs, result))))
        ctx.pending = None
        if collectives:
            assert cohort is not None, "a bridge with collectives needs its rank's cohort"
            differentiable = tuple(r for r, o in zip(result, outs) if o.requires_grad)
            ctx.pending = (cohort, _participation.add(cohort, differentiable))
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        if ctx.pending is not None:  # ran (or failed): no longer pending either way
            _participation.ran(*ctx.pending)
        ctx.saved_tensors  # noqa: B018 -- torch's version check, before any collective
        roots, cotangents = [], []
        for out, g in zip(ctx.dc_outputs, grads):
            if not out.requires_grad:
                continue
            if g is None:
                g = torch.zeros(out.shape, dtype=getattr(torch, out.dtype))
            roots.append(out)
            cotangents.append(to_diffcomm(g.contiguous()))
        wanted = [x for x in ctx.dc_inputs if x.requires_grad]
        result: List[Optional[torch.Tensor]] = [None, None, None]  # run, cohort, where
        # retain_graph: torch owns the graph's lifetime (a retained torch
        # graph may run this node again).
        got = iter(_core.grad(roots, wanted, cotangents, True) if roots and wanted else [])
        for x in ctx.dc_inputs:
            result.append(from_diffcomm(next(got)) if x.requires_grad else None)
        return tuple(result)


def _torch_peers(saved: Sequence[_core.Tensor],
                 pairs: Sequence[Tuple[_core.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
    """The torch tensors (bridge inputs and outputs) whose storage diffcomm
    saved for backward. A tensor diffcomm made inside the op has no torch
    peer: no torch op can write to it."""
    peers = []
    for s in saved:
        for dc, t in pairs:
            if s.numel() > 0 and dc.data_ptr == s.data_ptr and all(p is not t for p in peers):
                peers.append(t)
                break
    return peers


def refused(e: Exception, op: str, group: Optional[_core.ProcessGroup]) -> InvalidArgument:
    """A refused input's error (to_diffcomm's, or torch's own to_dlpack
    RuntimeError or BufferError) naming the op, and the rank and group when it
    has one."""
    where = op_site(op, group) if group is not None else f"diffcomm.torch.{op}"
    return InvalidArgument(f"{where}: {e}")


def _borrow(xs: Sequence[torch.Tensor], needs: Sequence[bool], op: str,
            group: Optional[_core.ProcessGroup]) -> List[_core.Tensor]:
    """to_diffcomm of every input, errors named (see refused)."""
    try:
        return [to_diffcomm(x, bool(n)) for x, n in zip(xs, needs)]
    except (InvalidArgument, RuntimeError, BufferError) as e:
        raise refused(e, op, group) from None


def apply(run: Callable[[List[_core.Tensor]], List[_core.Tensor]], *xs: torch.Tensor,
           op: str, group: Optional[_core.ProcessGroup] = None) -> Tuple[torch.Tensor, ...]:
    """Runs ``run`` through the bridge; ``op`` names it in errors; ``group``:
    any group of this rank when ``run`` issues collectives (their backward
    joins the rank's pending ones)."""
    grad = False
    for x in xs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"diffcomm.torch.{op}: expected torch.Tensor inputs, got "
                            f"{type(x).__name__}")
        if x.requires_grad:
            grad = True
    if grad and torch.is_grad_enabled():
        return _Bridge.apply(run, group._cohort_id if group is not None else None, (op, group),
                             *xs)
    # Nothing to differentiate: diffcomm records no node for inputs that do
    # not require grad, and the bridge would only add torch's
    # autograd.Function machinery to the call (outputs are non-differentiable
    # either way). This is every no-grad call's path, so to_diffcomm and
    # from_diffcomm are written out, without generator expressions, and one
    # output (most ops) skips the loop: about 1 us less per call than the
    # plain form (bench/RESULTS.md, the bridge's pieces).
    try:
        ins = []
        for x in xs:
            if x.is_neg():
                raise InvalidArgument(_NEGATED_VIEW)
            ins.append(_core.from_dlpack(_to_dlpack(x.detach() if x.requires_grad else x)))
    except (InvalidArgument, RuntimeError) as e:
        raise refused(e, op, group) from None
    outs = run(ins)
    if len(outs) == 1:
        return (_from_dlpack(_core.to_dlpack(outs[0])),)
    return tuple([_from_dlpack(_core.to_dlpack(o)) for o in outs])



def apply_one(run: Callable[[_core.Tensor], _core.Tensor], x: torch.Tensor, *, op: str,
               group: _core.ProcessGroup) -> torch.Tensor:
    """apply for an op of one tensor in and one out (most collectives):
    ``run`` maps a diffcomm tensor to one. The no-grad path is written out
    without apply's lists (0.4-0.7 us less per call, bench/RESULTS.md); every
    other case (an input requiring grad, a refused input) goes through apply,
    with its errors."""
    if isinstance(x, torch.Tensor) and not (x.requires_grad and torch.is_grad_enabled()) \
            and not x.is_neg():
        try:
            t = _core.from_dlpack(_to_dlpack(x.detach() if x.requires_grad else x))
        except (InvalidArgument, RuntimeError, BufferError) as e:
            raise refused(InvalidArgument(_META) if x.is_meta else e, op, group) from None
        return _from_dlpack(_core.to_dlpack(run(t)))
    return apply(lambda i: [run(i[0])], x, op=op, group=group)[0]

"""check_equivalence(..., torch_distributed=True): the step's torch DeviceMesh,
and each parameter's placement read from the model instead of declared.

Where a placement comes from, first match wins:
  1. the caller's ``placements={name: placement}`` (explicit overrides);
  2. a DTensor gradient (or parameter): its placements over its mesh's named
     dims (torch's ``[Shard(0), Replicate()]`` lists, FSDP2 and TP included);
  3. Megatron-core's attributes: ``tensor_model_parallel`` with
     ``partition_dim`` is Shard(partition_dim, "tp"), ``sequence_parallel``
     is Partial("tp") (its gradient is summed over TP by
     finalize_model_grads, which a step calling it must override);
  4. anything else: Replicate.
Megatron's ``main_grad`` (its DDP's gradient buffer) is read when set.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import _core
from ._equivalence import Placed, core_tensor, split

Placement = _core.sim.Placement


def device_mesh(dims: Sequence[Tuple[str, int]]) -> Any:
    """The torch DeviceMesh of the rank's world with the dims' names (CPU)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", tuple(s for _, s in dims),
                            mesh_dim_names=tuple(n for n, _ in dims))


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 (torch >= 2.4)
    except ImportError:  # pragma: no cover (older torch 2)
        from torch.distributed._tensor import DTensor  # noqa: PLC0415
    return DTensor


def _is_shard(p: Any, dim: Optional[int] = None) -> bool:
    """A plain Shard (not torch's _StridedShard), on ``dim`` if given."""
    return type(p).__name__ == "Shard" and (dim is None or p.dim == dim)


def _strided_anchor(where: str, i: int, name: str, placements: Sequence[Any],
                    sizes: Sequence[int]) -> int:
    """FSDP2 on top of TP writes [_StridedShard(d, sf) on dp, Shard(d) on tp]:
    the dim was cut by tp first, then each tp piece by dp, i.e. the nested
    placement [Shard(d, tp), Shard(d, dp)]. Returns the index of the last
    mesh dim cutting d after i (the strided one goes after it); a split
    factor other than their sizes' product is refused."""
    p = placements[i]
    later = [j for j in range(i + 1, len(placements)) if _is_shard(placements[j], p.dim)]
    product = 1
    for j in later:
        product *= sizes[j]
    if not later or getattr(p, "split_factor", None) != product:
        raise _core.InvalidArgument(
            f"{where}: DTensor placement {p!r} on mesh dim '{name}' is not a dim cut after the "
            f"later mesh dims' Shard({p.dim}) (split factor {product} expected); pass "
            f"placements={{name: ...}} for it")
    return later[-1]


def _from_dtensor(where: str, placements: Sequence[Any], names: Optional[Sequence[str]],
                  sizes: Sequence[int]) -> Tuple["Placement", List["Placement"]]:
    """A DTensor placement list over named mesh dims as (outer, inner)."""
    if names is None:
        raise _core.InvalidArgument(
            f"{where}: its DTensor's DeviceMesh has no mesh_dim_names; make the mesh from the "
            f"step's mesh (mesh['tp'], ...) so its dims are named")
    out: List["Placement"] = []
    deferred: Dict[int, List["Placement"]] = {}
    for i, (name, p) in enumerate(zip(names, placements)):
        if p.is_replicate():
            pass
        elif p.is_partial() and str(getattr(p, "reduce_op", "sum")).lower() == "sum":
            out.append(Placement.partial(name))
        elif _is_shard(p):
            out.append(Placement.shard(p.dim, name))
        elif type(p).__name__ == "_StridedShard":
            anchor = _strided_anchor(where, i, name, placements, sizes)
            deferred.setdefault(anchor, []).append(Placement.shard(p.dim, name))
        else:
            raise _core.InvalidArgument(
                f"{where}: DTensor placement {p!r} on mesh dim '{name}' is not supported by "
                f"check_equivalence (Shard, Replicate and Partial('sum') are); pass "
                f"placements={{name: ...}} for it")
        out += deferred.pop(i, [])
    if not out:
        return Placement.replicate(), []
    return out[0], out[1:]


def _grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    main = getattr(p, "main_grad", None)  # Megatron-core's DDP buffer
    return main if isinstance(main, torch.Tensor) else p.grad


def _placed_param(where: str, p: torch.nn.Parameter) -> Tuple[Any, "Placement", List["Placement"]]:
    grad = _grad_of(p)
    dtensor = _dtensor_type()
    holder = grad if isinstance(grad, dtensor) else p if isinstance(p, dtensor) else None
    if holder is not None:
        mesh = holder.device_mesh
        outer, inner = _from_dtensor(where, holder.placements, mesh.mesh_dim_names,
                                     tuple(mesh.shape))
        if isinstance(grad, dtensor):
            grad = grad.to_local()
        return grad, outer, inner
    if getattr(p, "tensor_model_parallel", False):
        return grad, Placement.shard(int(getattr(p, "partition_dim", 0)), "tp"), []
    if getattr(p, "sequence_parallel", False):
        return grad, Placement.partial("tp"), []
    return grad, Placement.replicate(), []


def module_grads(module: torch.nn.Module, rank: int,
                 overrides: Mapping[str, Any]) -> Dict[str, Placed]:
    """Every trainable parameter's gradient (None stays None) and placement,
    by ``named_parameters()`` name (a DDP wrapper's ``module.`` prefix off)."""
    inner_module = getattr(module, "module", None)
    if type(module).__name__ == "DistributedDataParallel" and inner_module is not None:
        module = inner_module
    out: Dict[str, Placed] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        where = f"check_equivalence: parameter '{name}' on rank {rank}"
        grad, outer, inner = _placed_param(where, p)
        if name in overrides:
            outer, inner = split(where, overrides[name])
        out[name] = (core_tensor(grad), outer, inner)
    unknown = sorted(set(overrides) - set(out))
    if unknown:
        raise _core.InvalidArgument(
            f"check_equivalence: placements names {unknown}, not trainable parameters of the "
            f"module on rank {rank} (it has {sorted(out)[:8]}{'...' if len(out) > 8 else ''})")
    return out

"""The mesh-equivalence oracle: a user's training step on meshes against the
same step on one rank (diffcomm.sim.check_equivalence; the comparison itself is
C++, sim/checks/include/diffcomm/sim/equivalence.hpp)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import _core
from ._run import run

Placement = _core.sim.Placement
ParamFinding = _core.sim.ParamFinding
MeshFindings = _core.sim.MeshFindings


def Replicate() -> "Placement":  # noqa: N802 (named as torch's DTensor placements)
    """Every rank holds the whole gradient (checked equal across the replicas)."""
    return Placement.replicate()


def Shard(dim: int, mesh_dim: str) -> "Placement":  # noqa: N802
    """The global gradient is the ranks' tensors concatenated along ``dim`` in
    ``mesh_dim`` coordinate order (uneven sizes allowed, torch.chunk's
    included); the other mesh dims hold replicas."""
    return Placement.shard(dim, mesh_dim)


def Partial(mesh_dim: str) -> "Placement":  # noqa: N802
    """The global gradient is the sum of the ranks' tensors over ``mesh_dim``;
    the other mesh dims hold replicas."""
    return Placement.partial(mesh_dim)


class EquivalenceReport:
    """What check_equivalence returns: ``meshes`` (one MeshFindings per mesh,
    in order: ``.mesh`` [(dim, size)], ``.params`` [ParamFinding], ``.ok``),
    ``ok`` and ``str(report)``: one line per finding (or one per passing
    mesh)."""

    def __init__(self, meshes: List["MeshFindings"]):
        self.meshes = meshes

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.meshes)

    def finding(self, mesh_index: int, name: str) -> "ParamFinding":
        """The finding of parameter ``name`` on mesh ``mesh_index``."""
        for f in self.meshes[mesh_index].params:
            if f.name == name:
                return f
        raise KeyError(f"check_equivalence report: no parameter '{name}' on mesh {mesh_index}")

    def __str__(self) -> str:
        return "\n".join(str(m) for m in self.meshes)

    def __repr__(self) -> str:
        return f"EquivalenceReport(ok={self.ok}, meshes={len(self.meshes)})"


def _dims(mesh: Mapping[str, int], names: Sequence[str]) -> List[Tuple[str, int]]:
    """The mesh's dims in its own order, then every other named dim at size 1."""
    for name, size in mesh.items():
        if not isinstance(name, str) or not isinstance(size, int) or size < 1:
            raise _core.InvalidArgument(
                f"check_equivalence: mesh {dict(mesh)}: dims are str -> int >= 1, got "
                f"{name!r}: {size!r}")
    return [(n, int(mesh[n])) for n in mesh] + [(n, 1) for n in names if n not in mesh]


#: (gradient or None, outer placement, inner placements): check_mesh's input.
Placed = Tuple[Optional["_core.Tensor"], "Placement", List["Placement"]]


def core_tensor(grad: Any) -> Optional["_core.Tensor"]:
    """A gradient (torch, DTensor: its local shard, or diffcomm) as a diffcomm
    tensor; None stays None (a finding: missing_ranks)."""
    if grad is None or isinstance(grad, _core.Tensor):
        return grad
    if type(grad).__name__ == "DTensor":  # its shard on this rank
        grad = grad.to_local()
    return _core.from_dlpack(grad.detach().contiguous(), False)


def explicit(where: str, value: Any) -> Placed:
    """(gradient, placement) with a placement or a list of them (outer to
    inner, Replicate entries dropped)."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{where}: expected (gradient tensor, placement), got {value!r:.80}")
    grad, placement = value
    outer, inner = split(where, placement)
    return core_tensor(grad), outer, inner


def split(where: str, placement: Any) -> Tuple["Placement", List["Placement"]]:
    """A Placement, or a list of them (DTensor order: outer to inner), as
    (outer, inner)."""
    if isinstance(placement, Placement):
        return placement, []
    if isinstance(placement, (list, tuple)) and all(isinstance(p, Placement) for p in placement):
        named = [p for p in placement if p.kind != "replicate"]
        return (named[0], named[1:]) if named else (Placement.replicate(), [])
    raise TypeError(f"{where}: expected a placement (Replicate(), Shard(dim, mesh_dim), "
                    f"Partial(mesh_dim)) or a list of them, got {placement!r:.80}")


def _placed(out: Any, rank: int, overrides: Mapping[str, Any],
            torch_mode: bool) -> Dict[str, Any]:
    """The step's return value as {name: (gradient or None, outer, inner)}."""
    if torch_mode and not isinstance(out, Mapping):
        import torch  # noqa: PLC0415

        if isinstance(out, torch.nn.Module):
            from . import _equivalence_torch as et  # noqa: PLC0415

            return et.module_grads(out, rank, overrides)
    if not isinstance(out, Mapping):
        expected = "a module or " if torch_mode else ""
        raise TypeError(f"check_equivalence: step returned {type(out).__name__} on rank "
                        f"{rank}, expected {expected}a dict name -> (gradient, placement)")
    return {str(k): explicit(f"check_equivalence: parameter '{k}' on rank {rank}", v)
            for k, v in out.items()}


def _run(step: Callable[..., Any], dims: List[Tuple[str, int]], seed: int, schedule: str,
         torch_mode: bool, overrides: Mapping[str, Any], run_options: Mapping[str, Any]
         ) -> List[Dict[str, Any]]:
    world = 1
    for _, size in dims:
        world *= size

    def body(rank: int, group: "_core.ProcessGroup") -> Dict[str, Any]:
        if torch_mode:
            from . import _equivalence_torch as et  # noqa: PLC0415

            mesh = et.device_mesh(dims)
        else:
            mesh = _core.DeviceMesh(group, dims)
        return _placed(step(rank, mesh, seed), rank, overrides, torch_mode)

    return list(run(world, body, seed=seed, schedule=schedule, trace=False,
                    torch_distributed=torch_mode, **run_options).results)


def _reference(per_rank: Dict[str, Any]) -> Dict[str, "_core.Tensor"]:
    out = {}
    for name, (grad, _, _) in per_rank.items():
        if grad is None:
            raise _core.InvalidArgument(
                f"check_equivalence: parameter '{name}' has no gradient (None) in the reference "
                f"run (one rank): backward did not reach it; freeze it (requires_grad=False) "
                f"or leave it out")
        out[name] = grad
    return out


def check_equivalence(step: Callable[[int, Any, int], Any],
                      meshes: Sequence[Mapping[str, int]], seed: int = 0,
                      rtol: float = 1e-12, *, factor_rtol: Optional[float] = None,
                      schedule: str = "random", torch_distributed: bool = False,
                      placements: Optional[Mapping[str, Any]] = None,
                      isolation: Optional[str] = None,
                      cuda: Optional[str] = None) -> EquivalenceReport:
    """Runs ``step(rank, mesh, seed)`` in the simulated world on one rank (the
    reference: every dim 1) and on each mesh of ``meshes`` (dicts of dim sizes,
    e.g. ``{"dp": 2, "tp": 2}``), and compares each parameter's reassembled
    gradient with the reference.

    ``mesh`` has the mesh's dims in its order followed by every other dim any
    mesh names (size 1). It is a ``diffcomm.DeviceMesh`` over the rank's world,
    or with ``torch_distributed=True`` a torch ``DeviceMesh`` with those
    ``mesh_dim_names``, torch.distributed being initialised on every rank (the
    c10d backend of ``diffcomm.sim.run``), so the step may use
    torch.distributed, functional collectives, DTensor, FSDP2 or Megatron-core
    as written. Ranks are processes by default (``isolation``, ``cuda`` as in
    ``run``).

    ``step`` returns ``{name: (gradient, placement)}`` with torch or diffcomm
    tensors and ``Replicate()``, ``Shard(dim, mesh_dim)``, ``Partial(mesh_dim)``
    or a list of them (a DTensor-style nested placement, outer to inner:
    ``[Shard(0, "dp"), Shard(0, "tp")]``). With ``torch_distributed=True`` it
    may instead return the module after ``backward()``: its trainable
    ``named_parameters()`` are checked, each placement read from the model
    (diffcomm/sim/_equivalence_torch.py: DTensor placements, Megatron-core's
    ``tensor_model_parallel``/``partition_dim``/``sequence_parallel`` on a
    mesh dim named ``"tp"``, ``main_grad`` when set, else Replicate), and
    ``placements={name: placement}`` overrides any of them. A gradient that is
    None on some ranks is a finding (``missing_ranks``), not an error.

    A gradient passes at max|g - r| / max|r| <= rtol; a failure is explained
    by a least-squares scalar factor and the mesh expressions it equals within
    ``factor_rtol`` (default: the larger of 1e-9 and rtol; ties listed), by
    the differing shards of a Shard placement, and by the replicas that
    disagree.

    Raises what the step raises (with ``.rank``), and InvalidArgument naming
    the parameter, the rank and expected vs received when the gradients do
    not fit the placements or the reference (or the reference has None).
    """
    factor_rtol = max(1e-9, rtol) if factor_rtol is None else factor_rtol
    overrides = dict(placements or {})
    if overrides and not torch_distributed:
        raise _core.InvalidArgument("check_equivalence: placements= applies to a module "
                                    "returned with torch_distributed=True")
    run_options = {"isolation": isolation, "cuda": cuda}
    names: List[str] = []
    for mesh in meshes:
        names += [n for n in mesh if n not in names]
    ref_dims = [(n, 1) for n in names]
    reference = _reference(_run(step, ref_dims, seed, schedule, torch_distributed, overrides,
                                run_options)[0])
    out = []
    for mesh in meshes:
        dims = _dims(mesh, names)
        per_rank = _run(step, dims, seed, schedule, torch_distributed, overrides, run_options)
        out.append(_core.sim.check_mesh(dims, per_rank, reference, rtol, factor_rtol))
    return EquivalenceReport(out)


__all__ = ["check_equivalence", "EquivalenceReport", "Replicate", "Shard", "Partial",
           "Placement", "ParamFinding", "MeshFindings"]

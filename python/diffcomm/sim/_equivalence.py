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


def _to_core(name: str, rank: int, value: Any) -> Tuple["_core.Tensor", "Placement"]:
    where = f"check_equivalence: parameter '{name}' on rank {rank}"
    if not isinstance(value, tuple) or len(value) != 2 or not isinstance(value[1], Placement):
        raise TypeError(f"{where}: expected (gradient tensor, placement), got {value!r:.80}")
    grad, placement = value
    if grad is None:
        raise _core.InvalidArgument(f"{where}: the gradient is None (backward did not reach it)")
    if isinstance(grad, _core.Tensor):
        return grad, placement
    return _core.from_dlpack(grad.detach().contiguous(), False), placement


def _run(step: Callable[..., Any], dims: List[Tuple[str, int]], seed: int,
         schedule: str) -> List[Dict[str, Tuple["_core.Tensor", "Placement"]]]:

    world = 1
    for _, size in dims:
        world *= size

    def body(rank: int, group: "_core.ProcessGroup") -> Dict[str, Any]:
        mesh = _core.DeviceMesh(group, dims)
        out = step(rank, mesh, seed)
        if not isinstance(out, Mapping):
            raise TypeError(f"check_equivalence: step returned {type(out).__name__} on rank "
                            f"{rank}, expected a dict name -> (gradient, placement)")
        return {str(k): _to_core(str(k), rank, v) for k, v in out.items()}

    return list(run(world, body, seed=seed, schedule=schedule, trace=False).results)


def check_equivalence(step: Callable[[int, "_core.DeviceMesh", int], Mapping[str, Any]],
                      meshes: Sequence[Mapping[str, int]], seed: int = 0,
                      rtol: float = 1e-12, *, factor_rtol: Optional[float] = None,
                      schedule: str = "random") -> EquivalenceReport:
    """Runs ``step(rank, mesh, seed)`` in the simulated world on one rank (the
    reference: every dim 1) and on each mesh of ``meshes`` (dicts of dim sizes,
    e.g. ``{"dp": 2, "tp": 2}``), and compares each parameter's reassembled
    gradient with the reference.

    ``mesh`` is a ``diffcomm.DeviceMesh`` over the rank's world with the
    mesh's dims in its order followed by every other dim any mesh names (size
    1). ``step`` returns ``{name: (gradient, placement)}`` with torch or
    diffcomm tensors and ``Replicate()``, ``Shard(dim, mesh_dim)`` or
    ``Partial(mesh_dim)``. A gradient passes at max|g - r| / max|r| <= rtol; a
    failure is explained by a least-squares scalar factor and the mesh
    expressions it equals within ``factor_rtol`` (default: the larger of
    1e-9 and rtol; ties listed), by the
    differing shards of a Shard placement, and by the replicas that disagree.

    Raises what the step raises (with ``.rank``), and InvalidArgument naming
    the parameter, the rank and expected vs received when the gradients do
    not fit the placements or the reference.
    """
    factor_rtol = max(1e-9, rtol) if factor_rtol is None else factor_rtol
    names: List[str] = []
    for mesh in meshes:
        names += [n for n in mesh if n not in names]
    ref_dims = [(n, 1) for n in names]
    reference = {k: v[0] for k, v in _run(step, ref_dims, seed, schedule)[0].items()}
    out = []
    for mesh in meshes:
        dims = _dims(mesh, names)
        per_rank = _run(step, dims, seed, schedule)
        out.append(_core.sim.check_mesh(dims, per_rank, reference, rtol, factor_rtol))
    return EquivalenceReport(out)


__all__ = ["check_equivalence", "EquivalenceReport", "Replicate", "Shard", "Partial",
           "Placement", "ParamFinding", "MeshFindings"]

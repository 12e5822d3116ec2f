"""check_equivalence(..., torch_distributed=True): steps written with
torch.distributed, DTensor tensor parallelism and FSDP2 as users write them
(examples/python/equivalence/torch_steps.py), returned as modules, with every
placement read from the model. Expected values: the single-rank run of the
same step (the oracle's reference) and, for the planted bugs, the factor
worked out by hand in the step's docstring."""
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm
import diffcomm.sim as dsim

if int(torch.__version__.split(".")[0]) < 2:
    pytest.skip("torch.distributed in the simulated world needs torch >= 2",
                allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401 (torch >= 2.6)
except ImportError as e:
    pytest.skip(f"FSDP2 is not in this torch: {e}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                                "equivalence"))
from torch_steps import tp_mlp_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP2's view warning


def check(step, meshes, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dsim.check_equivalence(step, meshes, torch_distributed=True, **kw)


meshes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8])).filter(
    lambda m: m[0] * m[1] <= 8)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(meshes, st.integers(0, 2**16))
def test_fsdp2_tp_mlp_equals_one_rank(mesh, seed):
    dp, tp = mesh
    report = check(tp_mlp_step, [{"dp": dp, "tp": tp}], seed=seed)
    assert report.ok, str(report)
    for f in report.meshes[0].params:
        assert f.max_rel_error <= 1e-12
    # Placements came from the DTensors: FSDP2 over TP on the same dim is
    # torch's _StridedShard, read as tp first, then dp.
    placements = {f.name: f.placement_str for f in report.meshes[0].params}
    if dp > 1 and tp > 1:
        assert placements["0.weight"] == "[Shard(0, tp), Shard(0, dp)]"
        assert placements["2.weight"] == "[Shard(0, dp), Shard(1, tp)]"


def test_loss_times_tp_is_named_tp():
    report = check(functools.partial(tp_mlp_step, loss_times_tp=True),
                   [{"dp": 1, "tp": 4}, {"dp": 2, "tp": 2}])
    assert not report.ok
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        f = report.finding(0, name)
        assert f.factor == pytest.approx(4.0, rel=1e-12) and f.expressions == ["tp"], str(f)
    assert report.finding(1, "0.weight").expressions == ["dp", "tp"]  # a tie at dp = tp
    assert "0.weight: grad = 4.000 x reference = tp on mesh {dp: 1, tp: 4}" in str(report)


def test_fsdp2_sum_instead_of_average_is_named_dp():
    report = check(functools.partial(tp_mlp_step, fsdp_sum=True), [{"dp": 4, "tp": 2}])
    assert not report.ok
    for f in report.meshes[0].params:
        assert f.factor_fits and f.expressions == ["dp"], str(report)


def _two_branches(rank, mesh, seed):
    """Rank 1 never uses branch b: its gradient stays None there."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 1, dtype=torch.float64),
                                 "b": torch.nn.Linear(3, 1, dtype=torch.float64)})
    x = torch.ones(2, 3, dtype=torch.float64)
    y = model["a"](x) + (model["b"](x) if rank != 1 else 0)
    y.sum().backward()
    return model


def test_missing_gradient_on_a_rank_is_a_finding():
    report = check(_two_branches, [{"dp": 2}])
    assert not report.ok
    b = report.finding(0, "b.weight")
    assert b.missing_ranks == [1] and not b.ok
    assert report.finding(0, "a.weight").ok
    assert ("b.weight: no gradient (None) on ranks 1 of mesh {dp: 2}; the reference has one"
            in str(report))


def _replicated_sum(rank, mesh, seed):
    """w's gradient is each rank's partial sum (never all-reduced): Partial(dp)."""
    w = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    torch.nn.init.ones_(w.weight)
    k, n = mesh["dp"].get_local_rank(), mesh["dp"].size()
    x = torch.arange(8, dtype=torch.float64).reshape(4, 2)[k * 4 // n:(k + 1) * 4 // n]
    w(x).sum().backward()
    return w


def test_explicit_placements_override_what_the_model_says():
    wrong = check(_replicated_sum, [{"dp": 2}])  # read as Replicate: replicas differ
    assert wrong.finding(0, "weight").divergent_ranks == [1]
    right = check(_replicated_sum, [{"dp": 2}], placements={"weight": dsim.Partial("dp")})
    assert right.ok, str(right)
    with pytest.raises(diffcomm.InvalidArgument, match=r"placements names \['bias'\], not "
                       r"trainable parameters of the module on rank 0"):
        check(_replicated_sum, [{"dp": 2}], placements={"bias": dsim.Replicate()})
    with pytest.raises(diffcomm.InvalidArgument, match="torch_distributed=True"):
        dsim.check_equivalence(_replicated_sum, [{"dp": 2}], placements={"weight": None})


def test_step_receives_a_named_torch_device_mesh():
    def step(rank, mesh, seed):
        # The mesh's dims in its order, then the other meshes' dims at size 1.
        names = mesh.mesh_dim_names
        assert names in (("tp", "dp"), ("dp", "tp")), names
        assert mesh["dp"].size() == 1 and mesh["tp"].size() == mesh.size()
        w = torch.ones(1, dtype=torch.float64, requires_grad=True)
        w.sum().backward()
        return {"w": (w.grad, dsim.Replicate())}

    assert check(step, [{"tp": 2}, {"dp": 1}]).ok


def test_rank_processes_after_a_dtensor_backward_in_this_process_say_why_they_fail():
    # torch refuses autograd in a fork of a process whose autograd engine
    # started device threads (a DTensor backward does): the rank's error says
    # what happened and what to do. A subprocess keeps this test's process clean.
    code = """if True:
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, sys.argv[1])
        import diffcomm.sim as dsim
        from torch_steps import tp_mlp_step
        mesh = [{"dp": 1, "tp": 2}]
        dsim.check_equivalence(tp_mlp_step, mesh, torch_distributed=True, isolation="thread")
        try:
            dsim.check_equivalence(tp_mlp_step, mesh, torch_distributed=True)
        except RuntimeError as e:
            print("\\n".join(getattr(e, "__notes__", [])[-1:]))
    """
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                            "equivalence")
    out = subprocess.run([sys.executable, "-c", code, examples], capture_output=True,
                         text=True, timeout=300)
    assert "Run the process-isolation steps before any such backward" in out.stdout, \
        out.stdout + out.stderr[-2000:]


def test_the_readme_example(readme_code):
    # README.md, "Check your step against one rank": its code block as written.
    scope = {}
    exec(readme_code("Check your step against one rank"), scope)  # noqa: S102
    assert str(scope["report"]).splitlines() == [
        f"{name}: grad = 2.000 x reference = tp on mesh {{tp: 2}}"
        for name in ("0.bias", "0.weight", "2.bias", "2.weight")]


def _main_grad_step(rank, mesh, seed, twice=False):
    """Gradients accumulated into main_grad (Megatron's DDP buffer) and
    summed over dp there, .grad left None, as Megatron's DDP leaves them."""
    w = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    torch.nn.init.ones_(w.weight)
    k, n = mesh["dp"].get_local_rank(), mesh["dp"].size()
    x = torch.arange(8, dtype=torch.float64).reshape(4, 2)[k * 4 // n:(k + 1) * 4 // n]
    w(x).sum().backward()
    w.weight.main_grad = w.weight.grad.clone()
    w.weight.grad = None
    for _ in range(2 if twice else 1):
        torch.distributed.all_reduce(w.weight.main_grad, group=mesh["dp"].get_group())
    return w


def test_main_grad_is_read_when_set():
    assert check(_main_grad_step, [{"dp": 2}, {"dp": 4}]).ok
    twice = check(functools.partial(_main_grad_step, twice=True), [{"dp": 4}])
    assert twice.finding(0, "weight").expressions == ["dp"]  # summed twice: dp x

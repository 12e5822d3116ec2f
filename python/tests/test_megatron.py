"""Real trainer code in the simulated world: megatron-core's public API, unmodified.

megatron-core keeps its process groups, its global memory buffer and its RNG
tracker in module globals, as trainers written for torchrun do. Each test
runs it with the default isolation (rank processes) and ``cuda="cpu"``
(megatron allocates with ``device=torch.cuda.current_device()``) against a
single-rank float64 reference or a closed form. The same programs on rank
threads must fail or be refused (``test_*_under_threads``): the suite shows
the difference process isolation makes.

Skipped, with the reason, where megatron-core cannot be imported
(scripts/test-python installs it into the PyPI-torch venv).
"""
import functools
import os
import signal
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if int(torch.__version__.split(".")[0]) < 2:
    pytest.skip("torch.distributed in the simulated world needs torch >= 2", allow_module_level=True)
try:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import mappings
except Exception as e:  # noqa: BLE001 (any import failure: the reason is reported)
    pytest.skip(f"megatron-core cannot be imported here: {type(e).__name__}: {e}",
                allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import diffcomm  # noqa: E402
import diffcomm.sim as sim  # noqa: E402


def run(n, fn, **kw):
    return sim.run(n, fn, torch_distributed=True, cuda="cpu", **kw)


# ------------------------------------------------------------ parallel_state
def _groups(rank, _):
    ps.initialize_model_parallel(4, 2)
    out = {}
    for name, group in (("tp", ps.get_tensor_model_parallel_group()),
                        ("pp", ps.get_pipeline_model_parallel_group()),
                        ("dp", ps.get_data_parallel_group())):
        t = torch.tensor([float(rank)], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        out[name] = (t.item(), sorted(dist.get_process_group_ranks(group)))
    out["ranks"] = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_data_parallel_rank())
    ps.destroy_model_parallel()
    return out


def test_initialize_model_parallel_then_collectives_on_every_group():
    res = run(8, _groups).results
    for rank, out in enumerate(res):
        tp, pp = rank % 4, rank // 4  # megatron's order: tp fastest, then dp, then pp
        assert out["ranks"] == (tp, pp, 0)
        members = out["tp"][1]
        assert members == [pp * 4 + i for i in range(4)]
        assert out["tp"][0] == sum(members)
        assert out["pp"] == (float(tp + tp + 4), [tp, tp + 4])
        assert out["dp"] == (float(rank), [rank])  # tp 4 x pp 2 at world 8: dp 1


def _under_threads():
    """The same program on rank threads; what it raised, as text."""
    try:
        sim.run(8, _groups, torch_distributed=True, isolation="thread")
    except Exception as e:  # noqa: BLE001 (the failure is the result)
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_initialize_model_parallel_under_threads():
    # Rank threads share megatron's module globals: the last rank to write
    # them wins, and rank 0 then calls collectives on ranks 4-7's group.
    # (Run inside a one-rank process, so the globals the threads leave behind
    # die with it instead of reaching the next test's rank processes.)
    text = sim.run(1, lambda r, g: _under_threads()).results[0]
    assert "rank threads share module globals" in text, text
    assert "isolation='process'" in text, text


# ------------------------------------------------------------ mappings
def _mappings(rank, _, tp):
    ps.initialize_model_parallel(tp, 1)
    t = ps.get_tensor_model_parallel_rank()
    out = {}

    def fwd_bwd(name, f, x, cot):
        x = x.clone().requires_grad_()
        y = f(x)
        (y * cot).sum().backward()
        out[name] = (y.detach().clone(), x.grad.clone())

    base = torch.arange(2 * tp * 3, dtype=torch.float64).reshape(2 * tp, 3)
    mine = base + 100 * t  # differs by tp rank
    fwd_bwd("copy", mappings.copy_to_tensor_model_parallel_region, mine, torch.ones(2 * tp, 3))
    fwd_bwd("reduce", mappings.reduce_from_tensor_model_parallel_region, mine,
            torch.full((2 * tp, 3), float(t + 1)))
    wide = torch.arange(2 * 4 * tp, dtype=torch.float64).reshape(2, 4 * tp)
    fwd_bwd("scatter", mappings.scatter_to_tensor_model_parallel_region, wide,
            torch.full((2, 4), float(t + 1)))
    fwd_bwd("gather", mappings.gather_from_tensor_model_parallel_region, mine[:, :2],
            torch.ones(2 * tp, 2 * tp))
    fwd_bwd("sp_scatter", mappings.scatter_to_sequence_parallel_region, base,
            torch.full((2, 3), float(t + 1)))
    fwd_bwd("sp_gather", mappings.gather_from_sequence_parallel_region, mine,
            torch.full((2 * tp * tp, 3), 1.0))
    fwd_bwd("sp_reduce_scatter", mappings.reduce_scatter_to_sequence_parallel_region, mine,
            torch.full((2, 3), float(t + 1)))
    ps.destroy_model_parallel()
    return t, out


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_mappings_closed_form(tp):
    base = torch.arange(2 * tp * 3, dtype=torch.float64).reshape(2 * tp, 3)
    wide = torch.arange(2 * 4 * tp, dtype=torch.float64).reshape(2, 4 * tp)
    total = sum(base + 100 * r for r in range(tp))  # the all-reduce of `mine`
    for t, out in run(4, lambda r, g: _mappings(r, g, tp)).results:
        mine = base + 100 * t
        y, dx = out["copy"]  # identity forward, all-reduce backward
        assert torch.equal(y, mine) and torch.equal(dx, torch.full_like(mine, float(tp)))
        y, dx = out["reduce"]  # all-reduce forward, identity backward
        assert torch.equal(y, total) and torch.equal(dx, torch.full_like(mine, float(t + 1)))
        y, dx = out["scatter"]  # last-dim split forward, all-gather backward
        assert torch.equal(y, wide[:, 4 * t:4 * t + 4])
        assert torch.equal(dx, torch.arange(1, tp + 1, dtype=torch.float64)
                           .repeat_interleave(4).expand(2, 4 * tp))
        y, dx = out["gather"]  # last-dim all-gather forward, split backward
        assert torch.equal(y, torch.cat([(base + 100 * r)[:, :2] for r in range(tp)], dim=1))
        assert torch.equal(dx, torch.ones(2 * tp, 2))
        y, dx = out["sp_scatter"]  # first-dim split forward, all-gather backward
        assert torch.equal(y, base[2 * t:2 * t + 2])
        assert torch.equal(dx, torch.arange(1, tp + 1, dtype=torch.float64)
                           .repeat_interleave(2)[:, None].expand(2 * tp, 3))
        y, dx = out["sp_gather"]  # first-dim all-gather forward, reduce-scatter backward
        assert torch.equal(y, torch.cat([base + 100 * r for r in range(tp)]))
        assert torch.equal(dx, torch.full_like(mine, float(tp)))
        y, dx = out["sp_reduce_scatter"]  # reduce-scatter forward, all-gather backward
        assert torch.equal(y, total[2 * t:2 * t + 2])
        assert torch.equal(dx, torch.arange(1, tp + 1, dtype=torch.float64)
                           .repeat_interleave(2)[:, None].expand(2 * tp, 3))


# ------------------------------------------------------------ parallel linears
S, B, H, F = 8, 2, 6, 8


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(F, H, generator=g, dtype=torch.float64),
            torch.randn(H, F, generator=g, dtype=torch.float64))


def _data(seed, dp_rank):
    g = torch.Generator().manual_seed(1000 + 10 * seed + dp_rank)
    return (torch.randn(S, B, H, generator=g, dtype=torch.float64),
            torch.randn(S, B, H, generator=g, dtype=torch.float64))


def _reference(seed, dp_rank):
    """One rank, float64: Y = gelu(X W1^T) W2^T, loss = sum(Y * C)."""
    w1, w2 = (w.requires_grad_() for w in _weights(seed))
    x, c = _data(seed, dp_rank)
    y = torch.nn.functional.gelu(x @ w1.t()) @ w2.t()
    (y * c).sum().backward()
    return w1.grad, w2.grad


def _mlp(rank, _, tp, seed, sequence_parallel):
    """ColumnParallelLinear -> GELU -> RowParallelLinear; relative error of
    this rank's weight-gradient shards against the reference."""
    ps.initialize_model_parallel(tp, 1)
    t, d = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                              use_cpu_initialization=True, params_dtype=torch.float64)
    col = mtp.ColumnParallelLinear(H, F, config=cfg, init_method=lambda w: w, bias=False,
                                   gather_output=False)
    row = mtp.RowParallelLinear(F, H, config=cfg, init_method=lambda w: w, bias=False,
                                input_is_parallel=True, skip_bias_add=True)
    w1, w2 = _weights(seed)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(tp, 0)[t])
        row.weight.copy_(w2.chunk(tp, 1)[t])
    x, c = _data(seed, d)
    if sequence_parallel:  # the sequence is split over the TP group
        x, c = x.chunk(tp, 0)[t], c.chunk(tp, 0)[t]
    h, _ = col(x.clone().requires_grad_())
    y, _ = row(torch.nn.functional.gelu(h))
    (y * c).sum().backward()
    g1, g2 = _reference(seed, d)
    ps.destroy_model_parallel()
    return max(((col.weight.grad - g1.chunk(tp, 0)[t]).abs().max() / g1.abs().max()).item(),
               ((row.weight.grad - g2.chunk(tp, 1)[t]).abs().max() / g2.abs().max()).item())


@pytest.mark.parametrize("tp,dp", [(2, 4), (4, 2)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_linears_give_the_single_rank_gradients(tp, dp, sequence_parallel):
    for seed in range(10):
        res = run(tp * dp, lambda r, g: _mlp(r, g, tp, seed, sequence_parallel), seed=seed)
        assert max(res.results) < 1e-13, (seed, res.results)


def test_cuda_calls_are_refused_under_threads():
    with pytest.raises(diffcomm.InvalidArgument, match="needs isolation='process'"):
        sim.run(2, lambda r, g: _mlp(r, g, 2, 0, True), torch_distributed=True, cuda="cpu",
                isolation="thread")


# ------------------------------------------------------------ RNG, failures
def test_manual_seed_then_draws_are_identical_on_every_rank():
    def fn(rank, _):
        ps.initialize_model_parallel(2, 1)
        torch.manual_seed(1234)
        torch.cuda.manual_seed(1234)
        dist.barrier()
        draw = torch.rand(4, device="cuda").tolist()
        ps.destroy_model_parallel()
        return draw

    draws = run(4, fn).results
    assert all(d == draws[0] for d in draws)
    torch.manual_seed(1234)
    assert draws[0] == torch.rand(4).tolist()  # "cuda" draws come from the CPU generator


def test_a_rank_process_killed_mid_collective_is_a_rank_failure():
    def fn(rank, _):
        ps.initialize_model_parallel(2, 1)
        x = torch.ones(4, dtype=torch.float64)
        if rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        mappings.reduce_from_tensor_model_parallel_region(x)
        dist.all_reduce(x)

    with pytest.raises(diffcomm.RankFailure, match=r"rank 3's process .*SIGKILL") as info:
        run(4, fn)
    assert info.value.rank == 3
    assert all(isinstance(e, diffcomm.RankFailure) for e in info.value.rank_errors)


def test_the_readme_example(readme_code):
    # README.md, "Test your torch.distributed code": its code block as written.
    scope = {}
    exec(readme_code("Test your torch.distributed code"), scope)  # noqa: S102
    assert [t.tolist() for t in scope["out"]] == [[6.0, 6.0]] * 4 + [[22.0, 22.0]] * 4


# ------------------------------------------------------------ the oracle on Megatron steps
# examples/python/equivalence/megatron_steps.py: a Megatron block as users
# write it, returned as a module; placements read from Megatron's attributes.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python",
                                "equivalence"))
from megatron_steps import megatron_step  # noqa: E402

megatron_meshes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8])).filter(
    lambda m: m[0] * m[1] <= 8)


def _judge(meshes, seed=0, **kw):
    return sim.check_equivalence(functools.partial(megatron_step, **kw), meshes, seed=seed,
                                 torch_distributed=True, cuda="cpu")


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(megatron_meshes, st.integers(0, 2**16), st.booleans())
def test_megatron_block_equals_one_rank(mesh, seed, sequence_parallel):
    dp, tp = mesh
    report = _judge([{"dp": dp, "tp": tp}], seed, sequence_parallel=sequence_parallel)
    assert report.ok and max(f.max_rel_error for f in report.meshes[0].params) <= 1e-12, \
        str(report)
    placements = {f.name: f.placement_str for f in report.meshes[0].params}
    sp = sequence_parallel and tp > 1  # the step runs without SP at tp 1 (the reference too)
    assert placements == {"pre.weight": "Partial(tp)" if sp else "Replicate()",
                          "col.weight": "Shard(0, tp)", "row.weight": "Shard(1, tp)"}


def test_row_parallel_that_forgets_its_all_reduce_is_flagged():
    report = _judge([{"dp": 2, "tp": 2}])
    bad = _judge([{"dp": 2, "tp": 2}], bug="row_forgets_all_reduce")
    assert report.ok and not bad.ok
    for name in ("pre.weight", "col.weight", "row.weight"):
        f = bad.finding(0, name)
        assert not f.ok and not f.factor_fits, str(bad)


def test_loss_averaged_over_tp_is_one_over_tp():
    report = _judge([{"dp": 1, "tp": 4}, {"dp": 2, "tp": 4}], bug="loss_averaged_over_tp")
    for i in (0, 1):
        for f in report.meshes[i].params:
            assert f.factor == pytest.approx(0.25, rel=1e-12) and f.expressions == ["1/tp"]


def test_megatron_5337_non_contiguous_reduce_is_flagged_and_its_fix_passes():
    # NVIDIA/Megatron-LM#5337: _reduce all-reduces input_.contiguous() and
    # returns input_; the replicated layer before the column-parallel one
    # keeps each TP rank's own partial gradient.
    bad = _judge([{"dp": 2, "tp": 2}, {"dp": 1, "tp": 4}], bug="transposed_copy")
    assert not bad.ok
    assert [f.name for m in bad.meshes for f in m.params if not f.ok] == ["pre.weight"] * 2
    assert bad.finding(0, "pre.weight").divergent_ranks == [1, 3]  # tp rank 1 of each dp
    assert bad.finding(1, "pre.weight").divergent_ranks == [1, 2, 3]
    assert ("pre.weight: replicas differ (Replicate()): ranks 1, 3 disagree with their first "
            "replica on mesh {dp: 2, tp: 2}") in str(bad)
    fixed = _judge([{"dp": 2, "tp": 2}, {"dp": 1, "tp": 4}], bug="transposed_copy",
                   fix_5337=True)
    assert fixed.ok, str(fixed)

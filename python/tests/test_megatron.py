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
import os
import signal

import pytest

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


def test_the_readme_example():
    # README.md, "Test your torch.distributed code": its code block as written.
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Test your torch.distributed code"):]
    start = section.index("```python\n") + 10
    code = section[start:section.index("\n```", start)]
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the README's own code)
    assert [t.tolist() for t in scope["out"]] == [[6.0, 6.0]] * 4 + [[22.0, 22.0]] * 4

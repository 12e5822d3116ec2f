"""Unmodified torch.distributed code in the simulated world (the c10d backend
"diffcomm_sim", diffcomm/sim/_c10d_backend.py): every op against closed forms at worlds
1, 3 and 4, mismatches and deadlocks reported on every rank, seeded trace
hashes, the functional collectives, and Megatron-style tensor-parallel mappings
against a single-rank float64 reference."""
import math
import os

import pytest
import torch

import diffcomm
import diffcomm.sim as sim

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
needs_torch2 = pytest.mark.skipif(not TORCH2, reason="the c10d backend needs torch >= 2")

if TORCH2:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

WORLDS = [1, 3, 4, 8]  # the 1, 3, 4 and c10d's usual 8


def run(n, fn, seed=0, **kw):
    """fn() in every rank of an n-rank world with torch.distributed initialised."""
    return sim.run(n, lambda rank, group: fn(rank), seed=seed, torch_distributed=True, **kw)


@pytest.mark.skipif(TORCH2, reason="checks the refusal on torch 1.x")
def test_old_torch_refused_naming_the_version():
    with pytest.raises(diffcomm.InvalidArgument, match=r"torch >= 2\.0"):
        sim.run(1, lambda rank, group: None, torch_distributed=True)


# ----------------------------------------------------------------- values
@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
def test_rank_size_and_default_group(n):
    res = run(n, lambda r: (dist.get_rank(), dist.get_world_size(),
                            dist.get_backend(), dist.is_initialized()))
    assert res.results == [(r, n, "diffcomm_sim", True) for r in range(n)]


@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"])
def test_all_reduce_ops(n, op):
    def fn(r):
        t = torch.tensor([r + 1.0, 2.0 * (r + 1)], dtype=torch.float64)
        red = dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
        dist.all_reduce(t, op=red)
        return t.tolist()

    s = n * (n + 1) / 2
    expected = {"SUM": [s, 2 * s], "AVG": [s / n, 2 * s / n],
                "PRODUCT": [math.factorial(n), math.factorial(n) * 2 ** n],
                "MIN": [1.0, 2.0], "MAX": [n, 2.0 * n], "PREMUL_SUM": [0.5 * s, s]}[op]
    for got in run(n, fn).results:
        assert got == pytest.approx(expected, rel=1e-12)


@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
def test_broadcast_reduce_async(n):
    def fn(r):
        b = torch.full((2, 2), float(r))
        dist.broadcast(b, src=n - 1)
        x = torch.tensor([float(r + 1)])
        dist.reduce(x, dst=n - 1)
        w = dist.all_reduce(torch.ones(3), async_op=True)
        w.wait()
        dist.barrier()
        return b.unique().item(), x.item(), w.is_completed()

    for r, (b, x, done) in enumerate(run(n, fn).results):
        assert b == n - 1 and done
        assert x == (n * (n + 1) / 2 if r == n - 1 else r + 1)  # non-root: unchanged


@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
def test_gathers(n):
    def fn(r):
        mine = torch.tensor([[r, 10.0 * r]])                          # (1, 2)
        outs = [torch.zeros(1, 2) for _ in range(n)]
        dist.all_gather(outs, mine)
        flat = torch.zeros(n, 2)
        dist.all_gather_into_tensor(flat, mine)
        uneven = [torch.zeros(s + 1) for s in range(n)]              # rank s sends s+1 values
        dist.all_gather(uneven, torch.full((r + 1,), float(r)))
        g = [torch.zeros(1, 2) for _ in range(n)] if r == 0 else None
        dist.gather(mine, g, dst=0)
        return torch.cat(outs), flat, torch.cat(uneven), g and torch.cat(g)

    rows = torch.tensor([[s, 10.0 * s] for s in range(n)])
    uneven = torch.cat([torch.full((s + 1,), float(s)) for s in range(n)])
    for r, (outs, flat, unev, g) in enumerate(run(n, fn).results):
        assert torch.equal(outs, rows) and torch.equal(flat, rows) and torch.equal(unev, uneven)
        assert (g is None) == (r != 0) and (r != 0 or torch.equal(g, rows))


@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
def test_scatter_and_reduce_scatters(n):
    def fn(r):
        out = torch.zeros(2)
        src = [torch.tensor([s, -s], dtype=torch.float32) for s in range(n)] if r == 0 else None
        dist.scatter(out, src, src=0)
        rs = torch.zeros(2)
        dist.reduce_scatter(rs, [torch.full((2,), 100.0 * r + s) for s in range(n)])
        rst = torch.zeros(1)
        dist.reduce_scatter_tensor(rst, torch.arange(float(n)) + r)
        return out.tolist(), rs.tolist(), rst.item()

    total_r = sum(100.0 * s for s in range(n))
    for r, (out, rs, rst) in enumerate(run(n, fn).results):
        assert out == [r, -r]
        assert rs == [total_r + n * r] * 2                            # sum_s (100 s + r)
        assert rst == n * r + n * (n - 1) / 2                         # sum_s (r + s)


@needs_torch2
@pytest.mark.parametrize("n", [3, 4])
def test_uneven_reduce_scatter(n):
    # Output s has s + 1 elements (gloo runs this; each rank's list has the
    # same sizes): rank s gets sum over ranks r of (10 r + i), i < s + 1.
    def fn(r):
        out = torch.zeros(r + 1)
        dist.reduce_scatter(out, [torch.arange(float(s + 1)) + 10.0 * r for s in range(n)])
        return out.tolist()

    for s, out in enumerate(run(n, fn).results):
        assert out == [n * i + 10.0 * n * (n - 1) / 2 for i in range(s + 1)]


def _a2a_split(i, j):
    """Rows rank i sends to rank j: uneven, with zeros."""
    return (i + 2 * j) % 3


def _a2a_rows(i, j):
    return [100.0 * i + 10 * j + k for k in range(_a2a_split(i, j))]


@needs_torch2
@pytest.mark.parametrize("n", WORLDS)
def test_all_to_all(n):
    def fn(r):
        ins = [_a2a_split(r, j) for j in range(n)]
        outs = [_a2a_split(i, r) for i in range(n)]
        x = torch.tensor(sum((_a2a_rows(r, j) for j in range(n)), [])).reshape(-1, 1).repeat(1, 2)
        y = torch.zeros(sum(outs), 2)
        dist.all_to_all_single(y, x, outs, ins)
        even = torch.zeros(n * 2)
        dist.all_to_all_single(even, torch.arange(n * 2.0) + 100 * r)
        lst = [torch.zeros(1) for _ in range(n)]
        dist.all_to_all(lst, [torch.tensor([10.0 * r + j]) for j in range(n)])
        return y, even.tolist(), torch.cat(lst).tolist()

    for r, (y, even, lst) in enumerate(run(n, fn).results):
        want = torch.tensor(sum((_a2a_rows(i, r) for i in range(n)), []))
        assert torch.equal(y, want.reshape(-1, 1).repeat(1, 2))
        assert even == [100.0 * i + 2 * r + k for i in range(n) for k in range(2)]
        assert lst == [10.0 * i + r for i in range(n)]


@needs_torch2
def test_new_group_and_subgroups_take_global_ranks():
    def fn(r):
        g = dist.new_group([0, 2])
        x = torch.tensor([float(r)])
        if r in (0, 2):
            dist.broadcast(x, src=2, group=g)                        # global rank 2
            dist.all_reduce(x, group=g)
        sub, _ = dist.new_subgroups(2)                               # {0,1} and {2,3}
        y = torch.tensor([float(r)])
        dist.all_reduce(y, group=sub)
        return x.item(), y.item(), dist.get_rank(sub)

    res = run(4, fn).results
    assert [x for x, _, _ in res] == [4.0, 1.0, 4.0, 3.0]
    assert [y for _, y, _ in res] == [1.0, 1.0, 5.0, 5.0]
    assert [g for _, _, g in res] == [0, 1, 0, 1]


@needs_torch2
def test_init_barrier_refused_not_hung(monkeypatch):
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    with pytest.raises(diffcomm.InvalidArgument, match="TORCH_DIST_INIT_BARRIER"):
        run(2, lambda r: None)


@needs_torch2
@pytest.mark.parametrize("n", [2, 3, 4])
def test_point_to_point(n):
    # Hand-computed: a blocking ring (even ranks send first), a symmetric
    # isend/irecv exchange waited after posting, batch_isend_irecv the other
    # way round, a tagged pair, and a non-contiguous recv buffer; then a
    # collective on the same group.
    def fn(r):
        nxt, prv = (r + 1) % n, (r - 1) % n
        x = torch.full((3,), float(r))
        ring = torch.empty(3)
        if r % 2 == 0 and r != n - 1:
            dist.send(x, nxt)
            dist.recv(ring, prv)
        else:
            dist.recv(ring, prv)
            dist.send(x, nxt)
        z = torch.empty(3)
        for w in [dist.isend(x * 10, nxt), dist.irecv(z, prv)]:
            w.wait()
        b = torch.empty(3)
        ops = [dist.P2POp(dist.isend, x * 100, prv), dist.P2POp(dist.irecv, b, nxt)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        strided = torch.zeros(3, 2)
        reqs = [dist.irecv(strided[:, 1], prv, tag=7), dist.isend(x + 1, nxt, tag=7)]
        for w in reqs:
            w.wait()
        total = x.clone()
        dist.all_reduce(total)
        return ring, z, b, strided, total

    for r, (ring, z, b, strided, total) in enumerate(run(n, fn)):
        prv, nxt = (r - 1) % n, (r + 1) % n
        assert ring.tolist() == [float(prv)] * 3
        assert z.tolist() == [10.0 * prv] * 3
        assert b.tolist() == [100.0 * nxt] * 3
        assert strided[:, 1].tolist() == [prv + 1.0] * 3 and strided[:, 0].tolist() == [0.0] * 3
        assert total.tolist() == [float(sum(range(n)))] * 3


@needs_torch2
def test_point_to_point_misuse_is_reported_not_hung():
    def both_send_first(r):  # safe only on a buffering transport: a hang on NCCL
        dist.send(torch.ones(4), 1 - r)
        dist.recv(torch.empty(4), 1 - r)

    with pytest.raises(diffcomm.Deadlock):
        run(2, both_send_first)

    def size_differs(r):
        if r == 0:
            dist.send(torch.ones(4), 1)
        else:
            dist.recv(torch.empty(5), 0)

    with pytest.raises(diffcomm.CollectiveMismatch):
        run(2, size_differs)

    def never_received(r):
        if r == 0:
            dist.isend(torch.ones(2), 1).wait()

    with pytest.raises((diffcomm.Deadlock, diffcomm.RankFailure)):
        run(2, never_received)


# ------------------------------------------------------ reports, not hangs
def _errors(excinfo):
    return excinfo.value.rank_errors


@needs_torch2
def test_broadcast_against_all_reduce_is_a_mismatch_on_every_rank():
    def fn(r):
        t = torch.ones(2)
        if r == 1:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)

    with pytest.raises(diffcomm.CollectiveMismatch) as e:
        run(4, fn)
    assert all(isinstance(x, diffcomm.CollectiveMismatch) for x in _errors(e))
    text = str(e.value)
    assert "broadcast" in text and "all_reduce" in text and "op differs" in text
    assert "torch.distributed.broadcast on the group of global ranks [0, 1, 2, 3]" in \
        str(_errors(e)[1])


@needs_torch2
def test_mismatch_in_a_subgroup_names_the_torch_call_and_global_ranks():
    def fn(r):
        g = dist.new_group([1, 3])
        if r == 1:
            dist.all_reduce(torch.ones(2), group=g)
        elif r == 3:
            dist.all_gather_into_tensor(torch.zeros(4), torch.ones(2), group=g)

    with pytest.raises(diffcomm.CollectiveMismatch) as e:
        run(4, fn)
    errors = _errors(e)
    assert errors[0] is None and errors[2] is None
    assert "torch.distributed.all_reduce on the group of global ranks [1, 3]" in str(errors[1])
    assert "torch.distributed.all_gather_into_tensor on the group of global ranks [1, 3] " \
        "(group rank 1)" in str(errors[3])


@needs_torch2
def test_different_tensor_size_is_a_mismatch_on_every_rank():
    def fn(r):
        dist.all_reduce(torch.ones(3 if r == 3 else 2))

    with pytest.raises(diffcomm.CollectiveMismatch) as e:
        run(4, fn)
    assert all(isinstance(x, diffcomm.CollectiveMismatch) for x in _errors(e))
    assert "rank 3" in str(e.value)


@needs_torch2
def test_skipped_collective_is_a_deadlock_report():
    def fn(r):
        if r != 3:  # rank 3 skips it and ends
            dist.all_reduce(torch.ones(2))  # the-users-line

    with pytest.raises(diffcomm.Deadlock) as e:
        run(4, fn)
    errors = _errors(e)
    assert all(isinstance(x, diffcomm.Deadlock) for x in errors[:3]) and errors[3] is None
    report = str(e.value)
    here = os.path.abspath(__file__)
    with open(here) as f:
        line = next(i for i, text in enumerate(f, 1)
                    if "# the-users-line" in text and "next(" not in text)
    for r in range(3):
        assert f"rank {r}: waiting in all_reduce" in report, report
    # the user's line, through torch.distributed and diffcomm's c10d backend
    assert report.count(f" at {here}:{line}\n") == 3, report
    assert "rank 3: finished" in report
    # ... and every rank's pending call in torch's terms, on every raising rank
    for err in errors[:3]:
        text = str(err)
        torch_part = text.split("pending torch.distributed calls:\n", 1)[1]
        for r in range(3):
            assert (f"rank {r}: torch.distributed.all_reduce on the group of global ranks "
                    f"[0, 1, 2, 3]") in torch_part, text
        assert "rank 3: no torch.distributed call (finished or elsewhere)" in torch_part, text

    def gather_vs_skip(r):  # the torch name, not diffcomm's (all_gather_single)
        if r < 2:
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))

    with pytest.raises(diffcomm.Deadlock) as e:
        run(3, gather_vs_skip)
    assert "rank 1: torch.distributed.all_gather_into_tensor" in str(e.value), str(e.value)


def _train(rank, early_stop_rank=None):
    """An ordinary data-parallel loop at any world size: average the gradient,
    step, and gather every rank's last loss at the end. Rank early_stop_rank
    leaves the loop one step early: the bug under test."""
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    x = torch.arange(3.0, dtype=torch.float64) + rank
    loss = None
    for step in range(3):
        if rank == early_stop_rank and step == 2:
            break
        loss = ((w * x).sum() - 1.0) ** 2
        w.grad = None
        loss.backward()
        dist.all_reduce(w.grad, op=dist.ReduceOp.AVG)
        with torch.no_grad():
            w -= 0.01 * w.grad
    losses = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    dist.all_gather_into_tensor(losses, loss.detach().reshape(1))
    return w.detach(), losses


@needs_torch2
def test_data_parallel_loop_at_world_8_and_its_bug_reported_on_every_rank():
    xs = [torch.arange(3.0, dtype=torch.float64) + r for r in range(8)]
    w, last = torch.zeros(3, dtype=torch.float64), None
    for _ in range(3):  # the single-process reference: the mean of the 8 gradients
        last = torch.stack([((w * x).sum() - 1.0) ** 2 for x in xs])
        w = w - 0.01 * torch.stack([2 * ((w * x).sum() - 1.0) * x for x in xs]).mean(0)
    for got_w, losses in run(8, _train, seed=3).results:
        torch.testing.assert_close(got_w, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(losses, last, rtol=1e-12, atol=1e-12)
    with pytest.raises(diffcomm.CollectiveMismatch) as e:
        run(8, lambda r: _train(r, early_stop_rank=5), seed=3)
    assert all(isinstance(x, diffcomm.CollectiveMismatch) for x in _errors(e))
    assert "all_reduce" in str(e.value) and "all_gather_single" in str(e.value)


@needs_torch2
def test_a_rank_that_raises_releases_the_others():
    def fn(r):
        if r == 2:
            raise ValueError("boom on 2")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(ValueError, match="boom on 2") as e:
        run(3, fn)
    assert isinstance(_errors(e)[0], diffcomm.RankFailure)
    assert "boom on 2" in str(_errors(e)[0])


@needs_torch2
def test_fault_injection_reaches_torch_code():
    def fn(r):
        for _ in range(3):
            dist.all_reduce(torch.ones(2))

    with pytest.raises(diffcomm.Error) as e:
        run(4, fn, seed=1, fault=(2, 2))
    assert "injected fault" in str(_errors(e)[2])
    assert all(isinstance(_errors(e)[r], diffcomm.RankFailure) for r in (0, 1, 3))


@needs_torch2
def test_torch_is_left_as_it_was():
    """Outside the rank threads, torch.distributed is untouched during and after a run."""
    from torch.distributed import distributed_c10d as c10d
    before = c10d._world
    seen = run(2, lambda r: dist.is_initialized()).results
    assert seen == [True, True]
    assert c10d._world is before and not dist.is_initialized()


@needs_torch2
def test_same_seed_same_trace_hash():
    def fn(r):
        t = torch.full((4,), float(r))
        for _ in range(3):
            dist.all_reduce(t)
            out = torch.zeros(4 * dist.get_world_size())
            dist.all_gather_into_tensor(out, t)
        return t.sum().item()

    a, b = run(4, fn, seed=7), run(4, fn, seed=7)
    assert a.trace_hash == b.trace_hash and a.results == b.results
    assert a.results[0] == 4 * (0 + 1 + 2 + 3) * 16



# ------------------------------------------------- functional collectives
def _funcol(name, old):
    """torch 2.15 renamed *_tensor to *_single (the old names warn): the newest one there is."""
    return getattr(funcol, name, None) or getattr(funcol, old)


@needs_torch2
def test_functional_collectives_and_their_autograd(n=4):
    def fn(r):
        g = dist.group.WORLD
        x = torch.tensor([r + 1.0, -(r + 1.0)], dtype=torch.float64)
        ar = funcol.all_reduce(x, "sum", g)
        ag = _funcol("all_gather_single", "all_gather_tensor")(x, 0, g)
        rs = _funcol("reduce_scatter_single", "reduce_scatter_tensor")(
            torch.arange(2.0 * n) + r, "sum", 0, g)
        x1 = x.clone().requires_grad_()       # L1 = sum_r w_r . all_gather(x)
        gather = _funcol("all_gather_single_autograd", "all_gather_tensor_autograd")
        (gather(x1, 0, g) * (r + 1) * torch.arange(2.0 * n)).sum().backward()
        x2 = torch.arange(2.0 * n, dtype=torch.float64).requires_grad_()
        scatter = _funcol("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd")
        y2 = scatter(x2, "sum", 0, g)
        (y2 * (r + 1) * torch.tensor([1.0, 2.0])).sum().backward()
        x3 = torch.zeros(n, dtype=torch.float64).requires_grad_()
        y3 = funcol.all_to_all_single_autograd(x3, None, None, g)
        (y3 * (torch.arange(n) + 10.0 * r)).sum().backward()
        return [t.wait() if hasattr(t, "wait") else t for t in (ar, ag, rs, y2)] + \
            [x1.grad, x2.grad, x3.grad]

    s = n * (n + 1) / 2
    for r, (ar, ag, rs, y2, g1, g2, g3) in enumerate(run(n, fn).results):
        assert ar.tolist() == [s, -s]
        assert ag.tolist() == sum(([k + 1.0, -(k + 1.0)] for k in range(n)), [])
        assert rs.tolist() == [n * (2 * r + i) + n * (n - 1) / 2 for i in range(2)]
        assert y2.tolist() == [n * (2 * r + i) for i in range(2)]
        assert g1.tolist() == [s * (2 * r + i) for i in range(2)]             # reduce_scatter(w)
        assert g2.tolist() == sum(([k + 1.0, 2 * (k + 1.0)] for k in range(n)), [])  # all_gather(c)
        assert g3.tolist() == [r + 10.0 * j for j in range(n)]               # v_j[r]


# ----------------------------------- Megatron-style tensor-parallel mappings
# Written as Megatron-Core writes them: plain torch.distributed calls inside
# torch.autograd.Function, the group passed in.
class _CopyToTP(torch.autograd.Function if TORCH2 else object):
    """Forward identity, backward all_reduce (copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function if TORCH2 else object):
    """Forward all_reduce, backward identity (reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _all_gather_dim0(x, group):
    out = torch.empty((dist.get_world_size(group) * x.shape[0],) + x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x, group):
    out = torch.empty((x.shape[0] // dist.get_world_size(group),) + x.shape[1:], dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherFromSP(torch.autograd.Function if TORCH2 else object):
    """gather_from_sequence_parallel_region: all_gather on dim 0, backward reduce_scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function if TORCH2 else object):
    """reduce_scatter_to_sequence_parallel_region: reduce_scatter on dim 0, backward all_gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_dim0(g, ctx.group), None


S, H, F = 8, 3, 16  # sequence, hidden, ffn: divisible by every tp size below


def _mlp_problem(dp_index):
    """X, W1, W2 and the output cotangent G of one data-parallel replica, float64."""
    gen = torch.Generator().manual_seed(1000 + dp_index)
    return [torch.randn(shape, generator=gen, dtype=torch.float64)
            for shape in ((S, H), (H, F), (F, H), (S, H))]


def _reference(dp_index):
    """Single-rank forward and gradients of L = <X W1 W2, G>."""
    X, W1, W2, G = [t.requires_grad_() for t in _mlp_problem(dp_index)]
    out = X @ W1 @ W2
    (out * G).sum().backward()
    return out.detach(), X.grad, W1.grad, W2.grad


def _tp_group(world, tp):
    return dist.group.WORLD if tp == world else dist.new_subgroups(tp)[0]


def _mlp_shards(rank, tp, sequence_parallel):
    X, W1, W2, G = _mlp_problem(rank // tp)
    t, s, f = rank % tp, S // tp, F // tp
    x = (X[t * s:(t + 1) * s] if sequence_parallel else X).clone().requires_grad_()
    w1 = W1[:, t * f:(t + 1) * f].clone().requires_grad_()
    w2 = W2[t * f:(t + 1) * f].clone().requires_grad_()
    return x, w1, w2, G[t * s:(t + 1) * s] if sequence_parallel else G


@needs_torch2
@pytest.mark.parametrize("world,tp", [(4, 4), (8, 8), (8, 4)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_mlp_matches_single_rank(world, tp, sequence_parallel):
    """Column- then row-parallel MLP. Without SP: copy_to / reduce_from; with SP:
    gather_from_sequence_parallel / reduce_scatter_to_sequence_parallel."""
    def fn(rank):
        group = _tp_group(world, tp)
        x, w1, w2, g = _mlp_shards(rank, tp, sequence_parallel)
        if sequence_parallel:
            out = _ReduceScatterToSP.apply(_GatherFromSP.apply(x, group) @ w1 @ w2, group)
        else:
            out = _ReduceFromTP.apply(_CopyToTP.apply(x, group) @ w1 @ w2, group)
        (out * g).sum().backward()
        return out.detach(), x.grad, w1.grad, w2.grad

    for rank, (out, gx, gw1, gw2) in enumerate(run(world, fn, seed=world + tp).results):
        ref_out, ref_x, ref_w1, ref_w2 = _reference(rank // tp)
        t, s, f = rank % tp, S // tp, F // tp
        rows = slice(t * s, (t + 1) * s) if sequence_parallel else slice(None)
        torch.testing.assert_close(out, ref_out[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, ref_x[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw1, ref_w1[:, t * f:(t + 1) * f], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw2, ref_w2[t * f:(t + 1) * f], rtol=1e-12, atol=1e-12)


# ------------------------------------------------- device mesh and DTensor
@needs_torch2
def test_init_device_mesh_2d_groups():
    def fn(r):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.tensor([float(r)])
        dist.all_reduce(x, group=mesh["tp"].get_group())
        y = torch.tensor([float(r)])
        dist.all_reduce(y, group=mesh["dp"].get_group())
        return x.item(), y.item()

    assert run(4, fn).results == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]


@needs_torch2
def test_dtensor_redistribute_and_backward(n=4):
    def fn(r):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (n,))
        full = torch.arange(16.0, dtype=torch.float64).reshape(8, 2)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        replicated = sharded.redistribute(mesh, [Replicate()])
        partial = DTensor.from_local(torch.arange(4.0) * (r + 1), mesh, [Partial()])
        x = distribute_tensor(full.clone(), mesh, [Shard(0)]).requires_grad_()
        w = torch.arange(16.0, dtype=torch.float64).reshape(8, 2) % 5
        (x.redistribute(mesh, [Replicate()]).to_local() * w).sum().backward()
        return (sharded.to_local(), replicated.to_local(), sharded.full_tensor(),
                partial.redistribute(mesh, [Replicate()]).to_local(),
                partial.redistribute(mesh, [Shard(0)]).to_local(), x.grad.full_tensor(), w)

    full = torch.arange(16.0, dtype=torch.float64).reshape(8, 2)
    s = n * (n + 1) / 2
    for r, (local, rep, whole, p_rep, p_shard, grad, w) in enumerate(run(n, fn).results):
        assert torch.equal(local, full[2 * r:2 * r + 2])
        assert torch.equal(rep, full) and torch.equal(whole, full)
        assert p_rep.tolist() == [s * k for k in range(4)]          # Partial -> Replicate: sum
        assert p_shard.tolist() == [s * r]                           # Partial -> Shard
        assert torch.equal(grad, w)                                  # cotangent, sliced back


@needs_torch2
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.15 deprecates the module
def test_torch_distributed_nn_functional(n=4):
    def fn(r):
        import torch.distributed.nn.functional as tnf
        x = torch.tensor([r + 1.0, 2.0], dtype=torch.float64, requires_grad=True)
        y = tnf.all_reduce(x)                                        # backward: all_reduce
        parts = tnf.all_gather(x)                                    # backward: reduce_scatter
        ((r + 1) * y.sum() + sum((k + 1) * p[0] for k, p in enumerate(parts))).backward()
        return y.detach().tolist(), x.grad.tolist()

    s = n * (n + 1) / 2
    for r, (y, g) in enumerate(run(n, fn).results):
        assert y == [s, 2.0 * n]
        # d/dx_r: sum_k (k+1) [1, 1] from all_reduce, plus sum_k (r+1) [1, 0] from the gathers
        assert g == [s + n * (r + 1), s]


# ------------------------------------------------- the documented example
@needs_torch2
def test_the_documented_example_passes():
    """docs/python.md, 'Test your torch.distributed code': its pytest file runs and passes."""
    pytest.importorskip("hypothesis")
    import os
    import re
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    with open(doc) as f:
        section = f.read().split("## Test your torch.distributed code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"__name__": "documented_example"}
    exec(compile(code, "docs/python.md (Test your torch.distributed code)", "exec"), namespace)
    namespace["test_tp_mlp_matches_single_rank"]()

"""diffcomm.torch over a production transport (MPI, or torch's gloo group
through the "torch" transport; see conftest.py) vs torch's differentiable
collectives (oracle.py: _functional_collectives where torch has them) on gloo in the same processes, vs closed forms, and vs the simulated world
bit for bit. Data and cotangents differ per rank (CASES.md 6)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist

import diffcomm
import diffcomm.torch as dt

import oracle  # noqa: I001 (this folder's module: pytest puts the folder on sys.path)

f64 = torch.float64


def rank():
    return tdist.get_rank()


def size():
    return tdist.get_world_size()


def data(*shape, salt=0):
    g = torch.Generator().manual_seed(1000 * rank() + salt)
    return torch.randint(-8, 9, shape, generator=g).to(f64)


def cot(*shape, salt=0):
    return data(*shape, salt=salt + 500)


def run_both(diffcomm_fn, torch_fn, inputs, cotangent_salt=0):
    """Values and input gradients of the same computation through diffcomm and torch."""
    out = []
    for fn in (diffcomm_fn, torch_fn):
        xs = [x.clone().requires_grad_() for x in inputs]
        ys = fn(*xs)
        ys = list(ys) if isinstance(ys, (tuple, list)) else [ys]
        loss = sum((y * cot(*y.shape, salt=cotangent_salt + k)).sum() for k, y in enumerate(ys))
        loss.backward()
        out.append(([y.detach() for y in ys], [x.grad for x in xs]))
    return out


def assert_same(a, b):
    (ya, ga), (yb, gb) = a, b
    assert len(ya) == len(yb)
    for u, v in zip(ya, yb):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)


def test_all_reduce_sum():
    assert_same(*run_both(lambda x: dt.all_reduce(x), lambda x: oracle.all_reduce(x), [data(3, 2)]))


def test_all_reduce_avg():
    # gloo has no AVG: the oracle is torch's differentiable SUM over N.
    assert_same(*run_both(lambda x: dt.all_reduce(x, tdist.ReduceOp.AVG),
                          lambda x: oracle.all_reduce(x) / size(), [data(5)]))


def test_broadcast_global_and_group_src():
    for src in range(size()):
        assert_same(*run_both(lambda x: dt.broadcast(x, src=src),
                              lambda x: oracle.broadcast(x, src), [data(4)]))
        assert_same(*run_both(lambda x: dt.broadcast(x, group_src=src),
                              lambda x: oracle.broadcast(x, src), [data(2, 2)]))


def test_in_place_forms_match_torch_distributed():
    # all_reduce_ / broadcast_ against torch.distributed's own in-place calls
    # on gloo, same data; float64 integer-valued data, so every op is exact.
    for op in (tdist.ReduceOp.SUM, tdist.ReduceOp.MAX, tdist.ReduceOp.MIN, tdist.ReduceOp.PRODUCT):
        x, t = data(3, 4), data(3, 4)
        assert dt.all_reduce_(x, op) is x
        tdist.all_reduce(t, op)
        torch.testing.assert_close(x, t, rtol=0, atol=0)
    for src in range(size()):
        x, t = data(5, salt=src), data(5, salt=src)
        dt.broadcast_(x, src=src)
        tdist.broadcast(t, src)
        torch.testing.assert_close(x, t, rtol=0, atol=0)


def test_empty_tensors_move_nothing_and_do_not_crash():
    # torch 1.13's gloo all_gather divides by the element count (SIGFPE) on
    # empty tensors: the torch transport skips gathers that move nothing
    # (the composed all_reduce issues one).
    for op in (dt.all_reduce, dt.all_reduce_):
        assert op(torch.ones(0)).shape == (0,)
    assert [t.shape for t in dt.all_gather(torch.ones(0, 2))] == [(0, 2)] * size()
    assert dt.all_gather_single(torch.ones(0, 2)).shape == (0, 2)
    assert dt.broadcast_(torch.ones(0), src=0).shape == (0,)
    assert dt.all_reduce(torch.ones(2))[0].item() == size()  # the group is still in step


def test_reduce_sum():
    dst = 2
    (yd, gd), (yt, gt) = run_both(lambda x: dt.reduce(x, dst=dst),
                                  lambda x: oracle.reduce(x, dst), [data(3)])
    # torch leaves non-dst outputs unspecified; diffcomm defines them as zeros.
    if rank() == dst:
        torch.testing.assert_close(yd[0], yt[0], rtol=0, atol=0)
    else:
        assert torch.count_nonzero(yd[0]) == 0
    # torch's backward ignores non-dst cotangents too, so gradients agree everywhere.
    torch.testing.assert_close(gd[0], gt[0], rtol=0, atol=0)


def test_all_gather():
    assert_same(*run_both(lambda x: dt.all_gather(x), lambda x: oracle.all_gather(x), [data(2, 3)]))


def test_gather():
    dst = 1
    (yd, gd), (yt, gt) = run_both(lambda x: dt.gather(x, dst=dst),
                                  lambda x: oracle.gather(x, dst), [data(3)])
    if rank() == dst:
        for u, v in zip(yd, yt):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
    torch.testing.assert_close(gd[0], gt[0], rtol=0, atol=0)


def test_scatter():
    src = 3
    xs = [data(2, salt=s) for s in range(size())]
    assert_same(*run_both(lambda *t: dt.scatter(list(t), src=src),
                          lambda *t: oracle.scatter(list(t), src), xs))


def test_all_to_all_single_uneven():
    n = size()
    # rank r sends (r + j) % 3 rows to j; receives (s + r) % 3 rows from s.
    ins = [(rank() + j) % 3 for j in range(n)]
    outs = [(s + rank()) % 3 for s in range(n)]
    x = data(sum(ins), 2)

    assert_same(*run_both(lambda t: dt.all_to_all_single(t, outs, ins),
                          lambda t: oracle.all_to_all_single(t, outs, ins), [x]))


def test_reduce_scatter_ops_vs_all_reduce_oracle():
    # gloo has no reduce_scatter: the oracle is torch's differentiable
    # all_reduce followed by this rank's slice (and funcol's
    # reduce_scatter_single_autograd where torch has it, which torch builds
    # from gloo's all_reduce the same way).
    n, r = size(), rank()
    xs = [data(2, salt=s) for s in range(n)]
    assert_same(*run_both(lambda *t: dt.reduce_scatter(list(t)),
                          lambda *t: oracle.all_reduce(torch.stack(t))[r], xs))
    x = data(3 * n, 2)
    assert_same(*run_both(lambda t: dt.reduce_scatter_single(t),
                          lambda t: oracle.reduce_scatter_single(t), [x]))
    assert_same(*run_both(lambda t: dt.reduce_scatter_single(t, "avg"),
                          lambda t: oracle.all_reduce(t)[3 * r:3 * r + 3] / n, [x]))
    splits = [1, 0, 3, 2][:n] + [1] * max(0, n - 4)
    x = data(sum(splits), 2)
    off = sum(splits[:r])
    assert_same(*run_both(lambda t: dt.reduce_scatter_v(t, splits),
                          lambda t: oracle.all_reduce(t)[off:off + splits[r]], [x]))


def test_gather_variants_vs_all_gather_oracle():
    n = size()
    x = data(2, 3)
    assert_same(*run_both(lambda t: dt.all_gather_single(t),
                          lambda t: torch.cat(oracle.all_gather(t)), [x]))
    splits = [(s * 2) % 3 for s in range(n)]
    x = data(splits[rank()], 2)

    def torch_v(t):  # pad to the max, all_gather, unpad
        m = max(splits)
        padded = torch.cat([t, t.new_zeros(m - t.shape[0], 2)])
        return torch.cat([y[:k] for y, k in zip(oracle.all_gather(padded), splits)])

    assert_same(*run_both(lambda t: dt.all_gather_v(t, splits), torch_v, [x]))


def test_all_to_all_list_vs_single_oracle():
    n = size()
    xs = [data(2, salt=j) for j in range(n)]

    def torch_a2a(*t):
        return list(oracle.all_to_all_single(torch.cat(t), [2] * n, [2] * n).split(2))

    assert_same(*run_both(lambda *t: dt.all_to_all(list(t)), torch_a2a, xs))


def test_copy_to_tp_region():
    # Oracle: Megatron's copy-to-TP-region written with torch's own all_reduce.
    assert_same(*run_both(lambda t: dt.copy_to_tp_region(t), lambda t: _CopyToTp.apply(t),
                          [data(3)]))


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        tdist.all_reduce(g)
        return g


def test_canonical_all_reduce_vs_all_reduce_oracle_and_one_process_bits():
    # Values and gradients against torch's differentiable all_reduce of each
    # rank's chunk sum (integer data: every order gives the same sum).
    assert_same(*run_both(lambda x: dt.canonical_all_reduce(x),
                          lambda x: oracle.all_reduce(x.sum(0)), [data(3, 2, 2)]))
    assert_same(*run_both(lambda x: dt.canonical_all_reduce(x, "avg"),
                          lambda x: oracle.all_reduce(x.sum(0)) / (3 * size()), [data(3, 5)]))
    # Bits: float64 chunks whose sum depends on the order; this world and a
    # sub-group of 2 members holding the same chunks give one process's bits.
    g = torch.Generator().manual_seed(11)
    chunks = (torch.rand(12, 3, generator=g, dtype=f64) - 0.5) * torch.pow(
        10.0, torch.randint(-8, 9, (12, 3), generator=g).to(f64))
    one = dt.canonical_sum(chunks)
    for members in (list(range(size())), [0, 1]):
        sub = dt.new_group(members)
        if sub is None or 12 % sub.size():
            continue
        k = 12 // sub.size()
        y = dt.canonical_all_reduce(chunks[sub.rank() * k:(sub.rank() + 1) * k].clone(), group=sub)
        assert torch.equal(y, one), (members, y - one)


def test_max_min_product_closed_forms():
    n, r = size(), rank()
    x = torch.tensor([float(r % 2), float(-r), 1.0 + r, 0.0 if r == 1 else 2.0], dtype=f64)
    allx = [torch.tensor([float(s % 2), float(-s), 1.0 + s, 0.0 if s == 1 else 2.0], dtype=f64)
            for s in range(n)]
    c = torch.tensor([1.0 + r, 2.0, -1.0, 0.5], dtype=f64)
    G = sum(torch.tensor([1.0 + s, 2.0, -1.0, 0.5], dtype=f64) for s in range(n))
    stack = torch.stack(allx)
    for op, ref in (("max", stack.max(0).values), ("min", stack.min(0).values),
                    ("product", stack.prod(0))):
        xl = x.clone().requires_grad_()
        y = dt.all_reduce(xl, op)
        (y * c).sum().backward()
        torch.testing.assert_close(y.detach(), ref, rtol=0, atol=0)
        if op == "product":
            expect = G * torch.stack([a for s, a in enumerate(allx) if s != r]).prod(0)
        else:
            holders = (stack == ref).to(f64)
            expect = G * holders[r] / holders.sum(0)
        torch.testing.assert_close(xl.grad, expect, rtol=0, atol=1e-12)


def test_nonzero_rank_mismatch_is_local_error():
    with pytest.raises(diffcomm.InvalidArgument):
        dt.all_to_all_single(data(3), [1] * size(), [5] * size())


def test_one_ranks_bad_splits_are_announced_to_its_peers():
    # Checked mode: rank 1 refuses its own call (its input_splits sum to
    # size + 1) and still takes part in the members' agreement, so the peers
    # raise CollectiveMismatch naming it and its error at once, not after
    # their 60 s deadline.
    import time  # noqa: PLC0415

    from conftest import checked_world  # noqa: PLC0415

    group = checked_world()
    splits = [1] * size()
    mine = [2] + [1] * (size() - 1) if rank() == 1 else splits
    start = time.monotonic()
    if rank() == 1:
        with pytest.raises(diffcomm.InvalidArgument, match="input_splits sum to"):
            dt.all_to_all_single(data(size()), splits, mine, group=group)
    else:
        with pytest.raises(diffcomm.CollectiveMismatch,
                           match=r"rank 1 \(global 1\) refused its own call all_to_all_single\("):
            dt.all_to_all_single(data(size()), splits, mine, group=group)
    assert time.monotonic() - start < 10
    t = dt.all_reduce(torch.ones(2, dtype=f64), group=group)  # the group goes on
    assert t.tolist() == [float(size())] * 2


def test_encoder_parallel_step_equals_reference():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                                    "python"))
    from encoder_parallel_step import StepConfig, check, step  # noqa: PLC0415

    world = dt.get_world()
    for cfg in (StepConfig(cp=2, tp=2, sp=True, ffn=4, seed=3),
                StepConfig(cp=1, tp=4, sp=False, ffn=8, seed=4),
                StepConfig(cp=2, tp=2, layout="zigzag", ffn=4, seed=5,
                           images=[[(640, 480), (90, 60)], [(333, 500)], []])):
        mine = step(rank(), world, cfg)
        # Every rank checks every rank's result: gather the shards over gloo.
        everyone = [None] * size()
        tdist.all_gather_object(everyone, mine)
        check(cfg, everyone)


@pytest.mark.mpi_only
def test_mpi4py_communicator():
    MPI = pytest.importorskip("mpi4py.MPI")
    # A split communicator (evens / odds), borrowed by diffcomm; src is global
    # in that communicator's numbering.
    comm = MPI.COMM_WORLD.Split(color=rank() % 2, key=rank())
    try:
        g = diffcomm._core.mpi.from_comm_address(MPI._addressof(comm), "halves")
        assert g.size() == comm.Get_size() and g.rank() == comm.Get_rank()
        x = torch.tensor([float(rank())], dtype=f64, requires_grad=True)
        y = dt.all_reduce(x, group=g)
        members = [r for r in range(size()) if r % 2 == rank() % 2]
        assert y.item() == float(sum(members))
        (y * (rank() + 1)).sum().backward()
        assert x.grad.item() == float(sum(r + 1 for r in members))
        del g
    finally:
        comm.Free()


def test_second_thread_on_a_busy_group_is_refused():
    # Rank 1 arrives late, so rank 0's first thread is still inside its
    # all_reduce when the main thread calls: refused (two threads on one
    # group mixed their messages: wrong sums, silently), and the group goes
    # on working with the same call numbers on every rank. Every rank issues
    # the all_reduce from a thread of its own and the barrier from main: the
    # same threads in the same order everywhere (members agree on them).
    import threading
    import time

    world = dt.get_world()
    x = torch.ones(2, dtype=f64)
    if rank() == 1:
        time.sleep(0.8)
    out = {}
    first = threading.Thread(target=lambda: out.setdefault("y", dt.all_reduce(x)))
    first.start()
    if rank() == 0:
        time.sleep(0.2)
        with pytest.raises(diffcomm.InvalidArgument, match=r"is inside all_reduce #\d+"):
            world.barrier()
    first.join()
    assert out["y"].tolist() == [float(size())] * 2
    world.barrier()


def test_threads_taking_turns_at_different_calls_are_a_mismatch():
    # Issue [4/7] item 3: rank 0 alone moves a call to a new thread, which
    # paired its call with the others' main-thread call (wrong sums, silently).
    # Checked mode refuses it on every member, naming both threads; the same
    # threads in the same order on every rank work.
    import threading

    from conftest import checked_world  # noqa: PLC0415

    def on_worker(fn):
        out = {}

        def body():
            try:
                out["result"] = fn()
            except Exception as e:  # noqa: BLE001 - handed to the main thread
                out["error"] = e

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["result"]

    g = checked_world()  # a fresh group: it numbers its threads from 0
    x = torch.ones(2, dtype=f64)
    assert dt.all_reduce(x, group=g).tolist() == [float(size())] * 2
    assert on_worker(lambda: dt.all_reduce(x, group=g)).tolist() == [float(size())] * 2
    with pytest.raises(diffcomm.CollectiveMismatch,
                       match=r"from its thread #2 .* from its thread #0: calling thread differs"):
        if rank() == 0:
            on_worker(lambda: dt.all_reduce(x, group=g))
        else:
            dt.all_reduce(x, group=g)


def test_participation_rule_when_losses_reach_different_collectives():
    # y1 = all_reduce(x), y2 = all_reduce(2x), x = 1; even ranks' loss y1,
    # odd ranks' y2: total = 2 * sum(x) + 2 * 2 * sum(x) at np 4, dx = 6 (the
    # issue's program at world 2 gives 3). A rank's plain loss.backward()
    # would run one bridge and pair y1's backward with y2's.
    x = torch.ones(1, dtype=f64, requires_grad=True)
    y1 = dt.all_reduce(x)
    y2 = dt.all_reduce(x * 2)
    dt.backward((y1 if rank() % 2 == 0 else y2).sum())
    evens, odds = (size() + 1) // 2, size() // 2
    assert x.grad.item() == float(evens + 2 * odds)


def test_a_rank_with_no_loss_joins_with_backward_pending():
    x = torch.tensor([float(rank() + 1)], dtype=f64, requires_grad=True)
    y = dt.all_reduce(x)
    if rank() == 0:
        dt.backward((y * 5).sum())
    else:
        dt.backward_pending()
    assert x.grad.item() == 5.0


def test_in_place_write_to_a_saved_reduction_input_raises_torchs_error():
    h = torch.tensor([float(rank() + 2)], dtype=f64, requires_grad=True) * 1.0
    y = dt.all_reduce(h, op="product")
    h.copy_(dt.all_reduce(h.detach()))  # the input rewritten after its forward use
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # on every rank, before any backward collective


def _program(salt):
    """Outputs and input gradients of a few ops on this rank's seeded data
    (the default group: the production transport, or a simulated rank)."""
    r, n = dt.get_rank(), dt.get_world_size()
    g = torch.Generator().manual_seed(100 * r + salt)
    x = torch.randn(2 * n + 1, 3, generator=g, dtype=torch.float32).requires_grad_()
    outs = [dt.all_reduce(x), dt.all_reduce(x, op="max"), dt.all_reduce(x, op="avg")]
    # Uneven all_to_all_single with zero splits (rank r sends (r + p) % 3 rows to p).
    send = [(r + p) % 3 for p in range(n)]
    recv = [(p + r) % 3 for p in range(n)]
    y = torch.randn(sum(send), 3, generator=g, dtype=torch.float32).requires_grad_()
    outs.append(dt.all_to_all_single(y, recv, send))
    outs.append(dt.all_gather_v(x[: r + 1], [p + 1 for p in range(n)]))
    outs.append(dt.reduce_scatter_single(x[: 2 * n]))
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    dt.backward(loss)
    return [o.detach().clone() for o in outs] + [x.grad.clone(), y.grad.clone()]


def test_outputs_and_gradients_bit_identical_to_the_simulated_world():
    import diffcomm.sim  # noqa: PLC0415

    mine = _program(salt=7)
    simulated = diffcomm.sim.run(size(), lambda r, g: _program(salt=7)).results[rank()]
    assert len(mine) == len(simulated)
    for k, (a, b) in enumerate(zip(mine, simulated)):
        assert torch.equal(a, b), (k, a, b)


def test_checked_mode_shape_mismatch_raises_on_every_rank():
    from conftest import checked_world  # noqa: PLC0415

    g = checked_world()
    x = torch.ones(3 if rank() != 1 else 4, dtype=f64)
    with pytest.raises(diffcomm.CollectiveMismatch, match="all_reduce"):
        dt.all_reduce(x, group=g)

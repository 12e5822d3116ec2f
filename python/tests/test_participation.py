"""diffcomm.torch follows diffcomm's gradient rules (issue [4/8]): the
participation rule through ``diffcomm.torch.backward`` (every rank runs the
backward of every collective it took part in, in reverse forward order), and
saved tensors versioned by torch (an in-place write after a diffcomm op
raises torch's error). Expected values: closed forms, or a float64 torch
computation of the summed loss of all ranks in one process."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt
from diffcomm import _participation

f64 = torch.float64


def leaf(values):
    return torch.tensor(values, dtype=f64, requires_grad=True)


def all_reduce_calls(world):
    return sum(e["calls"] for e in world.stats()["entries"] if e["op"] == "all_reduce")


# ------------------------------------------------------------ the rule
def test_each_ranks_loss_reaches_a_different_collective():
    """World 2, x = 1: loss_0 = sum(y1), loss_1 = sum(y2) with y1 =
    all_reduce(x), y2 = all_reduce(2x). Total (x0 + x1) + 2 (x0 + x1): dx = 3."""
    def fn(rank, world):
        x = leaf([1.0])
        y1 = dt.all_reduce(x)
        y2 = dt.all_reduce(x * 2)
        dt.backward((y1 if rank == 0 else y2).sum())
        return x.grad.item()

    for seed in range(4):
        assert sim.run(2, fn, seed=seed).results == [3.0, 3.0]


def test_plain_backward_of_different_collectives_names_the_forward_calls():
    def fn(rank, world):
        x = leaf([1.0])
        y1 = dt.all_reduce(x)
        y2 = dt.all_reduce(x * 2)
        (y1 if rank == 0 else y2).sum().backward()  # torch runs one bridge per rank

    with pytest.raises(diffcomm.CollectiveMismatch) as info:
        sim.run(2, fn, seed=3)
    msg = str(info.value)
    assert "(backward of all_reduce #0)" in msg and "(backward of all_reduce #1)" in msg, msg
    assert "forward call differs" in msg, msg


def test_a_loss_that_ignores_an_output_still_runs_its_backward():
    """loss_0 = y1 + y2, loss_1 = y1: d/dx_r = 2 (y1) + 2 (y2 = 2 x0 + 2 x1)."""
    def fn(rank, world):
        x = leaf([1.0])
        y1 = dt.all_reduce(x)
        y2 = dt.all_reduce(x * 2)
        dt.backward(y1.sum() + y2.sum() if rank == 0 else y1.sum())
        return x.grad.item(), all_reduce_calls(world)

    assert sim.run(2, fn, seed=5).results == [(4.0, 4), (4.0, 4)]


def test_a_dropped_output_still_runs_its_backward():
    def fn(rank, world):
        x = leaf([1.0])
        y1 = dt.all_reduce(x)
        y2 = dt.all_reduce(x * 2)
        if rank == 1:
            del y2
        dt.backward(y1.sum())
        return x.grad.item(), all_reduce_calls(world)

    assert sim.run(2, fn, seed=13).results == [(2.0, 4), (2.0, 4)]


def test_a_rank_with_no_loss_joins_with_backward_pending():
    """CASES 5: rank 1 sends its row to rank 0 and has no loss term."""
    def fn(rank, world):
        x = leaf([5.0 if rank == 0 else 7.0])
        out = dt.all_to_all_single(x, [1, 1] if rank == 0 else [0, 0], [1, 0])
        if rank == 0:
            dt.backward((out * torch.tensor([2.0, 3.0], dtype=f64)).sum())
        else:
            dt.backward_pending()
        return x.grad.item()

    assert sim.run(2, fn, seed=3).results == [2.0, 3.0]


def test_retain_graph_runs_every_collective_again():
    def fn(rank, world):
        x = leaf([1.0])
        y1 = dt.all_reduce(x)
        y2 = dt.all_reduce(x * 2)
        loss = (y1 if rank == 0 else y2).sum()
        dt.backward(loss, retain_graph=True)
        dt.backward(loss)
        return x.grad.item(), all_reduce_calls(world)

    assert sim.run(2, fn, seed=9).results == [(6.0, 6), (6.0, 6)]


def test_nothing_stays_pending_after_backward():
    """A step's collectives leave neither torch's registry nor diffcomm's
    cohort (backward_pending then issues no call): memory stays flat over a
    training loop, with dt.backward and with plain loss.backward()."""
    def fn(rank, world):
        x = leaf([1.0, 2.0])
        for step in range(6):
            y = dt.all_reduce(x * (rank + 1), op="max")
            loss = y.sum()
            dt.backward(loss) if step % 2 else loss.backward()
            assert _participation.pending(world._cohort_id) == []
        before = world.stats()["total"]["calls"]
        world.backward_pending()  # diffcomm's own cohort: nothing left
        return world.stats()["total"]["calls"] - before

    assert sim.run(2, fn).results == [0, 0]


def test_pending_outputs_are_forgotten_when_the_rank_returns():
    def fn(rank, world):
        dt.all_reduce(leaf([1.0]))  # never backwarded
        return world._cohort_id

    ids = sim.run(2, fn).results
    assert all(_participation.pending(i) == [] for i in ids)


def test_discard_pending_on_every_rank():
    def fn(rank, world):
        x = leaf([1.0])
        dt.all_reduce(x)
        dt.discard_pending()
        y = dt.all_reduce(x * 3)
        dt.backward(y.sum())
        return x.grad.item()

    assert sim.run(2, fn).results == [6.0, 6.0]


# ------------------------------------------------- random programs (the kind)
OPS = ("all_reduce", "max", "broadcast", "all_gather_single")


def program(rng, world_size):
    sub = sorted(rng.sample(range(world_size), rng.randint(2, world_size)))
    ops = []
    for _ in range(rng.randint(2, 6)):
        members = sub if rng.random() < 0.4 else list(range(world_size))
        ops.append({"op": rng.choice(OPS), "members": members, "src": rng.choice(members),
                    "coef": [rng.choice([1.0, -2.0, 3.0, 0.5]) for _ in range(world_size)]})
    uses = [[k for k in range(len(ops)) if rng.random() < 0.5] for _ in range(world_size)]
    weights = [[[rng.uniform(-2, 2) for _ in range(4 * world_size)] for _ in ops]
               for _ in range(world_size)]
    xs = [[rng.uniform(-3, 3) for _ in range(2)] for _ in range(world_size)]
    return sub, ops, uses, weights, xs


def forward_value(op, ins):
    """The op's output from its members' inputs, in plain torch (the reference)."""
    if op["op"] == "all_reduce":
        return sum(ins)
    if op["op"] == "max":
        return torch.stack(ins).amax(0)
    if op["op"] == "broadcast":
        return ins[op["members"].index(op["src"])]
    return torch.cat(ins)


def loss_of(rank, ys, uses, weights):
    terms = [(ys[k] * torch.tensor(weights[rank][k][:ys[k].numel()], dtype=f64)).sum()
             for k in uses[rank] if ys[k] is not None]
    return sum(terms) if terms else None


def reference_grads(world_size, prog):
    sub, ops, uses, weights, xs = prog
    leaves = [leaf(v) for v in xs]
    ys = [[None] * len(ops) for _ in range(world_size)]
    for k, op in enumerate(ops):
        out = forward_value(op, [leaves[r] * op["coef"][r] for r in op["members"]])
        for r in op["members"]:
            ys[r][k] = out
    losses = [loss_of(r, ys[r], uses, weights) for r in range(world_size)]
    total = sum(t for t in losses if t is not None)
    if isinstance(total, torch.Tensor):
        total.backward()
    return [x.grad.tolist() if x.grad is not None else [0.0, 0.0] for x in leaves]


def run_program(world_size, prog, seed):
    sub, ops, uses, weights, xs = prog

    def fn(rank, world):
        g = dt.new_group(sub, world)
        x = leaf(xs[rank])
        ys = [None] * len(ops)
        for k, op in enumerate(ops):
            if rank not in op["members"]:
                continue
            grp = world if len(op["members"]) == world_size else g
            h = x * op["coef"][rank]
            if op["op"] == "all_reduce":
                ys[k] = dt.all_reduce(h, group=grp)
            elif op["op"] == "max":
                ys[k] = dt.all_reduce(h, op="max", group=grp)
            elif op["op"] == "broadcast":
                ys[k] = dt.broadcast(h, src=op["src"], group=grp)
            else:
                ys[k] = dt.all_gather_single(h, group=grp)
        loss = loss_of(rank, ys, uses, weights)
        dt.backward([] if loss is None else loss)
        return x.grad.tolist() if x.grad is not None else [0.0, 0.0]

    return sim.run(world_size, fn, seed=seed).results


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(2, 4), program_seed=st.integers(0, 2**32 - 1),
       sim_seed=st.integers(0, 2**16))
def test_random_programs_match_the_summed_loss_reference(world_size, program_seed, sim_seed):
    prog = program(random.Random(program_seed), world_size)
    got = run_program(world_size, prog, sim_seed)
    want = reference_grads(world_size, prog)
    for r in range(world_size):
        assert got[r] == pytest.approx(want[r], abs=1e-12), (r, prog)


# ------------------------------------------------------------ saved tensors
def failing_ranks(world_size, fn):
    with pytest.raises(RuntimeError) as info:
        sim.run(world_size, fn)
    return info.value


def test_product_input_rewritten_in_place_raises_torchs_error():
    """h feeds a Product all_reduce, then h is all-reduced in place: the
    backward would read the new h (10/10 instead of 6/4)."""
    def fn(rank, world):
        h = leaf([2.0 if rank == 0 else 3.0]) * 1.0
        y = dt.all_reduce(h, op="product")
        h.copy_(dt.all_reduce(h.detach()))
        y.sum().backward()

    err = failing_ranks(2, fn)
    assert "modified by an inplace operation" in str(err), err
    assert all(isinstance(e, RuntimeError) for e in err.rank_errors), err.rank_errors


def test_max_output_written_in_place_raises_torchs_error():
    def fn(rank, world):
        x = leaf([float(rank)])
        y = dt.all_reduce(x, op="max")
        y.mul_(2)
        dt.backward(y.sum())

    err = failing_ranks(2, fn)
    assert "modified by an inplace operation" in str(err), err


def test_the_ddp_buffer_sync_pattern_raises_torchs_error():
    """x = [2] / [3], buf = [5] / [7]; loss = sum(x * buf); buf broadcast in place."""
    def fn(rank, world):
        x = leaf([2.0 if rank == 0 else 3.0])
        buf = torch.tensor([5.0 if rank == 0 else 7.0], dtype=f64)
        loss = (x * buf).sum()
        buf.copy_(dt.broadcast(buf, src=0))
        dt.backward(loss)

    err = failing_ranks(2, fn)
    assert "modified by an inplace operation" in str(err), err


def test_writes_before_the_forward_use_and_to_unsaved_inputs_are_allowed():
    """h = x + 1 written before the Product all_reduce reads it: y = 3 * 4,
    loss_r = y on both ranks: dx0 = 2 * 4, dx1 = 2 * 3. A Sum all_reduce saves
    nothing: writing its input afterwards changes no gradient."""
    def fn(rank, world):
        x = leaf([2.0 if rank == 0 else 3.0])
        h = x * 1.0
        h.add_(1.0)
        y = dt.all_reduce(h, op="product")
        s = x * 1.0
        z = dt.all_reduce(s)
        s.mul_(10.0)
        dt.backward(y.sum() + z.sum())
        return x.grad.item()

    assert sim.run(2, fn).results == [8.0 + 2.0, 6.0 + 2.0]

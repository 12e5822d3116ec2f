"""diffcomm.sim.run: CASES.md in Python, mismatch/deadlock on every rank,
determinism, the exchange property (hypothesis), the per-collective cost."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt

f64 = torch.float64


def leaf(values):
    return torch.tensor(values, dtype=f64, requires_grad=True)


# ------------------------------------------------------------ CASES.md 1-6
def test_case1_subgroup_all_gather():
    def fn(rank, world):
        g = dt.new_group([2, 3], world)  # global ranks; collective over the world
        if g is None:
            return None
        assert g.members() == [2, 3]
        x = leaf([1.0])
        sum(y.sum() for y in dt.all_gather(x, g)).backward()
        return x.grad.tolist()

    assert sim.run(4, fn, seed=7).results == [None, None, [2.0], [2.0]]


def test_case2_broadcast_src_in_subgroup():
    cot = [1.0, 2.0, 4.0]

    def fn(rank, world):
        x = leaf([10.0 + rank])
        y = dt.broadcast(x, src=1)
        assert y.tolist() == [11.0]
        (y * cot[rank]).sum().backward()
        return x.grad.tolist()

    assert sim.run(3, fn, seed=1).results == [[0.0], [7.0], [0.0]]

    def alone(rank, world):
        g = world.new_group([1])
        if g is None:
            return None
        out = []
        for kwargs in ({"src": 1}, {"group_src": 0}):  # global 1 == group-local 0
            x = leaf([1.0, 1.0])
            dt.broadcast(x, group=g, **kwargs).sum().backward()
            out.append(x.grad.tolist())
        return out

    assert sim.run(2, alone).results == [None, [[1.0, 1.0], [1.0, 1.0]]]


def test_case3_avg():
    xs, cot = [2.0, 4.0], [1.0, 3.0]

    def fn(rank, world):
        x = leaf([xs[rank]])
        y = dt.all_reduce(x, "avg")
        assert y.tolist() == [3.0]
        (y * cot[rank]).sum().backward()
        return x.grad.tolist()

    assert sim.run(2, fn).results == [[2.0], [2.0]]


def test_premul_sum():
    # Issue [4/5] item 8: W=2, factor 0.5, x = 2 and 4 gives 3; the adjoint is
    # the same scaled sum of the cotangents: 0.5 * (1 + 3) = 2 on both ranks.
    xs, cot = [2.0, 4.0], [1.0, 3.0]

    def fn(rank, world):
        x = leaf([xs[rank]])
        y = dt.all_reduce(x, dt.premul_sum(0.5))
        assert y.tolist() == [3.0]
        (y * cot[rank]).sum().backward()
        return x.grad.tolist()

    assert sim.run(2, fn).results == [[2.0], [2.0]]


def test_case4_zero_element_all_gather():
    def fn(rank, world):
        x = torch.zeros(1, 0, 2, dtype=f64, requires_grad=True)
        ys = dt.all_gather(x)
        assert [tuple(y.shape) for y in ys] == [(1, 0, 2), (1, 0, 2)]
        sum(y.sum() for y in ys).backward()
        return tuple(x.grad.shape), world.stats()["total"]["calls"]

    res = sim.run(2, fn).results
    assert res[0][0] == res[1][0] == (1, 0, 2)
    assert res[0][1] == res[1][1] == 2  # forward all_gather + backward reduce_scatter on both


def test_case5_rank_that_receives_nothing():
    def fn(rank, world):
        x = leaf([5.0 if rank == 0 else 7.0])
        out_splits = [1, 1] if rank == 0 else [0, 0]
        y = dt.all_to_all_single(x, out_splits, [1, 0])
        if rank == 0:
            assert y.tolist() == [5.0, 7.0]
            (2 * y[0] + 3 * y[1]).backward()
        else:
            assert y.numel() == 0
            y.sum().backward()  # no loss term, but it must still run the backward all-to-all
        return x.grad.tolist()

    assert sim.run(2, fn, seed=3).results == [[2.0], [3.0]]


def test_case6_asymmetric_cotangents():
    w = [(1.0, 2.0), (3.0, 4.0)]

    def fn(rank, world):
        x = leaf([10.0 * (rank + 1)])
        g0, g1 = dt.all_gather(x)
        (w[rank][0] * g0 + w[rank][1] * g1).sum().backward()
        return x.grad.tolist()

    assert sim.run(2, fn).results == [[4.0], [6.0]]


# ------------------------------------------------ Max/Min/Product (closed forms)
def test_nonlinear_reductions_closed_form():
    xs = [[3.0, -1.0, 0.0], [5.0, -1.0, 2.0], [5.0, 4.0, 0.5]]

    def fn(rank, world):
        out = {}
        for op in ("max", "min", "product"):
            x = leaf(xs[rank])
            y = dt.all_reduce(x, op)
            (y * (rank + 1)).sum().backward()
            out[op] = (y.tolist(), x.grad.tolist())
        return out

    res = sim.run(3, fn, seed=2).results
    G = 1 + 2 + 3
    assert res[0]["max"][0] == [5.0, 4.0, 2.0]
    # max: ties split evenly (element 0: ranks 1 and 2)
    assert [r["max"][1] for r in res] == [[0, 0, 0], [G / 2, 0, G], [G / 2, G, 0]]
    assert [r["min"][1] for r in res] == [[G, G / 2, G], [0, G / 2, 0], [0, 0, 0]]
    prod = [3.0 * 5 * 5, -1.0 * -1 * 4, 0.0 * 2 * 0.5]
    assert res[0]["product"][0] == prod
    for r in range(3):
        others = [[xs[s][i] for s in range(3) if s != r] for i in range(3)]
        assert res[r]["product"][1] == [G * a * b for a, b in others]


# ------------------------------------------------ mismatch, deadlock: every rank
def test_mismatch_raised_on_every_rank():
    def fn(rank, world):
        n = 3 if rank == 2 else 2
        try:
            dt.all_reduce(torch.ones(n, dtype=f64))
        except diffcomm.CollectiveMismatch as e:
            return str(e)
        return None

    msgs = sim.run(3, fn, seed=5).results
    assert all(m is not None for m in msgs)
    for m in msgs:
        assert "shape differs" in m and "rank 2 (global 2)" in m, m

    # Uncaught: run() re-raises the first, every rank's exception attached.
    with pytest.raises(diffcomm.CollectiveMismatch) as info:
        sim.run(3, lambda r, w: dt.all_reduce(torch.ones(3 if r == 2 else 2)), seed=5)
    assert [type(e) for e in info.value.rank_errors] == [diffcomm.CollectiveMismatch] * 3


def test_deadlock_cycle_reported_on_every_rank():
    # Three pairwise groups entered in a cycle: every rank waits for another.
    def fn(rank, world):
        a = world.new_group([0, 1])
        b = world.new_group([1, 2])
        c = world.new_group([0, 2])
        order = {0: [a, c], 1: [b, a], 2: [c, b]}[rank]
        try:
            for g in order:
                dt.all_reduce(torch.ones(1), group=g)
        except diffcomm.Deadlock as e:
            return str(e)
        return None

    msgs = sim.run(3, fn, seed=11).results
    assert all(m is not None for m in msgs), msgs
    for m in msgs:
        assert "deadlock" in m
        for r in range(3):
            assert f"rank {r}: waiting in all_reduce" in m, m


def _line_of(marker, path):
    """The line of `path` holding `marker` (in a comment) and nothing else marked."""
    with open(path) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line_of" not in text)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_deadlock_report_names_each_pending_calls_line(isolation):
    # Issue [4/7] item 5: the user's file and line, not diffcomm.torch's
    # wrapper, for every rank's pending call, in both isolations.
    def fn(rank, world):
        if rank == 2:
            return
        if rank == 0:
            dt.all_reduce(torch.ones(1))  # caller-mark-0
        else:
            dt.all_gather(torch.ones(1))  # caller-mark-1

    with pytest.raises(diffcomm.Deadlock) as info:
        sim.run(3, fn, seed=3, isolation=isolation)
    report = str(info.value)
    here = os.path.abspath(__file__)
    assert f"at {here}:{_line_of('caller-mark-0', here)}\n" in report, report
    assert f"at {here}:{_line_of('caller-mark-1', here)}\n" in report, report


def test_deadlock_skipped_backward_is_reported_not_hung():
    def fn(rank, world):
        x = leaf([1.0])
        y = dt.all_reduce(x)
        if rank != 1:  # rank 1 skips its backward collective
            y.sum().backward()

    with pytest.raises(diffcomm.Deadlock) as info:
        sim.run(3, fn, seed=0)
    errs = info.value.rank_errors
    assert errs[1] is None and isinstance(errs[0], diffcomm.Deadlock)
    assert "rank 1: finished" in str(errs[0])


def test_fault_gives_rank_failure_to_the_others():
    def fn(rank, world):
        for _ in range(3):
            dt.all_reduce(torch.ones(2))

    with pytest.raises(diffcomm.Error) as info:
        sim.run(4, fn, seed=1, fault=(2, 2))
    errs = info.value.rank_errors
    assert "injected fault" in str(errs[2])
    assert all(isinstance(errs[r], diffcomm.RankFailure) for r in (0, 1, 3))


def test_python_exception_on_one_rank_fails_the_others():
    def fn(rank, world):
        if rank == 0:
            raise ValueError("boom")
        dt.all_reduce(torch.ones(1))

    with pytest.raises(ValueError, match="boom") as info:
        sim.run(3, fn)
    assert isinstance(info.value.rank_errors[1], diffcomm.RankFailure)
    assert "boom" in str(info.value.rank_errors[1])


# ------------------------------------------------ determinism
def _interleaving(seed):
    log = []

    def fn(rank, world):
        g = world.new_group([0, 1, 2, 3, 4])
        for k in range(4):
            log.append((rank, k))
            dt.all_reduce(torch.ones(1), group=g if k % 2 else None)

    # Threads: the ranks append to one log (rank processes would each fill their own copy).
    r = sim.run(5, fn, seed=seed, isolation="thread")
    return r.trace_hash, tuple(log)


def test_same_seed_same_interleaving():
    a, b = _interleaving(42), _interleaving(42)
    assert a == b
    others = {_interleaving(s)[1] for s in range(8)}
    assert len(others) > 1, "the seed should change the interleaving"


# ------------------------------------------------ the exchange property
from encoder_parallel_step import StepConfig, check, step  # noqa: E402

meshes = st.sampled_from([(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (3, 1), (2, 3)])
image = st.tuples(st.integers(28, 400), st.integers(28, 400))
batches = st.lists(st.lists(image, max_size=3), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh=meshes, sp=st.booleans(), zigzag=st.booleans(), images=batches,
       seed=st.integers(0, 2**32 - 1))
def test_exchange_equals_single_rank_reference(mesh, sp, zigzag, images, seed):
    cp, tp = mesh
    cfg = StepConfig(cp=cp, tp=tp, sp=sp and tp > 1, layout="zigzag" if zigzag else "contiguous",
                     ffn=2 * tp, images=images, seed=seed % 1000)
    res = sim.run(cfg.world_size, lambda r, g: step(r, g, cfg), seed=seed)
    check(cfg, res.results)


def test_wrong_receiver_convention_fails_the_reference():
    cfg = StepConfig(tp=2, receiver_grad=sim.ReceiverGrad.Partial)  # TP replicas, no SP
    res = sim.run(2, lambda r, g: step(r, g, cfg))
    with pytest.raises(AssertionError, match="encoder grad rel diff"):
        check(cfg, res.results)


# ------------------------------------------------ cost of the baton
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: pinning is invisible")
@pytest.mark.parametrize("one_cpu", [True, False])
def test_one_cpu_pins_the_rank_threads_while_the_world_runs(one_cpu):
    # one_cpu=True: every rank thread runs on one CPU (the world's thread too)
    # and the same results come out; the caller's CPU set is untouched.
    # one_cpu=False: the OS places the threads.
    before = os.sched_getaffinity(0)

    def fn(rank, world):
        seen = os.sched_getaffinity(0)
        x = torch.full((3,), float(rank + 1), dtype=f64)
        return seen, dt.all_reduce(x).tolist()

    res = sim.run(4, fn, seed=2, one_cpu=one_cpu)
    sets = [seen for seen, _ in res]
    if one_cpu:
        assert all(len(s) == 1 for s in sets) and len(set(map(frozenset, sets))) == 1, sets
        assert sets[0] <= before
    else:
        assert all(s == before for s in sets), sets
    assert all(v == [10.0, 10.0, 10.0] for _, v in res)
    assert os.sched_getaffinity(0) == before


def test_cost_per_collective(capsys):
    """Measures one 8-byte all_reduce per rank through the thread baton and
    prints it (docs/python.md, 'Cost'); bounds it loosely."""
    calls = 200

    def fn(rank, world):
        x = torch.ones(1, dtype=f64)
        for _ in range(calls):
            dt.all_reduce(x)

    out = []
    for n in (2, 8):
        t = time.perf_counter()
        sim.run(n, fn, trace=False)
        per_call = (time.perf_counter() - t) / calls
        out.append((n, per_call * 1e6, per_call * 1e6 / n))
    with capsys.disabled():
        for n, us, per_rank in out:
            print(f"\n[cost] sim.run world {n}: {us:.0f} us per all_reduce ({per_rank:.1f} us per rank)")
    assert all(per_rank < 5000 for _, _, per_rank in out)


# ------------------------------------------------ Ctrl-C
@pytest.mark.parametrize("scenario,isolation,alive", [
    ("busy", "thread", 0), ("collective", "thread", 0), ("sleeping", "thread", 4),
    ("busy", "process", 0), ("collective", "process", 0), ("sleeping", "process", 0)])
def test_ctrl_c_interrupts_run(scenario, isolation, alive):
    # SIGINT once the ranks run: run() raises KeyboardInterrupt and every rank
    # ends. A rank thread sleeping outside diffcomm (no exception reaches
    # time.sleep) holds the baton, so run() raises after its grace period
    # (2 s here) and leaves the four rank threads behind (daemons); a rank
    # process gets SIGINT itself, so its sleep ends at once. No rank process
    # and no payload memfd is left after an interrupt.
    program = os.path.join(os.path.dirname(__file__), "programs", "sim_interrupt.py")
    # SIG_DFL in the child: Python installs its KeyboardInterrupt handler only
    # when SIGINT is not ignored at start, and ignored signals survive exec (a
    # job started in the background by a non-interactive shell ignores SIGINT;
    # a CI run launched that way failed here).
    proc = subprocess.Popen([sys.executable, program, scenario, isolation],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "READY\n"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    line = [x for x in out.splitlines() if x.startswith("INTERRUPTED")]
    assert line, out
    _, seconds, threads, children, memfds = line[0].split()
    assert int(threads) == alive, out
    assert (int(children), int(memfds)) == (0, 0), out
    assert float(seconds) < (5 if alive else 3), out
    assert proc.returncode == 0, out


def test_flight_recorder_dump_to_a_directory_is_refused_in_the_simulated_world(tmp_path):
    """A simulated world's recorder keeps no shapes, groups or global rank: dump(dir) refuses
    instead of writing one unreadable rank--1.json for every rank; str() gives its text."""

    def fn(rank, world):
        dt.all_reduce(torch.ones(4))
        with pytest.raises(diffcomm.InvalidArgument, match="simulated world's recorder"):
            world.flight_recorder().dump(str(tmp_path / "fr"))
        return str(world.flight_recorder())

    texts = list(sim.run(3, fn))
    assert len(texts) == 3 and all("all_reduce #0 on 'world'" in t for t in texts)
    assert not (tmp_path / "fr").exists()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(world_size=2**40), diffcomm.InvalidArgument,
     r"world_size = 1099511627776, expected 1\.\.16384"),
    (dict(world_size=0), diffcomm.InvalidArgument, r"world_size = 0, expected 1\.\.16384"),
    (dict(world_size=2.0), TypeError, "world_size must be an int, got float"),
    (dict(world_size=True), TypeError, "world_size must be an int, got bool"),
    (dict(world_size=2, seed=-1), diffcomm.InvalidArgument, r"seed = -1, expected 0\.\."),
    (dict(world_size=2, seed=2**64), diffcomm.InvalidArgument, "seed = 18446744073709551616"),
    (dict(world_size=2, fault=3), TypeError, r"fault must be a pair \(rank, k\), got 3"),
    (dict(world_size=2, fault=(2, 1)), diffcomm.InvalidArgument,
     r"fault rank = 2, expected 0\.\.1"),
    (dict(world_size=2, fault=(0, 0)), diffcomm.InvalidArgument, "fault call k = 0, expected 1"),
    (dict(world_size=2, fault=(0, 2**40)), diffcomm.InvalidArgument,
     "fault call k = 1099511627776"),
    (dict(world_size=2, interrupt_grace_s=-1.0), diffcomm.InvalidArgument,
     r"interrupt_grace_s = -1\.0, expected a finite number >= 0"),
    (dict(world_size=2, interrupt_grace_s=float("nan")), diffcomm.InvalidArgument,
     "interrupt_grace_s = nan"),
    (dict(world_size=2, interrupt_grace_s="5"), TypeError,
     "interrupt_grace_s must be a number, got '5'"),
])
def test_run_arguments_the_binding_cannot_take_get_diffcomm_errors(kwargs, error, message):
    """Values nanobind cannot convert (2**40 ranks, a negative seed) are named, not answered with
    the binding's list of signatures; no rank runs."""
    ran = []
    world_size = kwargs.pop("world_size")
    with pytest.raises(error, match=message) as info:
        sim.run(world_size, lambda rank, world: ran.append(rank), **kwargs)
    assert "incompatible function arguments" not in str(info.value)
    assert ran == []


def test_torch_style_output_first_all_to_all_single_is_named():
    """torch's all_to_all_single(output, input) puts the input where diffcomm's splits go:
    a TypeError says so (it used to be the binding's signature list); bad splits are named."""

    def fn(rank, world):
        x = torch.arange(4.0)
        with pytest.raises(TypeError, match=r"all_to_all_single: output_split_sizes must be a "
                                            r"sequence of ints, got a tensor .*takes \(output, "):
            dt.all_to_all_single(torch.empty(4), x)
        with pytest.raises(TypeError, match=r"input_split_sizes must be a sequence of ints, "
                                            r"got an element 1\.5 \(float\)"):
            dt.all_to_all_single(x, [2, 2], [1.5, 2.5])
        with pytest.raises(TypeError, match="all_gather_v: output_split_sizes must be a "
                                            "sequence of ints, got int"):
            dt.all_gather_v(x, 4)
        return dt.all_to_all_single(x, (2, 2), [2, 2]).tolist()  # tuples still work

    res = sim.run(2, fn).results
    assert res == [[0.0, 1.0, 0.0, 1.0], [2.0, 3.0, 2.0, 3.0]]

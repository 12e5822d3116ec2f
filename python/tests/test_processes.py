"""diffcomm.sim.run(isolation="process"): ranks as OS processes, every guarantee kept.

Each test states its expected values from the program (closed forms) or
compares the two isolations, which share one world and must agree call for
call (same seed, same trace hash, same report text).
"""
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt

ISOLATIONS = ("thread", "process")
_STATE = {"touched_by": None}  # a module global the ranks write


def _children() -> int:
    """Processes whose parent is this one (rank processes left behind)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                n += int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        except (OSError, IndexError, ValueError):
            pass
    return n


def _memfds() -> int:
    """Open payload memfds of this process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "diffcomm-sim-rank" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _python(program):
    """Runs program in a fresh interpreter, with a deadline (a hang fails the test)."""
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)


def _mixed(rank, group):
    """Collectives of several kinds, a sub-group and a send/recv ring."""
    n = group.size()
    x = torch.arange(4, dtype=torch.float64) + rank
    total = dt.all_reduce(x.clone())
    rows = dt.all_gather_single(torch.full((2,), float(rank)))
    evens = group.new_group(list(range(0, n, 2)))
    odds = group.new_group(list(range(1, n, 2)))
    pair = evens if rank % 2 == 0 else odds
    part = dt.all_reduce(torch.ones(3) * rank, group=pair)
    # A ring of sends (diffcomm's own: rendezvous, group-local ranks).
    got = diffcomm.from_dlpack(torch.zeros(5))
    mine = diffcomm.from_dlpack(torch.full((5,), float(rank)))
    if rank % 2 == 0:
        group.send(mine, (rank + 1) % n)
        group.recv(got, (rank - 1) % n)
    else:
        group.recv(got, (rank - 1) % n)
        group.send(mine, (rank + 1) % n)
    got = got.tolist()
    empty = dt.all_gather_single(torch.zeros(0))
    return total.tolist(), rows.tolist(), part.tolist(), got, list(empty.shape)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_one_seed_one_interleaving_in_both_isolations(seed):
    runs = {iso: sim.run(4, _mixed, seed=seed, isolation=iso) for iso in ISOLATIONS}
    assert runs["thread"].trace_hash == runs["process"].trace_hash
    assert runs["thread"].results == runs["process"].results
    assert runs["thread"].stats(2) == runs["process"].stats(2)
    total, rows, part, got, empty = runs["process"][1]
    assert total == [6.0, 10.0, 14.0, 18.0]  # sum over ranks 0..3 of (i + rank)
    assert rows == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert part == [4.0] * 3  # ranks 1 and 3
    assert got == [0.0] * 5 and empty == [0]  # rank 1 receives rank 0's


def test_ranks_are_processes_with_their_own_globals_and_rng():
    def fn(rank, group):
        _STATE["touched_by"] = rank
        torch.manual_seed(0)
        group.barrier()
        return os.getpid(), _STATE["touched_by"], torch.rand(3).tolist()

    res = sim.run(4, fn, isolation="process").results
    assert len({pid for pid, _, _ in res}) == 4 and os.getpid() not in {r[0] for r in res}
    assert [touched for _, touched, _ in res] == [0, 1, 2, 3]
    assert all(draw == res[0][2] for _, _, draw in res)  # as in real processes
    assert _STATE["touched_by"] is None  # the caller's globals are untouched
    # Threads share torch's default generator: the same program draws
    # differently per rank (the reason process isolation is the default).
    shared = sim.run(4, fn, isolation="thread").results
    assert len({tuple(draw) for _, _, draw in shared}) > 1
    _STATE["touched_by"] = None


def test_process_is_the_default_isolation():
    assert sim.run(2, lambda rank, g: os.getpid()).results[0] != os.getpid()


def test_exceptions_come_back_by_rank_with_their_traceback():
    def fn(rank, group):
        if rank == 2:
            raise ValueError("bad input on two")
        group.barrier()

    with pytest.raises(ValueError, match="bad input on two") as info:
        sim.run(4, fn, isolation="process")
    assert info.value.rank == 2
    assert "in fn" in info.value.rank_traceback and "bad input on two" in info.value.rank_traceback
    others = [type(e).__name__ for r, e in enumerate(info.value.rank_errors) if r != 2]
    assert others == ["RankFailure"] * 3


def test_an_unpicklable_return_value_is_named():
    with pytest.raises(TypeError, match="return value on rank 0 cannot be pickled"):
        sim.run(2, lambda rank, g: (lambda: rank), isolation="process")


@pytest.mark.parametrize("case", ["deadlock", "mismatch", "fault"])
def test_reports_have_the_same_text_in_both_isolations(case):
    def fn(rank, group):
        x = torch.ones(3)
        if case == "deadlock" and rank == 1:
            group.recv(diffcomm.from_dlpack(x), 0)
        elif case == "mismatch" and rank == 1:
            dt.broadcast(x, 0)
        else:
            dt.all_reduce(x)
            dt.all_reduce(x)

    texts = {}
    for iso in ISOLATIONS:
        fault = (1, 2) if case == "fault" else None
        with pytest.raises(diffcomm.Error) as info:
            sim.run(3, fn, isolation=iso, fault=fault, seed=5)
        texts[iso] = [f"{type(e).__name__}: {e}" for e in info.value.rank_errors]
    assert texts["thread"] == texts["process"]
    expected = {"deadlock": "Deadlock", "mismatch": "CollectiveMismatch", "fault": "RankFailure"}
    assert any(t.startswith(expected[case]) for t in texts["process"]), texts


@pytest.mark.parametrize("how,named", [
    ("kill", "killed by signal 9 (SIGKILL)"),
    ("exit", "exited with code 3"),
    ("segfault", "killed by signal 11 (SIGSEGV)"),
])
def test_a_rank_process_that_dies_is_a_rank_failure(how, named):
    def fn(rank, group):
        dt.all_reduce(torch.ones(2))
        if rank == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "exit":
                os._exit(3)
            else:
                import ctypes
                ctypes.string_at(0)  # a null read: SIGSEGV
        dt.all_reduce(torch.ones(2))

    before = (_children(), _memfds())
    start = time.monotonic()
    with pytest.raises(diffcomm.RankFailure, match=f"rank 1's process .*{re.escape(named)}") as info:
        sim.run(4, fn, isolation="process")
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    for r in (0, 2, 3):  # the waiting ranks hear of it, naming rank 1
        assert isinstance(info.value.rank_errors[r], diffcomm.RankFailure)
        assert "rank 1" in str(info.value.rank_errors[r])
    assert elapsed < 10  # not a hang (measured: well under a second)
    assert (_children(), _memfds()) == before


def test_nothing_is_left_after_success_or_failure():
    before = (_children(), _memfds())
    sim.run(3, _mixed, isolation="process")
    assert (_children(), _memfds()) == before
    with pytest.raises(diffcomm.Deadlock):
        sim.run(3, lambda rank, g: g.recv(diffcomm.from_dlpack(torch.ones(1)), (rank + 1) % 3),
                isolation="process")
    assert (_children(), _memfds()) == before


def test_large_payloads_grow_the_shared_memory():
    def fn(rank, group):
        x = torch.full((1 << 20,), float(rank + 1), dtype=torch.float64)  # 8 MiB
        return dt.all_reduce(x)[::4096].tolist()

    res = sim.run(3, fn, isolation="process").results
    assert all(v == [6.0] * 256 for v in res)


def test_autograd_through_collectives_in_rank_processes():
    def fn(rank, group):
        x = torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)
        x.requires_grad_()
        y = dt.all_gather_single(x)
        (y * y).sum().backward()  # every rank's loss holds x_r^2: dx_r = 3 * 2 x_r
        return x.grad.tolist()

    res = sim.run(3, fn, isolation="process").results
    assert res == [[6.0 * (r + 1), 12.0 * (r + 1)] for r in range(3)]


def test_bad_isolation_arguments_are_refused():
    with pytest.raises(diffcomm.InvalidArgument, match="isolation='fiber'"):
        sim.run(2, lambda r, g: None, isolation="fiber")
    with pytest.raises(diffcomm.InvalidArgument, match="needs isolation='process'"):
        sim.run(2, lambda r, g: None, isolation="thread", cuda="cpu")
    with pytest.raises(diffcomm.InvalidArgument, match="cuda='gpu'"):
        sim.run(2, lambda r, g: None, cuda="gpu")


def test_diffcomm_errors_survive_pickling():
    for cls in (diffcomm.Deadlock, diffcomm.RankFailure, diffcomm.InvalidArgument):
        e = pickle.loads(pickle.dumps(cls("x")))
        assert type(e) is cls and str(e) == "x"


def test_rank_processes_compute_after_the_caller_used_openmp():
    # The caller's OpenMP threads (torch's and MKL's CPU kernels) do not exist
    # in a forked rank process; a rank that used them would wait forever. Rank
    # processes compute with one thread. In a subprocess with a deadline: a
    # regression is a failure here, not a hung suite.
    program = (
        "import torch, diffcomm.sim as sim\n"
        "torch.set_num_threads(2)\n"
        "a = torch.randn(512, 512, dtype=torch.float64)\n"
        "(a @ a).sum()\n"
        "res = sim.run(2, lambda r, g: float((a @ a).sum()), isolation='process')\n"
        "ref = float((a @ a).sum())  # with 2 threads: another summation order\n"
        "print('OK', res.results[0] == res.results[1], abs(res.results[0] - ref) < 1e-9 * abs(ref))\n")
    out = _python(program)
    assert out.stdout.strip() == "OK True True", out.stdout + out.stderr


def test_cuda_on_cpu_survives_importing_torch_dynamo_and_megatron_inside_fn():
    # torch._dynamo, imported after the patch (megatron-core imports it),
    # refuses one function object under two torch.cuda names. In a subprocess:
    # this suite's own process has imported torch._dynamo already.
    if int(torch.__version__.split(".")[0]) < 2:
        pytest.skip("cuda='cpu' needs torch >= 2 (torch.distributed's rank processes)")
    program = (
        "import sys, torch, diffcomm.sim as sim\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "def fn(r, g):\n"
        "    import torch._dynamo\n"
        "    return torch.cuda.is_available(), torch.empty(2, device='cuda').device.type, \\\n"
        "        torch.ones(2).cuda().device.type, torch.cuda.current_device()\n"
        "print(sim.run(2, fn, cuda='cpu').results)\n")
    out = _python(program)
    assert out.stdout.strip() == "[(True, 'cpu', 'cpu', 0), (True, 'cpu', 'cpu', 0)]", \
        out.stdout + out.stderr


def test_running_out_of_file_descriptors_is_resource_exhausted():
    # Each rank process takes a socket and a memfd in the caller. In a
    # subprocess whose descriptor limit cannot hold 64 ranks.
    program = (
        "import resource, diffcomm, diffcomm.sim as sim\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "try:\n"
        "    sim.run(64, lambda r, g: None, isolation='process')\n"
        "except diffcomm.ResourceExhausted as e:\n"
        "    print('EXHAUSTED', e)\n")
    out = _python(program)
    assert "EXHAUSTED diffcomm.sim.run: cannot make the socket and memfd of rank" in out.stdout, \
        out.stdout + out.stderr
    assert "ulimit -n" in out.stdout

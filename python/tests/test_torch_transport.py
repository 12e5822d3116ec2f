"""The "torch" transport and the launcher checks, from outside the job: a
rank that skips a collective ends the others within the deadline (torch sees
a process that exited at once; a live one hits diffcomm's deadline), MPI
inside a torchrun-style launch is refused instead of running one-rank worlds,
and the "torch" backend needs torch.distributed first. The transport's ops,
gradients and bit-identity with the simulated world are tested as ranks in
python/tests/distributed (scripts/test-python launches them)."""
import os
import subprocess
import sys
import time

import pytest

import diffcomm
import diffcomm.torch as dt
from launch import free_port  # python/tests/launch.py (pytest puts this folder on sys.path)

HERE = os.path.dirname(__file__)
PROGRAM = os.path.join(HERE, "programs", "torch_early_exit.py")


def run_python(code, env):
    """stdout and the process of `code` in a fresh interpreter with `env`."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    return r.stdout, r


def launch(n, args, timeout=120):
    cmd = [sys.executable, os.path.join(HERE, "launch.py"), "-n", str(n), "--", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.parametrize("mode, kind", [("exit", "BackendError"), ("linger", "Timeout")])
def test_a_rank_that_skips_a_call_ends_the_others_within_the_deadline(mode, kind):
    proc, out, elapsed = launch(3, [PROGRAM, "3", mode])
    assert "RESULT rank 2: skipped the call" in out, out
    for r in (0, 1):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"RESULT rank {r}:")), "")
        assert f"RESULT rank {r}: {kind} after" in line, out
        assert f"all_reduce #1 on group 'world' (rank {r} of 3" in line, out
        seconds = float(line.split(" after ")[1].split(" s")[0])
        assert seconds < 3.0 + 2.0, line  # within the 3 s deadline (plus polling)
    assert elapsed < 60, f"the job took {elapsed:.0f} s"


@pytest.mark.mpi
@pytest.mark.skipif(not diffcomm._core.HAVE_MPI, reason="needs diffcomm built with MPI")
def test_mpi_in_a_torchrun_launch_is_refused():
    # What torchrun gives each process: WORLD_SIZE=4, no mpirun (an MPI singleton).
    code = ("import diffcomm, diffcomm.torch as dt\n"
            "try:\n"
            "    dt.init_process_group('mpi')\n"
            "    print('RESULT initialised')\n"
            "except diffcomm.BackendError as e:\n"
            "    print('RESULT BackendError:', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(WORLD_SIZE="4", RANK="0")
    out, _ = run_python(code, env)
    assert ("RESULT BackendError: init_process_group('mpi'): the launcher started WORLD_SIZE=4 "
            "processes but the mpi world has 1 rank(s) (each process is an MPI singleton") in out, out
    assert "init_process_group('torch')" in out, out


def test_torch_backend_needs_torch_distributed_first():
    import torch.distributed as tdist  # noqa: PLC0415

    if tdist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(diffcomm.InvalidArgument, match=r"torch\.distributed is not initialised"):
        dt.init_process_group("torch")


def test_gloo_is_not_a_diffcomm_backend_but_the_message_says_what_is():
    with pytest.raises(diffcomm.InvalidArgument,
                       match=r"unknown backend 'gloo' \(torch, mpi, nccl\).*init_process_group"):
        dt.init_process_group("gloo")


@pytest.mark.mpi
@pytest.mark.skipif(not diffcomm._core.HAVE_MPI, reason="needs diffcomm built with MPI")
def test_mpi_after_destroy_raises_instead_of_aborting_the_process():
    # MPI cannot be initialised again after MPI_Finalize: this used to abort
    # the whole process inside MPI. (A singleton world, as a lone process.)
    code = ("import diffcomm, diffcomm.torch as dt\n"
            "dt.init_process_group('mpi')\n"
            "dt.destroy_process_group()\n"
            "try:\n"
            "    dt.init_process_group('mpi')\n"
            "    print('RESULT initialised again')\n"
            "except diffcomm.BackendError as e:\n"
            "    print('RESULT BackendError:', e)\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_")) and k not in ("WORLD_SIZE", "RANK")}
    out, r = run_python(code, env)
    assert "RESULT BackendError: init_process_group('mpi'): MPI was finalised" in out, \
        out + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


def test_torch_transport_can_be_created_again_after_destroy():
    code = ("import os, torch, torch.distributed as tdist, diffcomm.torch as dt\n"
            "tdist.init_process_group('gloo', rank=0, world_size=1)\n"
            "for _ in range(2):\n"
            "    dt.init_process_group('torch')\n"
            "    assert dt.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]\n"
            "    dt.destroy_process_group()\n"
            "print('RESULT OK')\n")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("WORLD_SIZE", None)
    out, r = run_python(code, env)
    assert "RESULT OK" in out, out + r.stderr

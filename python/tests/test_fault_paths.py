"""Fault paths of Python programs (issue [7/8]): a job whose rank times out
ends at interpreter exit instead of hanging in MPI_Finalize; bad deadlines
are refused; a world whose rank threads or fiber stacks cannot be had raises
ResourceExhausted instead of aborting; one thread per group."""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import diffcomm
import diffcomm.sim as sim

HERE = os.path.dirname(__file__)
needs_mpi = pytest.mark.skipif(not diffcomm._core.HAVE_MPI or shutil.which("mpirun") is None,
                               reason="needs diffcomm built with MPI, and mpirun")


def mpirun(np, args, env=None, timeout=120):
    cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--allow-run-as-root", "--mca", "btl",
           "self,vader", sys.executable] + args
    full_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    **(env or {}))
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.mpi
@needs_mpi
def test_interpreter_exit_after_a_timeout_ends_the_job():
    # Rank 1 never arrives; rank 0 gets Timeout after 2 s and returns from the
    # program. Without the exit hook MPI_Finalize waited for the barrier's
    # request (forever: rank 1 sleeps 600 s).
    proc, out, elapsed = mpirun(2, [os.path.join(HERE, "programs", "exit_after_timeout.py"),
                                    "stall"])
    assert "RESULT rank 0: Timeout: timed out after 2 s waiting in barrier #0" in out, out
    assert "ending the MPI job with MPI_Abort (code 124)" in out, out
    assert "barrier #0 on group 'world' (rank 0 of 2) timed out earlier" in out, out
    assert proc.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


@pytest.mark.mpi
@needs_mpi
def test_a_nan_deadline_is_refused():
    proc, out, _ = mpirun(2, [os.path.join(HERE, "programs", "exit_after_timeout.py"), "nan"],
                          env={"DIFFCOMM_TIMEOUT": "nan"})
    for r in (0, 1):
        assert (f"RESULT rank {r}: InvalidArgument: DIFFCOMM_TIMEOUT='nan': expected a finite "
                "number of seconds > 0") in out, out
    assert proc.returncode == 0, out


def run_limited(code, timeout=120):
    """Runs `code` in a fresh interpreter whose address space is limited, after
    the imports, to what it uses plus LIMIT_MIB (set by the code)."""
    prelude = textwrap.dedent("""
        import resource, threading
        import diffcomm, diffcomm.sim as sim
        def limit_to(extra_mib):
            with open("/proc/self/status") as f:
                vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
            lim = vm + extra_mib * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    """)
    env = dict(os.environ, MALLOC_ARENA_MAX="1")  # no 64 MiB arena reservation per thread
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux")
def test_rank_threads_beyond_the_address_space_raise_resource_exhausted():
    # 4096 rank threads of 8 MiB stacks under +256 MiB: the OS refuses one.
    proc = run_limited("""
        limit_to(256)
        threading.stack_size(8 * 2**20)
        try:
            sim.run(4096, lambda rank, group: None, isolation="thread")
            print("RAN")
        except diffcomm.ResourceExhausted as e:
            print("EXHAUSTED", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "EXHAUSTED diffcomm.sim.run: cannot start the thread of rank" in proc.stdout, proc.stdout
    assert "of 4096" in proc.stdout and "8388608 bytes" in proc.stdout, proc.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux")
def test_fiber_stacks_beyond_the_address_space_raise_resource_exhausted():
    # The limit is set once the 1024 rank threads run, so what fails is the
    # world's fiber stacks (1024 x 64 KiB proxy stacks, 68 MiB with guards).
    proc = run_limited("""
        threading.stack_size(64 * 1024)
        import diffcomm.sim._run as sim_run  # the hook: run()'s thread start
        start_threads = sim_run._start_rank_threads
        def start_then_limit(world, threads):
            start_threads(world, threads)
            limit_to(16)
        sim_run._start_rank_threads = start_then_limit
        try:
            sim.run(1024, lambda rank, group: None, isolation="thread")
            print("RAN")
        except diffcomm.ResourceExhausted as e:
            print("EXHAUSTED", isinstance(e, MemoryError), e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "EXHAUSTED True" in proc.stdout, proc.stdout + proc.stderr
    assert "cannot allocate the fiber stack of rank" in proc.stdout, (
        proc.stdout + proc.stderr)
    assert "of 1024 (65536 bytes each" in proc.stdout, proc.stdout


@pytest.mark.mpi
@needs_mpi
def test_uncaught_exception_ends_the_mpi_job_at_once():
    program = os.path.join(HERE, "programs", "uncaught_exception.py")
    proc, out, elapsed = mpirun(3, [program])
    assert "RuntimeError: rank 1 gave up" in out, out  # Python's traceback first
    assert ("diffcomm: rank 1 of the MPI job raised an uncaught RuntimeError: rank 1 gave up; "
            "ending the job with MPI_Abort (code 1) once every rank has reported") in out, out
    # Issue [4/7] item 1: the others stop waiting and report before the abort.
    for r in (0, 2):
        assert (f"RankFailure: stopped waiting in barrier #0 on group 'world' (rank {r} of 3): "
                "barrier(): MPI rank 1 is ending the job (uncaught RuntimeError: rank 1 gave up)"
                ) in out, out
    assert "diffcomm: MPI rank 0 ends the job with MPI_Abort (code 1) after 3 of 3 processes "\
        "reported" in out, out
    assert "NOT REACHED" not in out, out
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end (deadline 600 s)"


@pytest.mark.mpi
@needs_mpi
def test_a_forked_child_leaves_the_parents_mpi_alone():
    # Issue [4/7] item 4: os.fork() after init_process_group("mpi") hung the
    # job when the child exited, and a collective after destroy_process_group
    # ended in Open MPI's abort.
    proc, out, elapsed = mpirun(2, [os.path.join(HERE, "programs", "fork_after_init.py")],
                                timeout=60)
    for r in (0, 1):
        assert f"RESULT rank {r}: child (exit) exit code 7" in out, out
        assert f"RESULT rank {r}: child (raise) exit code 1" in out, out
        assert f"RESULT rank {r}: sum [4.0, 4.0]" in out, out
        assert (f"RESULT rank {r}: after destroy_process_group: BackendError: all_reduce on "
                "group 'world'") in out, out
    assert "MPI was finalised (destroy_process_group" in out, out
    assert f"child of rank 0 gave up" in out, out  # the child's traceback, and no abort
    assert "MPI_Abort" not in out, out
    assert proc.returncode == 0, out
    assert elapsed < 30, f"the job took {elapsed:.0f} s"


@pytest.mark.mpi
@needs_mpi
def test_uncaught_exception_hook_can_be_turned_off():
    # DIFFCOMM_ABORT_ON_EXCEPTION=0: no abort; rank 1's interpreter exits
    # through MPI_Finalize, which waits for the others, and rank 0 waits in
    # its barrier until the deadline (1 s here, 600 s by default).
    code = textwrap.dedent("""
        import diffcomm.torch as dt
        dt.init_process_group("mpi", check=False, timeout_s=1)
        if dt.get_rank() == 1:
            raise RuntimeError("quiet")
        try:
            dt.get_world().barrier()
        except Exception as e:
            print("RESULT", type(e).__name__, flush=True)
    """)
    proc, out, _ = mpirun(2, ["-c", code], env={"DIFFCOMM_ABORT_ON_EXCEPTION": "0"})
    assert "RuntimeError: quiet" in out, out
    assert "ending the job with MPI_Abort (code 1)" not in out, out
    assert "RESULT Timeout" in out, out

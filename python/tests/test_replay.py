"""diffcomm.sim.replay (issue 22): PyTorch Flight Recorder dumps of real gloo
jobs (the checked-in fixtures, and fresh ones from the torch this suite runs
under when it records gloo, torch >= 2.5), and diffcomm's own dumps written
by a torch-transport or MPI job on request and at exit after an uncaught
error, each replayed to the verdict the job's failure must give."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import diffcomm
import diffcomm.sim as dsim

HERE = os.path.dirname(__file__)
FIXTURES = os.path.join(HERE, "..", "..", "tests", "data", "torch_fr")
JOB = os.path.join(HERE, "programs", "fr_dump_job.py")
TORCH_MAJOR_MINOR = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def test_torch_fixtures_give_their_verdicts():
    cases = {"ok-pkl": ("ok", "", None, [], ""),
             "dtype-pkl": ("mismatch", "all_reduce", 10, [0, 1], "dtype"),
             "size-json": ("mismatch", "all_reduce", 10, [0, 2], "shape"),
             # rank 0 called all_reduce, rank 1 broadcast: the report names rank 0's call
             "op-pkl": ("mismatch", "all_reduce", 10, [0, 1], "op"),
             "skip-pkl": ("deadlock", "barrier", 10, [2], ""),
             "wrap-pkl": ("incomplete", "", 1, [1], "")}
    for name, (verdict, op, call, ranks, field) in cases.items():
        rep = dsim.replay(os.path.join(FIXTURES, name))
        assert (rep.verdict, rep.op, rep.call, rep.ranks, rep.field) == \
            (verdict, op, call, ranks, field), (name, str(rep))
        assert rep.exit_code == {"ok": 0, "mismatch": 3, "deadlock": 3, "incomplete": 4}[verdict]
        assert any("all_to_all_single splits" in u for u in rep.unknown), rep.unknown
    dead = dsim.replay(os.path.join(FIXTURES, "skip-pkl"))
    assert [p.finished for p in dead.pending] == [False, False, True]
    assert dead.pending[0].not_reached == [2]
    assert "rank 0: waits in barrier #10 on 'world' (never reached by rank(s) 2)" in str(dead)


def test_edits_and_seeds_as_on_the_command_line():
    skip = os.path.join(FIXTURES, "skip-pkl")
    # what if rank 2 had reached the barrier?
    assert dsim.replay(skip, insert_barrier=["2:world:10"]).verdict == "ok"
    # what if ranks 0 and 1 had not called it?
    assert dsim.replay(skip, drop=["0:world:10", "1:world:10"]).verdict == "ok"
    for seed in range(3):
        assert dsim.replay(skip, seed=seed).verdict == "deadlock"
    with pytest.raises(diffcomm.InvalidArgument, match="recorded no call #99"):
        dsim.replay(skip, drop=["0:world:99"])
    with pytest.raises(diffcomm.InvalidArgument, match="--drop 0:world:10 given twice"):
        dsim.replay(skip, drop=["0:world:10", "0:world:10"])


def test_bad_input_names_the_file(tmp_path):
    d = tmp_path / "dumps"
    shutil.copytree(os.path.join(FIXTURES, "dtype-pkl"), d)
    (d / "rank_2.pkl").write_bytes((d / "rank_2.pkl").read_bytes()[:200])
    with pytest.raises(diffcomm.InvalidArgument, match=r"rank_2\.pkl: pickle truncated .* at offset 200"):
        dsim.replay(d)
    shutil.copy(os.path.join(FIXTURES, "dtype-pkl", "rank_2.pkl"), d / "rank_2.pkl")
    os.remove(d / "rank_1.pkl")
    with pytest.raises(diffcomm.InvalidArgument, match="no dump of rank 1"):
        dsim.replay(d)


def torchrun(n, args, env=None, timeout=180):
    cmd = [sys.executable, os.path.join(HERE, "launch.py"), "-n", str(n), "--grace", "20", "--",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    return proc, proc.stdout + proc.stderr


@pytest.mark.skipif(TORCH_MAJOR_MINOR < (2, 5),
                    reason="torch < 2.5 has no Flight Recorder for gloo")
@pytest.mark.parametrize("case, fmt, verdict, ranks", [("dtype", "pkl", "mismatch", [0, 1]),
                                                        ("skip", "json", "deadlock", [2])])
def test_fresh_torch_dumps_of_a_broken_gloo_job(tmp_path, case, fmt, verdict, ranks):
    generate = os.path.join(FIXTURES, "generate.py")
    proc, out = torchrun(3, [generate, case, str(tmp_path), fmt],
                         env={"TORCH_FR_BUFFER_SIZE": "2000"})
    assert proc.returncode == 0, out
    rep = dsim.replay(tmp_path)
    assert (rep.verdict, rep.ranks) == (verdict, ranks), str(rep)


def test_torch_transport_dumps_on_request(tmp_path):
    proc, out = torchrun(3, [JOB, "torch", "request", str(tmp_path)])
    assert proc.returncode == 0, out
    dump = json.loads((tmp_path / "rank-2.json").read_text())
    assert (dump["rank"], dump["world_size"]) == (2, 3)
    # Format 2: an entry is a row whose second value indexes the descriptions.
    ops = [dump["calls"][e[1]]["op"] for e in dump["entries"]]
    assert ops == ["all_reduce", "all_gather_single"] or ops[:1] == ["all_reduce"], dump
    assert dsim.replay(tmp_path).verdict == "ok"


def check_raise_dumps(tmp_path, out):
    """Rank 1 died between calls: its dump (from the excepthook) ends at
    all_gather #1; the others' (from the funnel) at all_reduce #2."""
    for r in (0, 2):
        assert f"RESULT rank {r}: " in out, out
    rep = dsim.replay(tmp_path)
    assert rep.verdict == "deadlock", str(rep) + out
    assert (rep.group, rep.call, rep.op, rep.ranks) == ("world", 2, "all_reduce", [1]), str(rep)


def test_torch_transport_rank_dying_of_an_uncaught_exception_dumps(tmp_path):
    start = time.monotonic()
    # PET_MONITOR_INTERVAL: torchrun's agent looks at its workers every 3 s
    # (not 0.1 s): the others' call fails at once and they dump then; the test
    # must not depend on that winning a race with the agent's SIGTERM.
    proc, out = torchrun(3, [JOB, "torch", "raise", str(tmp_path)],
                         env={"DIFFCOMM_FR_DUMP_DIR": str(tmp_path), "PET_MONITOR_INTERVAL": "3"})
    assert proc.returncode != 0, out
    assert "rank 1: a bug between two collectives" in out, out
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "rank-1.json", "rank-2.json"], out
    check_raise_dumps(tmp_path, out)
    assert time.monotonic() - start < 90


@pytest.mark.mpi
@pytest.mark.skipif(not diffcomm._core.HAVE_MPI or shutil.which("mpirun") is None,
                    reason="needs diffcomm built with MPI, and mpirun")
def test_mpi_rank_dying_of_an_uncaught_exception_dumps(tmp_path):
    # DIFFCOMM_ABORT_ON_EXCEPTION=0: the others live to their 3 s deadline and
    # dump on Timeout (with MPI_Abort they would be killed before any dump).
    cmd = ["mpirun", "-np", "3", "--oversubscribe", "--allow-run-as-root", "--mca", "btl",
           "self,vader", "-x", "DIFFCOMM_FR_DUMP_DIR", "-x", "DIFFCOMM_ABORT_ON_EXCEPTION",
           sys.executable, JOB, "mpi", "raise", str(tmp_path)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               DIFFCOMM_FR_DUMP_DIR=str(tmp_path), DIFFCOMM_ABORT_ON_EXCEPTION="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "rank-1.json", "rank-2.json"], out
    check_raise_dumps(tmp_path, out)

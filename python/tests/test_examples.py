"""The Python examples of docs/python.md, run as a user runs them."""
import os
import shutil
import subprocess
import sys

import pytest

import diffcomm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples", "python")


def test_sim_property_example():
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "sim_property.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal the single-rank reference" in r.stdout


def mpirun(np, script):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(["mpirun", "-np", str(np), "--oversubscribe", "--mca", "btl",
                           "self,vader", sys.executable, os.path.join(EXAMPLES, script)],
                          capture_output=True, text=True, timeout=600, env=env)


def torchrun(np, script):
    # torchrun's environment (python/tests/launch.py: torchrun itself where it works).
    return subprocess.run([sys.executable, os.path.join(ROOT, "python", "tests", "launch.py"),
                           "-n", str(np), "--", os.path.join(EXAMPLES, script)],
                          capture_output=True, text=True, timeout=600)


needs_mpi = pytest.mark.skipif(not diffcomm._core.HAVE_MPI or shutil.which("mpirun") is None,
                               reason="needs diffcomm built with MPI, and mpirun")


@pytest.mark.mpi
@needs_mpi
def test_train_step_mpi_example():
    r = mpirun(4, "train_step.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 4, r.stdout


def test_train_step_torchrun_example():
    r = torchrun(4, "train_step.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 4, r.stdout


@pytest.mark.parametrize("launcher",
                         ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi), "sim"])
def test_quickstart_example(launcher):
    # The README's first Python program, under its three launchers.
    if launcher == "mpirun" and (not diffcomm._core.HAVE_MPI or shutil.which("mpirun") is None):
        pytest.skip("needs diffcomm built with MPI, and mpirun")
    if launcher == "sim":
        r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "quickstart.py"), "--sim", "4"],
                           capture_output=True, text=True, timeout=600)
    else:
        r = (torchrun if launcher == "torchrun" else mpirun)(4, "quickstart.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 4, r.stdout

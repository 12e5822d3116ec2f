"""The Python examples of docs/python.md, run as a user runs them."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples", "python")


def test_sim_property_example():
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "sim_property.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal the single-rank reference" in r.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_train_step_mpi_example():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(["mpirun", "-np", "4", "--oversubscribe", "--mca", "btl", "self,vader",
                        sys.executable, os.path.join(EXAMPLES, "train_step.py")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 4, r.stdout


def test_train_step_torchrun_example():
    # torchrun's environment (python/tests/launch.py: torchrun itself where it works).
    r = subprocess.run([sys.executable, os.path.join(ROOT, "python", "tests", "launch.py"), "-n",
                        "4", "--", os.path.join(EXAMPLES, "train_step.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("-> OK") == 4, r.stdout

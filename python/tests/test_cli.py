"""The diffcomm-sim program shipped in the package: ``python -m diffcomm.sim`` and the
``diffcomm-sim`` console script run it with its arguments, output and exit codes, and it finds
the shipped COCO sizes next to itself (no source tree needed)."""
import os
import subprocess
import sys

import pytest

import diffcomm.sim as sim
from diffcomm.sim import __main__ as cli


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "diffcomm.sim", *args], capture_output=True,
                          text=True, timeout=120, cwd="/")


def test_the_program_is_inside_the_package_with_its_data():
    assert os.access(cli.program(), os.X_OK), cli.program()
    package = os.path.dirname(os.path.dirname(cli.program()))
    data = os.path.join(package, "share", "diffcomm", "data", "coco_val2017")
    assert os.path.exists(os.path.join(data, "image_sizes.csv"))
    assert os.path.exists(os.path.join(data, "README.md"))  # the license note travels with it
    assert sim.default_images_path() == os.path.join(data, "image_sizes.csv")


def test_python_m_diffcomm_sim_runs_the_step_and_its_exit_code():
    ok = run_module("step", "--ranks", "4", "--tp", "2", "--sp", "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"passed":true' in ok.stdout, ok.stdout
    bad = run_module("step", "--batch", "0")
    assert bad.returncode == 2
    assert bad.stderr.startswith("diffcomm-sim: bad argument: --batch"), bad.stderr
    unknown = run_module("nosuch")
    assert unknown.returncode == 2 and "unknown subcommand 'nosuch'" in unknown.stderr


def test_tokens_reads_the_shipped_sizes_from_any_directory():
    out = run_module("tokens")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "image_id,tokens" and len(lines) == 5001  # COCO val2017: 5000 images


def test_replay_of_a_missing_directory_is_a_bad_argument(tmp_path):
    out = run_module("replay", str(tmp_path / "nothing"))
    assert out.returncode == 2, out
    assert "diffcomm-sim" in out.stderr


def test_the_console_script_is_on_the_environments_path():
    script = os.path.join(os.path.dirname(sys.executable), "diffcomm-sim")
    if not os.path.exists(script):
        pytest.skip("diffcomm is on PYTHONPATH here, not pip-installed into this environment "
                    "(no console script)")
    out = subprocess.run([script, "check", "--op", "all_reduce", "--ranks", "3", "--seed", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all_reduce" in out.stdout

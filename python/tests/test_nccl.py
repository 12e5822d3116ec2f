"""NCCL from Python: skipped without a GPU (run by scripts/gpu-check on one)."""
import os

import pytest
import torch

import diffcomm

pytestmark = pytest.mark.skipif(
    not (diffcomm.HAVE_NCCL and torch.cuda.is_available()),
    reason="needs a diffcomm build with NCCL and a CUDA device")


def test_nccl_all_reduce_and_grad_single_rank():
    import torch.distributed as tdist

    import diffcomm.torch as dt

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", rank=0, world_size=1)
    g = dt.init_process_group("nccl", group=tdist.group.WORLD)
    x = torch.arange(4, dtype=torch.float32, device="cuda").requires_grad_()
    y = dt.all_reduce(x, group=g)
    (y * 3).sum().backward()
    torch.cuda.synchronize()
    assert y.device.type == "cuda" and y.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert x.grad.tolist() == [3.0] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_over_torchs_own_group():
    # What a pip-installed diffcomm does for "nccl": torch's NCCL group and
    # library, through the torch transport (one rank per visible GPU, at most 2).
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    n = min(torch.cuda.device_count(), 2)
    r = subprocess.run([sys.executable, os.path.join(here, "launch.py"), "-n", str(n), "--",
                        os.path.join(here, "programs", "nccl_torch.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": OK") == n, r.stdout + r.stderr

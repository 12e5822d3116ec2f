"""Multi-process tests of diffcomm.torch on a production transport, with torch
gloo over the same processes as the peer oracle. Two ways to run them:

* ``mpirun -np 4 python -m pytest python/tests/distributed``: diffcomm over MPI.
* ``python python/tests/launch.py -n 4 -- -m pytest python/tests/distributed``
  with ``DIFFCOMM_TEST_TRANSPORT=torch``: torchrun's environment contract
  (RANK, WORLD_SIZE, MASTER_ADDR, ...); diffcomm over the "torch" transport
  on torch's gloo group.

Otherwise every test is skipped (scripts/test-python runs both)."""
import os

import pytest
import torch.distributed as tdist

import diffcomm.torch as dt


def transport():
    """"mpi", "torch", or None (not launched as ranks)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return "mpi"
    if os.environ.get("DIFFCOMM_TEST_TRANSPORT") == "torch" and "RANK" in os.environ:
        return "torch"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi_only: needs the MPI transport (mpi4py)")
    kind = transport()
    if kind == "mpi":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", os.environ.get("DIFFCOMM_TEST_PORT", "29517"))
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        tdist.init_process_group("gloo", rank=rank, world_size=size)
        dt.init_process_group("mpi")
    elif kind == "torch":
        tdist.init_process_group("gloo")  # env:// from the launcher
        dt.init_process_group("torch")


def pytest_collection_modifyitems(config, items):
    kind = transport()
    for it in items:
        if kind is None:
            it.add_marker(pytest.mark.skip(
                reason="run as ranks: mpirun -np 4, or tests/launch.py -n 4 with "
                       "DIFFCOMM_TEST_TRANSPORT=torch (scripts/test-python does both)"))
        elif "mpi_only" in it.keywords and kind != "mpi":
            it.add_marker(pytest.mark.skip(reason="needs the MPI transport"))


def checked_world():
    """A second world group of the same transport, with checked mode on."""
    from diffcomm import _core  # noqa: PLC0415

    if transport() == "mpi":
        return _core.mpi.world(check=True, timeout_s=60)
    from diffcomm.torch._transport import TorchOps  # noqa: PLC0415

    ops = TorchOps()
    return _core.torch_transport.group(ops, ops.duplicate, "checked", check=True, timeout_s=60)

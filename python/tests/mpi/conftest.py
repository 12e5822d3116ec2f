"""Tests run under `mpirun -np 4 python -m pytest python/tests/mpi`: every
process is one rank of diffcomm's MPI world and of a torch gloo group (the
peer oracle), both over the same processes."""
import os

import pytest
import torch.distributed as tdist

import diffcomm.torch as dt


def pytest_configure(config):
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("DIFFCOMM_TEST_PORT", "29517"))
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    tdist.init_process_group("gloo", rank=rank, world_size=size)
    dt.init_process_group("mpi")


def pytest_collection_modifyitems(config, items):
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        skip = pytest.mark.skip(reason="run under mpirun -np 4 (scripts/test-python does)")
        for it in items:
            it.add_marker(skip)

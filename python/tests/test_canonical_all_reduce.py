"""diffcomm.torch.canonical_all_reduce: the same bits for every world size.

* In the simulated world (diffcomm.sim.run) on 1..8 ranks, float64 and
  float32, sum and avg: every rank's result equals canonical_sum of all the
  chunks on one process, bit for bit; an ordinary all_reduce of the same
  chunks does not (the problem this solves).
* Under mpirun (the MPI transport) and under torchrun's environment (the torch
  transport on gloo) with 8 processes: programs/canonical_bits.py runs it on
  every group size 1..8; every size must print the single-process bits.
The adjoint against torch's own all_reduce runs under both launchers in
distributed/test_torch_ops.py."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import diffcomm
import diffcomm.sim as dsim
import diffcomm.torch as dt

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "programs"))
import canonical_bits  # noqa: E402


def spread(c, n, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(c, n, generator=g, dtype=torch.float64) + 1) * torch.pow(
        2.0, torch.randint(-20, 21, (c, n), generator=g).to(torch.float64))
    return (x * (torch.randint(0, 2, (c, n), generator=g) * 2 - 1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_simulated_world_sizes_1_to_8_give_the_bits_of_one_process(dtype, op):
    chunks = spread(840, 5, dtype)
    one = dt.canonical_sum(chunks, op)
    plain = set()
    for w in range(1, 9):
        k = 840 // w

        def step(r, g, k=k):
            mine = chunks[r * k:(r + 1) * k].clone()
            ordinary = dt.all_reduce(mine.sum(0), group=g)
            return dt.canonical_all_reduce(mine, op, group=g), ordinary

        for y, ordinary in dsim.run(w, step, seed=w).results:
            assert torch.equal(y, one), (w, (y - one).abs().max())
            plain.add(ordinary.numpy().tobytes())
    assert len(plain) > 1  # an ordinary all_reduce's bits change with the world size


def test_canonical_sum_is_the_tree_of_the_header():
    x = torch.tensor([1e16, 1.0, -1e16, 1.0, 3.0, 1.0, 0.5, 1.0], dtype=torch.float64)
    expected = ((1e16 + 3.0) + (-1e16 + 0.5)) + ((1.0 + 1.0) + (1.0 + 1.0))
    assert dt.canonical_sum(x).item() == expected
    assert dt.canonical_sum(x).item() != sum(x.tolist())


def test_bad_arguments_name_the_op():
    with pytest.raises(diffcomm.InvalidArgument, match="canonical_all_reduce.*0-d"):
        dsim.run(2, lambda r, g: dt.canonical_all_reduce(torch.zeros(()), group=g))
    with pytest.raises(diffcomm.InvalidArgument, match="max is not canonical"):
        dsim.run(1, lambda r, g: dt.canonical_all_reduce(torch.zeros(2), "max", group=g))
    with pytest.raises(diffcomm.CollectiveMismatch, match="members must hold the same number"):
        dsim.run(2, lambda r, g: dt.canonical_all_reduce(torch.zeros(1 + r, 3), group=g))
    # Shapes whose slices fit and ops that differ were wrong sums without an error.
    with pytest.raises(diffcomm.CollectiveMismatch, match=r"chunks of \[4\]"):
        dsim.run(2, lambda r, g: dt.canonical_all_reduce(torch.zeros(2, 3 + r), group=g))
    with pytest.raises(diffcomm.CollectiveMismatch, match="op avg"):
        dsim.run(2, lambda r, g: dt.canonical_all_reduce(torch.ones(2, 3), ["sum", "avg"][r],
                                                         group=g))
    with pytest.raises(diffcomm.InvalidArgument, match="avg is undefined for integer"):
        dsim.run(1, lambda r, g: dt.canonical_all_reduce(torch.ones(2, 3, dtype=torch.int64),
                                                         "avg", group=g))
    with pytest.raises(diffcomm.InvalidArgument, match="torch.stack a list first"):
        dt.canonical_sum([torch.ones(2), torch.ones(2)])


def one_process_bits():
    y = dt.canonical_sum(canonical_bits.global_chunks())
    return hashlib.sha256(y.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("launcher", [pytest.param("mpi", marks=pytest.mark.mpi), "torch"])
def test_eight_processes_give_the_bits_of_one_on_every_group_size(launcher):
    if launcher == "mpi" and (not diffcomm._core.HAVE_MPI or shutil.which("mpirun") is None):
        pytest.skip("needs diffcomm built with MPI, and mpirun")
    program = os.path.join(HERE, "programs", "canonical_bits.py")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if launcher == "mpi":
        cmd = ["mpirun", "-np", "8", "--oversubscribe", "--mca", "btl", "self,vader",
               sys.executable, program, "mpi"]
    else:
        cmd = [sys.executable, os.path.join(HERE, "launch.py"), "-n", "8", "--", program, "torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    expected = one_process_bits()
    got = dict(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("BITS "))
    assert got == {str(s): expected for s in range(1, 9)}, out


def test_data_parallel_gradients_of_docs_python_md_are_identical_on_1_2_4_8_ranks():
    """The pattern of docs/python.md: C micro-batches, each one's gradient kept
    apart, averaged with canonical_all_reduce."""
    C = 8
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(C, 16, 5, generator=g, dtype=torch.float64) * 1e3
    ys = torch.randn(C, 16, generator=g, dtype=torch.float64)
    w0 = torch.randn(5, generator=g, dtype=torch.float64)

    def step(rank, group, world):
        k = C // world
        w = w0.clone().requires_grad_()
        grads = []
        for j in range(k):
            w.grad = None
            b = rank * k + j
            ((xs[b] @ w - ys[b]) ** 2).mean().backward()
            grads.append(w.grad.clone())
        canonical = dt.canonical_all_reduce(torch.stack(grads), "avg", group=group)
        plain = dt.all_reduce(torch.stack(grads).sum(0), group=group) / C
        return canonical, plain

    got = {w: dsim.run(w, lambda r, grp, w=w: step(r, grp, w)).results[0] for w in (1, 2, 4, 8)}
    for w in (2, 4, 8):
        assert torch.equal(got[w][0], got[1][0]), w
    assert any(not torch.equal(got[w][1], got[1][1]) for w in (2, 4, 8))

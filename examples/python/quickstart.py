"""The README's first Python program: one data-parallel training step whose
loss couples the ranks' rows, through diffcomm.torch, checked against the
single-rank float64 reference. The same train() runs under three launchers:

    torchrun --nproc_per_node 4 examples/python/quickstart.py        # torch's gloo group
    mpirun -np 4 python examples/python/quickstart.py                # MPI
    python examples/python/quickstart.py --sim 4                     # the simulated world
"""
import os
import sys

import torch

import diffcomm.torch as dt

f64 = torch.float64


def batch(rank):
    """This rank's 4 rows of the global batch."""
    return torch.randn(4, 8, dtype=f64, generator=torch.Generator().manual_seed(rank))


def loss_of(h):
    """A loss over the whole global batch: couples every rank's rows."""
    return (h.sum(0) ** 2).sum()


def train(rank, world, lr=0.1):
    n = world.size()
    w = torch.randn(8, 8, dtype=f64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)                    # replicated weight
    h = torch.tanh(batch(rank) @ w)                         # this rank's rows
    rows = dt.all_gather_single(h, group=world)            # all 4n rows, differentiable
    dt.backward(loss_of(rows) / n)                          # each rank backpropagates 1/n of the loss
    grad = dt.all_reduce(w.grad, group=world)              # sum of the ranks' parts = dL/dW
    with torch.no_grad():
        w -= lr * grad                                     # SGD, identical on every rank
    return grad


def reference(n):
    """dL/dW on one rank, float64: the global batch in one matrix."""
    w = torch.randn(8, 8, dtype=f64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    x = torch.cat([batch(r) for r in range(n)])
    loss_of(torch.tanh(x @ w)).backward()
    return w.grad


def check(rank, n, grad):
    ref = reference(n)
    err = float((grad - ref).abs().max() / ref.abs().max())
    assert err <= 1e-12, f"rank {rank}: gradient differs from the single-rank reference by {err}"
    line = f"rank {rank}/{n}: dL/dW rel diff vs single-rank reference {err:.1e} -> OK\n"
    os.write(1, line.encode())  # one write: ranks under a launcher share the terminal


def main():
    if "--sim" in sys.argv:                                # n ranks as threads, one process
        import diffcomm.sim as sim  # noqa: PLC0415

        n = int(sys.argv[sys.argv.index("--sim") + 1])
        for rank, grad in enumerate(sim.run(n, train, seed=0)):
            check(rank, n, grad)
        return
    if "OMPI_COMM_WORLD_RANK" in os.environ:               # mpirun
        world = dt.init_process_group("mpi")
    else:                                                  # torchrun
        import torch.distributed as dist  # noqa: PLC0415

        dist.init_process_group("gloo")
        world = dt.init_process_group("torch")             # diffcomm over torch's group
    check(world.rank(), world.size(), train(world.rank(), world))
    dt.destroy_process_group()
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        # torch's own group too: torch 1.13's gloo group left for interpreter
        # exit can end the process in std::terminate (a joinable thread).
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""diffcomm.torch over MPI against mpi4py on the same tensors (issue 27 items 2 and 3).

Run under mpirun (np 2 or 4), e.g.

    mpirun -np 2 --allow-run-as-root --mca btl self,vader \\
        build/python-venv/bin/python bench/bench_torch_mpi.py

Every iteration times `reps` calls of each variant back to back, in an order
shuffled per iteration (seeded: the same on every process; a rotation kept each
variant's predecessor fixed, which moved `core` by 20 % at 16 MiB), each
bracketed by barriers, taking the slowest process's time; the
table gives medians over iterations of the time per call, of the paired ratio
to the mpi4py call of the same iteration and (diffcomm.torch variants) of the
paired difference to `core`: what the torch layer adds over the C++ op.
`mpirun -np 1` (or no mpirun) measures that layer without a peer to wait for.

Variants (all_reduce, float32, sum, bytes per rank):
  mpi4py       comm.Allreduce(x, out): out preallocated once (the floor a user has)
  core         diffcomm's C++ op through its binding on diffcomm tensors made once
               (_core.nn.all_reduce: output allocated, deterministic reduction)
  torch        diffcomm.torch.all_reduce(x) (no input requires grad: no autograd bridge)
  torch_grad   the same with x.requires_grad (through the bridge); the recorded
               backward is discarded after each call (discard_pending), which is
               included in the time
  native       diffcomm.torch.all_reduce(x) on a native_reduction group (MPI's sum)
  mpi4py_ip    comm.Allreduce(MPI.IN_PLACE, x): the in-place floor
  torch_ip     diffcomm.torch.all_reduce_(x) (in place; its ratio is to mpi4py_ip)
Checks are off on every diffcomm group (check=False), as mpi4py has none.
Every variant has its own tensors, so none finds the cache warmed (or
cooled) by the variant before it (as bench_mpi.cpp).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch
from mpi4py import MPI

import diffcomm.torch as dct
from diffcomm import _core


def timed(comm, reps, fn):
    comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(reps):
        fn()
    comm.Barrier()
    return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX) / reps


def variants(comm, det, native, nbytes):
    n = max(nbytes // 4, 1)
    ones = lambda: torch.ones(n)  # noqa: E731
    x_mpi, out, x_core, x_torch, x_native = ones(), torch.empty(n), ones(), ones(), ones()
    x_ip, x_torch_ip = torch.zeros(n), torch.zeros(n)  # zeros: repeated sums stay finite
    xg = torch.ones(n, requires_grad=True)
    dx = dct.to_diffcomm(x_core)
    sum_op = _core.ReduceOp("sum")

    def grad_call():
        dct.all_reduce(xg, group=det)
        dct.discard_pending(det)

    return {
        "mpi4py": lambda: comm.Allreduce(x_mpi.numpy(), out.numpy(), op=MPI.SUM),
        "core": lambda: _core.nn.all_reduce(dx, det, sum_op),
        "torch": lambda: dct.all_reduce(x_torch, group=det),
        "torch_grad": grad_call,
        "native": lambda: dct.all_reduce(x_native, group=native),
        "mpi4py_ip": lambda: comm.Allreduce(MPI.IN_PLACE, x_ip.numpy(), op=MPI.SUM),
        "torch_ip": lambda: dct.all_reduce_(x_torch_ip, group=det),
    }


# The mpi4py call each variant's ratio is taken against.
BASELINE = {"mpi4py_ip": "mpi4py_ip", "torch_ip": "mpi4py_ip"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,65536,1048576,16777216",
                    help="bytes per rank, comma-separated")
    ap.add_argument("--iters", type=int, default=21)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    det = dct.init_process_group("mpi", check=False)
    native = _core.mpi.world(check=False, native_reduction=True)
    if rank == 0:
        print(f"# np {comm.Get_size()}, torch {torch.__version__}, {args.iters} iterations; "
              f"us per call (median), ratio = paired median of variant / mpi4py "
              "(torch_ip: / mpi4py_ip)")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        fns = variants(comm, det, native, nbytes)
        names = list(fns)
        reps = 5 if nbytes >= (1 << 20) else 200
        for fn in fns.values():  # warm-up: first touch, MPI connections
            fn()
        samples = {k: [] for k in names}
        shuffle = random.Random(nbytes)  # the same order on every process
        for _ in range(args.iters):
            order = names[:]
            shuffle.shuffle(order)
            for k in order:
                samples[k].append(timed(comm, reps, fns[k]))
        if rank == 0:
            cells = []
            for k in names:
                us = statistics.median(samples[k]) * 1e6
                base = samples[BASELINE.get(k, "mpi4py")]
                ratio = statistics.median(a / b for a, b in zip(samples[k], base))
                over = statistics.median(a - b for a, b in zip(samples[k], samples["core"])) * 1e6
                extra = f", core{over:+.1f}" if k not in ("mpi4py", "core", "mpi4py_ip") else ""
                cells.append(f"{k} {us:.1f} us ({ratio:.2f}x{extra})")
            print(f"{nbytes:>9} B: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What checked mode costs per diffcomm.torch call (issue [1/8] item 6: the
pip package's default), interleaved: the same op on two diffcomm groups over
the same transport, one with check=False, one with check=True (a fingerprint
exchange before every call, on a duplicate of the transport's group).

Per op and size, each repetition times `iters` calls unchecked then `iters`
checked, between barriers; rank 0 prints the median per-call times and the
median of the paired ratios (checked / unchecked). float32, forward only.

  python python/tests/launch.py -n 4 -- bench/bench_checked_mode.py torch
  mpirun -np 4 python bench/bench_checked_mode.py mpi
"""
import argparse
import statistics
import time

import torch

import diffcomm.torch as dt
from diffcomm import _core

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)


def groups(transport):
    """(unchecked, checked) diffcomm groups over one transport."""
    if transport == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        from diffcomm.torch._transport import TorchOps  # noqa: PLC0415

        dist.init_process_group("gloo")
        ops = TorchOps()
        return tuple(_core.torch_transport.group(ops, ops.duplicate, name, check=c)
                     for name, c in (("unchecked", False), ("checked", True)))
    _core.mpi.init()
    return _core.mpi.world(check=False), _core.mpi.world(check=True)


def timed(fn, group, iters):
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(group)
    group.barrier()
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transport", choices=("torch", "mpi"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    plain, checked = groups(a.transport)
    r, n = plain.rank(), plain.size()
    if r == 0:
        print(f"{a.transport} transport, np {n}, torch {torch.__version__}, float32, "
              f"{a.iters} calls x {a.reps} reps; ratio = checked / unchecked")
        print(f"{'op':<18}{'bytes':>10}{'unchecked us':>14}{'checked us':>12}{'ratio':>8}")
    for size in SIZES:
        x = torch.rand(size // 4)
        cases = [("all_reduce", lambda g: dt.all_reduce(x, group=g)),
                 ("all_gather", lambda g: dt.all_gather(x, group=g)),
                 ("broadcast", lambda g: dt.broadcast(x, src=0, group=g))]
        for name, op in cases:
            op(plain), op(checked)  # warm-up
            t_plain, t_checked = [], []
            for _ in range(a.reps):
                t_plain.append(timed(op, plain, a.iters))
                t_checked.append(timed(op, checked, a.iters))
            if r == 0:
                mp, mc = statistics.median(t_plain) * 1e6, statistics.median(t_checked) * 1e6
                paired = statistics.median(c / u for c, u in zip(t_checked, t_plain))
                print(f"{name:<18}{size:>10}{mp:>14.1f}{mc:>12.1f}{paired:>8.2f}", flush=True)


if __name__ == "__main__":
    main()

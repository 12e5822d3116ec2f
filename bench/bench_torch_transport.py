#!/usr/bin/env python3
"""diffcomm.torch over the "torch" transport against raw torch.distributed on
the same gloo group, interleaved (issue [1/8] item 7).

Per op and size, each repetition times `iters` calls of raw torch into
preallocated buffers ("raw", the floor), `iters` calls of raw torch returning
a new tensor ("raw+new": what a differentiable op, torch's functional
collectives included, pays), then `iters` calls of diffcomm.torch on the same
group (forward only, requires_grad False), between barriers; rank 0 prints
the median per-call time of each and the medians of the per-repetition
ratios (diffcomm / raw, diffcomm / raw+new, paired in time). all_reduce is reported for
diffcomm's deterministic composition (the default, bit-identical to the
simulated world) and for native_reduction=True (torch's own reduction) side
by side. float32; sizes are per-rank input bytes.

Run as ranks (torchrun's environment):
  python python/tests/launch.py -n 4 -- bench/bench_torch_transport.py [--iters 20 --reps 5]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import diffcomm.torch as dt
from diffcomm import _core
from diffcomm.torch._transport import TorchOps

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)


def timed(fn, iters):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dt.init_process_group("torch", check=False)
    ops = TorchOps()
    native = _core.torch_transport.group(ops, ops.duplicate, "native", check=False,
                                         native_reduction=True)
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        print(f"torch {torch.__version__} gloo, np {n}, float32, {a.iters} calls x {a.reps} "
              f"reps, median per call; ratio = diffcomm / raw, diffcomm / raw+new")
        print(f"{'op':<26}{'bytes':>10}{'raw us':>11}{'raw+new us':>12}{'diffcomm us':>13}"
              f"{'/raw':>7}{'/raw+new':>10}")
    for size in SIZES:
        k = size // 4
        x = torch.rand(k)
        blocks = torch.rand(n * max(k // n, 1))
        out_list = [torch.empty(k) for _ in range(n)]
        a2a_out = torch.empty_like(blocks)
        splits = [blocks.numel() // n] * n
        root = r == 0

        # "raw+new": the raw call returning a new tensor, as a differentiable
        # op must (torch's functional collectives do the same): the output
        # allocated per call, the root's broadcast data and the all_reduce
        # input copied first.
        cases = [
            ("all_gather", lambda: dist.all_gather(out_list, x),
             lambda: dist.all_gather([torch.empty(k) for _ in range(n)], x),
             lambda: dt.all_gather(x)),
            ("all_to_all_single", lambda: dist.all_to_all_single(a2a_out, blocks),
             lambda: dist.all_to_all_single(torch.empty_like(blocks), blocks),
             lambda: dt.all_to_all_single(blocks, splits, splits)),
            ("broadcast", lambda: dist.broadcast(x, 0),
             lambda: dist.broadcast(x.clone() if root else torch.empty_like(x), 0),
             lambda: dt.broadcast(x, src=0)),
            ("all_reduce (deterministic)", lambda: dist.all_reduce(x),
             lambda: dist.all_reduce(x.clone()), lambda: dt.all_reduce(x)),
            ("all_reduce (native)", lambda: dist.all_reduce(x),
             lambda: dist.all_reduce(x.clone()), lambda: dt.all_reduce(x, group=native)),
        ]
        for name, raw, raw_new, ours in cases:
            raw(), raw_new(), ours()  # warm-up
            t_raw, t_new, t_ours = [], [], []
            for _ in range(a.reps):
                t_raw.append(timed(raw, a.iters))
                t_new.append(timed(raw_new, a.iters))
                t_ours.append(timed(ours, a.iters))
            if r == 0:
                med = [statistics.median(t) * 1e6 for t in (t_raw, t_new, t_ours)]
                vs_raw = statistics.median(o / w for o, w in zip(t_ours, t_raw))
                vs_new = statistics.median(o / w for o, w in zip(t_ours, t_new))
                print(f"{name:<26}{size:>10}{med[0]:>11.1f}{med[1]:>12.1f}{med[2]:>13.1f}"
                      f"{vs_raw:>7.2f}{vs_new:>10.2f}", flush=True)
    del native, world
    dt.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The peer of bench_sim's BM_NnFwdBwd: the same work with
torch.distributed.nn.functional on gloo, world 8, one process per rank.

x = 8 peers x 4 rows x 16 float32 per rank (requires grad), y = op(x),
loss = y.sum(), backward; rank 0 times `iters` iterations between two
barriers, after `warmup` untimed ones. Prints microseconds per iteration
(median over `reps` timed runs) for all_to_all_single and all_reduce.

The figure depends on how many cores are free: gloo runs 8 processes that
talk over loopback TCP, so on a 2-core box most of the time is spent waiting
for a core (bench/RESULTS.md says which machine and load).

Run: /usr/bin/python3 bench/bench_torch_gloo.py [--world 8] [--iters 200]
(Debian's python3-torch; needs no GPU).
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.multiprocessing as mp


def worker(rank, world, iters, warmup, reps, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.full((world * 4, 16), 1.0 + rank, dtype=torch.float32, requires_grad=True)
    results = {}
    for name in ("all_to_all_single", "all_reduce"):

        def step():
            if name == "all_to_all_single":
                y = dnn.all_to_all_single(torch.empty_like(x), x)
            else:
                y = dnn.all_reduce(x)
            y.sum().backward()

        for _ in range(warmup):
            step()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            dist.barrier()
            times.append((time.perf_counter() - t0) / iters * 1e6)
        results[name] = statistics.median(times)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--port", type=int, default=29531)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, a.world, a.iters, a.warmup, a.reps, a.port, out))
        for r in range(a.world)
    ]
    for pr in procs:
        pr.start()
    res = out.get()
    for pr in procs:
        pr.join()
    print(f"torch {torch.__version__} gloo, world {a.world}, {os.cpu_count()} cores visible")
    for name, us in res.items():
        print(f"{name:18s} fwd+bwd {us:10.1f} us/iter (median of {a.reps} x {a.iters})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Per-collective cost of unmodified torch.distributed code in diffcomm's
simulated world (c10d backend "diffcomm_sim", diffcomm.sim.run(...,
torch_distributed=True)) against torch's own threaded process group
(torch.testing._internal.distributed.multi_threaded_pg), on the same work at
world 8, interleaved: each repetition runs the diffcomm world then the threaded
one, so drift on a shared machine hits both alike.

Work: `iters` calls of an 8-byte all_reduce (one float64) and of a 64 KiB
all_to_all_single (16384 float32 per rank, equal splits), between barriers.
Printed: the median over repetitions of the wall time per collective (all
ranks; one rank runs at a time in both, as both hold the GIL) and per rank.
local_tensor runs them on torch's LocalTensor (every rank's shard in one
thread; uniform SPMD code only). diffcomm_raw runs the same collectives on diffcomm's own ops in
the same world (no torch.distributed): the rest of the diffcomm_sim time is
c10d's Python path (torch.distributed's wrapper, the Python-group
trampoline, a Work) and the DLPack lending and output copy.

  python bench/bench_c10d_sim.py            # torch >= 2 (PyPI), diffcomm installed
"""
import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist

import diffcomm.sim as sim

WORLD = 8


def work(op, iters):
    """The per-rank program: times `iters` calls of op between barriers (seconds per call)."""
    if op == "all_reduce_8B":
        x = torch.ones(1, dtype=torch.float64)

        def call():
            dist.all_reduce(x)
    else:
        x = torch.ones(16384, dtype=torch.float32)
        y = torch.empty_like(x)

        def call():
            dist.all_to_all_single(y, x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def diffcomm_sim(op, iters):
    # Rank threads, as recorded in RESULTS.md (rank processes: bench_sim_processes.py).
    res = sim.run(WORLD, lambda rank, group: work(op, iters), seed=1, trace=False,
                  torch_distributed=True, isolation="thread")
    return max(res.results)


def diffcomm_raw(op, iters):
    """The same collectives straight on diffcomm's ops in the same world (no c10d,
    no copy into an output): the world's own share of the diffcomm_sim time."""
    from diffcomm import _core, nn  # noqa: PLC0415

    def fn(rank, group):
        if op == "all_reduce_8B":
            x = _core.from_dlpack(torch.ones(1, dtype=torch.float64))

            def call():
                nn.all_reduce(x, group)
        else:
            x = _core.from_dlpack(torch.ones(16384, dtype=torch.float32))
            splits = [16384 // WORLD] * WORLD

            def call():
                nn.all_to_all_single(x, splits, splits, group)
        group.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        group.barrier()
        return (time.perf_counter() - t0) / iters

    return max(sim.run(WORLD, fn, seed=1, trace=False, isolation="thread").results)


def threaded_pg(op, iters):
    """The same program on torch's threaded group, as its MultiThreadedTestCase sets it up."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg  # noqa: PLC0415

    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store, results, errors = dist.HashStore(), [0.0] * WORLD, []

    def body(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
            results[rank] = work(op, iters)
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            mtpg.ProcessLocalGroup.exception_handle(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
    if errors:
        raise errors[0]
    return max(results)


def local_tensor(op, iters):
    """The same collectives on torch's LocalTensor (one thread runs every rank's
    shard, torch >= 2.10): a "fake" default group, LocalTensorMode over the 8
    ranks. Only uniform SPMD code runs there (no per-rank control flow, no
    mismatch or deadlock reports), so it is the floor of a single-threaded
    simulation rather than an alternative for divergent programs."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: PLC0415
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        if op == "all_reduce_8B":
            x = LocalTensor({r: torch.ones(1, dtype=torch.float64) for r in range(WORLD)})

            def call():
                dist.all_reduce(x)
        else:
            x = LocalTensor({r: torch.ones(16384) for r in range(WORLD)})
            y = LocalTensor({r: torch.empty(16384) for r in range(WORLD)})

            def call():
                dist.all_to_all_single(y, x)
        with LocalTensorMode(WORLD):
            call()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            return (time.perf_counter() - t0) / iters
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"world {WORLD}, torch {torch.__version__}, {a.reps} interleaved repetitions of "
          f"{a.iters} calls; median us per collective (all ranks) and per rank")
    for op in ("all_reduce_8B", "all_to_all_single_64KiB"):
        times = {"diffcomm_sim": [], "threaded_pg": [], "local_tensor": [], "diffcomm_raw": []}
        for _ in range(a.reps):
            times["diffcomm_sim"].append(diffcomm_sim(op, a.iters))
            times["threaded_pg"].append(threaded_pg(op, a.iters))
            times["local_tensor"].append(local_tensor(op, a.iters))
            times["diffcomm_raw"].append(diffcomm_raw(op, a.iters))
        for name, ts in times.items():
            us = statistics.median(ts) * 1e6
            print(f"{op:26s} {name:13s} {us:9.1f} us per collective {us / WORLD:8.1f} us per rank")


if __name__ == "__main__":
    main()

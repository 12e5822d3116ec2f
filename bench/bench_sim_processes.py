#!/usr/bin/env python3
"""Ranks as processes (diffcomm.sim.run isolation="process") against rank
threads and against gloo processes, on the same torch.distributed programs.

  collectives  per-collective cost at --world (8, 64): the 8-byte all_reduce
               and the 64 KiB all_to_all_single of bench_c10d_sim.py, in
               rank processes, rank threads and (--gloo) gloo processes,
               interleaved over --reps repetitions; median us per collective
               (all ranks).
  megatron     wall time of one megatron-core step (ColumnParallelLinear ->
               GELU -> RowParallelLinear, sequence parallel, tp 4 x dp 2,
               forward + backward) in rank processes with cuda="cpu" against
               the same code in gloo processes (torch.cuda on the CPU there
               too), interleaved; and the memory of each rank process.
  scale        the largest world (doubling from 8) that runs the megatron
               step at tp 8, with each rank process's proportional set size
               (PSS: pages shared copy-on-write with the caller counted
               fractionally) and the whole run's peak.

Run with PyPI torch and megatron-core (scripts/test-python's venv):
  build/python-venv-pypi/bin/python bench/bench_sim_processes.py collectives --world 8 --gloo
"""
import argparse
import importlib
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import diffcomm.sim as sim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_c10d_sim  # noqa: E402


# ------------------------------------------------------------ programs
# The per-rank program of bench_c10d_sim.py: seconds per call of op between barriers.
collective_work = bench_c10d_sim.work


S, B, H, F = 64, 4, 256, 1024


def megatron_step(tp, steps=3):
    """One megatron-core SP MLP step (after a warm-up one): seconds, and this
    process's PSS in MiB."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core import tensor_parallel as mtp  # noqa: PLC0415
    from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: PLC0415

    ps.initialize_model_parallel(tp, 1)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    col = mtp.ColumnParallelLinear(H, F, config=cfg, init_method=torch.nn.init.normal_,
                                   bias=False, gather_output=False)
    row = mtp.RowParallelLinear(F, H, config=cfg, init_method=torch.nn.init.normal_,
                                bias=False, input_is_parallel=True, skip_bias_add=True)
    x = torch.randn(S // tp, B, H)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        h, _ = col(x)
        y, _ = row(torch.nn.functional.gelu(h))
        y.sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    ps.destroy_model_parallel()
    return statistics.median(times[1:]), pss_mib()


def pss_mib():
    """This process's proportional set size and its private pages, MiB
    (pages shared with the caller count 1/sharers in PSS)."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("Pss", "Private_Dirty", "Private_Clean"):
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        return float("nan"), float("nan")
    return out.get("Pss", float("nan")), out.get("Private_Dirty", 0) + out.get("Private_Clean", 0)


# ------------------------------------------------------------ runners
def in_sim(world, isolation, body, cuda=None):
    torch_kw = {"cuda": cuda} if cuda else {}
    return sim.run(world, lambda rank, g: body(), seed=1, trace=False, torch_distributed=True,
                   isolation=isolation, **torch_kw).results


def _gloo_worker(rank, world, port, body, cuda, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cuda:
        from diffcomm.sim import _cuda_on_cpu  # noqa: PLC0415

        _cuda_on_cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out[rank] = body()
    dist.destroy_process_group()


def in_gloo(world, body, cuda=False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, body, cuda, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"gloo worker failed: exit codes {[p.exitcode for p in procs]}")
    return [out[r] for r in range(world)]


# ------------------------------------------------------------ commands
def collectives(a):
    print(f"world {a.world}, torch {torch.__version__}, {a.reps} interleaved repetitions of "
          f"{a.iters} calls; median us per collective (all ranks)")
    for op in ("all_reduce_8B", "all_to_all_single_64KiB"):
        runs = {"process": [], "thread": []}
        if a.gloo:
            runs["gloo"] = []
        for _ in range(a.reps):
            body = lambda: collective_work(op, a.iters)  # noqa: E731
            runs["process"].append(max(in_sim(a.world, "process", body)))
            runs["thread"].append(max(in_sim(a.world, "thread", body)))
            if a.gloo:
                runs["gloo"].append(max(in_gloo(a.world, body)))
        med = {k: statistics.median(v) * 1e6 for k, v in runs.items()}
        ratios = [runs["process"][i] / runs["thread"][i] for i in range(a.reps)]
        line = "  ".join(f"{k} {v:9.1f}" for k, v in med.items())
        print(f"{op:26s} {line}   process/thread paired median {statistics.median(ratios):.2f}"
              f" (range {min(ratios):.2f}-{max(ratios):.2f})")


def megatron(a):
    print(f"megatron-core SP MLP step, world {a.world} (tp 4), S={S} B={B} H={H} F={F} "
          f"float32; {a.reps} interleaved repetitions; median seconds per step")
    body = lambda: megatron_step(4)  # noqa: E731
    runs = {"process": [], "gloo": []}
    pss = []
    for _ in range(a.reps):
        res = in_sim(a.world, "process", body, cuda="cpu")
        runs["process"].append(max(t for t, _ in res))
        pss.append(statistics.median(m[0] for _, m in res))
        private = statistics.median(m[1] for _, m in res)
        runs["gloo"].append(max(t for t, _ in in_gloo(a.world, body, cuda=True)))
    ratios = [p / g for p, g in zip(runs["process"], runs["gloo"])]
    for k, v in runs.items():
        print(f"  {k:8s} {statistics.median(v) * 1e3:8.1f} ms per step")
    print(f"  process/gloo paired median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); rank process PSS median "
          f"{statistics.median(pss):.0f} MiB, of it private {private:.0f} MiB")


def scale(a):
    import resource  # noqa: PLC0415

    world = 8
    while world <= a.max_world:
        t0 = time.perf_counter()
        try:
            res = in_sim(world, "process", lambda: megatron_step(8, steps=1), cuda="cpu")
        except Exception as e:  # noqa: BLE001 (the limit is the result)
            print(f"world {world:5d}: failed: {type(e).__name__}: {str(e)[:200]}")
            break
        wall = time.perf_counter() - t0
        pss = [m[0] for _, m in res]
        private = [m[1] for _, m in res]
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(f"world {world:5d}: run {wall:6.1f} s, step {max(t for t, _ in res):6.2f} s, "
              f"per rank PSS median {statistics.median(pss):6.1f} MiB, private median "
              f"{statistics.median(private):6.1f} MiB (max {max(private):6.1f}), ranks' PSS sum "
              f"{sum(pss) / 1024:5.2f} GiB; largest rank RSS {peak:.0f} MiB", flush=True)
        world *= 2


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["collectives", "megatron", "scale"])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--gloo", action="store_true", help="collectives: gloo processes too")
    p.add_argument("--max-world", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.command != "collectives":
        importlib.import_module("megatron.core.tensor_parallel")  # once, shared by the forks
    {"collectives": collectives, "megatron": megatron, "scale": scale}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())

"""diffcomm.sim.run per collective against the C++ simulated world (issue 27 item 5).

    build/python-venv/bin/python bench/bench_sim_run.py --bench-sim build/release/bench/bench_sim

Every repetition runs, back to back and rotating which goes first:
  one_cpu   sim.run(8, fn, trace=False): fn calls the op `calls` times (default placement:
            the world's threads share one CPU)
  os        the same with one_cpu=False (the OS places the threads)
  cpp       bench_sim's BM_NnAllReduce8B (world 8, defaults: Random schedule), one float64:
            dist::all_reduce (the primitive), nn::all_reduce without and with an input
            requiring grad (forward only), in the C++ fiber world
for two ops: `barrier` (group.barrier(), no tensor) and `all_reduce` (diffcomm.torch.all_reduce
of one float64 that requires no grad: what nn::all_reduce runs in C++). The table gives medians
over repetitions of the time per collective (all 8 ranks) and of the paired ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

import diffcomm.sim as sim
import diffcomm.torch as dt


def cpp_world(bench_sim: str) -> dict:
    """us per collective at world 8 (defaults) from one BM_NnAllReduce8B run."""
    out = subprocess.run([bench_sim, "--benchmark_filter=BM_NnAllReduce8B/./1",
                          "--benchmark_format=json"], check=True, capture_output=True,
                         text=True).stdout
    rows = {b["name"].split("/")[1]: b for b in json.loads(out)["benchmarks"]}
    return {"dist": statistics.median([rows["0"]["floor_us"], rows["1"]["floor_us"]]),
            "nn": rows["0"]["us_per_op"], "nn_grad": rows["1"]["us_per_op"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-sim", required=True, help="a Release bench_sim binary")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    calls = args.calls

    def barrier(rank, g):
        for _ in range(calls):
            g.barrier()

    def all_reduce(rank, g):
        x = torch.ones(1, dtype=torch.float64)
        for _ in range(calls):
            dt.all_reduce(x)

    def run(fn, one_cpu):
        t = time.perf_counter()
        sim.run(8, fn, trace=False, one_cpu=one_cpu, isolation="thread")
        return (time.perf_counter() - t) / calls * 1e6

    res = {k: [] for k in ("barrier/one_cpu", "barrier/os", "all_reduce/one_cpu",
                           "all_reduce/os", "cpp")}
    for i in range(args.reps):
        steps = [("barrier/one_cpu", lambda: run(barrier, True)),
                 ("barrier/os", lambda: run(barrier, False)),
                 ("all_reduce/one_cpu", lambda: run(all_reduce, True)),
                 ("all_reduce/os", lambda: run(all_reduce, False)),
                 ("cpp", lambda: cpp_world(args.bench_sim))]
        k = i % len(steps)
        for name, fn in steps[k:] + steps[:k]:
            res[name].append(fn())

    med = statistics.median
    cpp = res["cpp"]
    print(f"# world 8, torch {torch.__version__}, {args.reps} repetitions of {calls} calls; "
          "us per collective (median); ratios: medians of per-repetition ratios")
    print(f"C++ world (bench_sim, defaults): dist::all_reduce {med(c['dist'] for c in cpp):.2f}, "
          f"nn::all_reduce {med(c['nn'] for c in cpp):.2f}, "
          f"nn::all_reduce requires_grad {med(c['nn_grad'] for c in cpp):.2f}")
    for op in ("barrier", "all_reduce"):
        one, os_ = res[f"{op}/one_cpu"], res[f"{op}/os"]
        line = (f"sim.run {op:10s}: one_cpu {med(one):6.1f} ({med(one) / 8:.1f} per rank), "
                f"os {med(os_):6.1f}; os/one_cpu {med(b / a for a, b in zip(one, os_)):.2f}")
        if op == "all_reduce":
            for key in ("dist", "nn", "nn_grad"):
                line += f"; one_cpu / C++ {key} {med(a / c[key] for a, c in zip(one, cpp)):.1f}x"
        print(line)


if __name__ == "__main__":
    main()

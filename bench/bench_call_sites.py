#!/usr/bin/env python3
"""What recording each call's Python call site costs (issue [4/7] item 5):
the frame walk of diffcomm's bindings to the first frame outside diffcomm and
torch, on and off (DIFFCOMM_CALL_SITES, switched at run time with the same
hook), interleaved round by round inside the same rank programs.

Work, as users run it: diffcomm.sim.run at world 8 with its defaults (rank
processes), unmodified torch.distributed code (8-byte all_reduce through
torch.distributed, the c10d backend and diffcomm's group: the deepest Python
stack to walk) and diffcomm.torch.all_reduce. Printed per workload: the median
over rounds of rank 0's wall time per call with and without call sites, and
their ratio.

  python bench/bench_call_sites.py [--rounds 9] [--iters 400] [--world 8]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import diffcomm
import diffcomm.sim as sim
import diffcomm.torch as dt
from diffcomm import _core

WORLD = 8


def set_call_sites(on):
    """The switch diffcomm/__init__.py sets from DIFFCOMM_CALL_SITES, with its prefixes."""
    import importlib.util  # noqa: PLC0415

    prefixes = [os.path.dirname(os.path.abspath(diffcomm.__file__)) + os.sep]
    prefixes += [os.path.abspath(p) + os.sep
                 for p in importlib.util.find_spec("torch").submodule_search_locations]
    _core._set_caller_skip(prefixes, on)


def program(rounds, iters):
    """Per rank: for each round, `iters` calls of each workload with call sites on
    and then off (the order alternating by round). Returns seconds per call."""
    x = torch.ones(1, dtype=torch.float64)
    calls = {"torch.distributed.all_reduce": lambda: dist.all_reduce(x),
             "diffcomm.torch.all_reduce": lambda: dt.all_reduce(x)}
    out = {(name, on): [] for name in calls for on in (True, False)}
    for r in range(rounds):
        for name, call in calls.items():
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                set_call_sites(on)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                out[(name, on)].append((time.perf_counter() - t0) / iters)
    set_call_sites(True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--world", type=int, default=WORLD,
                    help="1: the walk against the cheapest call (no peer to wait for)")
    a = ap.parse_args()
    res = sim.run(a.world, lambda rank, group: program(a.rounds, a.iters), seed=1,
                  torch_distributed=True).results[0]
    print(f"world {a.world}, rank processes (sim.run defaults), torch {torch.__version__}, "
          f"{a.rounds} rounds x {a.iters} calls, median us per call on rank 0")
    for name in ("torch.distributed.all_reduce", "diffcomm.torch.all_reduce"):
        on = statistics.median(res[(name, True)]) * 1e6
        off = statistics.median(res[(name, False)]) * 1e6
        ratios = [a_ / b_ for a_, b_ in zip(res[(name, True)], res[(name, False)])]
        print(f"  {name:30s} call sites on {on:8.1f}  off {off:8.1f}  "
              f"on/off median of paired rounds {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

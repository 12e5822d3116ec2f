#!/usr/bin/env python3
"""diffcomm.sim.check_equivalence on one mesh of world 16 with the shipped
example step (examples/python/equivalence/vlm_step.py), issue [5/8] item 4;
goal: under 1 s per call.

Each repetition times one check_equivalence call (the world-1 reference run,
the 16-rank run and the comparison) and, apart, the comparison alone
(_core.sim.check_mesh on the gradients of one 16-rank run). Prints the median
and the minimum of `reps` repetitions after one warm-up call.

  PYTHONPATH=<built package> python bench/bench_equivalence.py [--reps 5]
"""
import argparse
import os
import statistics
import sys
import time

import diffcomm.sim as dsim
from diffcomm import _core
from diffcomm.sim import _equivalence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "python", "equivalence"))
from vlm_step import VlmStep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    mesh = {"dp": 2, "cp": 2, "tp": 4}
    dims = list(mesh.items())
    assert dsim.check_equivalence(VlmStep(), [mesh]).ok  # warm-up, and it must pass
    whole, compare = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        report = dsim.check_equivalence(VlmStep(), [mesh])
        whole.append(time.perf_counter() - t0)
        assert report.ok, str(report)
        per_rank = _equivalence._run(VlmStep(), dims, 0, "random")
        reference = {k: v[0] for k, v in _equivalence._run(VlmStep(), [(n, 1) for n in mesh], 0,
                                                           "random")[0].items()}
        t0 = time.perf_counter()
        _core.sim.check_mesh(dims, per_rank, reference, 1e-12, 1e-9)
        compare.append(time.perf_counter() - t0)
    print(f"check_equivalence(VlmStep(), [{mesh}]) world 16, {args.reps} reps:")
    print(f"  whole call  median {statistics.median(whole) * 1e3:8.1f} ms   "
          f"min {min(whole) * 1e3:8.1f} ms")
    print(f"  comparison  median {statistics.median(compare) * 1e3:8.3f} ms   "
          f"min {min(compare) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()

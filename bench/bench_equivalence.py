#!/usr/bin/env python3
"""diffcomm.sim.check_equivalence's cost per call (the world-1 reference run,
the mesh's run and the comparison), median and minimum of --reps after one
warm-up call.

  vlm    the shipped diffcomm-op example step (examples/python/equivalence/
         vlm_step.py) on one mesh of world 16, and apart the comparison alone
         (_core.sim.check_mesh); goal (issue [5/8]): under 1 s per call.
  torch  torch.distributed steps as users write them, returned as modules
         (issue [2/7] item 6; goal: one mesh at world 8 under process
         isolation under 2 s): the Megatron-core block of megatron_steps.py
         on {dp: 2, tp: 4} (cuda="cpu"), the DTensor TP MLP of torch_steps.py
         on {tp: 8} and the same with FSDP2 on {dp: 2, tp: 4}. Process
         isolation only: a DTensor backward in this process would stop torch
         autograd in later forks (docs/python.md).

  PYTHONPATH=<built package> python bench/bench_equivalence.py vlm [--reps 5]
  PYTHONPATH=<built package> build/python-venv-pypi/bin/python bench/bench_equivalence.py torch
"""
import argparse
import functools
import os
import statistics
import sys
import time
import warnings

import diffcomm.sim as dsim
from diffcomm import _core
from diffcomm.sim import _equivalence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "python", "equivalence"))


def timed(call, reps):
    call()  # warm-up (and it must pass)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        report = call()
        out.append(time.perf_counter() - t0)
        assert report.ok, str(report)
    return out


def line(what, times, unit=1e3, fmt="8.1f"):
    print(f"  {what:34s} median {statistics.median(times) * unit:{fmt}} ms   "
          f"min {min(times) * unit:{fmt}} ms")


def vlm(reps):
    from vlm_step import VlmStep  # noqa: PLC0415

    mesh = {"dp": 2, "cp": 2, "tp": 4}
    dims = list(mesh.items())
    whole = timed(lambda: dsim.check_equivalence(VlmStep(), [mesh]), reps)
    run = functools.partial(_equivalence._run, VlmStep(), seed=0, schedule="random",
                            torch_mode=False, overrides={}, run_options={})
    per_rank = run(dims)
    reference = _equivalence._reference(run([(n, 1) for n in mesh])[0])
    compare = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _core.sim.check_mesh(dims, per_rank, reference, 1e-12, 1e-9)
        compare.append(time.perf_counter() - t0)
    print(f"check_equivalence(VlmStep(), [{mesh}]) world 16, {reps} reps:")
    line("whole call", whole)
    line("comparison", compare, fmt="8.3f")


def torch_steps(reps):
    warnings.simplefilter("ignore")
    from megatron_steps import megatron_step  # noqa: PLC0415
    from torch_steps import tp_mlp_step  # noqa: PLC0415

    cases = [("megatron block {dp: 2, tp: 4}", megatron_step, {"dp": 2, "tp": 4}, "cpu"),
             ("DTensor TP MLP {tp: 8}", tp_mlp_step, {"dp": 1, "tp": 8}, None),
             ("FSDP2 + TP MLP {dp: 2, tp: 4}", tp_mlp_step, {"dp": 2, "tp": 4}, None)]
    print(f"check_equivalence(step, [mesh], torch_distributed=True), processes, {reps} reps:")
    for what, step, mesh, cuda in cases:
        line(what, timed(lambda: dsim.check_equivalence(step, [mesh], torch_distributed=True,
                                                        cuda=cuda), reps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["vlm", "torch"], nargs="?", default="vlm")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    (vlm if args.which == "vlm" else torch_steps)(args.reps)


if __name__ == "__main__":
    main()

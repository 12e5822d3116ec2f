"""What diffcomm.torch adds over the C++ op per call, in pieces (issue 27 item 3).

    mpirun -np 1 build/python-venv/bin/python bench/bench_torch_bridge.py [--bytes 1024]

One process (an MPI world of 1, check off: no transport cost), one float64 tensor of
--bytes, inputs requiring no grad. Variants, interleaved (rotating which goes first),
each timed over --calls back-to-back calls, --reps times:
  core          _core.nn.all_reduce on a diffcomm tensor made once (the C++ op and its binding)
  torch         diffcomm.torch.all_reduce (what a user calls)
  to_diffcomm   the input's borrow alone (torch -> diffcomm, DLPack)
  from_diffcomm the output's hand-back alone (diffcomm -> torch, DLPack)
  core_ip       the in-place C++ op (group.all_reduce_) on a diffcomm tensor made once
  torch_ip      diffcomm.torch.all_reduce_ (in place)
Prints medians (us per call) and, per repetition paired, torch - core (the bridge: item 3's
goal is <= 5 us at 1 KiB), torch_ip - core_ip, and the wrapper's own Python: torch - core
- to_diffcomm - from_diffcomm.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import torch
from mpi4py import MPI  # noqa: F401 (initialises MPI before diffcomm borrows it)

import diffcomm.torch as dct
from diffcomm import _core


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    g = dct.init_process_group("mpi", check=False)
    x = torch.ones(args.bytes // 8, dtype=torch.float64)
    dx = dct.to_diffcomm(x)
    out = _core.nn.all_reduce(dx, g, _core.ReduceOp("sum"))
    op = _core.ReduceOp("sum")
    variants = {
        "core": lambda: _core.nn.all_reduce(dx, g, op),
        "torch": lambda: dct.all_reduce(x),
        "to_diffcomm": lambda: dct.to_diffcomm(x),
        "from_diffcomm": lambda: dct.from_diffcomm(out),
        "core_ip": lambda: g.all_reduce_(dx, op),
        "torch_ip": lambda: dct.all_reduce_(x),
    }
    names = list(variants)
    us = {k: [] for k in names}
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            us[name].append(timeit.timeit(variants[name], number=args.calls) / args.calls * 1e6)

    med = statistics.median

    def paired(fn) -> float:
        return med(fn(*row) for row in zip(*(us[n] for n in names)))

    print(f"# torch {torch.__version__}, {args.bytes} B, {args.reps} x {args.calls} calls; "
          "us per call, medians")
    print("  " + ", ".join(f"{n} {med(us[n]):.2f}" for n in names))
    print(f"  bridge (torch - core) {paired(lambda c, t, a, b, ci, ti: t - c):+.2f}, "
          f"in place (torch_ip - core_ip) {paired(lambda c, t, a, b, ci, ti: ti - ci):+.2f}, "
          f"wrapper's own Python (torch - core - to - from) "
          f"{paired(lambda c, t, a, b, ci, ti: t - c - a - b):+.2f}")


if __name__ == "__main__":
    main()

"""Run by test_sim_run.py: a diffcomm.sim.run that never ends by itself, to be
interrupted with SIGINT (Ctrl-C). Prints READY once the ranks run, then
INTERRUPTED <seconds> <alive rank threads> when run() raised
KeyboardInterrupt.

  busy        rank 0 loops in Python; the others wait in an all_reduce
  collective  every rank all-reduces in an endless loop
  sleeping    rank 0 sleeps (outside diffcomm: only the grace period ends it)
"""
import faulthandler
import os
import sys
import threading
import time

import torch

import diffcomm.sim as sim
import diffcomm.torch as dt

scenario = sys.argv[1]
GRACE_S = 2.0  # run(interrupt_grace_s=...)
# A hang (CI saw one, sleeping scenario) prints every thread's stack and exits.
faulthandler.dump_traceback_later(20, exit=True)


def fn(rank, group):
    if rank == 0:
        global started
        started = time.monotonic()
        os.write(1, b"READY\n")
    if scenario == "busy" and rank == 0:
        while True:
            pass
    if scenario == "sleeping" and rank == 0:
        time.sleep(3600)
    while True:
        dt.all_reduce(torch.ones(2))


started = 0.0
try:
    sim.run(4, fn, interrupt_grace_s=GRACE_S)
except KeyboardInterrupt:
    alive = sum(t.name.startswith("diffcomm-sim-rank") and t.is_alive()
                for t in threading.enumerate())
    print(f"INTERRUPTED {time.monotonic() - started:.2f} {alive}", flush=True)

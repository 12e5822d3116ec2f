"""Run by test_sim_run.py: a diffcomm.sim.run that never ends by itself, to be
interrupted with SIGINT (Ctrl-C). Prints READY once the ranks run, then
INTERRUPTED <seconds> <alive rank threads> <rank processes left> <memfds left>
when run() raised KeyboardInterrupt. argv[2]: the isolation ("thread" or
"process").

  busy        rank 0 loops in Python; the others wait in an all_reduce
  collective  every rank all-reduces in an endless loop
  sleeping    rank 0 sleeps (outside diffcomm: only the grace period ends it)
"""
import faulthandler
import os
import signal
import sys
import threading
import time

import torch

import diffcomm.sim as sim
import diffcomm.torch as dt

scenario = sys.argv[1]
isolation = sys.argv[2] if len(sys.argv) > 2 else "thread"
GRACE_S = 2.0  # run(interrupt_grace_s=...)
# A hang (CI saw one, sleeping scenario) prints every thread's stack and exits.
faulthandler.dump_traceback_later(20, exit=True)


def on_sigint(signum, frame):
    # The seconds printed count from here (in the caller, not in a rank).
    global started
    started = started or time.monotonic()
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, on_sigint)


def fn(rank, group):
    if rank == 0:
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
    sim.run(4, fn, interrupt_grace_s=GRACE_S, isolation=isolation)
except KeyboardInterrupt:
    alive = sum(t.name.startswith("diffcomm-sim-rank") and t.is_alive()
                for t in threading.enumerate())
    seconds = time.monotonic() - started
    children = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                children += int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        except (OSError, IndexError, ValueError):
            pass
    memfds = sum("diffcomm-sim-rank" in os.readlink(f"/proc/self/fd/{fd}")
                 for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{fd}"))
    print(f"INTERRUPTED {seconds:.2f} {alive} {children} {memfds}", flush=True)

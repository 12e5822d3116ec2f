"""Issue [4/7] item 1 from Python: every rank makes all_reduce #0, then the
last rank leaves (returns: its interpreter exit meets the others) while the
others wait in barrier #1 until the first of them times out and raises the
alarm; every rank must report and dump before the job ends.
argv: backend (torch | mpi) timeout_s. DIFFCOMM_FR_DUMP_DIR is set by the test.
Prints "WAIT rank R <time.monotonic()>" entering the barrier and
"RESULT rank R: <Kind>: <first line>" after it."""
import os
import sys
import time

import torch

import diffcomm
import diffcomm.torch as dt

backend, timeout_s = sys.argv[1], float(sys.argv[2])
if backend == "torch":
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
dt.init_process_group(backend, check=False, timeout_s=timeout_s)
rank, size = dt.get_rank(), dt.get_world_size()


def say(text: str) -> None:
    os.write(1, f"{text}\n".encode())  # one write: ranks share a pipe


dt.all_reduce(torch.ones(4))
if rank != size - 1:
    say(f"WAIT rank {rank} {time.monotonic():.6f}")
    try:
        dt.get_world().barrier()
        say(f"RESULT rank {rank}: none: ")
    except diffcomm.Error as e:
        say(f"RESULT rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}")

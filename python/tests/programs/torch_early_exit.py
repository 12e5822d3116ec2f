"""The last rank of a torch-transport job skips a collective the others call:
``exit`` (its process ends: torch sees the peer gone, BackendError at once)
or ``linger`` (it stays alive: diffcomm's deadline, Timeout). Either way the
others end within the deadline, never hang. argv: timeout_s mode. Prints
RESULT lines."""
import os
import sys
import time

import torch
import torch.distributed as tdist

import diffcomm
import diffcomm.torch as dt

tdist.init_process_group("gloo")
dt.init_process_group("torch", timeout_s=float(sys.argv[1]))
rank = dt.get_rank()


def result(text: str) -> None:
    # One write(2) per line (< PIPE_BUF): ranks share the launcher's pipe,
    # and print() may split a long line between two writes.
    os.write(1, f"RESULT rank {rank}: {text}\n".encode())


dt.all_reduce(torch.ones(2))  # everyone is here
if rank == dt.get_world_size() - 1:
    result("skipped the call")
    if sys.argv[2] == "linger":
        time.sleep(2 * float(sys.argv[1]) + 2)
    sys.exit(0)
start = time.monotonic()
try:
    dt.all_reduce(torch.ones(2))
    result("completed")
except diffcomm.Error as e:
    result(f"{type(e).__name__} after {time.monotonic() - start:.1f} s: "
           f"{str(e).splitlines()[0]}")

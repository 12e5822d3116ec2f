"""A job that leaves flight recorder dumps for test_replay.py: every rank makes
two agreeing calls (all_reduce, all_gather), then
  ``request``: every rank dumps on request (group.flight_recorder().dump(dir))
  and the job ends cleanly;
  ``raise``: rank 1 dies of an uncaught Python exception (its dump comes from
  diffcomm's sys.excepthook) while the others call all_reduce #1, which ends
  for them in BackendError or Timeout (their dumps come from the funnel).
argv: backend (torch | mpi) mode dir. DIFFCOMM_FR_DUMP_DIR is set by the test
for ``raise``. Prints RESULT lines."""
import os
import sys
import time

import torch

import diffcomm.torch as dt

backend, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
if backend == "torch":
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
pg = dt.init_process_group(backend, timeout_s=3.0)
rank = dt.get_rank()


def result(text: str) -> None:
    os.write(1, f"RESULT rank {rank}: {text}\n".encode())  # one write: ranks share a pipe


dt.all_reduce(torch.ones(4))
dt.all_gather(torch.ones(2) * rank)
if mode == "request":
    result(f"dumped {pg.flight_recorder().dump(out)}")
elif rank == 1:
    time.sleep(0.5)  # the others are in all_reduce #1 by now
    raise RuntimeError("rank 1: a bug between two collectives")
else:
    try:
        dt.all_reduce(torch.ones(4))
        result("NOT REACHED: all_reduce #1 completed")
    except Exception as e:  # noqa: BLE001 - the test reads which error it was
        result(f"{type(e).__name__}")
        # The funnel has written the dump. Leave at once: after a Timeout an
        # MPI_Finalize (destroy_process_group) waits for the timed-out call.
        os._exit(0)
dt.destroy_process_group()
if backend == "torch":
    tdist.destroy_process_group()
# torch 1.13's gloo ends some processes in std::terminate at interpreter exit
# ("terminate called without an active exception": up to 3 in 5 runs of this
# program here); the test is about the dumps, not torch's shutdown.
os._exit(0)

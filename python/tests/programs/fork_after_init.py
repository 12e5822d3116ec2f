"""Run under `mpirun -np 2` by test_fault_paths.py: every rank forks twice
after init_process_group("mpi") and a first all_reduce; one child exits
normally (interpreter exit: atexit hooks and C++ static destructors run), the
other raises an uncaught exception. Neither may touch the parent's MPI: the
child's exit used to run MPI_Finalize through mpi::Environment's destructor
and hang the job, and its exception to MPI_Abort the parent's whole job.
The parents then go on with a second all_reduce and print their results, then
use the world group after destroy_process_group()."""
import os
import sys

import torch

import diffcomm
import diffcomm.torch as dt

dt.init_process_group("mpi", timeout_s=60)
rank = dt.get_rank()
t = torch.ones(2, dtype=torch.float64)
t = dt.all_reduce(t)
for how in ("exit", "raise"):
    pid = os.fork()
    if pid == 0:
        if how == "raise":
            raise RuntimeError(f"child of rank {rank} gave up")
        sys.exit(7)
    _, status = os.waitpid(pid, 0)
    print(f"RESULT rank {rank}: child ({how}) exit code {os.waitstatus_to_exitcode(status)}",
          flush=True)
t = dt.all_reduce(t)
print(f"RESULT rank {rank}: sum {t.tolist()}", flush=True)
# A group kept past destroy_process_group (which finalises MPI): a typed error
# where Open MPI aborted the job ("MPI_Irecv() ... called after MPI_FINALIZE").
world = dt.get_world()
dt.destroy_process_group()
try:
    dt.all_reduce(t, group=world)
except diffcomm.BackendError as e:
    print(f"RESULT rank {rank}: after destroy_process_group: BackendError: {e}", flush=True)

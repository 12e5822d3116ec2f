"""Run under `mpirun -np 3` by test_fault_paths.py: rank 1 raises an uncaught
exception right after init_process_group("mpi"); the others wait in a barrier
whose deadline (600 s) is far away. The job must end within seconds (MPI_Abort
from diffcomm's excepthook), naming rank 1 and the exception."""
import time

import diffcomm.torch as dt

dt.init_process_group("mpi", check=False, timeout_s=600)
if dt.get_rank() == 1:
    time.sleep(0.5)  # the others are in the barrier by now
    raise RuntimeError("rank 1 gave up")
dt.get_world().barrier()
print("NOT REACHED: the barrier completed", flush=True)

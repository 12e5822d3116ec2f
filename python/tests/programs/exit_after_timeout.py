"""Run under `mpirun -np 2`: one scenario of a Python program whose rank 1
misbehaves, to check how the job ends. Prints "RESULT rank R: <kind>: <msg>".

  stall      rank 1 never reaches the barrier; rank 0 catches Timeout and
             leaves the program normally: interpreter exit must end the job
             (MPI_Abort, code 124), not wait in MPI_Finalize forever
  nan        DIFFCOMM_TIMEOUT=nan on every rank: init_process_group refuses it
"""
import os
import sys
import time

import diffcomm
import diffcomm.torch as dt

scenario = sys.argv[1]
kind, what = "none", ""
try:
    dt.init_process_group("mpi", check=False, timeout_s=None if scenario == "nan" else 2.0)
    rank = dt.get_rank()
    if rank == 1:
        time.sleep(600)
    dt.get_world().barrier()
except diffcomm.Timeout as e:
    kind, what = "Timeout", str(e).splitlines()[0]
except diffcomm.InvalidArgument as e:
    kind, what = "InvalidArgument", str(e)
print(f"RESULT rank {os.environ['OMPI_COMM_WORLD_RANK']}: {kind}: {what}", flush=True)

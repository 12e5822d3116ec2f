"""How an MPI job of diffcomm.torch ends when one rank cannot go on.

MPI has no way for one process to tell the others it failed: a rank that dies
with an uncaught exception leaves its peers waiting in their next collective
until the deadline (600 s by default), and an MPI_Abort kills them before they
can report. diffcomm's alarm channel (``mpi::end_job``,
include/diffcomm/backends/mpi.hpp) tells them out of band: a peer waiting in a
call raises Timeout or RankFailure naming the failed rank, dumps its flight
recorder and reports; only then is the job aborted. Both hooks here are
installed by ``init_process_group("mpi")``:

* an uncaught exception ends the job through ``end_job`` after Python printed
  the traceback (``DIFFCOMM_ABORT_ON_EXCEPTION=0`` keeps MPI's default: the
  rank exits and its peers wait for their deadline);
* at interpreter exit, ``at_exit``: after a Timeout, ``end_job`` instead of an
  MPI_Finalize that would wait for the timed-out calls' requests forever;
  otherwise the processes meet before MPI_Finalize, and a rank that left early
  still dumps and reports when a peer fails meanwhile.

Neither runs in a process forked after init (os.fork, multiprocessing): its
exit leaves the parent's MPI alone (mpi::in_forked_child in C++).
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from .. import _core

#: MPI_Abort's error code after an uncaught exception (Python's own exit code
#: for one).
UNCAUGHT_EXCEPTION_CODE = 1

_installed = False
#: The process that installed the hooks: a child forked from it (os.fork, a
#: multiprocessing worker) holds a copy of the parent's MPI state but must not
#: end the parent's job when it raises (the C++ exit path checks the same).
_owner_pid = 0


def install_hooks() -> None:
    """Installs both hooks once per process (idempotent)."""
    global _installed, _owner_pid
    if _installed:
        return
    _installed = True
    _owner_pid = os.getpid()
    atexit.register(_core.mpi.at_exit)
    if os.environ.get("DIFFCOMM_ABORT_ON_EXCEPTION", "1") != "0":
        previous = sys.excepthook

        def hook(kind: Any, value: Any, tb: Any) -> None:
            previous(kind, value, tb)
            _abort_after_uncaught(kind, value)

        sys.excepthook = hook


def _abort_after_uncaught(kind: Any, value: Any) -> None:
    """end_job unless MPI is already finalised (or never started), the world
    has one rank, or the exception is a plain exit (SystemExit does not reach
    excepthook; KeyboardInterrupt does: mpirun forwards Ctrl-C to every rank
    anyway, ending the job is still right)."""
    if os.getpid() != _owner_pid:  # a forked child: the job is its parent's
        return
    if not _core.mpi.initialized() or _core.mpi.finalized() or _core.mpi.world_size() < 2:
        return
    rank = _core.mpi.world_rank()
    first_line = str(value).split("\n", 1)[0]
    sys.stderr.write(
        f"diffcomm: rank {rank} of the MPI job raised an uncaught {kind.__name__}: {first_line}; "
        f"ending the job with MPI_Abort (code {UNCAUGHT_EXCEPTION_CODE}) once every rank has "
        f"reported, so that the other ranks do not wait for their deadline "
        f"(DIFFCOMM_ABORT_ON_EXCEPTION=0 turns this off)\n")
    sys.stderr.flush()
    _core.mpi.end_job(UNCAUGHT_EXCEPTION_CODE, f"uncaught {kind.__name__}: {first_line}")

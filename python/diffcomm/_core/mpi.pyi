"""The Open MPI backend."""

import diffcomm._core


def init() -> None:
    """MPI_Init_thread unless MPI is already initialised (e.g. by mpi4py)."""

def finalize() -> None:
    """
    MPI_Finalize if diffcomm initialised MPI (not when mpi4py did). After a Timeout it ends the job with MPI_Abort instead (see abort_if_timed_out).
    """

def abort(code: int = 1) -> None:
    """
    MPI_Abort(MPI_COMM_WORLD, code): ends every process of the job; never returns.
    """

def timed_out() -> bool:
    """
    Whether a call of this process (any group, group creation included) raised Timeout.
    """

def abort_if_timed_out() -> None:
    """
    After a Timeout: prints which call timed out and ends the job with MPI_Abort (code 124), since MPI_Finalize could wait for the calls in flight forever; else returns. diffcomm.torch registers it to run at interpreter exit.
    """

def world(check: bool | None = None, native_reduction: bool = False, timeout_s: float | None = None) -> diffcomm._core.ProcessGroup:
    """
    The group of MPI_COMM_WORLD (borrowed). check: cross-rank fingerprint checks (None: DIFFCOMM_CHECK, else on in Debug builds); native_reduction: MPI's own reductions (faster, not bit-identical to the simulated world); timeout_s: deadline of every wait (None: DIFFCOMM_TIMEOUT, else 600).
    """

def from_comm_address(address: int, name: str = 'mpi', check: bool | None = None, native_reduction: bool = False, timeout_s: float | None = None) -> diffcomm._core.ProcessGroup:
    """
    A group over a caller's communicator given the address of its MPI_Comm handle (mpi4py: MPI._addressof(comm)); borrowed, never freed by diffcomm.
    """

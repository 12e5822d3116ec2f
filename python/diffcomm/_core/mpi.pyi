"""The Open MPI backend."""

import diffcomm._core


def init() -> None:
    """MPI_Init_thread unless MPI is already initialised (e.g. by mpi4py)."""

def finalize() -> None:
    """MPI_Finalize if diffcomm initialised MPI (not when mpi4py did)."""

def world(check: bool | None = None, native_reduction: bool = False, timeout_s: float | None = None) -> diffcomm._core.ProcessGroup:
    """
    The group of MPI_COMM_WORLD (borrowed). check: cross-rank fingerprint checks (None: DIFFCOMM_CHECK, else on in Debug builds); native_reduction: MPI's own reductions (faster, not bit-identical to the simulated world); timeout_s: deadline of every wait (None: DIFFCOMM_TIMEOUT, else 600).
    """

def from_comm_address(address: int, name: str = 'mpi', check: bool | None = None, native_reduction: bool = False, timeout_s: float | None = None) -> diffcomm._core.ProcessGroup:
    """
    A group over a caller's communicator given the address of its MPI_Comm handle (mpi4py: MPI._addressof(comm)); borrowed, never freed by diffcomm.
    """

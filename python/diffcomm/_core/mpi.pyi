"""The Open MPI backend."""

import diffcomm._core


def init() -> None:
    """MPI_Init_thread unless MPI is already initialised (e.g. by mpi4py)."""

def finalize() -> None:
    """MPI_Finalize if diffcomm initialised MPI (not when mpi4py did)."""

def world() -> diffcomm._core.ProcessGroup:
    """The group of MPI_COMM_WORLD (borrowed)."""

def from_comm_address(address: int, name: str = 'mpi') -> diffcomm._core.ProcessGroup:
    """
    A group over a caller's communicator given the address of its MPI_Comm handle (mpi4py: MPI._addressof(comm)); borrowed, never freed by diffcomm.
    """

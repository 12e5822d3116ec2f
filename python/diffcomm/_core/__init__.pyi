"""
diffcomm: differentiable collectives and the encoder-parallel exchange (C++ core).
"""

from collections.abc import Sequence

from numpy.typing import NDArray
import torch

from diffcomm._core import (
    encoder_parallel as encoder_parallel,
    mpi as mpi,
    nccl as nccl,
    nn as nn,
    sim as sim
)


class Error(Exception):
    pass

class InvalidArgument(Error):
    pass

class CollectiveMismatch(Error):
    pass

class Deadlock(Error):
    pass

class RankFailure(Error):
    pass

class Timeout(Error):
    pass

class BackendError(Error):
    pass

class Tensor:
    """
    A diffcomm tensor: a handle to shared, dense, row-major storage with diffcomm's own autograd state. Copies share data (like torch.Tensor).
    """

    @property
    def shape(self) -> list[int]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def requires_grad(self) -> bool: ...

    @property
    def is_leaf(self) -> bool: ...

    @property
    def data_ptr(self) -> int: ...

    def numel(self) -> int: ...

    def set_requires_grad(self, value: bool = True) -> Tensor: ...

    @property
    def grad(self) -> Tensor | None: ...

    def detach(self) -> Tensor: ...

    def tolist(self) -> list[float]:
        """Values as a flat list of floats (row-major)."""

    def __repr__(self) -> str: ...

def from_dlpack(array: NDArray, requires_grad: bool = False) -> Tensor:
    """
    Borrows a DLPack-capable array (torch.Tensor, numpy.ndarray, ...) as a diffcomm Tensor sharing its storage (no copy). Raises InvalidArgument for non-contiguous arrays.
    """

def to_torch(tensor: Tensor) -> torch.Tensor:
    """
    A torch.Tensor sharing the diffcomm tensor's storage (no copy, no autograd).
    """

def to_numpy(tensor: Tensor) -> NDArray:
    """A numpy array sharing the diffcomm tensor's storage (no copy)."""

def from_list(values: Sequence[float], shape: Sequence[int], dtype: str = 'float64') -> Tensor: ...

def zeros(shape: Sequence[int], dtype: str = 'float64') -> Tensor: ...

def grad(outputs: Sequence[Tensor], inputs: Sequence[Tensor], grad_outputs: Sequence[Tensor], retain_graph: bool = False) -> list[Tensor]:
    """
    diffcomm::grad: gradients of outputs w.r.t. inputs contracted with grad_outputs; runs the backward collectives of the recorded graph. Unused inputs get zeros.
    """

def hand_off(outputs: Sequence[Tensor]) -> tuple:
    """
    diffcomm::hand_off: the graph behind outputs leaves its cohorts (torch's engine orders its backward now); returns (saved tensors, number of collectives).
    """

def backward(roots: Sequence[Tensor], grad_roots: Sequence[Tensor] = []) -> None: ...

def add(arg0: Tensor, arg1: Tensor, /) -> Tensor: ...

def mul(arg0: Tensor, arg1: Tensor, /) -> Tensor: ...

def scale(arg0: Tensor, arg1: float, /) -> Tensor: ...

def sum(arg: Tensor, /) -> Tensor: ...

def dot(arg0: Tensor, arg1: Tensor, /) -> Tensor: ...

def matmul(arg0: Tensor, arg1: Tensor, /) -> Tensor: ...

def cat(arg: Sequence[Tensor], /) -> Tensor: ...

def narrow(arg0: Tensor, arg1: int, arg2: int, /) -> Tensor: ...

class ProcessGroup:
    """A diffcomm process group (ranks in every call are group-local)."""

    def rank(self) -> int:
        """This process's (thread's) rank in the group."""

    def size(self) -> int: ...

    def global_rank(self, group_rank: int) -> int:
        """Global rank of the member with group-local rank group_rank."""

    def members(self) -> list[int]:
        """Global ranks of all members, in group order."""

    def group_rank(self, global_rank: int) -> int:
        """Group-local rank of a member given its global rank."""

    @property
    def name(self) -> str: ...

    @property
    def backend_name(self) -> str: ...

    def stats(self) -> dict:
        """Traffic counters of this rank: {'total': {...}, 'entries': [...]}."""

    def new_group(self, ranks: Sequence[int], name: str = '') -> ProcessGroup | None:
        """
        Collective: the sub-group of the given group-local ranks (None on non-members).
        """

    def split(self, color: int, key: int, fingerprint: Sequence[int], name: str) -> ProcessGroup | None:
        """Collective, MPI_Comm_split semantics."""

    def barrier(self) -> None: ...

    def backward_pending(self) -> None:
        """
        Runs, with zero cotangents, the backward of every differentiable collective of this rank that has not run yet (the participation of a rank whose loss reaches none of them; diffcomm.grad/backward do it for the collectives they meet).
        """

    def __repr__(self) -> str: ...

class DeviceMesh:
    """Ranks laid out on named dims, row-major, last dim fastest."""

    def __init__(self, world: ProcessGroup, dims: Sequence[tuple[str, int]]) -> None: ...

    def size(self, dim: str) -> int: ...

    def coordinate(self, dim: str) -> int: ...

    def group(self, dims: object) -> ProcessGroup:
        """
        The group along one dim (a str) or several dims (a list, created on first use: collective).
        """

    def rank_of(self, coords: Sequence[int]) -> int: ...

    @property
    def dims(self) -> list[tuple[str, int]]: ...

    @property
    def world(self) -> ProcessGroup: ...

HAVE_MPI: bool = True

HAVE_NCCL: bool = True

HAVE_CUDA: bool = True

"""torch's own differentiable collectives, the oracle of test_torch_ops.py,
from the newest API the installed torch has.

torch >= 2.15 deprecates torch.distributed.nn.functional for
torch.distributed._functional_collectives ("funcol"), whose all_reduce,
all_gather_single_autograd, reduce_scatter_single_autograd and
all_to_all_single_autograd have autograd. Where funcol has those they are the
oracle; otherwise (torch 1.13 to 2.14) nn.functional is. funcol has no
differentiable broadcast (its backward warns "silently incorrect"), and no
reduce, gather or scatter at all: those stay on nn.functional, whose
broadcast deprecation warning is silenced here on purpose.
"""
import warnings

import torch
import torch.distributed as tdist
import torch.distributed.nn.functional as tnn

try:
    import torch.distributed._functional_collectives as funcol

    HAVE_FUNCOL_AUTOGRAD = hasattr(funcol, "all_gather_single_autograd")
except ImportError:  # torch 1.13
    funcol = None
    HAVE_FUNCOL_AUTOGRAD = False

def all_reduce(x):
    if HAVE_FUNCOL_AUTOGRAD:
        return funcol.all_reduce(x, "sum", tdist.group.WORLD)
    return tnn.all_reduce(x)


def all_gather(x):
    """Every rank's x, as a list by rank."""
    if HAVE_FUNCOL_AUTOGRAD:
        n = tdist.get_world_size()
        return list(funcol.all_gather_single_autograd(x, 0, tdist.group.WORLD).chunk(n))
    return list(tnn.all_gather(x))


def reduce_scatter_single(x):
    """This rank's 1/N slice (dim 0) of the elementwise sum."""
    if HAVE_FUNCOL_AUTOGRAD:
        return funcol.reduce_scatter_single_autograd(x, "sum", 0, tdist.group.WORLD)
    r, n = tdist.get_rank(), tdist.get_world_size()
    k = x.shape[0] // n
    return tnn.all_reduce(x)[r * k:(r + 1) * k]


def all_to_all_single(x, output_split_sizes, input_split_sizes):
    if HAVE_FUNCOL_AUTOGRAD:
        return funcol.all_to_all_single_autograd(x, output_split_sizes, input_split_sizes,
                                                 tdist.group.WORLD)
    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    return tnn.all_to_all_single(out, x, output_split_sizes, input_split_sizes)


def broadcast(x, src):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return tnn.broadcast(x, src=src)


def reduce(x, dst):
    return tnn.reduce(x, dst)


def gather(x, dst):
    return tnn.gather(x, dst=dst)


def scatter(xs, src):
    return tnn.scatter(xs, src=src)


__all__ = ["all_reduce", "all_gather", "reduce_scatter_single", "all_to_all_single", "broadcast",
           "reduce", "gather", "scatter", "HAVE_FUNCOL_AUTOGRAD", "torch"]

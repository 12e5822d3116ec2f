"""The differentiable collectives on diffcomm tensors: diffcomm::nn (C++,
include/diffcomm/nn/functional.hpp and canonical_all_reduce.hpp), whose docstrings are the reference.
For torch tensors use diffcomm.torch; this module is for code written on
diffcomm.Tensor (diffcomm.grad / diffcomm.backward)."""
from ._core.nn import (
    all_gather,
    all_gather_single,
    all_gather_v,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    canonical_all_reduce,
    canonical_sum,
    cat_or_empty,
    copy_to_tp_region,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_v,
    scatter,
)

__all__ = [
    "all_gather",
    "all_gather_single",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "canonical_all_reduce",
    "canonical_sum",
    "cat_or_empty",
    "copy_to_tp_region",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_v",
    "scatter",
]

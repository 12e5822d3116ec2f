"""Training steps written as torch users write them (torch.distributed,
DTensor tensor parallelism, FSDP2), each returning its module after
backward(): check_equivalence(step, meshes, torch_distributed=True) reads
every parameter's placement from the model. One correct step, two planted
bugs:

  tp_mlp_step(loss_times_tp=True)  the loss multiplied by the TP size (as if
                                   each TP rank held a different batch):
                                   every gradient x tp.
  tp_mlp_step(fsdp_sum=True)       FSDP2's reduce-scatter sums instead of
                                   averaging over dp (set_gradient_divide_
                                   factor(1)): every gradient x dp.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

BATCH, HIDDEN, FFN, OUT = 8, 6, 16, 4


def tp_mlp_step(rank, mesh, seed, *, loss_times_tp=False, fsdp_sum=False):
    """Linear -> ReLU -> Linear, tensor-parallel over mesh["tp"] (Colwise,
    Rowwise), FSDP2 over mesh["dp"]; each dp rank takes its rows of the
    global batch and the loss is their mean (FSDP2 averages over dp)."""
    torch.manual_seed(seed)  # the same weights and batch on every rank
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN, dtype=torch.float64),
                                torch.nn.ReLU(),
                                torch.nn.Linear(FFN, OUT, dtype=torch.float64))
    x = torch.randn(BATCH, HIDDEN, dtype=torch.float64)
    target = torch.randn(BATCH, OUT, dtype=torch.float64)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    if fsdp_sum:
        model.set_gradient_divide_factor(1.0)
    dp, k = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(k * BATCH // dp, (k + 1) * BATCH // dp)
    loss = torch.nn.functional.mse_loss(model(x[rows]), target[rows])
    if loss_times_tp:
        loss = loss * mesh["tp"].size()
    loss.backward()
    return model

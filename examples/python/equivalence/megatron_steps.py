"""Training steps written with megatron-core's public API, unmodified, each
returning its module after backward(); check_equivalence(step, meshes,
torch_distributed=True, cuda="cpu") reads the placements from Megatron's
parameter attributes (tensor_model_parallel, partition_dim) on a mesh
{"dp": d, "tp": t} (Megatron's rank order: tp fastest). The model:

    pre (torch Linear, replicated) -> ColumnParallelLinear -> GELU
    -> RowParallelLinear, loss = sum(y^2 * c) over the global batch,
    gradients summed over dp by hand (all_reduce on Megatron's dp group).

With `sequence_parallel=True` the sequence is split over TP (Column/Row
parallel all-gather and reduce-scatter it) and pre.weight is marked
`sequence_parallel` as Megatron marks the replicated parameters of that
region (its layer norms): its gradient is a partial sum over TP, which the
oracle reads as Partial("tp").

Planted bugs, one each (`bug=`):

  "row_forgets_all_reduce"  a custom RowParallelLinear whose forward skips
                            reduce_from_tensor_model_parallel_region: every
                            rank's output is a partial sum; every gradient
                            differs (no factor).
  "loss_averaged_over_tp"   the loss divided by the TP size, as if TP ranks
                            held different samples: every gradient x 1/tp.
  "transposed_copy"         NVIDIA/Megatron-LM#5337: a column-parallel layer
                            written with copy_to_tensor_model_parallel_region
                            whose input is used transposed; the gradient
                            reaching _reduce is non-contiguous, _reduce
                            all-reduces a contiguous copy and returns the
                            original, so pre.weight's gradient is never summed
                            over TP (its replicas differ, and it differs from
                            the reference). With `fix_5337=True` the step
                            patches _reduce to return the reduced copy: passes.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as mtp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

S, B, H, F = 8, 4, 6, 8  # sequence (split over tp with SP), batch (split over dp), hidden, ffn


class ForgetfulRowParallel(mtp.RowParallelLinear):
    """RowParallelLinear without its forward all-reduce (the bug)."""

    def forward(self, input_):
        return torch.nn.functional.linear(input_, self.weight), None


class TransposedColumn(torch.nn.Module):
    """A column-parallel projection of a [S, B, H] input to [B, S, F/tp],
    written with Megatron's mappings as Megatron's own layers were."""

    def __init__(self, weight_shard):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_shard.clone())
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x):
        x = mappings.copy_to_tensor_model_parallel_region(x)
        return torch.matmul(x.transpose(0, 1), self.weight.t()), None


class Block(torch.nn.Module):
    def __init__(self, tp, tp_rank, seed, bug, sequence_parallel=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w0, w1, w2 = (torch.randn(*shape, generator=g, dtype=torch.float64)
                      for shape in ((H, H), (F, H), (H, F)))
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                  params_dtype=torch.float64, sequence_parallel=sequence_parallel)
        self.pre = torch.nn.Linear(H, H, bias=False, dtype=torch.float64)
        self.pre.weight.sequence_parallel = sequence_parallel
        if bug == "transposed_copy":
            self.col = TransposedColumn(w1.chunk(tp, 0)[tp_rank])
        else:
            self.col = mtp.ColumnParallelLinear(H, F, config=cfg, init_method=lambda w: w,
                                                bias=False, gather_output=False)
        row_cls = ForgetfulRowParallel if bug == "row_forgets_all_reduce" else \
            mtp.RowParallelLinear
        self.row = row_cls(F, H, config=cfg, init_method=lambda w: w, bias=False,
                           input_is_parallel=True, skip_bias_add=True)
        with torch.no_grad():
            self.pre.weight.copy_(w0)
            self.col.weight.copy_(w1.chunk(tp, 0)[tp_rank])
            self.row.weight.copy_(w2.chunk(tp, 1)[tp_rank])

    def forward(self, x):
        h, _ = self.col(self.pre(x))
        y, _ = self.row(torch.nn.functional.gelu(h))
        return y


def _reduce_fixed(input_, group):
    """mappings._reduce as fixed: the reduced tensor is the one returned."""
    if group.size() == 1:
        return input_
    input_ = input_.contiguous()
    dist.all_reduce(input_, group=group)
    return input_


def megatron_step(rank, mesh, seed, *, bug=None, fix_5337=False, sequence_parallel=False):
    tp = mesh["tp"].size()
    sequence_parallel = sequence_parallel and tp > 1  # Megatron refuses SP without TP
    ps.initialize_model_parallel(tp, 1)
    try:
        t = ps.get_tensor_model_parallel_rank()
        model = Block(tp, t, seed, bug, sequence_parallel)
        g = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
        c = torch.randn(S, B, H, generator=g, dtype=torch.float64)
        dp, k = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = slice(k * B // dp, (k + 1) * B // dp)
        x, c = x[:, rows], c[:, rows]
        if sequence_parallel:  # this TP rank's part of the sequence
            x, c = x.chunk(tp, 0)[t], c.chunk(tp, 0)[t]
        if bug == "transposed_copy":
            c = c.transpose(0, 1)  # the layer's output is [B, S, H]
        fix = mock.patch.object(mappings, "_reduce", _reduce_fixed) if fix_5337 else \
            contextlib.nullcontext()
        with fix:
            loss = (model(x).square() * c).sum()
            if bug == "loss_averaged_over_tp":
                loss = loss / tp
            loss.backward()
        for p in model.parameters():  # the gradient of the global batch's loss
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        return model
    finally:
        ps.destroy_model_parallel()

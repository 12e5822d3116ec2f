"""VlmStep broken the ways public trainers broke, one bug each; check_equivalence
names the parameter and the factor (or the shards) of each:

  PerRankLossNorm   loss normalized by the rank's own tokens instead of the
                    global batch's (per-module normalization, Megatron-Bridge
                    #5555): every gradient x world (dp*cp*tp).
  SliceOnlyBackward the exchange's backward keeps only the rows this rank
                    produced itself, dropping the other ranks' contributions
                    (Megatron-Bridge #4784): encoder.w differs (no factor),
                    encoder.adapter differs in the dp shards whose samples
                    have image rows on another rank.
  PartialTwiceOverTp decoder.norm's gradient, already summed over the world,
                    summed again over TP: x tp.
  EncoderLossScaled the encoder's loss scaled by encoder_dp / llm_dp (every
                    rank runs the encoder, the LLM's replicas are dp:
                    encoder_dp / llm_dp = cp*tp; Megatron-Bridge #4066, #3197):
                    encoder.w and encoder.adapter x cp*tp.
"""
from __future__ import annotations

from typing import Dict, Type

import torch

import diffcomm.torch as dt

from vlm_step import VlmStep


class PerRankLossNorm(VlmStep):
    def loss_tokens(self, owned_tokens: int) -> int:
        return owned_tokens


def _drop_grad(t: torch.Tensor) -> torch.Tensor:
    """t forward, a zero gradient backward (the graph stays connected)."""
    return t.detach() + 0.0 * t


class SliceOnlyBackward(VlmStep):
    def exchange(self, plan, group, records, prototype):
        rows, recs = super().exchange(plan, group, records, prototype)
        mine = set(plan.buckets[group.rank()])
        return rows, [r if r.item.item_id in mine else type(r)(r.item, _drop_grad(r.rows))
                      for r in recs]


class PartialTwiceOverTp(VlmStep):
    def reduce_norm(self, g: torch.Tensor) -> torch.Tensor:
        return dt.all_reduce(super().reduce_norm(g), "sum", self.mesh.group("tp"))


class EncoderLossScaled(VlmStep):
    def encoder_rows(self, plan, bucket, w, adapter):
        scale = float(self.cp * self.tp)  # encoder_dp / llm_dp
        out = []
        for it, rows in super().encoder_rows(plan, bucket, w, adapter):
            rows.register_hook(lambda g: g * scale)
            out.append((it, rows))
        return out


MUTATIONS: Dict[str, Type[VlmStep]] = {
    "per_rank_loss_norm": PerRankLossNorm,
    "slice_only_backward": SliceOnlyBackward,
    "partial_twice_over_tp": PartialTwiceOverTp,
    "encoder_loss_scaled": EncoderLossScaled,
}

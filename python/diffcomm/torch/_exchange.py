"""The encoder-parallel feature exchange on torch tensors: ``route_features``,
``unpack_records`` and ``merge_into_decoder`` run the C++ exchange
(include/diffcomm/encoder_parallel/) through diffcomm.torch's autograd bridge."""
from __future__ import annotations

import collections
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .. import _core
from .._core import encoder_parallel as _ep
from ._args import group_or_default
from ._bridge import apply

#: An encoder record on torch: the work item and its feature rows [output_rows, hidden].
Record = collections.namedtuple("Record", ["item", "rows"])


def route_features(producer_records: Sequence[Tuple[Any, torch.Tensor]], prototype: torch.Tensor,
                   plan: "_ep.ExchangePlan", group: Optional[_core.ProcessGroup] = None, *,
                   exchange_rank: Optional[int] = None, mode: Any = None,
                   receiver_grad: Any = None) -> Tuple[torch.Tensor, List[Any]]:
    """Sends this rank's encoder records (``(EncoderWorkItem, rows)`` pairs,
    exactly the items of the bucket it produces, in bucket order; empty on
    non-producers) to the exchange ranks that own their tokens.

    ``prototype`` fixes dtype, device and width ([0, hidden] is fine).
    ``group`` is the exchange group (TP group in TP modes, CP x TP parent
    group in the parent mode); ``exchange_rank`` defaults to group.rank();
    ``mode`` to plan.mode; ``receiver_grad`` to the mesh's convention
    (ReplicatedOverTp for tp > 1 without SP, else Partial).
    Returns (rows, items): received rows and their work items in row order.
    In the all-to-all modes an item may be a piece of an image (row-level
    routing): the rows of the tokens this rank owns, with the item's id and
    decoder_token_start / output_rows narrowed to them; unpack_records and
    merge_into_decoder take pieces like whole items.
    The op always records a backward node (like cat_or_empty), so a rank that
    sends nothing still runs the backward all-to-all.
    """
    g = group_or_default(group)
    er = g.rank() if exchange_rank is None else exchange_rank
    m = plan.mode if mode is None else mode
    rg = receiver_grad if receiver_grad is not None else _ep.receiver_grad_for(
        plan.decoder.context(0, 0))
    items = [r[0] for r in producer_records]
    if not prototype.requires_grad:
        prototype = prototype.detach().requires_grad_()
    received: List[Any] = []

    def run(ins: List[_core.Tensor]) -> List[_core.Tensor]:
        feats = [_ep.EncoderFeature(it, t) for it, t in zip(items, ins[1:])]
        routed = _ep.route_features(m, feats, ins[0], er, plan, g, rg)
        received.extend(routed.items)
        return [routed.rows]

    rows = apply(run, prototype, *[r[1] for r in producer_records], op="route_features",
                  group=g)[0]
    return rows, received


def unpack_records(rows: torch.Tensor, received_items: Sequence[Any]) -> List[Record]:
    """Splits routed rows by the plan into Records sorted by (batch_index,
    decoder_token_start, item_id); each record's rows are differentiable.
    InvalidArgument when rows and items disagree."""
    order: List[Any] = []

    def run(ins: List[_core.Tensor]) -> List[_core.Tensor]:
        recs = _ep.unpack_records(ins[0], list(received_items))
        order.extend(r.item for r in recs)
        return [r.rows for r in recs]

    outs = apply(run, rows, op="unpack_records")
    return [Record(it, t) for it, t in zip(order, outs)]


def merge_into_decoder(base: torch.Tensor, records: Sequence[Tuple[Any, torch.Tensor]],
                       layout: "_ep.ShardLayout",
                       anchor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """base [layout.rows(), hidden] with every record's owned image-token rows
    replaced by the record's rows. ``anchor``: the routed rows the records came
    from (keeps the exchange's backward reachable on a rank with no records)."""
    items = [r[0] for r in records]
    xs = [base] + ([anchor] if anchor is not None else []) + [r[1] for r in records]
    has_anchor = anchor is not None

    def run(ins: List[_core.Tensor]) -> List[_core.Tensor]:
        rec_t = ins[2:] if has_anchor else ins[1:]
        feats = [_ep.EncoderFeature(it, t) for it, t in zip(items, rec_t)]
        return [_ep.merge_into_decoder(ins[0], feats, layout, ins[1] if has_anchor else None)]

    return apply(run, *xs, op="merge_into_decoder")[0]

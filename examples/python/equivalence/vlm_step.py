"""A small VLM-style training step for diffcomm.sim.check_equivalence, correct
on every mesh of dims dp (data parallel), cp (context parallel, contiguous) and
tp (tensor parallel with sequence parallel). mutations.py breaks it the ways
public trainers broke.

Model, float64, one global batch of SAMPLES sequences of SEQ_LEN tokens:
  encoder   rows of image i of sample b = P_i @ W + adapter[b]
            (W [F, H] "encoder.w", adapter [SAMPLES, H] "encoder.adapter")
  exchange  route_features over the TP group (the CP x TP group when cp > 1)
            -> unpack_records -> merge_into_decoder over the text embeddings
            of the tokens this rank owns (sequence parallel)
  decoder   xs = e * s ("decoder.norm" [H]), x = all_gather_single(xs) over TP,
            y = x @ A[:, this TP rank's columns] ("decoder.a" [H, FFN])
  loss      (sum of <xs_row, U_row> over owned tokens + 0.5 |y|^2) / tokens of
            the global batch (normalized over tokens, globally)
Data parallel: dp replica d takes samples [d * SAMPLES/dp, (d+1) * SAMPLES/dp).

Gradients returned (after the reductions a trainer does):
  encoder.w        all-reduced over cp x tp      Partial("dp")
  encoder.adapter  this replica's rows, over cp x tp   Shard(0, "dp")
  decoder.a        all-reduced over dp x cp      Shard(1, "tp")
  decoder.norm     all-reduced over the world    Replicate()
"""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch

import diffcomm
import diffcomm.sim as dsim
import diffcomm.torch as dt

SAMPLES, SEQ_LEN, HIDDEN, IN_FEATURES, FFN = 4, 32, 4, 3, 8

# (token_start, tokens) of each sample's images. Sample 0's image lies in the
# first quarter of the sequence; sample 1 is text only; sample 2's image
# straddles the middle; sample 3 has two.
IMAGES: Tuple[Tuple[Tuple[int, int], ...], ...] = (((2, 5),), (), ((12, 8),), ((2, 6), (20, 10)))


def _gen(*key: int) -> torch.Generator:
    g = torch.Generator()
    h = 0
    for k in key:
        h = (h * 1000003 + int(k) + 7) % (2**61 - 1)
    g.manual_seed(h)
    return g


def _randn(*shape: int, key: Tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(*key), dtype=torch.float64)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient (a copy), zeros when backward did not reach p on this rank
    (a rank that encodes no image does not use the adapter)."""
    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)


def mesh_size(mesh: "diffcomm.DeviceMesh", name: str) -> int:
    """The size of a dim, 1 when the mesh does not name it."""
    return dict(mesh.dims).get(name, 1)


class VlmStep:
    """``VlmStep()(rank, mesh, seed)`` is the step check_equivalence runs.
    Every rank calls the same object (one thread each), so a call works on
    its own copy: the attributes below are per rank."""

    def __call__(self, rank: int, mesh: "diffcomm.DeviceMesh", seed: int) -> Dict[str, tuple]:
        return copy.copy(self)._step(mesh, seed)

    def _step(self, mesh: "diffcomm.DeviceMesh", seed: int) -> Dict[str, tuple]:
        self.seed = seed
        self.dp, self.cp, self.tp = (mesh_size(mesh, n) for n in ("dp", "cp", "tp"))
        self.mesh = mesh
        coord = dict(zip([n for n, _ in mesh.dims], self._coords(mesh)))
        self.d, self.c, self.t = coord.get("dp", 0), coord.get("cp", 0), coord.get("tp", 0)
        w = torch.nn.Parameter(_randn(IN_FEATURES, HIDDEN, key=(seed, 1)))
        adapter = torch.nn.Parameter(_randn(SAMPLES, HIDDEN, key=(seed, 2)))
        a = torch.nn.Parameter(_randn(HIDDEN, FFN, key=(seed, 3)))
        norm = torch.nn.Parameter(1 + 0.1 * _randn(HIDDEN, key=(seed, 4)))
        loss = self.forward(w, adapter, a, norm)
        loss.backward()
        return self.gradients(w, adapter, a, norm)

    # ------------------------------------------------------------ the data
    def _coords(self, mesh: "diffcomm.DeviceMesh") -> List[int]:
        return [mesh.coordinate(n) for n, _ in mesh.dims]

    def first_sample(self) -> int:
        return self.d * (SAMPLES // self.dp)

    def batch(self) -> "dsim.Batch":
        """This dp replica's samples."""
        lo = self.first_sample()
        return dsim.Batch([
            dsim.Sample(SEQ_LEN, [dsim.ImageSpan(s, n, 4 * n, 10 * b + i)
                                  for i, (s, n) in enumerate(IMAGES[b])])
            for b in range(lo, lo + SAMPLES // self.dp)])

    def plan(self) -> "dsim.ExchangePlan":
        decoder = dsim.DecoderMesh(self.cp, self.tp, True, dsim.CpLayout.Contiguous)
        exchange = self.cp * self.tp if self.cp > 1 else self.tp
        return dsim.plan_exchange(self.batch(), decoder, dsim.EncoderLayout(exchange, 1))

    def exchange_group(self, plan: "dsim.ExchangePlan") -> "diffcomm.ProcessGroup":
        parent = plan.mode == dsim.FeatureExchangeMode.ParentVariableA2A
        return self.mesh.group(["cp", "tp"]) if parent else self.mesh.group("tp")

    # ------------------------------------------------------------ the model
    def encoder_rows(self, plan, bucket: int, w, adapter) -> List[tuple]:
        """(item, rows) of the images this rank's encoder produces."""
        out = []
        for item_id in plan.buckets[bucket]:
            it = plan.items[item_id]
            b = self.first_sample() + it.batch_index
            p = _randn(it.output_rows, IN_FEATURES, key=(self.seed, 5, b, it.decoder_token_start))
            out.append((it, p @ w + adapter[b]))
        return out

    def exchange(self, plan, group, records, prototype) -> Tuple[torch.Tensor, list]:
        """Routed rows and their records (item, rows)."""
        rows, items = dt.route_features(records, prototype, plan, group)
        return rows, dt.unpack_records(rows, items)

    def forward(self, w, adapter, a, norm) -> torch.Tensor:
        plan = self.plan()
        group = self.exchange_group(plan)
        me = group.rank()
        rows, recs = self.exchange(plan, group, self.encoder_rows(plan, me, w, adapter), w[:0])
        layout = diffcomm.encoder_parallel.ShardLayout(plan, me)
        first = self.first_sample()
        owned = layout.tokens()
        base = torch.stack([_randn(HIDDEN, key=(self.seed, 6, first + b, t)) for b, t in owned]) \
            if owned else torch.zeros(0, HIDDEN, dtype=torch.float64)
        u = torch.stack([_randn(HIDDEN, key=(self.seed, 7, first + b, t)) for b, t in owned]) \
            if owned else torch.zeros(0, HIDDEN, dtype=torch.float64)
        e = dt.merge_into_decoder(base, recs, layout, anchor=rows)
        xs = e * norm
        x = dt.all_gather_single(xs, self.mesh.group("tp"))
        cols = FFN // self.tp
        y = x @ a[:, self.t * cols:(self.t + 1) * cols]
        return ((xs * u).sum() + 0.5 * (y ** 2).sum()) / self.loss_tokens(len(owned))

    def loss_tokens(self, owned_tokens: int) -> int:
        """The loss's normalizer: the tokens of the global batch."""
        return SAMPLES * SEQ_LEN

    # ------------------------------------------------------- the reductions
    def gradients(self, w, adapter, a, norm) -> Dict[str, tuple]:
        cp_tp = self.mesh.group(["cp", "tp"])
        gw = dt.all_reduce(_grad(w), "sum", cp_tp)
        lo, n = self.first_sample(), SAMPLES // self.dp
        gadapter = dt.all_reduce(_grad(adapter)[lo:lo + n].contiguous(), "sum", cp_tp)
        cols = FFN // self.tp
        ga = dt.all_reduce(_grad(a)[:, self.t * cols:(self.t + 1) * cols].contiguous(), "sum",
                           self.mesh.group(["dp", "cp"]))
        gnorm = self.reduce_norm(_grad(norm))
        return {
            "encoder.w": (gw, dsim.Partial("dp")),
            "encoder.adapter": (gadapter, dsim.Shard(0, "dp")),
            "decoder.a": (ga, dsim.Shard(1, "tp")),
            "decoder.norm": (gnorm, dsim.Replicate()),
        }

    def reduce_norm(self, g: torch.Tensor) -> torch.Tensor:
        """decoder.norm is used on sequence-parallel rows: its gradient is
        partial over every dim, summed once over the world."""
        return dt.all_reduce(g, "sum", self.mesh.group(["dp", "cp", "tp"]))

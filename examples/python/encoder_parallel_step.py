"""One encoder-parallel training step in torch through diffcomm.torch, and its
single-rank float64 reference. Used by train_step.py (under torchrun or mpirun), by
sim_property.py (in diffcomm.sim.run) and by the tests.

Model (as diffcomm's C++ training step, DESIGN.md):
  encoder   features of image i = P_i @ W (W [F, H] replicated, P_i fixed per image)
  exchange  route_features -> unpack_records -> merge_into_decoder over this
            rank's decoder shard of text embeddings
  decoder   Megatron style: without SP, X = copy_to_tp_region(E) (identity,
            all-reduce of the gradient over TP); with SP, X = all_gather_single(E)
            over TP; then Y = X @ A[:, columns of this TP rank]
  loss      sum of <X_row, U(sample, token)> over this rank's tokens (counted
            once per token: TP rank 0 only without SP) + 0.5 |Y|^2
Reference: one rank, the full sequences, torch autograd in float64.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

import diffcomm
import diffcomm.sim as dsim
import diffcomm.torch as dt


@dataclasses.dataclass
class StepConfig:
    cp: int = 1
    tp: int = 1
    sp: bool = False
    layout: str = "contiguous"  # or "zigzag"
    hidden: int = 8
    in_features: int = 4
    ffn: int = 4  # multiple of tp
    seed: int = 0
    images: Sequence[Sequence[Tuple[int, int]]] = ((224, 224), (100, 300)), ((56, 56),)
    receiver_grad: object = None  # None: the mesh's convention; force one to see it fail

    @property
    def world_size(self) -> int:
        return self.cp * self.tp

    def decoder(self) -> "diffcomm.encoder_parallel.DecoderMesh":
        layout = dsim.CpLayout.Zigzag if self.layout == "zigzag" else dsim.CpLayout.Contiguous
        return dsim.DecoderMesh(self.cp, self.tp, self.sp, layout)

    def batch(self) -> "diffcomm.encoder_parallel.Batch":
        return dsim.batch_from_image_sizes(
            self.images, text_tokens=5, seq_multiple=dsim.required_seq_multiple(self.decoder()))

    def plan(self) -> "diffcomm.encoder_parallel.ExchangePlan":
        mode = dsim.select_feature_exchange(self.decoder().context(0, 0))
        exchange = self.cp * self.tp if mode == dsim.FeatureExchangeMode.ParentVariableA2A \
            else self.tp
        return dsim.plan_exchange(self.batch(), self.decoder(), dsim.EncoderLayout(exchange, 1))


def _gen(*key: int) -> torch.Generator:
    g = torch.Generator()
    h = 0
    for k in key:
        h = (h * 1000003 + int(k) + 7) % (2**61 - 1)
    g.manual_seed(h)
    return g


def weights(cfg: StepConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encoder W [F, H] and decoder A [H, ffn], float64, from the seed."""
    w = torch.randn(cfg.in_features, cfg.hidden, generator=_gen(cfg.seed, 1), dtype=torch.float64)
    a = torch.randn(cfg.hidden, cfg.ffn, generator=_gen(cfg.seed, 2), dtype=torch.float64)
    return w, a


def patches(cfg: StepConfig, batch_index: int, token_start: int, tokens: int) -> torch.Tensor:
    """P_i of the image at (sample, first token): [tokens, F]."""
    return torch.randn(tokens, cfg.in_features, generator=_gen(cfg.seed, 3, batch_index, token_start),
                       dtype=torch.float64)


def text(cfg: StepConfig, batch_index: int, seq_len: int) -> torch.Tensor:
    """Text embeddings of a sample [seq_len, H]."""
    return torch.randn(seq_len, cfg.hidden, generator=_gen(cfg.seed, 4, batch_index),
                       dtype=torch.float64)


def cotangent(cfg: StepConfig, batch_index: int, seq_len: int) -> torch.Tensor:
    """U of a sample [seq_len, H]."""
    return torch.randn(seq_len, cfg.hidden, generator=_gen(cfg.seed, 5, batch_index),
                       dtype=torch.float64)


def reference(cfg: StepConfig) -> Tuple[List[torch.Tensor], torch.Tensor, float]:
    """Single rank: full decoder inputs per sample, dL/dW, loss."""
    w, a = weights(cfg)
    w.requires_grad_()
    loss = (w * 0.0).sum()  # keeps W in the graph when the batch has no images
    full = []
    for b, sample in enumerate(cfg.batch().samples):
        e = text(cfg, b, sample.seq_len)
        for im in sample.images:
            rows = patches(cfg, b, im.token_start, im.tokens) @ w
            e = torch.cat([e[:im.token_start], rows, e[im.token_start + im.tokens:]])
        full.append(e.detach())
        loss = loss + (e * cotangent(cfg, b, sample.seq_len)).sum() + 0.5 * ((e @ a) ** 2).sum()
    (dw,) = torch.autograd.grad(loss, [w])
    return full, dw, loss.item()


def step(rank: int, world: "diffcomm.ProcessGroup", cfg: StepConfig, lr: float = 0.0):
    """This rank's step. Returns (decoder shard E, shard tokens, dL/dW summed
    over the world, this rank's loss). With lr > 0 also applies one SGD step to
    its copy of W (the same on every rank: the gradient is all-reduced)."""
    mesh = diffcomm.DeviceMesh(world, [("cp", cfg.cp), ("tp", cfg.tp)])
    cp_rank, tp_rank = mesh.coordinate("cp"), mesh.coordinate("tp")
    tp_group = mesh.group("tp")
    plan = cfg.plan()
    parent = plan.mode == dsim.FeatureExchangeMode.ParentVariableA2A
    exchange_group = mesh.group(["cp", "tp"]) if parent else tp_group
    exchange_rank = exchange_group.rank()

    w, a = weights(cfg)
    w = torch.nn.Parameter(w)
    opt = torch.optim.SGD([w], lr=lr)
    opt.zero_grad()
    # Encoder: this rank produces bucket exchange_rank (encoder_cp = 1).
    records = []
    for item_id in plan.buckets[exchange_rank]:
        it = plan.items[item_id]
        p = patches(cfg, it.batch_index, it.decoder_token_start, it.output_rows)
        records.append((it, p @ w))
    prototype = w[:0]  # [0, H]: dtype, width and an autograd anchor
    rows, items = dt.route_features(records, prototype, plan, exchange_group,
                                     receiver_grad=cfg.receiver_grad)
    recs = dt.unpack_records(rows, items)
    layout = diffcomm.encoder_parallel.ShardLayout(plan, exchange_rank)
    tokens = layout.tokens()
    base = torch.zeros(layout.rows(), cfg.hidden, dtype=torch.float64)
    u = torch.zeros(layout.rows(), cfg.hidden, dtype=torch.float64)
    samples = plan.seq_lens
    texts = [text(cfg, b, n) for b, n in enumerate(samples)]
    cots = [cotangent(cfg, b, n) for b, n in enumerate(samples)]
    for row, (b, t) in enumerate(tokens):
        base[row] = texts[b][t]
        u[row] = cots[b][t]
    e = dt.merge_into_decoder(base, recs, layout, anchor=rows)

    cols = cfg.ffn // cfg.tp
    a_t = a[:, tp_rank * cols:(tp_rank + 1) * cols].contiguous()
    if cfg.sp:
        x = dt.all_gather_single(e, tp_group)
        loss = (e * u).sum()
    else:
        # The TP region: every TP rank gets the complete, equal gradient of e
        # (the all-reduce in copy_to_tp_region's backward), so the exchange's
        # ReplicatedOverTp convention may keep one copy.
        x = dt.copy_to_tp_region(e, tp_group)
        loss = (x * u).sum() if tp_rank == 0 else (x * u).sum() * 0.0
    loss = loss + 0.5 * ((x @ a_t) ** 2).sum()
    loss.backward()
    dw = dt.all_reduce(w.grad.detach().clone(), "sum", world)
    w.grad.copy_(dw)
    opt.step()
    return e.detach(), tokens, dw, loss.item(), w.detach()


def check(cfg: StepConfig, results, tol: float = 1e-12) -> None:
    """Asserts every rank's shard and gradient equal the reference."""
    full, dw_ref, loss_ref = reference(cfg)
    total = 0.0
    for r, (e, tokens, dw, loss, _) in enumerate(results):
        for row, (b, t) in enumerate(tokens):
            assert torch.equal(e[row], full[b][t]), f"rank {r}: shard row {row} differs"
        err = float((dw - dw_ref).abs().max() / max(float(dw_ref.abs().max()), 1e-300))
        assert err <= tol, f"rank {r}: encoder grad rel diff {err:.3g} > {tol}"
        total += loss
    assert abs(total - loss_ref) <= 1e-9 * abs(loss_ref), (total, loss_ref)

"""The seeded simulated world from Python.

``run(world_size, fn, seed=...)`` runs ``fn(rank, group)`` once per rank, each
rank in its own OS process (``isolation="process"``, the default on Linux:
globals, RNG and torch.distributed state per rank, as under torchrun) or on its
own OS thread (``isolation="thread"``), with the guarantees of the C++
``sim::World``:

* exactly one rank runs at a time (a seeded baton; the GIL is released while a
  rank waits), so the same seed gives the same interleaving
  (``RunResult.trace_hash`` is equal);
* a collective whose members disagree raises ``CollectiveMismatch`` on every
  member, and when every live rank waits and none can proceed every waiting
  rank raises ``Deadlock`` with the per-rank report; neither hangs. A rank
  blocked on something other than diffcomm (a lock, ``time.sleep`` in a loop,
  ``input()``) is outside the world's view and can still hang.

How: every rank has a proxy fiber in an ordinary ``sim::World``; the proxy
hands the baton to its rank's thread and executes that thread's collectives
on the world's own backend (rendezvous, fingerprint comparison, data move,
stats, faults, deadlock report). Cost: each collective call crosses two
threads per rank, on one CPU (``one_cpu``): about 3 us per rank per call
plus the torch bridge, against a fraction of a microsecond in the C++ world
(``bench/bench_sim_run.py``; docs/python.md).

Also here: ``step``, ``check`` and ``sweep`` return the fields of
``diffcomm-sim ... --json`` (the reports are built by the C++ library), and
the planner and token rules.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple

from .. import _core
from .._core import encoder_parallel as _ep
from ._equivalence import EquivalenceReport, Partial, Replicate, Shard, check_equivalence  # noqa
from ._replay import PendingCall, ReplayReport, replay  # noqa
from ._run import INTERRUPT_GRACE_S, MAX_RANKS, RunResult, run  # noqa

# The planner and the token rules.
Batch = _ep.Batch
Sample = _ep.Sample
ImageSpan = _ep.ImageSpan
DecoderMesh = _ep.DecoderMesh
EncoderLayout = _ep.EncoderLayout
CpLayout = _ep.CpLayout
MeshContext = _ep.MeshContext
FeatureExchangeMode = _ep.FeatureExchangeMode
ReceiverGrad = _ep.ReceiverGrad
ExchangePlan = _ep.ExchangePlan
plan_exchange = _ep.plan_exchange
select_feature_exchange = _ep.select_feature_exchange
receiver_grad_for = _ep.receiver_grad_for
owned_ranges = _ep.owned_ranges
mode_name = _ep.mode_name
smart_resize = _ep.smart_resize
image_tokens = _ep.image_tokens
image_patches = _ep.image_patches
required_seq_multiple = _ep.required_seq_multiple

__all__ = [
    "run", "RunResult", "MAX_RANKS", "INTERRUPT_GRACE_S", "step", "check", "sweep", "StepReport",
    "default_images_path",
    "batch_from_image_sizes", "Batch", "Sample", "ImageSpan", "DecoderMesh", "EncoderLayout",
    "CpLayout", "MeshContext", "FeatureExchangeMode", "ReceiverGrad", "ExchangePlan",
    "plan_exchange", "select_feature_exchange", "receiver_grad_for", "owned_ranges", "mode_name",
    "smart_resize", "image_tokens", "image_patches", "required_seq_multiple",
    "check_equivalence", "EquivalenceReport", "Replicate", "Shard", "Partial",
    "replay", "ReplayReport", "PendingCall",
]


# ------------------------------------------------------ step / check / sweep
class StepReport(dict):
    """The fields of ``diffcomm-sim step --json`` (a dict), plus ``text`` (the
    human report) and ``exit_code`` (0 passed, 1 failed, 3 injected fault)."""

    text: str
    exit_code: int

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


def default_images_path() -> str:
    """The MS COCO 2017 val image sizes shipped with the package (CC BY 4.0)."""
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "share", "diffcomm", "data",
                        "coco_val2017", "image_sizes.csv")
    if os.path.exists(here):
        return here
    path = _ep.default_image_sizes_path()
    if not path:
        raise _core.InvalidArgument("diffcomm.sim: the shipped COCO image sizes were not found")
    return path


def _step_options(ranks: Optional[int] = None, dp: Optional[int] = None, cp: int = 1,
                  tp: int = 1, sp: bool = False, cp_layout: str = "contiguous",
                  encoder_buckets: Optional[int] = None, encoder_cp: int = 1, batch: int = 4,
                  images_per_sample: int = 2, hidden: int = 32, ffn: int = 32,
                  dtype: str = "float64", seed: int = 0, images: Optional[str] = None,
                  receiver_grad: str = "auto", model: str = "qwen2vl",
                  sp_chunks: int = 4, grad_block_rows: int = 64,
                  ffn_blocks: int = 4) -> "_core.sim.StepOptions":
    """The C++ StepOptions (sim/step_options.hpp) from keywords; its
    resolved() fills the defaults and checks the options, as the CLI does."""
    o = _core.sim.StepOptions()
    o.ranks, o.dp = ranks or 0, dp or 0
    o.cp, o.tp, o.sp, o.sp_chunks, o.cp_layout = cp, tp, sp, sp_chunks, cp_layout
    o.grad_block_rows, o.ffn_blocks = grad_block_rows, ffn_blocks
    o.encoder_buckets, o.encoder_cp = encoder_buckets or 0, encoder_cp
    o.batch, o.images_per_sample, o.hidden, o.ffn = batch, images_per_sample, hidden, ffn
    o.dtype, o.seed, o.receiver_grad, o.model = dtype, seed, receiver_grad, model
    o.images = images or default_images_path()
    return o


def step(
    *,
    ranks: Optional[int] = None,
    dp: Optional[int] = None,
    cp: int = 1,
    tp: int = 1,
    sp: bool = False,
    sp_chunks: int = 4,
    grad_block_rows: int = 64,
    ffn_blocks: int = 4,
    cp_layout: str = "contiguous",
    encoder_buckets: Optional[int] = None,
    encoder_cp: int = 1,
    batch: int = 4,
    images_per_sample: int = 2,
    hidden: int = 32,
    ffn: int = 32,
    dtype: str = "float64",
    seed: int = 0,
    images: Optional[str] = None,
    receiver_grad: str = "auto",
    model: str = "qwen2vl",
    fault: Optional[Tuple[int, int]] = None,
    trace: Optional[str] = None,
    equivalence: bool = False,
) -> StepReport:
    """``diffcomm-sim step`` as a function: one seeded encoder-parallel training
    step on real image sizes in the simulated world, checked against the
    single-rank reference. Same options and defaults as the CLI (one C++
    StepOptions resolves both); returns the fields of ``--json`` (see the table
    in docs/cli.md). ``equivalence=True`` is ``--equivalence``: the report's
    ``equivalence`` holds the mesh-equivalence oracle's findings on the
    encoder gradient and the decoder input's shards, and a finding fails the
    step."""
    options = _step_options(ranks, dp, cp, tp, sp, cp_layout, encoder_buckets, encoder_cp, batch,
                            images_per_sample, hidden, ffn, dtype, seed, images, receiver_grad,
                            model, sp_chunks, grad_block_rows, ffn_blocks)
    js, text, code = _core.sim.step(options, fault, trace or "", equivalence)
    rep = StepReport(json.loads(js))
    rep.text = text
    rep.exit_code = code
    return rep


def check(op: str, ranks: int, seed: int, dtype: str = "float64") -> Dict[str, Any]:
    """``diffcomm-sim check --json``: the adjoint identity of one differentiable
    op on a random sub-group; keys op, ranks, seed, dtype, group, lhs, rhs,
    rel_err, tolerance, passed."""
    js, _ = _core.sim.check(op, ranks, seed, dtype)
    return json.loads(js)


def sweep(seeds: Tuple[int, int], **kwargs: Any) -> Dict[str, Any]:
    """``diffcomm-sim sweep``: step over seeds first..last (inclusive, a pair),
    with step()'s keywords except seed, fault and trace. Keys: first, last,
    seeds, passed, failed, failures [{seed, exit_code, what}]."""
    first, last = seeds
    for bad in ("seed", "fault", "trace"):
        if bad in kwargs:
            raise _core.InvalidArgument(f"sweep: '{bad}' is not a sweep option")
    try:
        options = _step_options(**kwargs)
    except TypeError as e:
        raise _core.InvalidArgument(f"sweep: {e}") from None
    return json.loads(_core.sim.sweep(options, first, last))


def batch_from_image_sizes(
    samples: Sequence[Sequence[Tuple[int, int]]],
    *,
    text_tokens: int = 16,
    seq_multiple: int = 1,
) -> "_ep.Batch":
    """A Batch from image sizes: ``samples[i]`` lists the (height, width) in
    pixels of sample i's images. Each sample is text, image, text, image, ...,
    text (``text_tokens`` text tokens each), padded with text to a multiple of
    ``seq_multiple`` (use ``required_seq_multiple(decoder_mesh)``). Image
    tokens and patches follow Qwen2-VL (``image_tokens``: resize to multiples
    of 28 px within min/max pixels, tokens = (H/28)(W/28); patches = 4x)."""
    if text_tokens < 0 or seq_multiple < 1:
        raise _core.InvalidArgument("batch_from_image_sizes: text_tokens >= 0, seq_multiple >= 1")
    out = []
    source = 0
    for sizes in samples:
        pos = 0
        spans = []
        for (h, w) in sizes:
            pos += text_tokens
            tokens = image_tokens(h, w)
            spans.append(ImageSpan(pos, tokens, image_patches(h, w), source))
            source += 1
            pos += tokens
        pos += text_tokens
        seq_len = -(-pos // seq_multiple) * seq_multiple if pos else seq_multiple
        out.append(Sample(seq_len, spans))
    return Batch(out)

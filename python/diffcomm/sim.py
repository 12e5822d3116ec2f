"""The seeded simulated world from Python.

``run(world_size, fn, seed=...)`` runs ``fn(rank, group)`` once per rank, each
rank on its own OS thread, with the guarantees of the C++ ``sim::World``:

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

import ctypes
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _context, _core, _participation
from ._core import encoder_parallel as _ep
from ._equivalence import EquivalenceReport, Partial, Replicate, Shard, check_equivalence  # noqa
from ._replay import PendingCall, ReplayReport, replay  # noqa

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
    "run", "RunResult", "MAX_RANKS", "step", "check", "sweep", "StepReport",
    "default_images_path",
    "batch_from_image_sizes", "Batch", "Sample", "ImageSpan", "DecoderMesh", "EncoderLayout",
    "CpLayout", "MeshContext", "FeatureExchangeMode", "ReceiverGrad", "ExchangePlan",
    "plan_exchange", "select_feature_exchange", "receiver_grad_for", "owned_ranges", "mode_name",
    "smart_resize", "image_tokens", "image_patches", "required_seq_multiple",
    "check_equivalence", "EquivalenceReport", "Replicate", "Shard", "Partial",
    "replay", "ReplayReport", "PendingCall",
]


# --------------------------------------------------------------------- run
class RunResult:
    """What ``run`` returns: per-rank return values and the world's record."""

    def __init__(self, world: "_core.sim.ThreadedWorld", results: List[Any]):
        self._world = world
        #: fn's return value on every rank, by rank.
        self.results = results
        #: Hash of the interleaving (calls in completion order with their
        #: members' arrival order): equal for equal seeds.
        self.trace_hash: int = world.trace_hash()
        #: Virtual time of the run from the world's alpha-beta cost model (us).
        self.sim_time_us: float = world.sim_time_us()

    def stats(self, rank: int) -> Dict[str, Any]:
        """Calls and bytes of one rank: {'total': {...}, 'entries': [...]}."""
        return self._world.stats(rank)

    def write_trace(self, path: str) -> None:
        """Chrome trace-event JSON of the run (open in Perfetto)."""
        self._world.write_trace(path)

    def __getitem__(self, rank: int) -> Any:
        return self.results[rank]

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self):
        return iter(self.results)


def _start_rank_threads(world: "_core.sim.ThreadedWorld", threads: List[threading.Thread]) -> None:
    """Starts one thread per rank; when the OS refuses one (out of memory or
    of threads), releases the started ones and raises BackendError naming the
    rank count and the stack size to reduce."""
    for rank, t in enumerate(threads):
        try:
            t.start()
        except RuntimeError as e:  # "can't start new thread"
            size = threading.stack_size()
            stack = f"{size} bytes" if size else "the default size (ulimit -s)"
            why = (f"diffcomm.sim.run: cannot start the thread of rank {rank} of {len(threads)} "
                   f"({e}); each rank thread has a stack of {stack}: use fewer ranks or a "
                   f"smaller threading.stack_size()")
            world.cancel(why)
            for started in threads[:rank]:
                started.join()
            raise _core.BackendError(why) from e


def _interrupt(world: "_core.sim.ThreadedWorld", threads: List[threading.Thread],
               in_fn: List[bool], finished: List[bool]) -> None:
    """After Ctrl-C: raises KeyboardInterrupt in the rank thread that runs its
    own code (only one runs at a time: the baton holder), once per rank, until
    the world ends. A rank waiting in diffcomm is never interrupted: the world
    releases it (RankFailure naming the interrupted rank), so diffcomm's
    bookkeeping is never cut in half. Gives up after INTERRUPT_GRACE_S, for a
    rank blocked outside diffcomm (time.sleep, input()) that no exception
    reaches; rank threads are daemons. Polls with time.sleep, taking no lock
    another thread takes (see _drive)."""
    interrupted = set()
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while not finished and time.monotonic() < deadline:
        r = world.running_rank()
        if r >= 0 and in_fn[r] and r not in interrupted and threads[r].ident is not None:
            interrupted.add(r)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threads[r].ident),
                                                       ctypes.py_object(KeyboardInterrupt))
        time.sleep(0.01)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _drive(world: "_core.sim.ThreadedWorld", threads: List[threading.Thread],
           in_fn: List[bool]) -> None:
    """Runs the world on a driver thread while this (the calling, usually the
    main) thread waits in short slices, so that Ctrl-C reaches Python: the
    signal handler runs only between bytecodes, never while a thread sits in
    world.run() in C++. On KeyboardInterrupt, see _interrupt; then re-raises
    it here.

    The wait is one acquire of a lock the driver releases when the world ends:
    a C call that KeyboardInterrupt either cuts short (the lock not taken) or
    follows. Not Event.wait: its `with` on the condition's lock has a window
    where KeyboardInterrupt leaves that lock held, and the next wait and the
    driver's set() then block forever (a CI run hung so). Not Thread.join: one
    that KeyboardInterrupt cuts short can leave the thread marked as ended."""
    failure: List[BaseException] = []
    finished: List[bool] = []  # appended to (atomic) by the driver as the world ends
    done = threading.Lock()
    done.acquire()

    def drive() -> None:
        try:
            world.run()
        except BaseException as e:  # re-raised on the calling thread
            failure.append(e)
        finally:
            finished.append(True)
            done.release()

    threading.Thread(target=drive, name="diffcomm-sim-world", daemon=True).start()
    try:
        while not done.acquire(timeout=0.05):
            pass
    except KeyboardInterrupt:
        _interrupt(world, threads, in_fn, finished)
        raise
    for t in threads:
        t.join()
    if failure:
        raise failure[0]


#: Seconds run() waits, after Ctrl-C, for rank threads to end before it
#: re-raises KeyboardInterrupt anyway (they are daemon threads).
INTERRUPT_GRACE_S = 5.0


#: The most ranks a simulated world runs (C++ ``sim::kMaxRanks``).
MAX_RANKS: int = _core.sim.MAX_RANKS


def _whole(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"sim.run: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise _core.InvalidArgument(f"sim.run: {name} = {value}, expected {low}..{high}")


def _check_run_arguments(world_size: Any, seed: Any, fault: Any) -> None:
    """Checks what the binding would refuse with nanobind's TypeError listing its signature
    (2**40 ranks, a negative seed, a fault that is no pair), naming the argument instead."""
    _whole("world_size", world_size, 1, MAX_RANKS)
    _whole("seed", seed, 0, 2**64 - 1)
    if fault is None:
        return
    if not isinstance(fault, (tuple, list)) or len(fault) != 2:
        raise TypeError(f"sim.run: fault must be a pair (rank, k), got {fault!r}")
    _whole("fault rank", fault[0], 0, world_size - 1)
    _whole("fault call k", fault[1], 1, 2**31 - 1)


def run(
    world_size: int,
    fn: Callable[[int, "_core.ProcessGroup"], Any],
    *,
    seed: int = 0,
    schedule: str = "random",
    fault: Optional[Tuple[int, int]] = None,
    trace: bool = True,
    torch_distributed: bool = False,
    one_cpu: bool = True,
) -> RunResult:
    """Runs ``fn(rank, group)`` for every rank of a simulated world.

    ``group`` is the rank's world group (a ``diffcomm.ProcessGroup``); inside
    ``fn``, ``group=None`` in diffcomm.torch means this group. ``schedule``:
    ``"random"`` (seeded) or ``"round_robin"``. ``fault=(rank, k)`` makes that
    rank fail at its k-th diffcomm call (the others get ``RankFailure``; a
    ``Deadlock`` instead if that rank catches its error and returns).

    Ctrl-C (SIGINT) interrupts the run: the rank running its own code gets
    KeyboardInterrupt, the world ends the others as it does for any failing
    rank (RankFailure), and ``run`` raises KeyboardInterrupt. A rank blocked
    outside diffcomm (``time.sleep``, ``input()``) holds the baton where no
    exception reaches it: ``run`` raises after ``INTERRUPT_GRACE_S`` seconds,
    leaving the rank threads (daemons) behind.

    ``torch_distributed=True`` (torch >= 2): in every rank thread,
    torch.distributed is initialised with the c10d backend ``"diffcomm_sim"``
    (default group = this simulated world) before fn runs and destroyed after,
    so unmodified torch.distributed code runs with the guarantees above.

    ``one_cpu=True`` (default): the world's thread and the rank threads are
    pinned to one CPU (the one ``run`` was called on) while the world runs,
    and get their CPU sets back after: only one of them runs at a time, and
    a hand-over between threads on one CPU is a context switch, not a
    wake-up on another core (about 4x cheaper per collective at world 8;
    docs/python.md). Threads that torch or OpenMP first start inside ``fn``
    inherit the pinning. ``one_cpu=False`` leaves placement to the OS.

    Before any rank runs: TypeError for a world_size, seed or fault that is
    not an int (fault: a pair of ints), InvalidArgument for world_size outside
    1..MAX_RANKS, a seed outside 0..2**64-1, or a fault outside the world.

    Returns a RunResult. If any rank raised, re-raises the first failure in
    the world's (deterministic) order, with ``.rank`` (the rank that raised
    it) and ``.rank_errors`` (every rank's exception or None) attached;
    diffcomm errors keep their class (CollectiveMismatch, Deadlock, ...).
    """
    _check_run_arguments(world_size, seed, fault)
    if torch_distributed:  # the c10d backend: diffcomm/_c10d_sim.py
        from . import _c10d_sim  # noqa: PLC0415 (torch >= 2 only: imported on request)

        return _c10d_sim.run(lambda body: run(world_size, body, seed=seed, schedule=schedule,
                                              fault=fault, trace=trace, one_cpu=one_cpu), fn)
    world = _core.sim.ThreadedWorld(world_size, seed, schedule, fault, trace, one_cpu)
    results: List[Any] = [None] * world_size
    errors: List[Optional[BaseException]] = [None] * world_size
    order: List[int] = []
    in_fn = [False] * world_size  # the rank thread runs fn (may be interrupted)

    def body(rank: int) -> None:
        try:
            group = world.start(rank)
        except _core.Error as e:  # the world ended before this rank ran
            errors[rank] = e
            return
        _context.set_thread_group(group)
        try:
            in_fn[rank] = True
            results[rank] = fn(rank, group)
            in_fn[rank] = False
        except BaseException as e:  # reported, re-raised by run()
            in_fn[rank] = False
            errors[rank] = e
            order.append(rank)
            msg = f"rank {rank}: {type(e).__name__}: {e}"
            _participation.discard(group._cohort_id)
            del group
            _context.set_thread_group(None)
            world.finish(rank, msg)
            return
        _participation.discard(group._cohort_id)  # as sim::World discards the rank's cohort
        del group
        _context.set_thread_group(None)
        world.finish(rank, "")

    threads = [
        threading.Thread(target=body, args=(r,), name=f"diffcomm-sim-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    _start_rank_threads(world, threads)
    _drive(world, threads, in_fn)
    if order:
        first = errors[order[0]]
        assert first is not None
        first.rank = order[0]  # type: ignore[attr-defined]
        first.rank_errors = errors  # type: ignore[attr-defined]
        raise first
    return RunResult(world, results)


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
    here = os.path.join(os.path.dirname(__file__), "data", "image_sizes.csv")
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
                  sp_chunks: int = 4) -> "_core.sim.StepOptions":
    """The C++ StepOptions (sim/step_options.hpp) from keywords; its
    resolved() fills the defaults and checks the options, as the CLI does."""
    o = _core.sim.StepOptions()
    o.ranks, o.dp = ranks or 0, dp or 0
    o.cp, o.tp, o.sp, o.sp_chunks, o.cp_layout = cp, tp, sp, sp_chunks, cp_layout
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
) -> StepReport:
    """``diffcomm-sim step`` as a function: one seeded encoder-parallel training
    step on real image sizes in the simulated world, checked against the
    single-rank reference. Same options and defaults as the CLI (one C++
    StepOptions resolves both); returns the fields of ``--json`` (see the table
    in docs/cli.md)."""
    options = _step_options(ranks, dp, cp, tp, sp, cp_layout, encoder_buckets, encoder_cp, batch,
                            images_per_sample, hidden, ffn, dtype, seed, images, receiver_grad,
                            model, sp_chunks)
    js, text, code = _core.sim.step(options, fault, trace or "")
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

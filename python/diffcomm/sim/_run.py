"""diffcomm.sim.run: the seeded simulated world's ranks as OS threads taking
turns (the engine is the C++ sim::ThreadedWorld); see the package's docstring."""
from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _context, _core, _participation

class RunResult:
    """What ``run`` returns: per-rank return values and the world's record."""

    def __init__(self, world: "_core.sim.ThreadedWorld", results: List[Any],
                 rank_stats: Optional[List[Dict[str, Any]]] = None):
        self._world = world
        self._rank_stats = rank_stats
        #: fn's return value on every rank, by rank.
        self.results = results
        #: Hash of the interleaving (calls in completion order with their
        #: members' arrival order): equal for equal seeds.
        self.trace_hash: int = world.trace_hash()
        #: Virtual time of the run from the world's alpha-beta cost model (us).
        self.sim_time_us: float = world.sim_time_us()

    def stats(self, rank: int) -> Dict[str, Any]:
        """Calls and bytes of one rank: {'total': {...}, 'entries': [...]}."""
        if self._rank_stats is not None:  # isolation="process": counted in the rank's process
            if not 0 <= rank < len(self._rank_stats):
                raise _core.InvalidArgument(
                    f"RunResult.stats: rank {rank} outside [0, {len(self._rank_stats)})")
            return self._rank_stats[rank]
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
    of threads), releases the started ones and raises ResourceExhausted naming
    the rank count and the stack size to reduce."""
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
            raise _core.ResourceExhausted(why) from e


#: Seconds run() waits, after Ctrl-C, for rank threads to end before it
#: re-raises KeyboardInterrupt anyway (they are daemon threads): the default
#: of run's ``interrupt_grace_s``.
INTERRUPT_GRACE_S = 5.0


def _interrupt(world: "_core.sim.ThreadedWorld", threads: List[threading.Thread],
               in_fn: List[bool], finished: List[bool], grace_s: float) -> None:
    """After Ctrl-C: raises KeyboardInterrupt in the rank thread that runs its
    own code (only one runs at a time: the baton holder), once per rank, until
    the world ends. A rank waiting in diffcomm is never interrupted: the world
    releases it (RankFailure naming the interrupted rank), so diffcomm's
    bookkeeping is never cut in half. Gives up after grace_s seconds, for a
    rank blocked outside diffcomm (time.sleep, input()) that no exception
    reaches; rank threads are daemons. Polls with time.sleep, taking no lock
    another thread takes (see _drive)."""
    interrupted = set()
    deadline = time.monotonic() + grace_s
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
           on_interrupt: Callable[[List[bool]], None]) -> None:
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
        on_interrupt(finished)
        raise
    for t in threads:
        t.join()
    if failure:
        raise failure[0]




#: The most ranks a simulated world runs (C++ ``sim::kMaxRanks``).
MAX_RANKS: int = _core.sim.MAX_RANKS


def _whole(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"sim.run: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise _core.InvalidArgument(f"sim.run: {name} = {value}, expected {low}..{high}")


def _check_run_arguments(world_size: Any, seed: Any, fault: Any, grace_s: Any) -> None:
    """Checks what the binding would refuse with nanobind's TypeError listing its signature
    (2**40 ranks, a negative seed, a fault that is no pair), naming the argument instead."""
    _whole("world_size", world_size, 1, MAX_RANKS)
    _whole("seed", seed, 0, 2**64 - 1)
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)):
        raise TypeError(f"sim.run: interrupt_grace_s must be a number, got {grace_s!r}")
    if not 0 <= grace_s < float("inf"):
        raise _core.InvalidArgument(
            f"sim.run: interrupt_grace_s = {grace_s}, expected a finite number >= 0")
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
    isolation: Optional[str] = None,
    cuda: Optional[str] = None,
    one_cpu: bool = True,
    interrupt_grace_s: float = INTERRUPT_GRACE_S,
) -> RunResult:
    """Runs ``fn(rank, group)`` for every rank of a simulated world.

    ``group`` is the rank's world group (a ``diffcomm.ProcessGroup``); inside
    ``fn``, ``group=None`` in diffcomm.torch means this group. ``schedule``:
    ``"random"`` (seeded) or ``"round_robin"``. ``fault=(rank, k)`` makes that
    rank fail at its k-th diffcomm call (the others get ``RankFailure``; a
    ``Deadlock`` instead if that rank catches its error and returns).

    ``isolation``: ``"process"`` (the default where the platform has fork and
    memfd, i.e. Linux) runs every rank in its own OS process forked from the
    caller, so module globals, torch's RNG, hooks, the environment and
    torch.distributed's state are per rank, as under torchrun. ``fn`` and what
    it reads are inherited (no pickling, no re-import); its return value, or
    its exception (with ``.rank_traceback``, the rank's traceback text), comes
    back by pickle. A rank process that dies (a signal, ``os._exit``, out of
    memory) is a ``RankFailure`` naming the rank and how it died; no process
    or memfd outlives ``run``. ``"thread"`` runs every rank on a thread of the
    caller: faster, for code that keeps no process-wide state (every rank then
    shares module globals and torch's default generator). Both give the same
    interleaving, trace hash and reports for the same seed (docs/python.md).

    ``cuda="cpu"`` (process isolation only): in every rank process,
    ``torch.cuda`` calls and ``device="cuda"`` land on the CPU, so trainer code
    that hard-codes CUDA runs unmodified (diffcomm/sim/_cuda_on_cpu.py lists
    what is covered). Default None: torch.cuda untouched.

    Ctrl-C (SIGINT) interrupts the run: the rank running its own code gets
    KeyboardInterrupt, the world ends the others as it does for any failing
    rank (RankFailure), and ``run`` raises KeyboardInterrupt. A thread rank
    blocked outside diffcomm (``time.sleep``, ``input()``) holds the baton
    where no exception reaches it: ``run`` raises after ``interrupt_grace_s``
    seconds (default ``INTERRUPT_GRACE_S``, 5), leaving the rank threads
    (daemons) behind; rank processes still running then are killed.

    ``torch_distributed=True`` (torch >= 2): in every rank, torch.distributed
    is initialised with the c10d backend ``"diffcomm_sim"`` (default group =
    this simulated world) before fn runs and destroyed after, so unmodified
    torch.distributed code runs with the guarantees above.

    ``one_cpu=True`` (default): the world's thread and the ranks (threads or
    processes) are pinned to one CPU (the one ``run`` was called on) while
    the world runs, and get their CPU sets back after: only one of them runs
    at a time, and a hand-over between them on one CPU is a context switch,
    not a wake-up on another core (about 4x cheaper per collective at world
    8; docs/python.md). Threads that torch or OpenMP first start inside ``fn``
    inherit the pinning. ``one_cpu=False`` leaves placement to the OS.

    Before any rank runs: TypeError for a world_size, seed or fault that is
    not an int (fault: a pair of ints), InvalidArgument for world_size outside
    1..MAX_RANKS, a seed outside 0..2**64-1, a fault outside the world, an
    unknown isolation or cuda, or isolation="process" where the platform has
    no fork/memfd.

    Returns a RunResult. If any rank raised, re-raises the first failure in
    the world's (deterministic) order, with ``.rank`` (the rank that raised
    it) and ``.rank_errors`` (every rank's exception or None) attached;
    diffcomm errors keep their class (CollectiveMismatch, Deadlock, ...).
    """
    _check_run_arguments(world_size, seed, fault, interrupt_grace_s)
    isolation = _resolve_isolation(isolation, cuda)
    if torch_distributed:  # the c10d backend: diffcomm/sim/_c10d_backend.py
        from . import _c10d_backend  # noqa: PLC0415 (torch >= 2 only: imported on request)

        return _c10d_backend.run(
            lambda body: run(world_size, body, seed=seed, schedule=schedule, fault=fault,
                             trace=trace, isolation=isolation, cuda=cuda, one_cpu=one_cpu,
                             interrupt_grace_s=interrupt_grace_s),
            fn, isolation, world_size)
    world = _core.sim.ThreadedWorld(world_size, seed, schedule, fault, trace, one_cpu)
    if isolation == "process":
        return _run_processes(world, world_size, fn, cuda, one_cpu, interrupt_grace_s)
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
    _drive(world, threads,
           lambda finished: _interrupt(world, threads, in_fn, finished, interrupt_grace_s))
    _raise_first(order, errors)
    return RunResult(world, results)


def _raise_first(order: List[int], errors: List[Optional[BaseException]]) -> None:
    """Raises the first failure in the world's order, with .rank and .rank_errors."""
    if order:
        first = errors[order[0]]
        assert first is not None
        first.rank = order[0]  # type: ignore[attr-defined]
        first.rank_errors = errors  # type: ignore[attr-defined]
        raise first


ISOLATIONS = ("process", "thread")


def _resolve_isolation(isolation: Optional[str], cuda: Optional[str]) -> str:
    """isolation=None: "process" where the platform runs rank processes, else "thread"."""
    from . import _processes  # noqa: PLC0415

    if isolation is None:
        isolation = "process" if _processes.available() else "thread"
    if isolation not in ISOLATIONS:
        raise _core.InvalidArgument(
            f"sim.run: isolation={isolation!r}, expected 'process' or 'thread'")
    if isolation == "process" and not _processes.available():
        raise _core.InvalidArgument(
            f"sim.run: isolation='process' needs fork and memfd (Linux); this is "
            f"{sys.platform}: use isolation='thread'")
    if cuda not in (None, "cpu"):
        raise _core.InvalidArgument(f"sim.run: cuda={cuda!r}, expected None or 'cpu'")
    if cuda == "cpu" and isolation != "process":
        raise _core.InvalidArgument(
            "sim.run: cuda='cpu' patches torch.cuda in each rank process: it needs "
            "isolation='process' (threads would share, and leak, the patch)")
    return isolation


def _run_processes(world: "_core.sim.ThreadedWorld", world_size: int,
                   fn: Callable[[int, Any], Any], cuda: Optional[str], one_cpu: bool,
                   grace_s: float) -> RunResult:
    """isolation="process" (diffcomm/sim/_processes.py)."""
    from . import _processes  # noqa: PLC0415

    if cuda == "cpu":
        from . import _cuda_on_cpu  # noqa: PLC0415 (torch only: imported on request)

        fn = _cuda_on_cpu.wrap(fn)
    job = _processes.ProcessRun(world, world_size, fn)
    job.start(one_cpu)
    try:
        _drive(world, job.threads, lambda finished: job.interrupt(finished, grace_s))
    finally:
        job.cleanup(grace_s)
    _raise_first(job.order, job.errors)
    return RunResult(world, job.results, job.stats)

"""diffcomm.sim.run: the seeded simulated world's ranks as OS threads taking
turns (the engine is the C++ sim::ThreadedWorld); see the package's docstring."""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _context, _core, _participation

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
           in_fn: List[bool], grace_s: float) -> None:
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
        _interrupt(world, threads, in_fn, finished, grace_s)
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
    one_cpu: bool = True,
    interrupt_grace_s: float = INTERRUPT_GRACE_S,
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
    exception reaches it: ``run`` raises after ``interrupt_grace_s`` seconds
    (default ``INTERRUPT_GRACE_S``, 5), leaving the rank threads (daemons)
    behind.

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
    _check_run_arguments(world_size, seed, fault, interrupt_grace_s)
    if torch_distributed:  # the c10d backend: diffcomm/sim/_c10d_backend.py
        from . import _c10d_backend  # noqa: PLC0415 (torch >= 2 only: imported on request)

        return _c10d_backend.run(lambda body: run(world_size, body, seed=seed, schedule=schedule,
                                              fault=fault, trace=trace, one_cpu=one_cpu,
                                              interrupt_grace_s=interrupt_grace_s), fn)
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
    _drive(world, threads, in_fn, interrupt_grace_s)
    if order:
        first = errors[order[0]]
        assert first is not None
        first.rank = order[0]  # type: ignore[attr-defined]
        first.rank_errors = errors  # type: ignore[attr-defined]
        raise first
    return RunResult(world, results)

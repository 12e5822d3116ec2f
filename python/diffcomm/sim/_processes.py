"""diffcomm.sim.run(isolation="process"): every rank an OS process.

Each rank is forked from the caller (after its imports: nothing is imported
again, memory is shared copy-on-write), so module globals, torch's RNG,
hooks, the environment and c10d's state are the rank's own, as under
torchrun. The simulated world stays one ``ThreadedWorld`` in the caller:
each rank has a thread there that starts the rank (the baton), then serves
its process: every primitive call the process makes comes over a socket
(tensors through the rank's shared memfd, not pickled) and runs on the
world's own backend, whose outcome goes back. So the world sees the same
calls as with thread ranks: same seed, same trace hash, same reports
(C++: sim/world/include/diffcomm/sim/rank_process.hpp; the design and why:
docs/simulated-world.md).

What crosses back by pickle, once per rank: ``fn``'s return value, or its
exception with the traceback text, and the rank's stats.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

from .. import _context, _core, _participation


def available() -> bool:
    """Whether this platform runs rank processes (fork, memfd: Linux)."""
    return hasattr(os, "fork") and hasattr(os, "memfd_create") and sys.platform.startswith("linux")


class _Rank:
    """The caller's end of one rank process."""

    def __init__(self, rank: int):
        self.rank = rank
        self.mine, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.memory = os.memfd_create(f"diffcomm-sim-rank-{rank}", os.MFD_CLOEXEC)
        self.pid = 0
        self.reaped = False

    def close(self) -> None:
        self.mine.close()
        self.theirs.close()
        if self.memory >= 0:
            os.close(self.memory)
            self.memory = -1

    def reap(self) -> int:
        """Waits for the process to end; its wait status (once)."""
        if self.reaped:
            return 0
        self.reaped = True
        while True:
            try:
                return os.waitpid(self.pid, 0)[1]
            except ChildProcessError:
                return 0
            except InterruptedError:
                continue


def _how_it_died(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {sig} ({name})"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"ended with wait status {status}"


# ----------------------------------------------------------- rank process
def _encode_end(rank: int, group: Any, value: Any, error: Optional[BaseException]) -> bytes:
    stats = group.stats()
    if error is None:
        try:
            return pickle.dumps(("ok", value, stats))
        except Exception as e:  # noqa: BLE001 (any pickling failure)
            raise TypeError(f"fn's return value on rank {rank} cannot be pickled back to the "
                            f"caller (isolation='process'): {type(e).__name__}: {e}") from None
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        exc_bytes = pickle.dumps(error)
        pickle.loads(exc_bytes)  # an exception whose class cannot be rebuilt goes as text
    except Exception:  # noqa: BLE001 (any failure to pickle: sent as text)
        exc_bytes = b""
    return pickle.dumps(("error", exc_bytes, type(error).__name__, str(error), text, stats))


def _one_compute_thread() -> None:
    """OpenMP (GNU libgomp, under torch's and MKL's CPU kernels) cannot run in
    a process forked after the caller's OpenMP threads started: the child
    inherits a thread pool whose threads do not exist, and its first parallel
    region waits for them forever. With one thread no pool is used. (Ranks
    run one at a time anyway.)"""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


#: What torch imports on first use, seconds at a time: torch._dynamo (2.3 s
#: with torch 2.15 on this project's machine) comes with the first
#: optimizer, torch.compile or a DTensor op. Imported once in the caller,
#: before the forks, instead of once in every rank process (a world of 8 paid
#: 8 x 2.3 s per run; bench/RESULTS.md, "Issue 49").
LAZY_TORCH_MODULES = ("torch._dynamo",)


_lazy_tried = set()


def _import_lazy_torch_modules() -> None:
    if "torch" not in sys.modules:
        return  # fn cannot use torch without importing it, and then pays it once per rank
    for name in LAZY_TORCH_MODULES:
        if name not in sys.modules and name not in _lazy_tried:
            _lazy_tried.add(name)
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (absent in torch 1.x; the rank imports what it needs)
                pass


#: torch refuses autograd in a process forked after its autograd engine
#: started device threads in the parent (torch/csrc/autograd/engine.cpp).
AUTOGRAD_FORK = "Unable to handle autograd's threading in combination with fork"
AUTOGRAD_FORK_NOTE = (
    "diffcomm.sim.run: rank processes are forked from this process, which already ran a "
    "backward that started torch's autograd device threads (a DTensor or FSDP2 backward, "
    "e.g. under isolation='thread', or CUDA); torch refuses autograd in such forks. Run the "
    "process-isolation steps before any such backward (or in a fresh process), or run this "
    "one with isolation='thread' too.")


def _rank_main(rank: int, fn: Callable[[int, Any], Any], me: _Rank, cpu: int) -> int:
    """The rank process: waits for the world's start, runs fn, reports."""
    _one_compute_thread()
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})  # one runs at a time: a hand-over stays on one CPU
    try:
        group = _core.sim.connect_rank_process(me.theirs.fileno(), me.memory)
    except _core.Error:
        return 70  # the world ended before this rank started
    _context.set_thread_group(group)
    try:
        failure, payload = "", _encode_end(rank, group, fn(rank, group), None)
    except BaseException as e:  # noqa: BLE001 (reported to the caller, re-raised there)
        # fn has ended: a second Ctrl-C (a terminal's reaches every rank
        # process) must not cut the report short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        failure = f"rank {rank}: {type(e).__name__}: {e}"
        payload = _encode_end(rank, group, None, e)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _participation.discard(group._cohort_id)
    _core.sim.finish_rank_process(me.theirs.fileno(), failure, payload)
    return 0


def _fork_rank(rank: int, fn: Callable[[int, Any], Any], ranks: List[_Rank], cpu: int) -> int:
    """Forks rank `rank`'s process; returns its pid (never returns in the child)."""
    with warnings.catch_warnings():
        # Python >= 3.12 warns on fork from a process with threads (torch's
        # OpenMP pool, the caller's own): the child is handled for that
        # (_one_compute_thread; the world's threads start after the forks).
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid != 0:
        return pid
    code = 71
    try:
        for other in ranks:  # only its own end stays open: a rank's death is its EOF
            if other.rank != rank:
                other.theirs.close()
                os.close(other.memory)
            other.mine.close()
        code = _rank_main(rank, fn, ranks[rank], cpu)
    except KeyboardInterrupt:
        code = 72  # Ctrl-C before fn ran or while reporting: the caller sees the exit
    except BaseException:  # noqa: BLE001 (nothing may escape a forked child)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 (a closed stream: nothing to flush)
                pass
        os._exit(code)


# ----------------------------------------------------------- caller side
class ProcessRun:
    """The caller's side of one run: the rank processes and their threads."""

    def __init__(self, world: "_core.sim.ThreadedWorld", world_size: int,
                 fn: Callable[[int, Any], Any]):
        self.world = world
        self.n = world_size
        self.fn = fn
        self.results: List[Any] = [None] * world_size
        self.errors: List[Optional[BaseException]] = [None] * world_size
        self.stats: List[Dict[str, Any]] = [{} for _ in range(world_size)]
        self.order: List[int] = []
        self.ranks: List[_Rank] = []
        self.threads: List[threading.Thread] = []

    def start(self, one_cpu: bool) -> None:
        """Forks every rank process, then starts the threads that serve them
        (forking before any thread of the run exists)."""
        try:
            for r in range(self.n):
                self.ranks.append(_Rank(r))
        except OSError as e:  # out of file descriptors (ulimit -n) or memory
            self.cleanup(0.0)
            raise _core.ResourceExhausted(
                f"diffcomm.sim.run: cannot make the socket and memfd of rank {len(self.ranks)} of "
                f"{self.n} ({e}); each rank process takes 2 file descriptors in the caller: raise "
                f"ulimit -n, use fewer ranks, or isolation='thread'") from e
        cpu = self.world.cpu() if one_cpu else -1
        _import_lazy_torch_modules()
        for stream in (sys.stdout, sys.stderr):  # not written twice by the children
            stream.flush()
        try:
            for rank in self.ranks:
                rank.pid = _fork_rank(rank.rank, self.fn, self.ranks, cpu)
        except OSError as e:
            self.kill()
            self.cleanup(0.0)
            raise _core.ResourceExhausted(
                f"diffcomm.sim.run: cannot fork the process of rank {len(self._forked())} of "
                f"{self.n} ({e}): use fewer ranks, or isolation='thread'") from e
        for rank in self.ranks:
            rank.theirs.close()
        self.threads = [threading.Thread(target=self._serve, args=(r,),
                                         name=f"diffcomm-sim-rank-{r}", daemon=True)
                        for r in range(self.n)]
        for t in self.threads:
            t.start()

    def _forked(self) -> List[_Rank]:
        return [r for r in self.ranks if r.pid > 0]

    def _serve(self, rank: int) -> None:
        me = self.ranks[rank]
        try:
            group = self.world.start(rank)
        except _core.Error as e:  # the world ended before this rank ran
            self.errors[rank] = e
            return
        try:
            reported, failure, payload = _core.sim.serve_rank_process(
                self.world, rank, group, me.mine.fileno(), me.memory)
        except BaseException as e:  # noqa: BLE001 (the world's side failed: the rank failed)
            reported, payload = False, b""
            failure = f"the world could not serve rank {rank}'s process: {type(e).__name__}: {e}"
        del group
        if reported:
            failure = self._take_end(rank, failure, payload)
        else:
            why = failure or (f"rank {rank}'s process (pid {me.pid}) {_how_it_died(me.reap())} "
                              f"before fn returned")
            failure = f"rank {rank}: RankFailure: {why}"
            self.errors[rank] = _core.RankFailure(why)
            self.errors[rank].rank_traceback = ""  # type: ignore[attr-defined]
            self.order.append(rank)
        self.world.finish(rank, failure)

    def _take_end(self, rank: int, failure: str, payload: bytes) -> str:
        try:
            end = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 (fn's value could not be rebuilt here)
            self.errors[rank] = _core.Error(
                f"rank {rank}: fn's return value cannot be unpickled in the caller: {e}")
            self.order.append(rank)
            return f"rank {rank}: {self.errors[rank]}"
        if end[0] == "ok":
            _, self.results[rank], self.stats[rank] = end
            return failure
        _, exc_bytes, type_name, message, text, self.stats[rank] = end
        error: Optional[BaseException] = None
        if exc_bytes:
            try:
                error = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001 (rebuilt as text below)
                error = None
        if not isinstance(error, BaseException):
            error = _core.Error(f"{type_name}: {message}")
        error.rank_traceback = text  # type: ignore[attr-defined]
        if hasattr(error, "add_note"):
            error.add_note(f"raised on rank {rank}:\n{text.rstrip()}")
            if AUTOGRAD_FORK in message:
                error.add_note(AUTOGRAD_FORK_NOTE)
        self.errors[rank] = error
        self.order.append(rank)
        return failure

    def interrupt(self, finished: List[bool], grace_s: float) -> None:
        """After Ctrl-C: SIGINT to the rank process running its own code (the
        baton holder: it raises KeyboardInterrupt there), once per rank, until
        the world ends it and the others (RankFailure), as with threads; then,
        after grace_s, SIGKILL to any rank process still running. The threads
        serving them are joined either way."""
        interrupted = set()
        deadline = time.monotonic() + grace_s
        while not finished and time.monotonic() < deadline:
            r = self.world.running_rank()
            if r >= 0 and r not in interrupted and not self.ranks[r].reaped:
                interrupted.add(r)
                try:
                    os.kill(self.ranks[r].pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        self.kill()
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def signal(self, sig: int) -> None:
        for rank in self._forked():
            if not rank.reaped:
                try:
                    os.kill(rank.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def cleanup(self, grace_s: float) -> None:
        """Every socket and memfd closed (a rank process still waiting for
        its start sees the world gone and ends), then every rank process
        reaped: SIGKILL for one still running grace_s seconds later (a rank
        that caught its error and went on computing)."""
        for rank in self.ranks:
            rank.close()
        deadline = time.monotonic() + grace_s
        for rank in self._forked():
            while not rank.reaped and time.monotonic() < deadline:
                try:
                    pid, _ = os.waitpid(rank.pid, os.WNOHANG)
                except ChildProcessError:
                    pid = rank.pid
                if pid == rank.pid:
                    rank.reaped = True
                else:
                    time.sleep(0.002)
        self.kill()
        for rank in self._forked():
            rank.reap()

"""How a torch-transport job (``init_process_group("torch")``, torchrun) ends
so that every rank reports first: the alarm, through torch's store.

torchrun ends a job when one worker exits with an error: it terminates the
others at once, before their own deadline fires, so their reports and
flight-recorder dumps were lost. As torch's own dump-on-timeout does, the
first rank whose call times out or fails (or that dies of an uncaught
exception) raises an alarm in the job's store; every rank watches it (a
daemon thread polling every ``_POLL_S``), and on seeing it dumps its flight
recorder, prints one line naming the failed rank and its own last call, and
counts itself as reported. The failing rank leaves only when every rank has
reported, or after ``_GRACE_S``. A rank that leaves normally writes its dump
as it leaves (with ``DIFFCOMM_FR_DUMP_DIR`` set), so a rank that left early is
in the replay; it does not wait for the others, since its exit is what tells
gloo's peers at once that it is gone. The MPI backend does the same through
its own channel (``mpi::end_job`` in include/diffcomm/backends/mpi.hpp).

Exit codes: a rank whose call timed out leaves with 124 (as the MPI backend's
abort after a Timeout), one whose call failed otherwise or that raised an
uncaught exception with 1.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any, Optional

from .. import _core

_POLL_S = 0.1
_GRACE_S = 3.0
_PREFIX = "diffcomm/job_end/"
TIMEOUT_CODE = 124


class _Job:
    def __init__(self, store: Any, rank: int, size: int, pg: Any):
        self.store, self.rank, self.size, self.pg = store, rank, size, pg
        self.lock = threading.Lock()
        self.sent = False  # this rank raised the alarm
        self.reported = False  # this rank counted itself as reported
        self.failed_code: Optional[int] = None  # set when a call of this rank failed
        self.alarm: Optional[str] = None  # the first alarm this rank saw (or sent)
        self.pid = os.getpid()

    # --------------------------------------------------------------- store
    def _key(self, name: str) -> str:
        return _PREFIX + name

    def _alarm_text(self) -> Optional[str]:
        # A counter, not Store.check: torch 1.13's PrefixStore has no check,
        # and add(key, 0) never blocks.
        try:
            if self.store.add(self._key("alarms"), 0) == 0:
                return None
            return self.store.get(self._key("alarm")).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host is gone: the job is ending
            return None

    def raise_alarm(self, text: str) -> None:
        with self.lock:
            if self.sent or self.alarm is not None:
                return
            self.sent, self.alarm = True, text
        try:
            try:  # the first writer wins: a later alarm keeps the first's text
                self.store.compare_set(self._key("alarm"), "", text)
            except (AttributeError, RuntimeError):  # a store without compare_set
                self.store.set(self._key("alarm"), text)
            self.store.add(self._key("alarms"), 1)  # after the text: readers see it set
        except Exception:  # noqa: BLE001 - the store's host is gone: the job is ending
            pass

    def report(self) -> None:
        with self.lock:
            if self.reported:
                return
            self.reported = True
        try:
            self.store.add(self._key("reported"), 1)
        except Exception:  # noqa: BLE001
            pass

    def wait_for_reports(self) -> None:
        end = time.monotonic() + _GRACE_S
        while time.monotonic() < end:
            try:
                if self.store.add(self._key("reported"), 0) >= self.size:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.02)

    # ------------------------------------------------------- what ranks do
    def on_alarm(self, text: str, where: str) -> None:
        """A peer's alarm seen: dump, one line, reported."""
        with self.lock:
            if self.alarm is not None:
                return
            self.alarm = text
        dumped = _core.dump_flight_recorders_on_error()
        last = str(self.pg.flight_recorder()).strip().splitlines() if self.pg else []
        sys.stderr.write(
            f"diffcomm: rank {self.rank}: {text}; {where}this rank's last call: "
            f"{last[-1].strip() if last else 'none'}; "
            f"{'its flight recorder is dumped' if dumped else 'no flight recorder dump directory'}"
            f"\n")
        sys.stderr.flush()
        self.report()

    def watch(self) -> None:
        while os.getpid() == self.pid:
            text = self._alarm_text()
            if text is not None:
                if not self.sent:
                    self.on_alarm(text, "")
                return
            time.sleep(_POLL_S)

    def end(self, code: int) -> None:
        """This rank has reported: wait for the others, then leave with code."""
        self.report()
        self.wait_for_reports()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        if self.failed_code is not None:
            self.end(self.failed_code)
        # A rank leaving while the others may still be in calls (it left
        # early): its dump now, so that a replay sees where it stopped. It
        # does not wait for them: its exit is what tells torch's transport
        # (gloo closes the connections) that it is gone, at once.
        _core.dump_flight_recorders_on_error()
        self.report()  # its dump is written: a failing peer need not wait for it
        # Let the group go before the interpreter's end (a reference held
        # here would be reported as leaked by nanobind).
        self.pid, self.pg = -1, None


_job: Optional[_Job] = None


def install(pg: Any) -> None:
    """Once per process, for the world group of a torch-transport job: the
    watcher thread, the exit hook and the uncaught-exception hook."""
    global _job
    import torch.distributed as dist  # noqa: PLC0415

    if _job is not None or dist.get_world_size() < 2:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (an unusual init): no alarm
        return
    _job = _Job(store, dist.get_rank(), dist.get_world_size(), pg)
    threading.Thread(target=_job.watch, name="diffcomm-alarm", daemon=True).start()
    atexit.register(_job.at_exit)
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        previous(kind, value, tb)
        if _job is None or os.getpid() != _job.pid:
            return
        first = str(value).split("\n", 1)[0]
        if _job.failed_code is not None:
            _job.end(_job.failed_code)
        _job.raise_alarm(f"rank {_job.rank} is ending the job (uncaught {kind.__name__}: "
                         f"{first})")
        _job.end(1)

    sys.excepthook = hook


def note_failure(where: str, timed_out: bool) -> None:
    """A call of this process raised Timeout (timed_out) or BackendError: the
    group is unusable, so the job ends; every other rank is told now (the
    torch transport calls this)."""
    if _job is None:
        return
    _job.failed_code = TIMEOUT_CODE if timed_out else 1
    what = "timed out in" if timed_out else "failed (BackendError) in"
    _job.raise_alarm(f"rank {_job.rank} {what} {where} and is ending the job")

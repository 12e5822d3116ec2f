"""Flight recorder dumps when a rank ends on an uncaught Python exception.

With ``DIFFCOMM_FR_DUMP_DIR`` set, every rank writes ``DIR/rank-<global
rank>.json`` when a call raises Timeout, CollectiveMismatch, BackendError or
RankFailure (the C++ funnel does that) — and, through the hook here, when the rank's
program dies of any uncaught exception, e.g. a peer's failure seen as a
Python error, or the program's own bug between collectives. The C++ side
(FlightRecorder::dump_all_on_error) covers an uncaught C++ exception.
``init_process_group`` installs the hook once per process, before any
other hook of ours runs, so the dump is written before MPI_Abort ends the job.
"""
from __future__ import annotations

import sys
from typing import Any

from .. import _core

_installed = False


def install_hook() -> None:
    """Wraps sys.excepthook once: dump every recorder that has a dump
    directory (none: nothing happens), then the hook it replaced."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        _core.dump_flight_recorders_on_error()
        previous(kind, value, tb)

    sys.excepthook = hook

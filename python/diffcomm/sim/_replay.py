"""diffcomm.sim.replay: production flight recorder dumps replayed in the
simulated world (the C++ core is sim/replay/include/diffcomm/sim/replay.hpp; the
command line is ``diffcomm-sim replay``, with the same report)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .. import _core

__all__ = ["replay", "ReplayReport", "PendingCall"]


@dataclass(frozen=True)
class PendingCall:
    """A rank's state when the replay deadlocked: the call it waits in, and
    the members of that call's group that never reached it."""

    rank: int
    finished: bool
    group: str = ""
    call: Optional[int] = None
    op: str = ""
    not_reached: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayReport:
    """The replay's verdict, field for field ``diffcomm-sim replay --json``.

    ``verdict`` is "ok", "mismatch", "deadlock" or "incomplete"; ``group``,
    ``call``, ``op`` name the call it is about; ``ranks`` the disagreeing
    pair (mismatch), the ranks that never reached the pending call
    (deadlock) or whose rings lost calls (incomplete); ``field`` what
    differs ("dtype", "shape", "op", ...); ``message`` the simulated world's
    own message; ``pending`` every rank's state for a deadlock; ``unknown``
    what the dumps do not record and the replay did not compare. ``str()``
    is the command's text; ``exit_code`` its exit status (0 ok, 3 mismatch or
    deadlock, 4 incomplete)."""

    verdict: str
    group: str
    call: Optional[int]
    op: str
    ranks: List[int]
    field: str
    message: str
    pending: List[PendingCall]
    unknown: List[str]
    exit_code: int
    text: str

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def __str__(self) -> str:
        return self.text


def replay(path: "str | os.PathLike[str]", *, seed: int = 0, drop: Sequence[str] = (),
           insert_barrier: Sequence[str] = ()) -> ReplayReport:
    """Replays the flight recorder dumps in directory ``path`` in the
    simulated world and returns the report checked mode would have given.

    ``path`` holds diffcomm's ``rank-<global rank>.json`` (written with
    ``DIFFCOMM_FR_DUMP_DIR``) or PyTorch Flight Recorder dumps
    (``<prefix><rank>``, pickle or JSON). ``seed`` picks the simulated
    world's interleaving. ``drop`` and ``insert_barrier`` are what-if edits,
    ``"RANK:GROUP:CALL"`` each, as the command line's ``--drop`` /
    ``--insert-barrier``: every CALL in the recorded numbering, whatever
    the order given (a drop given twice is refused).

    Raises ``diffcomm.InvalidArgument`` (one line naming the file) for a
    missing rank file, a corrupt or truncated file (with its byte offset),
    or an edit that names no recorded call.
    """
    text_json, text, code = _core.sim.replay_dir(os.fspath(path), int(seed), list(drop),
                                                 list(insert_barrier))
    j = json.loads(text_json)
    pending = [PendingCall(rank=p["rank"], finished=p["finished"], group=p.get("group", ""),
                           call=p.get("call"), op=p.get("op", ""),
                           not_reached=p.get("not_reached", [])) for p in j["pending"]]
    return ReplayReport(verdict=j["verdict"], group=j["group"], call=j["call"], op=j["op"],
                        ranks=j["ranks"], field=j["field"], message=j["message"],
                        pending=pending, unknown=j["unknown"], exit_code=code, text=text)

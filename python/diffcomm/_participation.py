"""The participation rule in torch's terms: each rank's pending bridges.

diffcomm's C++ engine keeps, per rank, the differentiable collectives whose
backward has not run (``Cohort``): a backward pass runs all of them, with zero
cotangents where the loss does not reach, so backward collectives pair across
ranks. Under diffcomm.torch, torch's engine runs the backward, and one
diffcomm op is one torch node (``_Bridge``); the bridge hands its diffcomm
graph off (``_core.hand_off``) and registers its outputs here instead, keyed
by the rank's cohort (one per rank, shared by all its groups).
``diffcomm.torch.backward`` adds every pending output of the rank as a root
with a zero gradient; torch's engine then runs the bridges by descending
sequence number, i.e. in reverse forward order on every rank.

The registry owns the outputs (as the C++ cohort owns its nodes) until their
backward ran. No torch import: diffcomm.sim clears a rank's entries when its
function returns.
"""
import atexit
import itertools
from typing import Any, Dict, List, Tuple

# cohort id -> {bridge id: outputs that require grad}, in creation order.
_pending: Dict[int, Dict[int, Tuple[Any, ...]]] = {}
_ids = itertools.count()


def add(cohort: int, outputs: Tuple[Any, ...]) -> int:
    """Registers a bridge's outputs; returns its id."""
    key = next(_ids)
    _pending.setdefault(cohort, {})[key] = outputs
    return key


def ran(cohort: int, key: int) -> None:
    """The bridge's backward ran: it is no longer pending."""
    entries = _pending.get(cohort)
    if entries is not None:
        entries.pop(key, None)


def pending(cohort: int) -> List[Tuple[int, Tuple[Any, ...]]]:
    """(id, outputs) of every pending bridge of the rank, oldest first."""
    return list(_pending.get(cohort, {}).items())


def restore(cohort: int, entries: List[Tuple[int, Tuple[Any, ...]]]) -> None:
    """Makes entries pending again (a pass with retain_graph), keeping creation order."""
    merged = dict(_pending.get(cohort, {}))
    merged.update(entries)
    _pending[cohort] = dict(sorted(merged.items()))


def discard(cohort: int) -> None:
    """Forgets the rank's pending bridges without running them."""
    _pending.pop(cohort, None)


def discard_all() -> None:
    _pending.clear()


# Pending outputs hold torch graph nodes, which hold diffcomm tensors: release
# them while the interpreter (and the extension's types) are still alive.
atexit.register(discard_all)

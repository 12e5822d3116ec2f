"""Per-thread default groups: what ``group=None`` means in diffcomm.torch.

A simulated rank (diffcomm.sim.run) sets its world group for its own thread;
a process initialised with diffcomm.torch.init_process_group sets one for the
process. The thread's group wins.
"""
import threading


class _ThreadGroup(threading.local):
    # A class default, so a thread that never set one reads None without the
    # AttributeError that getattr(local, name, None) raises and catches
    # (0.2-0.3 us on every group=None call of an MPI or torchrun process).
    group = None


_local = _ThreadGroup()
_process_group = None


def set_thread_group(group):
    _local.group = group


def set_process_group(group):
    global _process_group
    _process_group = group


def default_group():
    group = _local.group
    if group is not None:
        return group
    if _process_group is not None:
        return _process_group
    from ._core import InvalidArgument

    raise InvalidArgument(
        "diffcomm: group=None but no default group: call diffcomm.torch.init_process_group() "
        "(MPI/NCCL) or run inside diffcomm.sim.run, or pass group="
    )

"""Gloo's collective threads, brought to rest before the interpreter can finalize.

A ``ProcessGroupGloo`` runs its collectives on threads of its own (``pt_gloo_runloop``, two a
group). Such a thread lets go of a finished collective only after the caller has seen it finish,
and where its reference is the last one to a tensor Python made -- the caller dropped the tensor
as soon as the collective returned, as every temporary does -- letting go takes the GIL. If the
interpreter has begun to finalize by then (the program ended right after its last collective,
and the thread was slow to get a core on a busy machine), CPython ends the thread inside the C++
destructor and the process aborts after a run that succeeded: "terminate called without an
active exception". Leaving the group does not stop these threads: they end when the last
reference to the group goes, and a model sharded over the workers (FSDP's ``DeviceMesh``,
``DTensor`` parameters) holds one for as long as it lives.

:func:`bring_to_rest` waits, with the GIL released, until every such thread of the process waits
for its next collective: blocked, as Linux shows in ``/proc``, in the futex wait of a condition
variable without a time limit (glibc's ``pthread_cond_wait``: the wait for the next collective,
which a thread reaches only once it has let go of the one before). A thread waiting for the GIL
waits with a time limit (CPython's), and one blocked on a lock waits in a plain futex wait, so
neither passes for one. Where ``/proc`` does not say, it returns at once.
"""

from __future__ import annotations

import logging
import os
import platform
import time

import torch.distributed as dist

#: how long the threads may take to let go of what they hold (they need only a core and the GIL)
REST_SECONDS = 10.0

#: the futex system call's number, by machine
_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT_BITSET = 9   # (a condition variable's wait; a lock's is FUTEX_WAIT, 0)

logger = logging.getLogger("stratagem.comm")


def bring_to_rest(timeout: float = REST_SECONDS, *, warn: bool = True) -> bool:
    """Wait until every gloo thread of this process waits for its next collective; False if one was
    still busy after ``timeout`` seconds (with a warning naming the risk) or ``/proc`` cannot say.

    >>> bring_to_rest()   # no gloo group in this process: nothing to wait for
    True
    """
    deadline = time.monotonic() + timeout
    while True:
        busy = _busy_threads()
        if busy is None:
            return False
        if not busy:
            return True
        if time.monotonic() > deadline:
            if warn:
                logger.warning("gloo's threads %s still held a collective %g s after the last one; the process "
                               "may abort at exit ('terminate called without an active exception')", busy, timeout)
            return False
        time.sleep(0.001)   # (the GIL released: a thread that needs it to let go gets it)


def leave_every_group() -> None:
    """Bring gloo's threads to rest, then destroy every group (a lone process's group at exit)."""
    if dist.is_initialized():   # (a test may have left it already)
        bring_to_rest()
        dist.destroy_process_group()


def thread_names() -> "dict[int, str]":
    """This process's threads, id -> name, as ``/proc`` lists them (empty where it does not)."""
    names = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names[int(task)] = f.read().strip()
        except OSError:   # (a thread that ended meanwhile)
            pass
    return names


def _busy_threads() -> "list[int] | None":
    """The ids of gloo's threads not at rest; None where this system does not say."""
    if _FUTEX is None or not os.path.isdir("/proc/self/task"):
        return None
    busy = []
    for task, name in thread_names().items():
        if name != "pt_gloo_runloop":
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{task}/syscall") as f:
                call = f.read().split()
        except FileNotFoundError:   # (a thread that ended meanwhile)
            continue
        except OSError:   # (a system that keeps system calls from the process itself)
            return None
        if not _waiting_untimed(state, call):
            busy.append(task)
    return busy


def _waiting_untimed(state: str, call: list[str]) -> bool:
    """Whether a thread blocks in a condition variable's futex wait without a time limit: ``syscall``
    reads ``nr uaddr op val timeout ...`` for a thread blocked in a system call, ``running`` otherwise."""
    if state != "S" or len(call) < 5 or not call[0].isdigit() or int(call[0]) != _FUTEX:
        return False
    return (int(call[2], 16) & 0x7F) == _FUTEX_WAIT_BITSET and int(call[4], 16) == 0

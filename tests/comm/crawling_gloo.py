"""Gloo's threads made to crawl for a while, for the tests of what a process does at exit.

:func:`crawl` gives this process's gloo threads (``pt_gloo_runloop``) the idlest scheduling class
on a core a busy process holds, where there are two cores: they run a moment now and then, as a
thread does on a machine far busier than its cores, and whatever they hold they hold for a while.
After ``seconds`` the busy process ends and the threads get their class and cores back, so a
machine that is busy already (the test suite's) cannot starve them for longer than that.
"""

import os
import subprocess
import sys
import threading

from stratagem.comm.gloo_threads import thread_names


def gloo_threads(name: str = "pt_gloo_runloop") -> list[int]:
    """The ids of this process's threads called ``name``."""
    return [tid for tid, named in thread_names().items() if named == name]


def crawl(seconds: float = 3.0) -> "subprocess.Popen | None":
    """Make gloo's threads crawl for ``seconds``; returns the busy process (kill it when done, or let
    it end), None on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    hog = subprocess.Popen([sys.executable, "-c",
                            f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"])
    os.sched_setaffinity(hog.pid, {cores[-1]})
    threads = gloo_threads()
    for tid in threads:
        os.sched_setaffinity(tid, {cores[-1]})
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

    def restore() -> None:
        for tid in threads:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.sched_setaffinity(tid, cores)
            except OSError:   # (a thread that ended meanwhile)
                pass

    timer = threading.Timer(seconds, restore)
    timer.daemon = True   # (exit does not wait for it: what it undoes may still be pending then)
    timer.start()
    return hog

"""Gloo's threads made to crawl, for the tests of what a process does at exit.

:func:`crawl` gives this process's gloo threads (``pt_gloo_runloop``) the idlest scheduling class
on a core a busy process holds, where there are two cores: they run a moment every few hundred
milliseconds, as a thread does on a machine far busier than its cores, and whatever they hold they
hold for a while.
"""

import os
import subprocess
import sys


def gloo_threads(name: str = "pt_gloo_runloop") -> list[int]:
    """The ids of this process's threads called ``name``."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(task))
        except OSError:   # (a thread that ended meanwhile)
            pass
    return found


def crawl() -> "subprocess.Popen | None":
    """Make gloo's threads crawl; returns the busy process (kill it when done), None on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(hog.pid, {cores[-1]})
    for tid in gloo_threads():
        os.sched_setaffinity(tid, {cores[-1]})
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return hog

"""The hang, located for a parameter server (real processes): a ps stopped by SIGSTOP mid-training is
declared lost, and the error the coordinator's user gets says where each task stands -- the ps's
state and its last completed call (method, bytes), the worker's call in flight to it -- with every
stack in a file it names. Bounded: the stopped ps is not waited for (a few seconds at most)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from stratagem.errors import UnavailableError
from stratagem.launch import launch_local
from stratagem.observe import answer, hang_report
from stratagem.ps.health import PsWatchdog

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("forked_launches")]

SCRIPT = Path(__file__).with_name("ps_lost_script.py")


@pytest.mark.multiprocess
def test_a_stopped_parameter_server_is_located_in_the_error() -> None:
    out, err = io.StringIO(), io.StringIO()
    launch_local(SCRIPT, num_workers=1, num_ps=1, stdout=out, stderr=err, grace_period=2.0)
    output = out.getvalue()
    assert re.search(r"\[chief\] +ps 0 stopped", output), output + err.getvalue()
    assert "UnavailableError: parameter server ps 0 is lost" in output, output + err.getvalue()
    message = output.split("UnavailableError: ", 1)[1]
    assert re.search(r"ps 0 did not answer: it is stopped \(SIGSTOP or a debugger\): state T[^;\n]*; its last call, "
                     r"#\d+ rpc served (push|pull) \(144 B, step 0\), ended \d+ s ago", message), message
    assert re.search(r"worker 0 waits in #\d+ rpc (push|pull) to ps 0 \(step 3\) since \d+ s", message), message
    found = re.search(r"the full stacks of every thread: (\S+)", message)
    assert found, message
    stacks = Path(found.group(1)).read_text()
    assert "=== ps 0: did not answer: it is stopped" in stacks and "=== worker 0 (pid" in stacks, stacks
    assert "=== chief (pid" in stacks, stacks


def test_a_ps_call_that_timed_out_fails_its_closure_with_where_the_tasks_stand(monkeypatch) -> None:
    """A closure whose ps call timed out and that is not run again (the ps answers the coordinator,
    so it is not lost) carries the report as a note; other errors and a loss's own do not."""
    monkeypatch.delenv(answer.OBSERVE_VARIABLE, raising=False)
    monkeypatch.setattr(hang_report, "_last_report", [0.0, ""])
    watchdog = PsWatchdog.__new__(PsWatchdog)   # (its judgement alone: no coordinator, no thread)
    watchdog.clients = (SimpleNamespace(task="ps 0"),)
    watchdog.failure = watchdog.last_failure = None
    error = watchdog.located(UnavailableError("ps 0 did not answer 'push' within 60 s", task="ps 0"))
    notes = "\n".join(getattr(error, "__notes__", []))
    assert notes.startswith("Where the tasks stand:\nchief ") and "the full stacks of every thread: " in notes, notes
    os.unlink(notes.rsplit("the full stacks of every thread: ", 1)[1].strip())
    other = watchdog.located(UnavailableError("worker 1 is unavailable", task="worker 1"))
    assert not getattr(other, "__notes__", None)
    watchdog.failure = watchdog.last_failure = UnavailableError("parameter server ps 0 is lost", task="ps 0")
    assert not getattr(watchdog.located(watchdog.failure), "__notes__", None)

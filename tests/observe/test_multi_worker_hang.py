"""The hang, located (real processes): where every task stands when a job stops making progress.

Two workers train (``hang_script.py``); at step 3 worker 1 hangs -- stopped by SIGSTOP, asleep in
the user's code inside the step, or past a ``strategy.reduce`` it skipped. The launcher's
``--hang-timeout`` (or, without it, worker 0's collective timing out) must name worker 1 and
what it does, worker 0's collective and its line of the script, and a file with every stack.
Nothing waits a fixed time: the job itself times out, and each test is bounded.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from stratagem.launch import launch_local

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240),
              pytest.mark.usefixtures("forked_launches")]

SCRIPT = Path(__file__).with_name("hang_script.py")
HANG_TIMEOUT = 8.0   # seconds without progress: a healthy step here takes milliseconds
#: the communication timeout of the test without --hang-timeout: as short, for the same reason
COLLECTIVE_TIMEOUT = 8


def _place(code: str) -> str:
    """A pattern for where a message places the line of ``hang_script.py`` whose code is ``code``."""
    lines = [n for n, text in enumerate(SCRIPT.read_text().splitlines(), start=1) if text.strip() == code]
    assert len(lines) == 1, code
    return rf"\S*{re.escape(SCRIPT.name)}:{lines[0]}"


def _at(code: str) -> str:
    """"at FILE:N `code`": where a task waits."""
    return rf"at {_place(code)} `{re.escape(code)}`"


def _in(code: str) -> str:
    """"`code` at FILE:N": where a task not in a collective is."""
    return rf"`{re.escape(code)}` at {_place(code)}"


def _launch(how: str) -> str:
    """The launcher's messages for a job that hangs ``how``; the job must stop with status 1."""
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, [how, "120"], num_workers=2, stdout=out, stderr=err,
                          hang_timeout=HANG_TIMEOUT, grace_period=2.0)
    assert status == 1, out.getvalue() + err.getvalue()
    assert "[worker 1] step 2 done" in out.getvalue(), out.getvalue()
    assert "finished without hanging" not in out.getvalue()
    return err.getvalue()


def _stacks(message: str) -> str:
    found = re.search(r"the full stacks of every thread: (\S+)", message)
    assert found, message
    path = Path(found.group(1))
    assert path.exists(), message
    return path.read_text()


def _waits(message: str, kind: str, code: str) -> None:
    """worker 0 waits in a collective of ``kind`` at the line ``code``."""
    assert re.search(rf"worker 0 waits in #\d+ {re.escape(kind)} \(.*step 3\) since \d+ s, {_at(code)}", message), \
        message


def test_a_worker_stopped_by_sigstop_is_named_by_the_hang_timeout() -> None:
    message = _launch("stop")
    assert "no task made progress" in message and "--hang-timeout 8" in message, message
    assert re.search(r"worker 1 did not answer: it is stopped \(SIGSTOP or a debugger\): state T", message), message
    _waits(message, "gradient all_reduce", "loss.backward()")
    stacks = _stacks(message)
    assert "=== worker 0" in stacks and "=== worker 1: did not answer" in stacks, stacks
    assert "loss.backward()" in stacks and 'Thread "MainThread" (main)' in stacks, stacks


def test_a_worker_asleep_in_the_step_is_named_at_its_line() -> None:
    message = _launch("sleep")
    found = re.search(rf"worker 1 is in {_in('time.sleep(3600)')} \(step 3\), "
                      r"not in a collective; its last collective, #(\d+) .*; "
                      r"the others wait in #(\d+)", message)
    assert found and int(found.group(2)) == int(found.group(1)) + 1, message
    _waits(message, "gradient all_reduce", "loss.backward()")
    stacks = _stacks(message)
    assert "=== worker 1 (pid" in stacks and "time.sleep(3600)" in stacks, stacks


def test_a_worker_that_skipped_a_collective_is_named_at_its_line() -> None:
    message = _launch("skip")
    assert re.search(rf"worker 1 is in {_in('time.sleep(0.2)')} \(step 3\), "
                     r"not in a collective; .* it has not reached that collective, or skipped it", message), message
    _waits(message, "strategy.reduce", 'total = strategy.reduce("sum", loss, axis=None)')
    assert "=== worker 0" in _stacks(message)


def test_a_timed_out_collective_says_where_every_task_stands() -> None:
    """Without --hang-timeout: worker 0's all-reduce times out (``CommunicationOptions(timeout_seconds=8)``)
    and its error says where each task stands; the launcher then kills the stopped worker 1."""
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(SCRIPT, ["stop", str(COLLECTIVE_TIMEOUT)], num_workers=2, stdout=out, stderr=err,
                          grace_period=2.0)
    output = out.getvalue()
    assert status == 1, output + err.getvalue()
    assert "UnavailableError" in output and "worker 1 stopped answering" in output, output
    assert re.search(r"worker 1 did not answer: it is stopped \(SIGSTOP or a debugger\): state T", output), output
    _waits(output, "gradient all_reduce", "loss.backward()")
    assert "=== worker 0" in _stacks(output)
    assert "worker 1 is stopped (SIGSTOP or a debugger)" in err.getvalue(), err.getvalue()


def test_a_parameter_server_worker_asleep_in_a_closure_is_named_at_its_line() -> None:
    script = SCRIPT.with_name("ps_hang_script.py")
    out, err = io.StringIO(), io.StringIO()
    status = launch_local(script, num_workers=1, num_ps=1, stdout=out, stderr=err,
                          hang_timeout=HANG_TIMEOUT, grace_period=2.0)
    message = err.getvalue()
    assert status == 1 and re.search(r"\[chief\] +step 2 done", out.getvalue()), out.getvalue() + message
    lines = [n for n, text in enumerate(script.read_text().splitlines(), start=1) if text.strip() == "time.sleep(3600)"]
    assert re.search(rf"worker 0 is in `time.sleep\(3600\)` at \S*ps_hang_script.py:{lines[0]} \(step 3\), "
                     r"not in a collective", message), message
    assert re.search(r"chief waits in #\d+ rpc run .* at \S*ps_hang_script.py:\d+ `coordinator.join\(\)`", message), message
    assert "=== ps 0" in _stacks(message)

"""Asking tasks where they stand and saying it (stratagem/observe/hang_report.py, answer.py, stacks.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.observe import answer, flight, hang_report
from stratagem.observe.stacks import snapshot, user_frame


def _waiting(seq: int, kind: str = "gradient all_reduce", line: int = 40, seconds: float = 31.0) -> dict:
    return {"main": {"file": "train.py", "line": line, "function": "<module>", "code": "loss.backward()"},
            "step": 12, "last_completed": {"seq": seq - 1, "kind": kind, "nbytes": 10, "step": 12, "seconds": 31.0},
            "in_flight": [{"seq": seq, "kind": kind, "nbytes": 4_200_000, "peers": "", "step": 12,
                           "main_thread": True, "seconds": seconds}]}


def _idle(last_seq: int | None) -> dict:
    last = None if last_seq is None else {"seq": last_seq, "kind": "strategy.reduce", "nbytes": 520, "step": 12,
                                          "seconds": 30.4}
    return {"main": {"file": "train.py", "line": 42, "function": "step", "code": "time.sleep(3600)"},
            "step": 12, "last_completed": last, "in_flight": []}


def test_the_task_not_in_a_collective_comes_first_then_the_waiting_groups() -> None:
    message = hang_report.describe({"worker 0": _waiting(58), "worker 1": _idle(57), "worker 2": _waiting(58, seconds=40),
                                    "worker 3": _waiting(58)})
    assert message.splitlines() == [
        "worker 1 is in `time.sleep(3600)` at train.py:42 (step 12), not in a collective; its last collective, "
        "#57 strategy.reduce (520 B), ended 30 s ago; the others wait in #58: it has not reached that collective, "
        "or skipped it",
        "workers 0, 2 and 3 wait in #58 gradient all_reduce (4.2 MB, step 12) since 40 s, at train.py:40 "
        "`loss.backward()`"]


def test_silent_tasks_and_tasks_in_different_collectives() -> None:
    message = hang_report.describe(
        {"chief": _waiting(7, "strategy.reduce"), "worker 0": _waiting(7, "gradient all_reduce", line=41),
         "worker 1": None, "worker 2": _idle(None)},
        {"worker 1": "it is stopped (SIGSTOP or a debugger): state T (stopped) in /proc/9/status"})
    lines = message.splitlines()
    assert lines[0] == "worker 1 did not answer: it is stopped (SIGSTOP or a debugger): state T (stopped) in /proc/9/status"
    assert lines[1].startswith("worker 2 is in `time.sleep(3600)`") and "it has completed no collective" in lines[1]
    assert "the others wait in #7" in lines[1]
    assert lines[2].startswith("chief waits in #7 strategy.reduce") and lines[3].startswith("worker 0 waits in #7 gradient")
    assert lines[4] == ("the tasks wait in different collectives as #7 (gradient all_reduce, strategy.reduce): the "
                        "script issues different collectives on different tasks (one skipped or added one)")


def test_names_are_grouped_by_job() -> None:
    answers = {name: _waiting(3) for name in ("chief", "worker 0", "worker 1")}
    assert hang_report.describe(answers).startswith("chief and workers 0 and 1 wait in #3")


@pytest.mark.multiprocess
def test_why_a_process_did_not_answer_comes_from_proc() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert hang_report.silence(child.pid).startswith("stuck in C code that holds the GIL")
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not (hang_report.proc_state(child.pid) or "").startswith("T") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hang_report.silence(child.pid) == \
            f"it is stopped (SIGSTOP or a debugger): state T (stopped) in /proc/{child.pid}/status"
    finally:
        child.kill()
        child.wait()
    assert hang_report.silence(child.pid) == "its process has exited"
    assert hang_report.proc_state(child.pid) is None


def test_the_users_frame_skips_stratagem_and_the_standard_library() -> None:
    frame = user_frame(sys._getframe())
    assert frame is not None and frame.f_code.co_name == "test_the_users_frame_skips_stratagem_and_the_standard_library"
    state = snapshot("worker 0")
    assert state["pid"] == os.getpid() and state["step"] == flight.step()
    assert state["main"]["file"] == __file__ and state["main"]["code"] == 'state = snapshot("worker 0")'


def test_a_task_answers_a_question_in_its_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(answer.OBSERVE_VARIABLE, str(tmp_path))
    answer.start("worker 3")
    try:
        assert hang_report.registered(tmp_path) == {"worker 3": os.getpid()}
        with flight.record("strategy.reduce", 16, "worker 0, worker 3"):
            answers = hang_report.ask(tmp_path, wait_s=30)   # (answered within 0.2 s)
        assert list(answers) == ["worker 3"]
        mine = answers["worker 3"]
        assert mine["task"] == "worker 3" and mine["main"]["file"] == __file__
        assert mine["main"]["code"] == "answers = hang_report.ask(tmp_path, wait_s=30)   # (answered within 0.2 s)"
        assert [r["kind"] for r in mine["in_flight"]][-1] == "strategy.reduce"
        assert (tmp_path / "progress" / "worker-3").exists()
        path = hang_report.write_stacks(answers, path=tmp_path / "stacks.txt")
        text = Path(path).read_text()
        assert text.startswith(f"=== worker 3 (pid {os.getpid()}") and "strategy.reduce (16 B" in text
        assert 'Thread "stratagem-observe"' in text and "(main)" in text
    finally:
        answer.stop()


def test_a_question_nobody_answers_takes_the_time_given(tmp_path: Path) -> None:
    answers = hang_report.ask(tmp_path, {"worker 0": os.getpid()}, wait_s=0.2)
    assert answers == {"worker 0": None}
    assert hang_report.ask(tmp_path, {"worker 0": 2 ** 22 + 7}, wait_s=30) == {"worker 0": None}   # gone: no wait


def test_report_outside_the_launcher_says_where_this_task_stands(monkeypatch) -> None:
    monkeypatch.delenv(answer.OBSERVE_VARIABLE, raising=False)
    monkeypatch.setattr(hang_report, "_last_report", [0.0, ""])
    text = hang_report.report("worker 0")
    assert hang_report.report("worker 0") == text   # (again within ten seconds: the same report)
    assert text.startswith("worker 0 ")
    path = text.rsplit("the full stacks of every thread: ", 1)[1]
    assert Path(path).read_text().startswith("=== worker 0 (pid")
    os.unlink(path)


def test_rpc_calls_show_no_unknown_bytes_and_no_sequence_hints() -> None:
    idle = _idle(4)
    idle["last_completed"].update(kind="rpc push", nbytes=0)
    coordinator = _waiting(12, "rpc run")
    message = hang_report.describe({"chief": coordinator, "worker 0": idle})
    assert "its last call, #4 rpc push, ended 30 s ago" in message, message
    assert "the others wait" not in message, message   # (RPC numbers do not compare across tasks)


def test_an_rpc_call_in_flight_names_its_peer() -> None:
    worker = _waiting(9, "rpc push")
    worker["in_flight"][0].update(peers="ps 0", nbytes=0, main_thread=False)
    assert hang_report.describe({"worker 0": worker}).startswith("worker 0 waits in #9 rpc push to ps 0 (step 12)")


def test_a_task_leaves_its_last_completed_call_for_when_it_cannot_answer(tmp_path: Path, monkeypatch) -> None:
    """A stopped task cannot answer: what it last completed comes from the note it kept while it ran."""
    monkeypatch.setenv(answer.OBSERVE_VARIABLE, str(tmp_path))
    answer.start("ps 0")
    try:
        with flight.record("rpc served push", 144):
            pass
        seq = flight.last_completed().seq
        note = tmp_path / "last" / "ps-0.json"
        deadline = time.monotonic() + 60
        while f'"seq": {seq},' not in (note.read_text() if note.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)   # (written within 0.2 s)
    finally:
        answer.stop()
    said = hang_report.last_note(tmp_path, "ps 0", os.getpid())
    assert said == f"; its last call, #{seq} rpc served push (144 B, step {flight.step()}), ended 0 s ago", said
    assert hang_report.last_note(tmp_path, "ps 0", os.getpid() + 1) == ""   # another process of that task
    assert hang_report.last_note(tmp_path, "ps 1") == ""
    reasons = hang_report.silent_reasons(tmp_path, {"ps 0": os.getpid()}, {"ps 0": None})
    assert list(reasons) == ["ps 0"]
    assert reasons["ps 0"].startswith("stuck in C code") and reasons["ps 0"].endswith(said)
    message = hang_report.describe({"ps 0": None}, reasons)
    assert message.startswith("ps 0 did not answer: ") and message.endswith(said[2:]), message

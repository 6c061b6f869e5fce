"""RemoteError's message: the error, the user's frames and the one that raised; nested calls told as one."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer
from stratagem.rpc.errors import MAX_FRAMES_SHOWN, RemoteError, describe_exception

pytestmark = pytest.mark.timeout(60)


def _remote(fn: Callable[[], Any], method: str, task: str) -> RemoteError:
    """What a client raises when a handler running ``fn`` raised (the transport left out)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a handler's error, whatever it is
        described, original = describe_exception(exc)
        return RemoteError.from_reply(described, method=method, task=task, remote_exception=original)
    raise AssertionError("fn did not raise")


def _parse(text: str) -> Any:
    return json.loads(text)   # raises inside the standard library


def user_step() -> Any:
    return _parse("{not json")


def test_the_message_shows_the_users_frames_and_the_one_that_raised() -> None:
    error = _remote(user_step, "run", "worker 0")
    message = str(error)
    first, blank, header, *frames = message.splitlines()
    assert first.startswith("'run' on worker 0 raised json.decoder.JSONDecodeError: Expecting property name")
    assert header == ("Remote traceback (worker 0): your code, then the line that raised (every frame: "
                      "error.remote_traceback)")
    assert f'File "{__file__}"' in frames[0] and "in _remote" in frames[0]
    assert [line.rsplit(" in ", 1)[-1] for line in frames if line.startswith("  File")] == [
        "_remote", "user_step", "_parse", "raw_decode"]   # json's own frames but the last: left out
    assert 'return _parse("{not json")' in message    # source lines
    assert "json/__init__.py" not in message and "json/__init__.py" in error.remote_traceback
    assert error.remote_type == "json.decoder.JSONDecodeError" and error.chain == (("run", "worker 0"),)
    assert isinstance(error.remote_exception, json.JSONDecodeError)


def test_a_failed_call_inside_a_handler_is_told_as_the_innermost_error_with_its_way() -> None:
    ps = ParameterServer(name="ps 1")

    def call_ps() -> None:   # the worker's call to the ps; RpcClient raises this
        raise _remote(lambda: ps.pull(["w"]), "pull", "ps 1")

    def worker_step() -> None:
        call_ps()

    error = _remote(worker_step, "run", "worker 0")
    message = str(error)
    lines = message.splitlines()
    assert lines[0] == ("'run' on worker 0 -> 'pull' on ps 1 raised stratagem.errors.InvalidArgumentError: "
                        "ps 1 has no variable 'w'; it has 0: none.")
    assert lines[2].startswith("Remote traceback (worker 0 -> ps 1): ")
    frames = [line.strip() for line in lines if line.startswith("  File")]
    assert [frame.rsplit(" in ", 1)[-1] for frame in frames] == [
        "_remote  [worker 0]", "worker_step  [worker 0]", "call_ps  [worker 0]", "_remote  [ps 1]",
        "<lambda>  [ps 1]", "_get  [ps 1]"]   # stratagem's pull left out; _get raised
    assert "stratagem/ps/service.py" in frames[-1] and len(lines) < 20
    assert error.remote_type == "stratagem.errors.InvalidArgumentError"
    assert isinstance(error.remote_exception, InvalidArgumentError) and error.task == "worker 0"
    assert error.chain == (("run", "worker 0"), ("pull", "ps 1"))
    worker_part, ps_part = error.remote_traceback.split("Remote traceback of 'pull' on ps 1:")
    assert "in worker_step" in worker_part and "in call_ps" in worker_part
    assert "in pull" in ps_part and "in _get" in ps_part   # every frame of the ps


def _recurse(depth: int) -> float:
    return _recurse(depth - 1) if depth else 1 / 0


def test_deep_recursion_shows_the_first_and_last_frames() -> None:
    message = str(_remote(lambda: _recurse(50), "run", "worker 0"))
    frames = [line for line in message.splitlines() if line.startswith("  File") or line == "  ..."]
    assert len(frames) == MAX_FRAMES_SHOWN + 1 and frames[3] == "  ..."
    assert message.splitlines()[-1].strip() == "return _recurse(depth - 1) if depth else 1 / 0"


def test_a_reply_without_frames_shows_its_traceback_text() -> None:
    reply = {"type": "builtins.KeyError", "message": "'x'", "traceback": "Traceback ...\nKeyError: 'x'\n"}
    error = RemoteError.from_reply(reply, method="get", task="ps 0", remote_exception=None)
    assert str(error) == "'get' on ps 0 raised builtins.KeyError: 'x'\n\nRemote traceback (ps 0):\nTraceback ...\nKeyError: 'x'"


def test_an_error_without_a_message_ends_its_first_line_with_its_type() -> None:
    def fail() -> None:
        raise StopIteration

    assert str(_remote(fail, "run", "worker 2")).splitlines()[0] == "'run' on worker 2 raised builtins.StopIteration"

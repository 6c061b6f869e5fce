"""``stratagem launch --hang-timeout``: its watch and its options (the hung jobs themselves:
tests/observe/test_multi_worker_hang.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stratagem.errors import InvalidArgumentError
from stratagem.launch import hang_watch, launch_local
from stratagem.launch.command import build_parser, run_launch


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _touch(folder: Path, name: str, stamp: int) -> None:
    (folder / "progress").mkdir(exist_ok=True)
    path = folder / "progress" / name
    path.touch()
    os.utime(path, ns=(stamp, stamp))


def test_the_watch_is_armed_by_the_first_progress_and_reset_by_each(tmp_path: Path, monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(hang_watch, "time", clock)
    watch = hang_watch.HangWatch(tmp_path, timeout=10)
    clock.now += 60
    assert not watch.hung()                   # no progress yet: the join timeout's business
    _touch(tmp_path, "worker-0", 1)
    assert not watch.hung()
    clock.now += 9
    assert not watch.hung()
    _touch(tmp_path, "worker-1", 2)           # another task's progress counts as the job's
    clock.now += 9
    assert not watch.hung()
    clock.now += 1.5
    assert not watch.hung()                   # 1.5 s since worker 1's progress
    clock.now += 9
    assert watch.hung()
    watch.restart()                           # the group started again: disarmed
    clock.now += 60
    assert not watch.hung()


def test_no_timeout_never_hangs(tmp_path: Path) -> None:
    _touch(tmp_path, "worker-0", 1)
    assert not hang_watch.HangWatch(tmp_path, timeout=0).hung()


def test_a_negative_hang_timeout_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with pytest.raises(InvalidArgumentError, match=r"--hang-timeout \(hang_timeout\) must be a number of seconds >= 0"):
        launch_local(script, hang_timeout=-1)


@pytest.mark.parametrize("where", [["--nnodes", "2", "--rdzv", "127.0.0.1:29400"], ["--ray", "127.0.0.1:6379"]])
def test_hang_timeout_is_refused_beyond_one_machine(tmp_path: Path, capsys, where: list[str]) -> None:
    args = build_parser().parse_args(["--hang-timeout", "60", *where, str(tmp_path / "train.py")])
    assert run_launch(args) == 2
    assert "--hang-timeout watches the tasks of a launch on one machine" in capsys.readouterr().err


def test_the_option_reaches_the_launcher(tmp_path: Path, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr("stratagem.launch.command.launch_local", lambda *a, **kw: seen.update(kw) or 0)
    assert run_launch(build_parser().parse_args(["--hang-timeout", "300", str(tmp_path / "t.py")])) == 0
    assert seen["hang_timeout"] == 300.0
    assert build_parser().parse_args(["t.py"]).hang_timeout == 0.0

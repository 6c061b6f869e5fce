"""`stratagem launch --timeline` and the launcher's epoch lines, without starting a job."""

from __future__ import annotations

import io
import json

import pytest

from stratagem.errors import InvalidArgumentError
from stratagem.launch.command import build_parser, run_launch
from stratagem.launch.output import TaskOutput
from stratagem.launch.timeline import check_timeline, write_timeline
from stratagem.observe.epochs import marker_line

pytestmark = pytest.mark.timeout(60)


def test_the_chiefs_epoch_line_becomes_the_launchers_summary() -> None:
    out, err = io.StringIO(), io.StringIO()
    output = TaskOutput(out, err)
    line = marker_line("Epoch 2/3", samples=6400, steps=100, seconds=2.0)
    output.write("[worker 0] ", [b"before\n", line.encode() + b"\n", b"after\n"])
    assert out.getvalue() == "[worker 0] before\n[worker 0] after\n"
    assert err.getvalue() == ("[launch] epoch 2/3: 6400 samples in 2.0 s -- 3200 samples/s, 50.0 steps/s "
                              "(20.0 ms a step) (worker 0)\n")


def test_a_timeline_path_is_checked_before_anything_starts(tmp_path) -> None:
    assert check_timeline(None) is None
    assert check_timeline(str(tmp_path / "t.json")) == str(tmp_path / "t.json")
    with pytest.raises(InvalidArgumentError, match="is a directory; give a file name"):
        check_timeline(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="does not exist; create it"):
        check_timeline(str(tmp_path / "missing" / "t.json"))


def test_timeline_with_nodes_or_ray_is_refused_naming_the_script_side_timeline(capsys) -> None:
    args = build_parser().parse_args(["--nnodes", "2", "--rdzv", "127.0.0.1:1", "--timeline", "t.json", "x.py"])
    assert run_launch(args) == 2
    assert "sg.experimental.Timeline(path)" in capsys.readouterr().err


def test_the_merged_trace_names_each_task_and_survives_a_torn_last_line(tmp_path) -> None:
    folder = tmp_path / "events"
    folder.mkdir()
    span = '{"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0}'
    (folder / "worker-1-11.jsonl").write_text('{"task": "worker 1", "pid": 11}\n' + span + "\n")
    (folder / "worker-0-10.jsonl").write_text('{"task": "worker 0", "pid": 10}\n' + span + '\n{"name": "st')
    out, err = io.StringIO(), io.StringIO()
    write_timeline(str(folder), str(tmp_path / "trace.json"), TaskOutput(out, err))
    assert "timeline of 2 tasks written to" in err.getvalue() and not folder.exists()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["worker 0", "worker 1"]
    assert sum(e["name"] == "step" for e in events) == 2

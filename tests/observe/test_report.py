"""The straggler table, the merged trace and `stratagem timeline`, from made-up steps and traces."""

from __future__ import annotations

import importlib.util
import json

import pytest

from stratagem.cli import main
from stratagem.observe.chrome import load, merge, write
from stratagem.observe.report import format_report, straggler, summarize

pytestmark = pytest.mark.timeout(60)


def _steps(total: float, waiting_input: float, waiting: float, count: int = 11) -> list[tuple]:
    return [(i, total, waiting_input, waiting, waiting, 1 << 20) for i in range(count)]


def test_the_worker_the_others_wait_for_is_named_with_where_its_time_goes() -> None:
    summaries = [summarize(_steps(0.1, 0.001, 0.05), 0), summarize(_steps(0.1, 0.001, 0.001), 1),
                 summarize(_steps(0.1, 0.001, 0.05), 2)]
    assert straggler(summaries) == 1
    text = format_report(summaries)
    assert "straggler: worker 1" in text and "compute" in text.splitlines()[-1]
    assert text.splitlines()[0].startswith("step report: 10 steps on 3 workers")   # (the first step left out)


def test_no_straggler_when_the_workers_wait_alike_or_work_alone() -> None:
    even = [summarize(_steps(0.1, 0.0, 0.02), 0), summarize(_steps(0.1, 0.0, 0.021), 1)]
    assert straggler(even) is None and "straggler: none (the workers wait" in format_report(even)
    assert "straggler: none (one worker)" in format_report([even[0]])
    assert straggler([summarize([], 0), summarize([], 1)]) is None


def _trace() -> dict:
    def worker(input_us: float, wait_us: float) -> list[dict]:
        out = []
        for i in range(5):
            ts = 10000.0 * i
            out += [{"name": "step", "cat": "step", "ph": "X", "tid": 0, "ts": ts, "dur": 10000.0, "args": {"step": i}},
                    {"name": "input", "cat": "input", "ph": "X", "tid": 0, "ts": ts, "dur": input_us},
                    {"name": "stratagem.gradients.sync", "cat": "wait", "ph": "X", "tid": 0,
                     "ts": ts + input_us + 10, "dur": wait_us},
                    {"name": "exchange", "cat": "exchange", "ph": "X", "tid": 1, "ts": ts + 100, "dur": 50.0,
                     "args": {"pack": 0, "bytes": 4096}}]
        return out
    return merge([("worker 1", worker(6000.0, 100.0)), ("worker 0", worker(100.0, 6000.0))])


def test_stratagem_timeline_prints_the_tasks_and_the_straggler(tmp_path, capsys) -> None:
    path = write(_trace(), str(tmp_path / "trace.json"))
    assert main(["timeline", path]) == 0
    out = capsys.readouterr().out
    assert "from 2 tasks with steps" in out and "straggler: worker 1" in out and "waiting for input" in out


def test_stratagem_timeline_refuses_what_is_no_trace(tmp_path, capsys) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"events": []}))
    assert main(["timeline", str(tmp_path / "bad.json")]) == 2
    assert "is not a Chrome trace (JSON)" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "other.json")]) == 2
    assert "no Chrome trace" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed "
                    "(pip install 'stratagem[timeline]')")
def test_stratagem_timeline_draws_a_png(tmp_path) -> None:
    path = write(_trace(), str(tmp_path / "trace.json"))
    assert main(["timeline", path, "--png", str(tmp_path / "trace.png")]) == 0
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_picture_is_refused_naming_the_extra(tmp_path, capsys, monkeypatch) -> None:
    import builtins
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = write(_trace(), str(tmp_path / "trace.json"))
    assert main(["timeline", path, "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install 'stratagem[timeline]'" in capsys.readouterr().err
    assert load(path)["traceEvents"]

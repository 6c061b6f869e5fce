"""The timeline and the straggler table over real worker processes (MultiWorkerMirroredStrategy,
gloo over loopback), and `stratagem launch --timeline`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from stratagem.launch.local import launch_local
from stratagem.observe.chrome import load
from stratagem.testing import run_local_cluster

from .traces import assert_nested, assert_steps_add_up, process_names, spans

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).with_name("timeline_script.py")


def _run(tmp_path: Path, mode: str) -> dict:
    results = run_local_cluster(SCRIPT, 2, args=[str(tmp_path), mode], timeout=200)
    for r in results:
        assert r.returncode == 0 and f"{r.task} done" in r.output, f"{r.task} failed:\n{r.output}"
    return {r.task: r.output for r in results}


def _overlapping_backward(trace: dict, pid: int) -> int:
    """How many packs left while a backward of ``pid`` still ran."""
    backwards = [e for e in spans(trace) if e["pid"] == pid and e["name"] == "backward"]
    packs = [e for e in spans(trace) if e["pid"] == pid and e["name"] == "exchange"]
    assert packs and all(e["args"]["bytes"] > 0 for e in packs)
    return sum(any(b["ts"] < p["ts"] < b["ts"] + b["dur"] for b in backwards) for p in packs)


def test_fit_on_two_workers_writes_one_trace_whose_packs_leave_during_backward(tmp_path) -> None:
    outputs = _run(tmp_path, "fit")
    trace = load(str(tmp_path / "trace.json"))
    names = process_names(trace)
    assert sorted(names.values()) == ["worker 0", "worker 1"]
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 2 * 2 * 12   # 2 workers, 2 epochs of 12 steps
    for pid in names:
        # the packs of the layers backward reached first leave before it ends (the docs' overlap)
        assert _overlapping_backward(trace, pid) >= 24
    assert "step report: 23 steps on 2 workers" in outputs["worker 0"]   # the chief's (its first step left out)
    assert "step report" not in outputs["worker 1"]


def test_a_worker_slowed_in_its_input_pipeline_is_named(tmp_path) -> None:
    outputs = _run(tmp_path, "slow")
    report = outputs["worker 0"][outputs["worker 0"].index("step report"):]
    assert "straggler: worker 1" in report and "waiting for input" in report, report


def test_a_custom_loop_gets_the_report_on_every_worker(tmp_path) -> None:
    outputs = _run(tmp_path, "loop")
    for output in outputs.values():
        assert "step report: 11 steps on 2 workers" in output, output
    trace = load(str(tmp_path / "trace.json"))
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 2 * 12


def test_stratagem_launch_timeline_merges_every_task(tmp_path) -> None:
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "job.json"
    status = launch_local(SCRIPT, ["-", "fit"], num_workers=2, timeline=str(path), stdout=out, stderr=err,
                          join_timeout=200)
    assert status == 0, out.getvalue() + err.getvalue()
    assert f"timeline of 2 tasks written to {path}" in err.getvalue()
    trace = json.loads(path.read_text())
    assert sorted(process_names(trace).values()) == ["worker 0", "worker 1"]
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 2 * 2 * 12

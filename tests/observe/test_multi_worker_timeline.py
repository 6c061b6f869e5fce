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


def test_a_worker_slowed_by_a_cpu_hog_in_its_forward_is_named(tmp_path) -> None:
    outputs = _run(tmp_path, "hog")
    report = outputs["worker 0"][outputs["worker 0"].index("step report"):]
    assert "straggler: worker 1" in report and "its extra time goes to compute" in report, report


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
    # the chief's epochs, each one line of the launcher's (and not the task's marker line)
    assert "[launch] epoch 1/2: 768 samples in" in err.getvalue() and "[launch] epoch 2/2: 768 samples" in err.getvalue()
    assert "stratagem-epoch-summary" not in out.getvalue()
    trace = json.loads(path.read_text())
    assert sorted(process_names(trace).values()) == ["worker 0", "worker 1"]
    assert_nested(trace)
    assert assert_steps_add_up(trace) == 2 * 2 * 12


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _launched(tmp_path: Path, script: Path, args: list[str], **shape) -> dict:
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "job.json"
    status = launch_local(script, args, timeline=str(path), stdout=out, stderr=err, join_timeout=200, **shape)
    assert status == 0, out.getvalue() + err.getvalue()
    trace = load(str(path))
    assert_nested(trace)
    return trace


def test_a_pipelines_micro_batches_are_on_a_lane_per_stage(tmp_path) -> None:
    trace = _launched(tmp_path, EXAMPLES / "pipeline.py", ["--schedule", "gpipe", "--steps", "3"], num_workers=2)
    lanes = {(e["pid"], e["args"]["name"]): e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    for pid, stage in enumerate(("stage 0", "stage 1")):
        on_lane = [e for e in spans(trace) if e["pid"] == pid and e["tid"] == lanes[(pid, stage)]]
        # 3 training steps of 4 micro-batches, forward and backward (and the evaluation's forwards)
        assert sum(e["name"] == "backward" for e in on_lane) == 12, stage
        assert sum(e["name"] == "forward" for e in on_lane) >= 12, stage
        assert {e["args"]["microbatch"] for e in on_lane} == {0, 1, 2, 3}


def test_a_parameter_server_jobs_closures_go_from_the_coordinator_to_the_workers(tmp_path) -> None:
    trace = _launched(tmp_path, EXAMPLES / "train_ps.py", ["--steps", "12"], num_workers=2, num_ps=1)
    names = process_names(trace)
    assert sorted(names.values()) == ["chief 0", "ps 0", "worker 0", "worker 1"]
    by_task = {task: [e for e in spans(trace) if e["pid"] == pid] for pid, task in names.items()}
    sent = [e for e in by_task["chief 0"] if e["name"] == "closure"]
    ran = [e for task in ("worker 0", "worker 1") for e in by_task[task] if e["name"] == "stratagem.ps.closure"]
    assert sent and ran and len(ran) >= len(sent) - 2   # (a worker killed at the end may lose its last second)
    assert any(e["name"] == "stratagem.rpc.handle" for e in by_task["ps 0"])
    # each closure ran on a worker while its dispatcher waited for it (one clock on one machine)
    first = min(ran, key=lambda e: e["ts"])
    assert any(s["ts"] <= first["ts"] and first["ts"] + first["dur"] <= s["ts"] + s["dur"] for s in sent)

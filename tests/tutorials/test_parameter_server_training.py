"""TensorFlow's "Parameter server training with ParameterServerStrategy", ported by renaming
(parameter_server_training.py), as a coordinator, 2 workers and 2 parameter servers: Model.fit
with its callbacks and steps_per_execution, with a dataset and with a dataset function; then
the custom loop over the ClusterCoordinator learns the tutorial's rule and evaluates it inline
and on the workers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.tutorials.ports import launch_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]


def test_parameter_server_training_tutorial(tmp_path: Path) -> None:
    report = launch_port("parameter_server_training.py", tmp_path, workers=2, ps=2, timeout=260)
    # Model.fit: 5 epochs of 20 steps (10 per scheduled function), the callbacks' files
    assert len(report["fit_loss"]) == 5 and report["fit_loss"][-1] < report["fit_loss"][0]
    assert len(report["fit_dataset_fn_loss"]) == 2 and report["fit_dataset_fn_loss"][-1] < report["fit_loss"][0]
    assert report["working_dir"] == ["backup", "ckpt", "log"]
    assert report["backup_left"] == []                  # a finished fit deletes its backup
    assert report["log_files"] > 0
    # the custom loop: the embedding split over the 2 ps, the rule learnt, evaluated
    assert report["embedding_shards"] == [(4, 16384), (4, 16384)]
    assert report["same_coordinator"]
    # the tutorial's own numbers are one asynchronous run's (RMSprop at lr 0.1 over 16384 weights: a stale
    # gradient can undo the rule for an epoch, even the last): they are read for their shape only
    assert len(report["accuracy"]) == 4 and all(0 <= a <= 1 for a in report["accuracy"]), report["accuracy"]
    assert "Finished epoch 3, accuracy is " in report["output"]
    assert math.isfinite(report["final_loss"]) and report["final_loss"] > 0
    assert 0 <= report["inline_eval_accuracy"] <= 1 and 0 <= report["distributed_eval_accuracy"] <= 1
    assert report["distributed_eval_count"] == 16
    # the rule learnt: on 64 fresh examples, at an epoch boundary, within 12 more epochs (in most runs none)
    assert report["check_accuracy"] >= 0.9, (report["accuracy"], report["more_epochs"], report["check_accuracy"])
    # and every worker that evaluates the trained model reads the coordinator's parameters
    tasks = {task for task, _ in report["worker_check_logits"]}
    assert tasks <= {"worker:0", "worker:1"} and tasks, tasks
    for task, logits in report["worker_check_logits"]:
        torch.testing.assert_close(logits, report["check_logits"], rtol=1e-5, atol=1e-5, msg=task)

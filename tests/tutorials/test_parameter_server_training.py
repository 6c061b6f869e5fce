"""TensorFlow's "Parameter server training with ParameterServerStrategy", ported by renaming
(parameter_server_training.py), as a coordinator, 2 workers and 2 parameter servers: Model.fit
with its callbacks and steps_per_execution, with a dataset and with a dataset function; then
the custom loop over the ClusterCoordinator learns the tutorial's rule and evaluates it inline
and on the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    assert report["accuracy"][-1] >= 0.9, report["accuracy"]
    assert 0 < report["final_loss"] < 2   # one asynchronous step's loss: it varies from run to run
    assert report["inline_eval_accuracy"] >= 0.9 and report["distributed_eval_accuracy"] >= 0.9
    assert "Finished epoch 3, accuracy is " in report["output"]

"""TensorFlow's "Distributed training with Keras", ported by renaming (keras_mirrored.py): fit with
the tutorial's callbacks learns, the learning rate follows the schedule, the latest checkpoint's
weights are the trained ones, and the saved model evaluates the same without the strategy and
under it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tutorials.ports import run_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.usefixtures("forked_launches")]


def test_keras_tutorial(tmp_path: Path) -> None:
    report = run_port("keras_mirrored.py", tmp_path)
    loss, accuracy = report["history"]["loss"], report["history"]["accuracy"]
    assert len(loss) == 5 and loss[-1] < loss[0] and accuracy[-1] > 0.9, report["history"]
    assert report["checkpoints"] == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4", "ckpt_5"]
    assert report["logs"] > 0
    printed = [float(rate) for rate in re.findall(r"Learning rate for epoch \d is (\S+)", report["output"])]
    assert printed == [1e-3, 1e-3, 1e-3, 1e-4, 1e-5], printed
    assert report["loaded_equal"]
    eval_loss, eval_acc = report["eval"]
    assert eval_acc > 0.9
    for name, replicas in (("unreplicated", 1), ("replicated", 2)):
        loss, acc, count = report[name]
        assert count == replicas and acc == eval_acc and abs(loss - eval_loss) < 1e-5, (name, report[name])

"""What ``sg.experimental.plan`` refuses before any process starts, each error naming the fix."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.errors import InvalidArgumentError
from stratagem.experimental.planning.request import make_optimizer

from . import models

SAMPLE = models.mlp_batch(4)


@pytest.mark.parametrize("change, match", [
    ({"model_fn": models.mlp()}, "model_fn must be a function that builds the model"),
    ({"sample_batch": torch.randn(4, 16)}, r"sample_batch must be \(inputs, target\)"),
    ({"sample_batch": (torch.randn(4, 16), torch.randn(3, 4))}, "same number of rows"),
    ({"devices_or_cluster": 0}, "devices_or_cluster must be a number of local processes"),
    ({"devices_or_cluster": True}, "devices_or_cluster must be"),
    ({"devices_or_cluster": "tpu"}, "devices_or_cluster must be"),
    ({"global_batch": 0}, "global_batch must be a positive int"),
    ({"optimizer": "lamb"}, r"optimizer must be one of \['adam', 'adamw', 'momentum', 'sgd'\]"),
    ({"memory_limit": -1}, "memory_limit must be None or bytes per process"),
    ({"memory_limit": "4GB"}, "memory_limit must be None or bytes per process"),
    ({"time_budget_s": 0}, "time_budget_s must be a positive number"),
    ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ({"tensor_plan": {"0": "diagonal"}}, "tensor_plan must be None or a dict of module names"),
    ({"num_measured": 0}, "num_measured must be a positive int or None"),
    ({"steps": None}, "steps must be a positive int"),
])
def test_bad_requests_are_refused_naming_the_fix(change, match) -> None:
    request = {"model_fn": models.mlp, "sample_batch": SAMPLE, "devices_or_cluster": 2, "global_batch": 8}
    request.update(change)
    args = [request.pop(k) for k in ("model_fn", "sample_batch", "devices_or_cluster")]
    with pytest.raises(InvalidArgumentError, match=match):
        sg.experimental.plan(*args, **request)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without GPUs")
def test_cuda_without_gpus_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="torch sees none"):
        sg.experimental.plan(models.mlp, SAMPLE, "cuda", global_batch=8)


def test_named_optimizers_and_a_function() -> None:
    params = list(models.mlp().parameters())
    assert isinstance(make_optimizer("adam", params), torch.optim.Adam)
    assert make_optimizer("momentum", params).param_groups[0]["momentum"] == 0.9
    assert isinstance(make_optimizer(lambda p: torch.optim.SGD(p, lr=1.0), params), torch.optim.SGD)

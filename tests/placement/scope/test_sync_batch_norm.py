"""BatchNorm under replicas in one process: ``torch.nn.SyncBatchNorm`` trains to plain PyTorch's
whole-batch result (parameters and running statistics, float64, uneven batches) under
``MirroredStrategy``, ``CentralStorageStrategy`` and through ``sg.Model.fit``; plain BatchNorm
normalizes per replica and says so once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import InvalidArgumentError

from . import batch_norm_model


def _assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("make", [lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"])], ids=["mirrored", "central"])
def test_sync_batch_norm_trains_to_plain_pytorch_on_the_whole_batch(make) -> None:
    strategy = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sg.nn.BatchNormWarning)   # SyncBatchNorm: nothing to say
        model = batch_norm_model.train(strategy, sync=True)
    assert type(model.bn).__name__ == "SyncBatchNorm" and isinstance(model.bn, nn.SyncBatchNorm)
    _assert_equal_states(batch_norm_model.state(model), batch_norm_model.train_plain())


def test_sync_batch_norm_through_fit() -> None:
    module = batch_norm_model.fit(sg.MirroredStrategy(["cpu:0", "cpu:1"]))
    _assert_equal_states(batch_norm_model.state(module), batch_norm_model.train_plain())


def test_sync_batch_norm_eval_uses_the_running_statistics_and_outside_run_is_the_whole_batch() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        sync = batch_norm_model.build(True)
    plain = batch_norm_model.build(False)
    x, _ = batch_norm_model.data()[0]
    torch.testing.assert_close(sync(x), plain(x))   # training mode, outside run: this process's batch
    sync.eval(), plain.eval()
    torch.testing.assert_close(sync(x), plain(x))
    _assert_equal_states(batch_norm_model.state(sync), batch_norm_model.state(plain))


def test_plain_batch_norm_under_replicas_warns_once() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.warns(sg.nn.BatchNormWarning) as caught:
        model = batch_norm_model.train(strategy, sync=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, sg.nn.BatchNormWarning)]
    assert len(messages) == 1, messages
    assert "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)" in messages[0]
    assert "BatchNorm2d" in messages[0]
    # per replica by design: not plain PyTorch's whole-batch result
    plain = batch_norm_model.train_plain()
    assert (batch_norm_model.state(model)["bn.running_mean"] - plain["bn.running_mean"]).abs().max() > 1e-3


def test_plain_batch_norm_is_per_replica_with_averaged_buffers() -> None:
    with pytest.warns(sg.nn.BatchNormWarning):
        model = batch_norm_model.train(sg.MirroredStrategy(["cpu:0", "cpu:1"]), sync=False)
    _assert_equal_states(batch_norm_model.state(model), batch_norm_model.train_per_replica(2))


def test_sync_batch_norm_is_refused_under_tensor_parallel_at_its_first_training_forward() -> None:
    strategy = sg.experimental.TensorParallelStrategy(plan={"0": "colwise"})   # a 1 x 1 mesh
    try:
        with strategy.scope():
            model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
        model.eval()
        strategy.run(model, args=(torch.randn(6, 4),))   # eval: the running statistics, nothing to combine
        model.train()
        with pytest.raises(InvalidArgumentError, match=r"torch.nn.SyncBatchNorm cannot combine.*torch.nn.LayerNorm"):
            strategy.run(model, args=(torch.randn(6, 4),))
    finally:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
            torch.distributed.destroy_process_group()   # (the 1 x 1 mesh's group: later tests find none)

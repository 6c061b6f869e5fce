"""Which GPUs a MultiWorkerMirroredStrategy worker takes when no devices are given: the CUDA paths
run here with the visible GPU count patched (no GPU needed), the choice itself is what is tested."""

from __future__ import annotations

import pytest
import torch

from stratagem.errors import InvalidArgumentError
from stratagem.strategies import multi_worker
from stratagem.strategies.multi_worker import gpu_share


class TorchrunClusterResolver:   # (matched by name, as the strategy does)
    def __init__(self, local_rank: int, local_world_size: int | None = None):
        self.local_rank, self.local_world_size = local_rank, local_world_size


class TFConfigResolver:
    pass


@pytest.mark.parametrize("count,rank,world,expected", [
    (8, None, None, [0, 1, 2, 3, 4, 5, 6, 7]),   # alone, or nothing says: every GPU (TensorFlow's)
    (8, 0, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
    (8, 1, 4, [2, 3]), (8, 3, 4, [6, 7]),          # an even share each
    (4, 2, 4, [2]), (6, 1, 4, [1]),               # one each (the rest unused: not an even share)
    (2, 3, 4, [1]), (1, 1, 2, [0]),               # more processes than GPUs: shared round-robin
])
def test_gpu_share_splits_the_host_s_gpus_between_its_worker_processes(count, rank, world, expected) -> None:
    assert list(gpu_share(count, rank, world)) == expected


def test_no_two_workers_of_a_host_take_the_same_gpu_when_there_are_enough() -> None:
    for count in range(1, 9):
        for world in range(1, count + 1):
            taken = [i for rank in range(world) for i in gpu_share(count, rank, world)]
            assert len(taken) == len(set(taken)) and all(0 <= i < count for i in taken)


def test_a_local_rank_outside_the_local_world_is_refused_naming_both() -> None:
    with pytest.raises(InvalidArgumentError, match="LOCAL_RANK=4 is outside LOCAL_WORLD_SIZE=4"):
        gpu_share(8, 4, 4)


def test_default_devices_follow_the_launcher_s_local_rank(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [str(d) for d in multi_worker._default_worker_devices(TFConfigResolver())] == ["cuda:2", "cuda:3"]
    # torchrun: a DDP script's device, cuda:LOCAL_RANK, whatever the count
    assert [str(d) for d in multi_worker._default_worker_devices(TorchrunClusterResolver(1, 2))] == ["cuda:1"]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert len(multi_worker._default_worker_devices(TFConfigResolver())) == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert [str(d) for d in multi_worker._default_worker_devices(TFConfigResolver())] == ["cpu:0"]

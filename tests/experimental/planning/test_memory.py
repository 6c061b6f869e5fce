"""The memory model: Ψ_r by stages and plan, the bytes of each ZeRO stage, storages counted once."""

from __future__ import annotations

import pytest
import torch

from stratagem.experimental.planning.memory import block_parameters, model_states, rank_parameters, storage_bytes

from . import models


def test_rank_parameters_by_stage_and_plan() -> None:
    model = models.transformer()
    whole = sum(q.numel() for q in model.parameters())
    assert sum(rank_parameters(model, [(0, 4)], None, 1)) == whole
    assert sum(rank_parameters(model, [(0, 2), (2, 4)], None, 1)) == whole
    block = sum(q.numel() for q in model[1].parameters())
    # split over 2: q, k (no bias), v and the first MLP layer (weights and biases), out and the second MLP
    # layer (weights)
    w = models.WIDTH
    split = 3 * w * w + 2 * w + (w * 4 * w + 4 * w) + w * w + 4 * w * w
    [one] = rank_parameters(model, [(1, 2)], models.TRANSFORMER_PLAN, 2)
    assert one == block - split / 2


def test_a_model_that_is_not_sequential_is_one_stage() -> None:
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)

        def forward(self, x):
            return self.b(self.a(x))
    assert rank_parameters(Two(), [(0, 1)], None, 1) == [26.0]


@pytest.mark.parametrize("sharding, want", [(None, (800, 800, 1600)), ("optimizer", (800, 800, 400)),
                                             ("gradients", (800, 800, 400)), ("parameters", (200, 200, 400))])
def test_model_states_under_each_zero_stage(sharding, want) -> None:
    assert model_states(100, data=4, sharding=sharding, element_size=8, state_per_parameter=16) == want


def test_storage_bytes_counts_each_storage_once() -> None:
    a = torch.zeros(10, dtype=torch.float64)
    assert storage_bytes([a, a[2:], None, torch.zeros(3, device="meta")]) == 80


def test_split_gradients_held_twice_under_a_data_axis() -> None:
    # a model axis and a data axis on one stage: the pack's copy and the DTensor gradient over its sum
    mlp = models.mlp()
    split = block_parameters(mlp, models.MLP_PLAN, 2, split_only=True)
    assert split == [(16 * 64 + 64) / 2, 0.0, 64 * 64 / 2, 0.0, 0.0]
    assert model_states(10, data=2, sharding=None, element_size=8, state_per_parameter=16, copied=4) == (80, 112, 160)

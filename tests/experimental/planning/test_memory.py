"""The memory model: Ψ_r by stages and plan, the bytes of each ZeRO stage, storages counted once, what a
forward saves, a schedule's peak."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stratagem.experimental.planning.activations import saved_bytes
from stratagem.experimental.planning.memory import (gather_bytes, model_states, rank_parameters, schedule_peak,
                                                    storage_bytes, unit_shapes)

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


def test_what_each_block_saves_counted_once_and_split_by_the_plan() -> None:
    mlp = models.mlp()
    x, y = models.mlp_batch(8)
    got = saved_bytes(mlp, [str(i) for i in range(5)], list(mlp), (x,), models.MLP_PLAN, y, F.mse_loss)
    # Linear(16, 64) saves its input (whole: a colwise layer's input is not split); the ReLU after it its
    # output (split: between the colwise layer and the rowwise one), which Linear(64, 64) saves too; the second
    # ReLU its output, which the last layer saves too; the loss its target (the output is held anyway)
    assert got.whole == [16 * 8, 0, 0, 64 * 8, 0] and got.split == [0, 64 * 8, 0, 0, 0]
    assert got.saves_input == [True, False, True, False, True]
    assert got.saves_output == [False, True, False, True, False]
    assert got.loss == 4 * 8


def test_the_schedule_peak_points() -> None:
    saved, io, grads = [100.0, 10.0], 5.0, [50.0, 500.0]
    # 1F1B with more micro-batches than in flight: the next forward while the gradients are there
    assert schedule_peak(saved, io, grads, in_flight=2, microbatches=4, recompute=False) == 2 * 115 + 550
    # recomputation: a micro-batch in flight holds its input and output; its backward saves the stage again
    assert schedule_peak(saved, io, grads, in_flight=2, microbatches=2, recompute=True) == 5 + 110 + 550
    # ZeRO-3: the last block's forward, everything saved and its parameters gathered
    assert schedule_peak(saved, 0.0, [5.0, 50.0], in_flight=1, microbatches=1, recompute=False,
                         gathered=[10.0, 100.0]) == 110 + 100


def test_zero3_under_1f1b_a_forward_after_a_backward_reshards_what_it_runs() -> None:
    # two blocks saving 10 and 100 bytes, their parameters 200 and 20 whole (gradients as many), io 5: the first
    # backward leaves both whole; the next forward reshards block 0 once it ends (its gradient stays), so the
    # most is block 0 running: 10 saved + 220 whole + 220 of gradients -- not all saved with all whole
    saved, blocks = [10.0, 100.0], [200.0, 20.0]
    zero3 = dict(recompute=False, gathered=blocks, regathered=blocks)
    grads = [2 * b for b in blocks]
    assert schedule_peak(saved, 5.0, grads, in_flight=1, microbatches=2, **zero3) == 5 + 10 + 220 + 220
    # two in flight (the first pipe rank of two, 4 micro-batches): the other one's saved bytes and io besides
    assert schedule_peak(saved, 5.0, grads, in_flight=2, microbatches=4, **zero3) == 115 + 5 + 10 + 220 + 220
    # every micro-batch in flight (no forward after a backward): the last backward with everything whole
    assert schedule_peak(saved, 5.0, grads, in_flight=2, microbatches=2, **zero3) == 5 + 110 + 440


def test_gather_buffer_pads_each_parameter_to_the_data_axis() -> None:
    # FSDP gathers a unit as one buffer, each parameter's rows padded to a multiple of d: Linear(4, 10) over 4
    # processes is 12 x 4 + 12 elements, over 2 exactly its 50
    assert gather_bytes([(10, 40), (10, 10)], data=4, element_size=8) == 8 * (48 + 12)
    assert gather_bytes([(10, 40), (10, 10)], data=2, element_size=8) == 8 * 50
    # the units ZeRO-3 makes of the tests' transformer: one a block; under a model axis of 2 a colwise layer's
    # rows and a rowwise layer's columns are split
    shapes = unit_shapes(models.transformer(), models.TRANSFORMER_PLAN, 2)
    assert [len(units) for units in shapes] == [1, 1, 1, 1]
    w = models.WIDTH
    [block] = shapes[1]
    assert (w / 2, w * w / 2) in block and (w, w * w / 2) in block   # attn.q's weight, attn.out's
    assert sum(n for _, n in block) == rank_parameters(models.transformer(), [(1, 2)], models.TRANSFORMER_PLAN, 2)[0]


# ZeRO-3's all-gather buffers (``staged``): FSDP keeps the buffer a forward gathered a unit into until the next
# gather; a backward that gathers prefetches the unit before; a replay's units free their own as they end
def test_zero3_a_forward_that_gathers_keeps_the_running_units_buffer() -> None:
    blocks = [10.0, 300.0]
    got = schedule_peak([1000.0, 10.0], 0.0, [20.0, 400.0], in_flight=1, microbatches=1, recompute=False,
                        gathered=blocks, regathered=blocks, staged=blocks)
    assert got == 1010 + 300 + 300   # block 1 running: everything saved, its parameters whole, its buffer


def test_zero3_a_backward_that_gathers_holds_the_block_befores_prefetched_buffer() -> None:
    blocks = [100.0, 100.0, 100.0]
    got = schedule_peak([10.0, 500.0, 10.0], 0.0, [200.0] * 3, in_flight=1, microbatches=1, recompute=False,
                        gathered=blocks, regathered=blocks, staged=blocks)
    # block 1's backward: blocks 0 and 1 saved, block 2's parameters and gradient, block 1 whole, block 0's buffer
    assert got == 510 + 200 + 100 + 100


def test_zero3_a_replay_holds_the_running_units_buffer_and_the_prefetched_one() -> None:
    blocks = [100.0, 100.0, 100.0]
    got = schedule_peak([50.0, 50.0, 5.0], 0.0, [10.0] * 3, in_flight=1, microbatches=1, recompute=True,
                        gathered=blocks, regathered=blocks, staged=blocks)
    # the last block's backward gathered it and prefetched block 1; the replay at block 1: blocks 0 and 1 saved
    # again, all three whole, block 1's buffer (the prefetched one, now its own); at block 0 both buffers but
    # less saved; complete, no buffer (each replayed unit freed its own as it ended)
    assert got == 100 + 300 + 100


def test_zero3_under_1f1b_the_backward_after_a_resharding_forward_prefetches() -> None:
    # as test_zero3_under_1f1b_a_forward_after_a_backward_reshards_what_it_runs, with the buffers: the backward
    # after that forward, at block 1: block 1 gathered again, block 0's buffer prefetched, every gradient
    saved, blocks = [10.0, 100.0], [200.0, 20.0]
    got = schedule_peak(saved, 5.0, [400.0, 40.0], in_flight=1, microbatches=2, recompute=False, gathered=blocks,
                        regathered=blocks, staged=blocks)
    assert got == 5 + 110 + 20 + 200 + 440 - 220


def test_the_meter_refuses_a_torch_whose_fsdp_hides_its_gather_buffers() -> None:
    from types import SimpleNamespace

    from stratagem.experimental.planning.peak import gather_buffers, gathered

    class Unit(torch.nn.Module):   # FSDP2's face as the meter reads it, without the attributes it counts
        def _get_fsdp_state(self):
            return SimpleNamespace(_fsdp_param_group=SimpleNamespace())
    with pytest.raises(RuntimeError, match="all-gather buffers .* uncounted"):
        gather_buffers([Unit()])
    with pytest.raises(RuntimeError, match="fsdp_params .* uncounted"):
        gathered([Unit()])
    # a module without FSDP has none
    assert gather_buffers([torch.nn.Linear(2, 2)]) == [] == gathered([torch.nn.Linear(2, 2)])

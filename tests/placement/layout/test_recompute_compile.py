"""Activation recomputation (``torch.utils.checkpoint``) and ``torch.compile`` on models created in a
strategy's scope train exactly as plain single-device PyTorch does (float64), on replica threads
that each compute with their own copies of the parameters.

The two-worker cases are in ``tests/placement/layout/test_multi_worker_recompute_compile.py``.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import stratagem as sg
from . import tiny_gpt

pytestmark = pytest.mark.timeout(120)

STRATEGIES: dict[str, Callable[[], sg.Strategy]] = {
    "mirrored": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    # the path GPUs take (see tests/strategies/test_equivalence.py): every replica, the first too, computes
    # with a copy of its own, refreshed after each update
    "central_storage_copies": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def make_strategy(kind: str, monkeypatch: pytest.MonkeyPatch) -> sg.Strategy:
    if kind == "central_storage_copies":
        monkeypatch.setattr("stratagem.placement.data_axis.central._same_memory", lambda device, home: False)
    return STRATEGIES[kind]()
EXACT = 1e-12        # checkpointing recomputes the same float64 operations
COMPILED = 1e-9      # inductor fuses float64 operations in another order than eager PyTorch


def train(strategy: sg.Strategy, batch_sizes: list[int], *, tolerance: float, recompute: str | None = None,
          shared_blocks: bool = False, compile_model: bool = False, compile_step: bool = False,
          clip: float | None = None, after_each_step: Callable[[int], None] = lambda step: None,
          compile_options: dict | None = None) -> None:
    """Train TinyGPT in ``strategy`` and compare the loss, every parameter and the gradient norm
    ``clip_grad_norm_`` returns (with ``clip``) with plain PyTorch (no recomputation, not
    compiled) after every step."""
    batches = tiny_gpt.make_batches(batch_sizes)
    expected = tiny_gpt.plain_history(tiny_gpt.make_model(shared_blocks=shared_blocks), batches, clip=clip)
    with strategy.scope():
        model = tiny_gpt.make_model(recompute=recompute, shared_blocks=shared_blocks)
        optimizer = tiny_gpt.make_optimizer(model)
    forward = torch.compile(model, options=compile_options) if compile_model else model

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(tiny_gpt.per_example_loss(forward(x), y))
        optimizer.zero_grad()
        loss.backward()
        # each replica's backward reached its own copies of the parameters (on logical CPU
        # devices they share memory: gradients sent to another replica's copy would show here)
        own_gradients = all(p.grad is not None for p in model.parameters())
        norm = None
        if clip is not None:   # the gradients are the global batch's: the norm is plain PyTorch's
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss.detach(), own_gradients, norm

    if compile_step:
        step = torch.compile(step)
    for i, (batch, want) in enumerate(zip(strategy.experimental_distribute_dataset(batches), expected)):
        losses, own_gradients, norms = strategy.run(step, args=(batch,))
        assert all(strategy.experimental_local_results(own_gradients)), i
        loss = strategy.reduce("sum", losses, axis=None)
        assert loss.item() == pytest.approx(want["loss"], rel=tolerance), f"step {i}"
        if clip is not None:
            assert want["norm"] > clip, "the test should clip"
            for replica, norm in enumerate(strategy.experimental_local_results(norms)):
                assert norm.item() == pytest.approx(want["norm"], rel=tolerance), f"step {i}, replica {replica}"
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, want["params"][name], rtol=tolerance, atol=tolerance,
                                       msg=lambda m: f"step {i}, {name}: {m}")
        after_each_step(i)


# the loop as written without a strategy: zero_grad, backward, step; and with clip_grad_norm_
# between backward and step (the gradient norm is about 5: clipping to 2 always acts)
LOOPS = pytest.mark.parametrize("clip", [None, 2.0], ids=["textbook", "clipped"])


@LOOPS
@pytest.mark.parametrize("recompute", ["nonreentrant", "reentrant"])
@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_checkpointed_blocks_match_plain_pytorch(kind: str, recompute: str, clip: float | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 rows over 2 replicas: an uneven last batch
    train(make_strategy(kind, monkeypatch), [8, 8, 5], tolerance=EXACT, recompute=recompute, clip=clip)


@LOOPS
def test_reentrant_checkpoint_of_a_block_used_twice(clip: float | None) -> None:
    """One block applied twice: its parameters get gradients from two nested backward passes,
    each of which ends (and sums the gradients it accumulated) before the outer one does."""
    train(STRATEGIES["mirrored"](), [8, 8, 5], tolerance=EXACT, recompute="reentrant", shared_blocks=True,
          clip=clip)


def _count_compiled_graphs() -> Callable[[int], None]:
    """Start from an empty dynamo cache; the check run after each step: every replica thread
    compiled the model once at the first step, and nothing was compiled again after it (a
    recompilation at every step ends in a silent fallback to eager)."""
    torch._dynamo.reset()
    counters.clear()
    seen: list[int] = []

    def check(step: int) -> None:
        seen.append(counters["stats"]["unique_graphs"])
        assert seen[0] > 0, "nothing was compiled"
        assert seen[-1] == seen[0], f"recompiled after the first step: graphs per step {seen}"
    return check


@pytest.mark.timeout(600)
def test_compiled_model_under_mirrored() -> None:
    check = _count_compiled_graphs()
    train(STRATEGIES["mirrored"](), [8, 8, 8], tolerance=COMPILED, compile_model=True, after_each_step=check)
    assert counters["stats"]["unique_graphs"] == 2    # one graph per replica thread: each its own parameters


@pytest.mark.timeout(600)
def test_compiled_model_with_the_cpp_wrapper_under_mirrored() -> None:
    """Inductor's C++ wrapper (each compiled graph runs with the GIL released, so the replica threads'
    graphs run at once: the form docs/guarantees.md advises for CPU replicas) trains as plain PyTorch."""
    check = _count_compiled_graphs()
    train(STRATEGIES["mirrored"](), [8, 8, 8], tolerance=COMPILED, compile_model=True, after_each_step=check,
          compile_options={"cpp_wrapper": True}, clip=2.0)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["central_storage", "central_storage_copies"])
def test_compiled_checkpointed_model_under_central_storage(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's order: blocks checkpointed, then the model compiled."""
    check = _count_compiled_graphs()
    train(make_strategy(kind, monkeypatch), [8, 8, 8], tolerance=COMPILED, recompute="nonreentrant",
          compile_model=True, after_each_step=check)


@pytest.mark.timeout(600)
def test_compiled_training_step_under_mirrored() -> None:
    """``torch.compile`` of the whole step: forward, loss and clipping compiled; zero_grad,
    backward (with the strategy's gradient hooks) and the strategy's optimizer step run eagerly
    (graph breaks, as zero_grad and backward are in plain PyTorch too)."""
    check = _count_compiled_graphs()
    train(STRATEGIES["mirrored"](), [8, 8, 8], tolerance=COMPILED, compile_step=True, clip=2.0,
          after_each_step=check)

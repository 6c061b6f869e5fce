"""Row-sparse updates against torch.optim: touched rows as the dense optimizer, others untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stratagem.errors import InvalidArgumentError
from stratagem.ps import ParameterServer

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1,
                           "initial_accumulator_value": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05, "maximize": True}),
]
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for cls, kw in OPTIMIZERS]


def _table_ps(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
              init: torch.Tensor) -> ParameterServer:
    ps = ParameterServer()
    ps.create("table", init, (cls, kwargs))
    return ps


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=IDS)
def test_touched_rows_follow_torch_optim_and_the_others_do_not_move(
        cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    init = torch.randn(12, 3)
    ps = _table_ps(cls, kwargs, init)
    rows = torch.tensor([2, 5, 9])
    reference = torch.nn.Parameter(init[rows].clone())   # the dense optimizer on those rows only
    optimizer = cls([reference], **kwargs)
    for _ in range(5):
        grads = torch.randn(3, 3)
        halves = grads / 2
        # Shuffled, and row 5 split in two halves: repeats are summed.
        ps.push_rows("table", torch.tensor([9, 5, 2, 5]), torch.stack([grads[2], halves[1], grads[0], halves[1]]))
        reference.grad = torch.stack([grads[0], halves[1] + halves[1], grads[2]])
        optimizer.step()
    table = ps.pull(["table"])["table"]
    torch.testing.assert_close(table[rows], reference.detach(), rtol=0, atol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(table[untouched], init[untouched])
    state = ps.get_state()["table"]["optimizer_state"]["state"][0]
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape[:1] == (12,) and key != "row_step":
            initial = kwargs.get("initial_accumulator_value", 0.0) if key == "sum" else 0.0
            assert torch.all(value[untouched] == initial), key
    assert state.get("row_step", torch.zeros(12, dtype=torch.int64))[untouched].eq(0).all()


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS[1:], ids=IDS[1:])
def test_each_row_evolves_as_if_stepped_only_when_touched(
        cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    torch.manual_seed(1)
    init = torch.randn(6, 4)
    ps = _table_ps(cls, kwargs, init)
    references = [torch.nn.Parameter(init[row:row + 1].clone()) for row in range(6)]
    optimizers = [cls([reference], **kwargs) for reference in references]
    schedule = [[0, 1, 2], [1], [1, 3], [0, 1, 5], [3], [1, 2, 3]]   # rows end with 2..5 steps
    for rows in schedule:
        grads = torch.randn(len(rows), 4)
        ps.push_rows("table", rows, grads)
        for row, grad in zip(rows, grads):
            references[row].grad = grad[None]
            optimizers[row].step()
    table = ps.pull(["table"])["table"]
    for row in range(6):
        torch.testing.assert_close(table[row:row + 1], references[row].detach())
    assert torch.equal(table[4], init[4])


def test_plain_sgd_sparse_push_equals_a_dense_push_with_zeros_elsewhere() -> None:
    init = torch.randn(20, 5)
    sparse, dense = (_table_ps(torch.optim.SGD, {"lr": 0.3}, init) for _ in range(2))
    rows, grads = torch.tensor([3, 17, 3]), torch.randn(3, 5)
    sparse.push_rows("table", rows, grads)
    full = torch.zeros(20, 5).index_add_(0, rows, grads)
    dense.push({"table": full})
    assert torch.equal(sparse.pull(["table"])["table"], dense.pull(["table"])["table"])


def test_a_dense_step_then_a_sparse_step_share_the_optimizer_state() -> None:
    torch.manual_seed(2)
    init = torch.randn(8, 2)
    ps = _table_ps(torch.optim.Adam, {"lr": 0.05}, init)
    rows = torch.tensor([1, 6])
    reference = torch.nn.Parameter(init[rows].clone())
    optimizer = torch.optim.Adam([reference], lr=0.05)
    first, second = torch.randn(8, 2), torch.randn(2, 2)
    ps.push({"table": first})
    ps.push_rows("table", rows, second)
    for grad in (first[rows], second):
        reference.grad = grad
        optimizer.step()
    torch.testing.assert_close(ps.pull(["table"])["table"][rows], reference.detach(), rtol=0, atol=0)


def test_unsupported_optimizers_and_empty_pushes() -> None:
    ps = _table_ps(torch.optim.RMSprop, {"lr": 0.1}, torch.zeros(4, 2))
    with pytest.raises(InvalidArgumentError, match="support torch.optim.SGD, torch.optim.Adagrad.*RMSprop"):
        ps.push_rows("table", [0], torch.ones(1, 2))
    ps.push({"table": torch.ones(4, 2)})                    # dense pushes still work
    sgd = _table_ps(torch.optim.SGD, {"lr": 1.0}, torch.zeros(4, 2))
    sgd.push_rows("table", torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    assert torch.equal(sgd.pull(["table"])["table"], torch.zeros(4, 2))

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


class _MyAdam(torch.optim.Adam):
    """A user's subclass: its step() may differ from Adam's, so it gets no row rule."""


DENSE_OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1}),
    (torch.optim.Adadelta, {"lr": 0.5}),
    (torch.optim.NAdam, {"lr": 0.01}),
    (_MyAdam, {"lr": 0.01}),
]
DENSE_IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for cls, kw in DENSE_OPTIMIZERS]


def _dense_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "stratagem.ps" and "has no row-sparse update" in r.getMessage()]


@pytest.mark.parametrize(("cls", "kwargs"), DENSE_OPTIMIZERS, ids=DENSE_IDS)
def test_an_optimizer_without_a_row_rule_takes_the_dense_step_and_warns_once(
        cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(3)
    init = torch.randn(10, 3)
    ps = _table_ps(cls, kwargs, init)
    reference = torch.nn.Parameter(init.clone())   # plain PyTorch: nn.Embedding(sparse=False)
    optimizer = cls([reference], **kwargs)
    schedule = [[2, 5, 2], [7], [5, 5, 0], [2, 9], [1, 2, 1, 2]]   # repeated rows, rows left alone
    for rows in schedule:
        ids = torch.tensor(rows)
        grads = torch.randn(len(rows), 3)
        ps.push(rows=[("table", ids, grads)])
        reference.grad = torch.zeros(10, 3).index_add_(0, ids, grads)
        optimizer.step()
    torch.testing.assert_close(ps.pull(["table"])["table"], reference.detach())
    [message] = _dense_warnings(caplog)   # logged once, on the ps
    assert f"{cls.__name__} has no row-sparse update" in message
    assert "'table' on ps" in message and "(10, 3)" in message and "whole table" in message
    assert "proportional to the table's 10 rows" in message and "SGD, Adagrad, Adam, AdamW" in message
    assert "separate optimizer" in message


def test_dense_row_updates_restore_from_a_checkpoint() -> None:
    torch.manual_seed(4)
    spec = (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5})
    ps = ParameterServer(name="ps 0")
    ps.create("table", torch.randn(6, 2), spec)
    pushes = [(torch.tensor(rows), torch.randn(len(rows), 2)) for rows in ([1, 4], [4], [0, 1, 1], [5])]
    for ids, grads in pushes[:2]:
        ps.push_rows("table", ids, grads)
    saved = ps.get_state()
    restored = ParameterServer(name="ps 1")
    restored.set_state(saved)
    for server in (ps, restored):
        for ids, grads in pushes[2:]:
            server.push_rows("table", ids, grads)
    assert torch.equal(ps.pull(["table"])["table"], restored.pull(["table"])["table"])
    state = saved["table"]["optimizer_state"]["state"][0]
    assert state["square_avg"].shape == (6, 2) and "row_step" not in state


def test_sparse_adam_gets_the_sparse_gradient_of_nn_embedding_sparse_true(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(5)
    init = torch.randn(8, 4)
    ps = _table_ps(torch.optim.SparseAdam, {"lr": 0.05}, init)
    plain = torch.nn.Embedding(8, 4, sparse=True, _weight=init.clone())
    optimizer = torch.optim.SparseAdam(plain.parameters(), lr=0.05)
    for rows in ([1, 3, 1], [6], [3, 0]):
        ids = torch.tensor(rows)
        grads = torch.randn(len(rows), 4)
        ps.push_rows("table", ids, grads)
        optimizer.zero_grad()
        plain(ids).backward(grads)
        optimizer.step()
    assert not _dense_warnings(caplog)
    table = ps.pull(["table"])["table"]
    torch.testing.assert_close(table, plain.weight.detach())
    assert torch.equal(table[[2, 4, 5, 7]], init[[2, 4, 5, 7]])


def test_empty_pushes_change_nothing() -> None:
    for cls in (torch.optim.SGD, torch.optim.RMSprop):
        ps = _table_ps(cls, {"lr": 1.0}, torch.zeros(4, 2))
        ps.push_rows("table", torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
        assert torch.equal(ps.pull(["table"])["table"], torch.zeros(4, 2))


def test_a_complex_table_takes_dense_steps_with_any_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    init = torch.randn(5, 2, dtype=torch.complex64)
    ps = _table_ps(torch.optim.Adam, {"lr": 0.1}, init)
    reference = torch.nn.Parameter(init.clone())
    optimizer = torch.optim.Adam([reference], lr=0.1)
    ids, grads = torch.tensor([3, 1, 3]), torch.randn(3, 2, dtype=torch.complex64)
    ps.push_rows("table", ids, grads)
    assert "Adam has no row-sparse update" in _dense_warnings(caplog)[0]
    reference.grad = torch.zeros(5, 2, dtype=torch.complex64).index_add_(0, ids, grads)
    optimizer.step()
    torch.testing.assert_close(ps.pull(["table"])["table"], reference.detach())


def test_an_optimizer_that_needs_a_closure_is_refused_with_the_reason() -> None:
    ps = ParameterServer(name="ps 0")
    with pytest.raises(InvalidArgumentError, match="LBFGS.step needs a closure that recomputes the loss"):
        ps.create("w", torch.zeros(3), (torch.optim.LBFGS, {"lr": 1.0}))

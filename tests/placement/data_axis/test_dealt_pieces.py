"""Pieces dealt to the replica threads by cost: the split update (``ShardedUpdate(balance=True)``)
and the CPU gradient sum (``HierarchicalCopyAllReduce``) spread a model's small tensors over the
threads instead of leaving them all to the last, and every value stays what it was."""

from __future__ import annotations

import threading

import torch
from torch import nn

import stratagem as sg
from stratagem.comm.collective import PIECE_OVERHEAD, deal_pieces
from stratagem.comm.replicas import RangeCollective
from stratagem.devices import Device
from stratagem.placement.data_axis.sharded_update import ShardedUpdate


def _costs(sizes: list[int], owners: list[int], parts: int) -> list[int]:
    return [sum(s + PIECE_OVERHEAD for s, o in zip(sizes, owners) if o == r) for r in range(parts)]


def test_dealing_evens_the_threads_costs() -> None:
    sizes = [40_000] + [64] * 30   # one weight, then the biases a cut into equal ranges gives the last thread
    for parts in (2, 3, 4):
        owners = deal_pieces(sizes, parts)
        costs = _costs(sizes, owners, parts)
        assert max(costs) - min(costs) <= max(sizes) + PIECE_OVERHEAD, (parts, costs)
    owners = deal_pieces([10, 10, 10, 10], 2)
    assert owners == [0, 1, 0, 1] and deal_pieces([], 3) == [] and deal_pieces([5], 3) == [0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), *[nn.LayerNorm(300) for _ in range(12)], nn.Linear(300, 4))


def _split_update(balance: bool, kind: type, steps: int = 3) -> tuple[list[torch.Tensor], dict, ShardedUpdate]:
    with sg.MirroredStrategy(["cpu:0", "cpu:1"]).scope():   # (a scoped optimizer: its hyperparameters)
        model = _model()
        params = list(model.parameters())
        optimizer = kind(params, lr=0.01, weight_decay=0.1)
    sharded = ShardedUpdate(optimizer, lambda p: (p,), 2, balance=balance)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        threads = [threading.Thread(target=sharded.step, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return [p.detach().clone() for p in params], sharded.state(), sharded


def test_a_balanced_split_update_gives_the_same_values_and_state_bit_for_bit() -> None:
    for kind in (torch.optim.SGD, torch.optim.AdamW):
        dealt, dealt_state, sharded = _split_update(True, kind)
        by_range, range_state, unbalanced = _split_update(False, kind)
        assert all(torch.equal(a, b) for a, b in zip(dealt, by_range))
        assert list(dealt_state) == list(range_state) == sorted(dealt_state)   # (index order)
        for index, state in dealt_state.items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(range_state[index][k])) for k, v in state.items())
        # by range, the second thread holds every norm weight; dealt, both threads hold some
        assert len(unbalanced.pieces[1]) > 2 * len(unbalanced.pieces[0])
        sizes = [[stop - start for _, _, _, start, stop in pieces] for pieces in sharded.pieces]
        costs = [sum(sizes[r]) + PIECE_OVERHEAD * len(sizes[r]) for r in range(2)]
        assert abs(costs[0] - costs[1]) <= 64 * 300 + PIECE_OVERHEAD, costs


def test_the_gradient_sum_deals_small_tensors_to_every_thread_and_sums_exactly() -> None:
    collective = RangeCollective([Device("cpu", 0), Device("cpu", 1)], sg.HierarchicalCopyAllReduce())
    numels = (50_000,) + (32,) * 40
    plan = collective._plan(numels, 2)
    assert all(sum(1 for i, _, _ in plan[r] if i > 0) >= 15 for r in range(2)), plan
    covered = sorted((i, start, stop) for pieces in plan for i, start, stop in pieces)
    assert [(i, start) for i, start, _ in covered if start == 0] == [(i, 0) for i in range(len(numels))]
    g = torch.Generator().manual_seed(2)
    mine = [[torch.randn(n, generator=g) for n in numels] for _ in range(2)]
    want = [a + b for a, b in zip(*mine)]
    results: list = [None, None]

    def replica(r: int) -> None:
        results[r] = collective.all_reduce(r, mine[r], sg.ReduceOp.SUM)
    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(results[r], want))

"""Gradient compression in one process: the options, the refusals, and the codecs' arithmetic.

The codecs are driven here as the packs drive them across workers, with the all-reduce played
by a plain sum over simulated workers (:func:`sum_packs`): each worker has its own parameters,
packs and codec, and every round's tensors are summed in worker order and handed back.
Across real processes: ``test_multi_worker_compression.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import stratagem as sg
from stratagem.comm import compression
from stratagem.comm.gradients import GradientPacks

pytestmark = pytest.mark.timeout(120)


def make_packs(workers: list[list[torch.Tensor]], codecs: list) -> list[GradientPacks]:
    """Worker ``w``'s packs of the parameters ``workers[w]``, travelling through ``codecs[w]``."""
    return [GradientPacks(params, None, codec=codec) for params, codec in zip(workers, codecs)]


def sum_packs(packs: list[GradientPacks], codecs: list, *, drop_first: bool = False) -> list[GradientPacks]:
    """Every worker's packs (their parameters' ``.grad``) summed through ``codecs[w]``;
    ``drop_first``: each pack's rounds are first abandoned after round 1 (a late gradient)."""
    for k in range(len(packs[0].packs)):
        mine = [p.packs[k] for p in packs]
        for pack in mine:
            for i in range(len(pack.params)):
                pack.fill(i)
            pack.seal()   # (the presence flags into the buffer, as GradientPacks does before a pack leaves)
        if drop_first:
            rounds = [codec.rounds(pack) for codec, pack in zip(codecs, mine)]
            _all_reduce([next(r) for r in rounds])
            for r in rounds:
                r.close()
            for pack in mine:
                for i in range(len(pack.params)):
                    pack.fill(i)
                pack.seal()
        rounds = [codec.rounds(pack) for codec, pack in zip(codecs, mine)]
        while True:
            wires = [next(r, None) for r in rounds]
            if all(w is None for w in wires):
                break
            assert all(w is not None for w in wires), "the workers ran different numbers of rounds"
            _all_reduce(wires)
    return packs


def _all_reduce(wires: list[torch.Tensor]) -> None:
    total = wires[0].clone()
    for wire in wires[1:]:
        total += wire
    for wire in wires:
        wire.copy_(total)


def _workers(shapes: list[tuple[int, ...]], num: int, dtype=torch.float32, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    workers = []
    for _ in range(num):
        params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
        workers.append(params)
    return workers


def _sums(packs: GradientPacks) -> list[torch.Tensor]:
    """The summed gradient per parameter, in parameter order."""
    return [packs.packs[k].slot(i).clone() for k, i in sorted(packs._where.values(), reverse=True)]


def _codecs(name: str | None, num: int, rank: int | None = None) -> list:
    return [compression.codec(name, num_workers=num, powersgd_rank=rank) for _ in range(num)]


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("kwargs,message", [
    ({"compression": "int8"}, "compression must be None (exact sums) or one of ['bf16', 'fp16', 'powersgd'], got 'int8'"),
    ({"compression": "BF16"}, "got 'BF16'"),
    ({"powersgd_rank": 2}, "powersgd_rank=2 is given but compression is None; pass compression='powersgd'"),
    ({"compression": "bf16", "powersgd_rank": 2}, "but compression is 'bf16'"),
    ({"compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be an integer >= 1"),
    ({"compression": "powersgd", "powersgd_rank": 1.5}, "got 1.5"),
    ({"compression": "powersgd", "powersgd_rank": True}, "got True"),
    ({"powersgd_start_step": 10}, "powersgd_start_step=10 is given but compression is None; pass "
                                  "compression='powersgd'"),
    ({"compression": "fp16", "powersgd_start_step": 0}, "but compression is 'fp16'"),
    ({"compression": "powersgd", "powersgd_start_step": -1}, "powersgd_start_step must be an integer >= 0"),
    ({"compression": "powersgd", "powersgd_start_step": 2.0}, "got 2.0"),
    ({"compression": "powersgd", "powersgd_start_step": False}, "got False"),
])
def test_bad_compression_options_are_refused_naming_the_fix(kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        sg.CommunicationOptions(**kwargs)
    assert message in str(raised.value)


def test_exact_by_default_and_powersgd_rank_one_unless_given() -> None:
    assert sg.CommunicationOptions().compression is None
    assert sg.CommunicationOptions().powersgd_rank is None
    assert sg.CommunicationOptions(compression="powersgd").powersgd_rank == 1
    assert sg.CommunicationOptions(compression="powersgd", powersgd_rank=4).powersgd_rank == 4
    assert sg.CommunicationOptions().compression_settings == (None, None, None)
    assert sg.CommunicationOptions(compression="powersgd").compression_settings == ("powersgd", 1, 0)
    assert sg.CommunicationOptions(compression="powersgd", powersgd_start_step=1000).powersgd_start_step == 1000


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
def test_compression_with_a_sharding_that_never_all_reduces_gradients_is_refused(sharding) -> None:
    options = sg.CommunicationOptions(compression="bf16")
    with pytest.raises(ValueError, match=f"sharding={sharding!r} reduce-scatters them .* use sharding='optimizer'"):
        sg.MultiWorkerMirroredStrategy(communication_options=options, sharding=sharding)
    with pytest.raises(ValueError, match=f"sharding={sharding!r} reduce-scatters them"):
        sg.experimental.PipelineStrategy(communication_options=options, sharding=sharding)


def test_compression_on_one_worker_warns_that_nothing_is_compressed() -> None:
    options = sg.CommunicationOptions(compression="powersgd")
    with pytest.warns(UserWarning, match="'powersgd' has nothing to compress: MultiWorkerMirroredStrategy has one"):
        strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        model = torch.nn.Linear(8, 8)
    strategy.run(lambda: model(torch.ones(2, 8)).sum().backward())
    assert torch.equal(model.weight.grad, torch.ones(8, 1).expand(8, 8) * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions())


# ---------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_is_the_sum_of_bf16_rounded_gradients(dtype) -> None:
    workers = _workers([(3, 5), (7,)], 2, dtype)
    packs = sum_packs(*_packed(workers, "bf16", 2))
    for i, total in enumerate(_sums(packs[0])):
        g0, g1 = workers[0][i].grad, workers[1][i].grad
        assert total.dtype == dtype
        assert torch.equal(total, (g0.bfloat16() + g1.bfloat16()).to(dtype))
        assert not torch.equal(total, g0 + g1)


def test_fp16_divides_by_the_number_of_workers_so_large_gradients_do_not_overflow() -> None:
    workers = _workers([(4,)], 2)
    for params in workers:
        params[0].grad = torch.tensor([60000.0, -49152.0, 1.0, 3e-8])
    (total,) = _sums(sum_packs(*_packed(workers, "fp16", 2))[0])
    assert total.tolist() == [120000.0, -98304.0, 2.0, 0.0]   # 3e-8 / 2 is below float16's subnormals
    assert torch.isinf(torch.tensor(60000.0).half() + torch.tensor(60000.0).half())   # unscaled, it would overflow


def test_complex_packs_travel_exactly_whatever_the_compression() -> None:
    workers = _workers([(4, 4)], 2, torch.complex64)
    for name in ("bf16", "powersgd"):
        (total,) = _sums(sum_packs(*_packed(workers, name, 2))[0])
        assert torch.equal(total, workers[0][0].grad + workers[1][0].grad)


# ---------------------------------------------------------------------------- PowerSGD


def test_powersgd_compresses_large_matrices_and_sends_vectors_and_small_matrices_exactly() -> None:
    workers = _workers([(64, 32), (32,), (2, 3), (16, 4, 3, 3)], 3)
    packs = sum_packs(*_packed(workers, "powersgd", 3, rank=2))
    sums = _sums(packs[0])
    exact = [sum(w[i].grad for w in workers) for i in range(4)]
    assert torch.equal(sums[1], exact[1]) and torch.equal(sums[2], exact[2])
    for i in (0, 3):
        matrix = sums[i].reshape(sums[i].shape[0], -1)
        assert torch.linalg.matrix_rank(matrix) == 2
        assert not torch.allclose(sums[i], exact[i], atol=1e-3)
    for other in packs[1:]:   # every worker holds the same sums
        assert all(torch.equal(a, b) for a, b in zip(_sums(other), sums))


def _regrad(workers: list[list[torch.Tensor]], seed: int) -> None:
    """New gradients for the same parameters (the next step)."""
    for params, fresh in zip(workers, _workers([tuple(p.shape) for p in workers[0]], len(workers),
                                               workers[0][0].dtype, seed)):
        for p, q in zip(params, fresh):
            p.grad = q.grad


def test_powersgd_error_feedback_loses_nothing_over_the_steps() -> None:
    """What was applied over the steps plus every worker's residual is what was computed."""
    workers = _workers([(24, 10), (10,)], 2, torch.float64)
    packs, codecs = _packed(workers, "powersgd", 2)
    applied = computed = None
    for step in range(20):
        _regrad(workers, step)
        sums = _sums(sum_packs(packs, codecs)[0])
        total = [sum(w[i].grad for w in workers) for i in range(2)]
        applied = sums if applied is None else [a + s for a, s in zip(applied, sums)]
        computed = total if computed is None else [c + t for c, t in zip(computed, total)]
    residual = sum(p.packs[0].coded.matrices[0].residual for p in packs)
    assert residual.abs().max() > 0.1   # (something was held back)
    torch.testing.assert_close(applied[0] + residual, computed[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(applied[1], computed[1], rtol=0, atol=1e-12)


def test_powersgd_rounds_dropped_after_the_first_leave_no_trace() -> None:
    workers = _workers([(16, 8)], 2)
    (first, first_codecs), (second, second_codecs) = _packed(workers, "powersgd", 2), _packed(workers, "powersgd", 2)
    for step in range(3):
        _regrad(workers, step)
        a = _sums(sum_packs(first, first_codecs)[0])
        b = _sums(sum_packs(second, second_codecs, drop_first=True)[0])
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(first[0].packs[0].coded.matrices[0].residual, second[0].packs[0].coded.matrices[0].residual)


def test_powersgd_keeps_the_residual_of_a_parameter_no_worker_has_a_gradient_for() -> None:
    workers = _workers([(16, 8)], 2)
    packs, codecs = _packed(workers, "powersgd", 2)
    sum_packs(packs, codecs)
    matrix = packs[0].packs[0].coded.matrices[0]
    before = matrix.residual.clone()
    for params in workers:
        params[0].grad = None
    sum_packs(packs, codecs)
    assert packs[0].packs[0].flags.tolist() == [0.0]
    assert torch.equal(matrix.residual, before)


def test_powersgd_start_step_sums_exactly_first_then_starts_afresh() -> None:
    """``powersgd_start_step=2``: each pack's first two sums are the exact ones, bit for bit, and
    nothing is held back; the third is PowerSGD's first, as a codec that compresses from the start
    makes it from the same gradients (zero residuals, the seeded ``Q``); every worker holds the same."""
    workers = _workers([(48, 20), (20,)], 3)
    codecs = [compression.codec("powersgd", num_workers=3, powersgd_start_step=2) for _ in range(3)]
    packs = make_packs(workers, codecs)
    for step in range(2):
        _regrad(workers, step)
        summed = sum_packs(packs, codecs, drop_first=step == 1)   # (a pack summed again counts once)
        for i in range(2):
            assert torch.equal(_sums(summed[0])[i], sum(w[i].grad for w in workers)), (step, i)
        assert packs[0].packs[0].coded.matrices[0].residual is None
    _regrad(workers, 2)
    third = [_sums(p) for p in sum_packs(packs, codecs)]
    fresh_workers = _workers([(48, 20), (20,)], 3)
    _regrad(fresh_workers, 2)
    first = _sums(sum_packs(*_packed(fresh_workers, "powersgd", 3))[0])
    assert all(torch.equal(a, b) for a, b in zip(third[0], first))
    assert torch.linalg.matrix_rank(third[0][0]) == 1 and not torch.allclose(third[0][0], sum(w[0].grad for w in workers))
    assert all(torch.equal(a, b) for other in third[1:] for a, b in zip(other, third[0]))


def _train(codec_name: str | None, steps: int = 300, workers: int = 2, rank: int = 1) -> list[float]:
    """A two-layer regression, each simulated worker on its share of the batch, SGD on the sums."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 8, generator=g))
    copies = [[torch.nn.Parameter(p.detach().clone()) for p in model.parameters()] for _ in range(workers)]
    packs, codecs = _packed(copies, codec_name, workers, rank)
    losses = []
    for _ in range(steps):
        losses.append(torch.nn.functional.mse_loss(model(x), y).item())
        for w, params in enumerate(copies):
            model.zero_grad()
            (torch.nn.functional.mse_loss(model(x[w::workers]), y[w::workers]) / workers).backward()
            for p, q in zip(params, model.parameters()):
                p.grad = q.grad.clone()
        sums = _sums(sum_packs(packs, codecs)[0])
        with torch.no_grad():
            for p, s in zip(model.parameters(), sums):
                p.sub_(0.2 * s)
    return losses


def test_powersgd_training_loss_falls_like_uncompressed() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: a second intra-op thread only waits on a shared machine
    try:
        exact, compressed = _train(None), _train("powersgd")
    finally:
        torch.set_num_threads(threads)
    assert exact[-1] < 0.35 * exact[0]
    assert compressed[-1] < 0.35 * compressed[0]
    assert compressed[-1] < 1.15 * exact[-1], (compressed[-1], exact[-1])


def _packed(workers: list[list[torch.Tensor]], name: str | None, num: int, rank: int | None = None) -> tuple:
    codecs = _codecs(name, num, rank)
    return make_packs(workers, codecs), codecs

"""The message every worker sends before a collective across workers, in one process.

What the workers compare, how a mismatch is worded, and how small values ride in the message.
The real exchange between processes is tested in tests/comm/test_mismatch.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stratagem.comm import agreement
from stratagem.comm.agreement import Call
from stratagem.errors import CollectiveMismatchError, InvalidArgumentError


def said(what="ReplicaContext.all_reduce", detail="with 'sum'", tensors=((4,),), dtype=torch.float32,
         rule="same", axis=0):
    return (what, detail, [[(shape, dtype) for shape in tensors]], rule, axis)


def test_the_digest_covers_what_the_rule_says_must_agree() -> None:
    def key(*args, **kwargs):
        return Call(*said(*args, **kwargs)).key()
    assert key() == key()
    assert key(dtype=torch.int32) != key()
    assert key(tensors=((5,),)) != key()
    assert key(tensors=((4,), (2,))) != key()
    assert key(detail="with 'mean'") != key()
    assert key("ReplicaContext.all_gather") != key()
    gather = dict(what="ReplicaContext.all_gather", detail="along axis 0", rule="gather")
    assert key(tensors=((2, 3),), **gather) == key(tensors=((5, 3),), **gather)   # only the axis differs
    assert key(tensors=((2, 3),), **gather) != key(tensors=((2, 4),), **gather)
    assert key(tensors=((2, 3),), rule="count") == key(tensors=((7,),), rule="count")
    assert key(tensors=((2, 3),), rule="count") != key(tensors=((2, 3), (1,)), rule="count")


def test_a_mismatch_names_each_worker_and_what_it_passed() -> None:
    error = agreement.mismatch_error(["chief", "worker 0", "worker 1"],
                                     [said(), said(), said(dtype=torch.int32)])
    assert isinstance(error, InvalidArgumentError)
    assert str(error).startswith("ReplicaContext.all_reduce across workers: chief and worker 0 all-reduce "
                                 "float32[4] with 'sum', worker 1 int32[4]: every worker must pass tensors of "
                                 "the same dtypes and shapes"), str(error)


def test_different_collectives_are_a_collective_mismatch() -> None:
    error = agreement.mismatch_error(["worker 0", "worker 1"], [
        said(), said("ReplicaContext.all_gather", "along axis 0", rule="gather")])
    assert isinstance(error, CollectiveMismatchError)
    assert "worker 0 all-reduces float32[4] with 'sum', worker 1 all-gathers float32[4] along axis 0: the " \
           "workers called different collectives" in str(error), str(error)


def test_different_arguments_are_named() -> None:
    error = agreement.mismatch_error(["worker 0", "worker 1"], [
        said("ReplicaContext.broadcast", "from replica 0", rule="count"),
        said("ReplicaContext.broadcast", "from replica 1", rule="count")])
    assert "worker 0 broadcasts float32[4] from replica 0, worker 1 float32[4] from replica 1" in str(error)
    assert "with the same arguments" in str(error)


def test_long_structures_show_their_first_difference() -> None:
    mine = said(tensors=[(2,)] * 9)
    theirs = said(tensors=[(2,)] * 9)
    theirs[2][0][7] = ((2,), torch.float64)
    message = str(agreement.mismatch_error(["worker 0", "worker 1"], [mine, theirs]))
    assert "9 tensors (float32[2], float32[2]" in message and "...)" in message, message
    assert "(tensor #7 is float32[2] on worker 0 but float64[2] on worker 1)" in message, message


def test_shapes_travel_as_a_few_integers_and_long_ones_do_not() -> None:
    described = [[((2, 3), torch.float32), ((), torch.int64)], [((5,), torch.bool)]]
    assert agreement._decode(agreement._encode(described)) == described
    assert agreement._encode([[((1,) * 70, torch.float32)]]) is None       # too long: pickled instead
    assert agreement._encode([[((2,), torch.float8_e4m3fn)]]) is None      # an unusual dtype: pickled


def test_small_values_ride_in_the_message_and_are_summed_in_worker_order() -> None:
    tensors = [torch.tensor([1.5, 2.0]), torch.tensor(3, dtype=torch.int32), torch.tensor([True, False]),
               torch.tensor([[0.5, 1.0]], dtype=torch.bfloat16), torch.tensor([1 + 2j], dtype=torch.complex64)]
    assert agreement.fits(tensors, 3) and not agreement.fits([torch.zeros(5462 // 4 + 1)], 3)
    assert agreement.inline_bytes(2) == 8192 and agreement.inline_bytes(64) == 512
    messages = [bytearray(agreement.message_bytes(3)) for _ in range(3)]
    for w, message in enumerate(messages):
        agreement._pack(message, [t * (w + 1) if t.dtype != torch.bool else t for t in tensors])
    rows = np.stack([np.frombuffer(bytes(m), dtype=np.uint8) for m in messages])
    sums = agreement.summed(rows[:, agreement.HEADER * 8:], tensors)
    assert sums[0].tolist() == [9.0, 12.0] and sums[0].dtype == torch.float32
    assert sums[1].item() == 18 and sums[1].dtype == torch.int32 and sums[1].shape == ()
    assert sums[2].tolist() == [True, False]
    assert sums[3].tolist() == [[3.0, 6.0]] and sums[3].dtype == torch.bfloat16
    assert sums[4].tolist() == [6 + 12j] and sums[4].dtype == torch.complex64


@pytest.mark.parametrize("rule", ["same", "gather", "count"])
def test_every_rule_words_its_fix(rule: str) -> None:
    message = str(agreement.mismatch_error(["worker 0", "worker 1"], [
        said(rule=rule, tensors=((2, 3),)), said(rule=rule, tensors=((2, 3), (1,)))]))
    assert message.endswith("and make the same collective calls in the same order"), message

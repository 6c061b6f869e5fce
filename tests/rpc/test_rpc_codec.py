"""encode/decode: tensors of every dtype and layout, nested structures, functions, bad input."""

from __future__ import annotations

import threading
import traceback
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from stratagem.rpc import CodecError, decode, encode

pytestmark = pytest.mark.timeout(30)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape) * 100).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (works for dtypes without comparison kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*raw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (4, 3, 2)], ids=str)
def test_every_dtype_and_shape_round_trips(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _random(shape, dtype)
    out = decode(encode(tensor))
    assert _same(out, tensor)
    assert out.device.type == "cpu" and out.is_contiguous()


def test_non_contiguous_and_lazy_views_arrive_as_their_values() -> None:
    base = torch.randn(6, 8)
    complex_base = torch.randn(4, 4, dtype=torch.complex64)
    views = [base.t(), base[::2, 1::3], base.expand(2, 6, 8), complex_base.conj(),
             torch.randn(3, 3)._neg_view() if hasattr(torch.Tensor, "_neg_view") else -base]
    for view, out in zip(views, decode(encode(views))):
        assert out.shape == view.shape and out.is_contiguous()
        assert torch.equal(out, view.resolve_conj().resolve_neg())


@dataclass
class Batch:
    features: torch.Tensor
    labels: list[torch.Tensor]


Pair = namedtuple("Pair", "left right")


def test_nested_structures_keep_their_types_identity_and_flags() -> None:
    shared = torch.arange(10.)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    tracked = torch.ones(2, requires_grad=True)
    obj = {"batch": Batch(torch.randn(2, 3), [torch.tensor(1), torch.tensor([2, 3])]),
           "pair": Pair(shared, shared), "nested": [(shared, {"deep": [weight, tracked]})],
           "plain": ("text", 3, 4.5, None, b"bytes", torch.float16, torch.Size([2, 3]))}
    out = decode(encode(obj))
    assert isinstance(out["batch"], Batch) and isinstance(out["pair"], Pair)
    assert torch.equal(out["batch"].features, obj["batch"].features)
    assert [t.tolist() for t in out["batch"].labels] == [1, [2, 3]]
    assert out["pair"].left is out["pair"].right is out["nested"][0][0]   # sent once
    weight_out, tracked_out = out["nested"][0][1]["deep"]
    assert isinstance(weight_out, torch.nn.Parameter) and weight_out.requires_grad
    assert torch.equal(weight_out.detach(), weight.detach())
    assert tracked_out.requires_grad and not isinstance(tracked_out, torch.nn.Parameter)
    assert out["plain"] == obj["plain"]


def test_functions_and_closures_travel() -> None:
    scale = torch.tensor(3.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * scale + offset

    offset = 1.0
    out = decode(encode({"step": step, "lambda": lambda n: n + 1}))
    assert torch.equal(out["step"](torch.ones(2)), torch.full((2,), 4.0))
    assert out["lambda"](1) == 2


def test_functions_sent_by_value_keep_their_file_name_and_lines() -> None:
    # cloudpickle renames the file <dynamic-code>: errors on the receiving side lost the user's file
    source = "def f(value):\n    def scale(v):\n        return 1 / v\n    return scale(value)\n"
    namespace = {"__name__": "__main__"}   # what a training script defines: sent by value
    exec(compile(source, "/home/me/train.py", "exec"), namespace)
    sent = decode(encode(namespace["f"]))
    assert sent(4) == 0.25
    with pytest.raises(ZeroDivisionError) as info:
        sent(0)
    frames = traceback.extract_tb(info.value.__traceback__)[1:]
    assert [(frame.filename, frame.lineno, frame.name) for frame in frames] == [
        ("/home/me/train.py", 4, "f"), ("/home/me/train.py", 3, "scale")]


def test_decode_is_zero_copy_on_a_writable_buffer() -> None:
    message = bytearray(encode(torch.zeros(1000)))
    out = decode(message)
    out[7] = 5.0                      # writes into the buffer
    assert decode(message)[7] == 5.0


def test_decode_of_bytes_gives_writable_tensors_and_leaves_the_bytes_alone() -> None:
    message = encode({"a": torch.zeros(16), "b": torch.ones(4, dtype=torch.int64)})
    before = bytes(message)
    out = decode(message)
    out["a"].add_(1)
    out["b"].mul_(7)
    assert message == before and torch.equal(out["a"], torch.ones(16))


def test_read_only_decode_of_bytes_shares_the_bytes_without_a_copy_or_warning() -> None:
    import warnings

    message = encode({"a": torch.arange(16.0), "n": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch's "buffer is not writable" warning is not shown
        out = decode(message, writable=False)
    assert out["n"] == 3 and torch.equal(out["a"], torch.arange(16.0))
    start = out["a"].data_ptr() - _address_of(message)
    assert 0 < start < len(message)   # a view into the bytes object itself
    assert decode(message)["a"].data_ptr() != out["a"].data_ptr()   # writable: a copy


def _address_of(data: bytes) -> int:
    import ctypes

    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def test_tensors_are_aligned_in_the_message() -> None:
    message = bytearray(encode([torch.zeros(3, dtype=torch.int8), torch.zeros(5, dtype=torch.float64)]))
    first, second = decode(message)
    assert (second.data_ptr() - first.data_ptr()) % 64 == 0


def test_no_tensor_message_is_small() -> None:
    assert len(encode(None)) < 40


def test_bad_bytes_raise_codec_error() -> None:
    with pytest.raises(CodecError, match="not a stratagem message"):
        decode(b"GARBAGE-GARBAGE-GARBAGE")
    with pytest.raises(CodecError, match="at least"):
        decode(b"SG")
    message = encode(torch.zeros(100))
    with pytest.raises(CodecError):
        decode(message[:-100])


def test_unframeable_objects_raise_codec_error_naming_the_fix() -> None:
    with pytest.raises(CodecError, match="to_dense"):
        encode(torch.eye(3).to_sparse())
    with pytest.raises(CodecError, match="picklable"):
        encode({"lock": threading.Lock()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_arrive_on_the_cpu() -> None:
    tensor = torch.randn(128, 3, device="cuda")
    out = decode(encode({"t": tensor}))["t"]
    assert out.device.type == "cpu"
    assert torch.equal(out, tensor.cpu())

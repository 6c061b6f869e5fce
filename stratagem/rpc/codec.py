"""How a Python object travels: a pickle for the structure, raw bytes for its tensors.

``encode(obj)`` pickles ``obj`` with cloudpickle (so functions, lambdas and closures travel
too) but pulls every ``torch.Tensor`` out of the pickle: each is written as its raw
contiguous CPU bytes, described by a small JSON header (dtype name, shape, offset). This
keeps tensors out of pickle's own format (no extra copies inside the pickler, no
``torch.save`` zip archive) and lets :func:`decode` build each tensor straight over the
received buffer with ``torch.frombuffer``.

A message::

    b"SGR1" | u32 header length | u64 pickle length | header (JSON) | pickle
            | padding to a multiple of 64 | tensor bytes, each starting on a multiple of 64

The JSON header is ``[[dtype, shape, offset, nbytes, flags], ...]``, one entry per distinct
tensor (the same tensor object twice in ``obj`` is sent once and decodes as one object);
``flags`` bit 0 is ``requires_grad``, bit 1 ``nn.Parameter``.

What a decoded tensor is:

- always a CPU tensor, contiguous, with the dtype and shape that was sent; tensors on an
  accelerator are copied to the CPU by :func:`encode` (the receiver moves them where it
  wants them);
- a view of the message: no copy when the buffer given to :func:`decode` is writable (a
  ``bytearray`` or writable ``memoryview``); when it is read-only (``bytes``, which is what
  gRPC hands over) the tensor region is copied once into a ``bytearray`` -- tensors must be
  writable, and writing into a ``bytes`` object would corrupt it -- unless the caller
  promises to only read them (``decode(data, writable=False)``: views of the read-only
  buffer, for receivers that copy the values elsewhere or use them as gradients; the
  transport does this for handlers marked :func:`~stratagem.rpc.server.reads_only` and
  replies asked for with ``writable_reply=False``). Every tensor of a message keeps that
  whole region alive: ``clone()`` one that is kept long while the others are not;
- sharing nothing with other tensors: two views of one storage arrive as two tensors.

Sparse, quantized and nested tensors cannot be framed and raise :class:`CodecError`.

Functions sent by value keep the name of the file they were written in (cloudpickle
renames it ``<dynamic-code>``): an error in one, on the receiving side, then shows the
user's file and line -- and its source, when that side can read the file.

Decoding unpickles, and unpickling runs code: only decode bytes whose sender was
authenticated (the transport checks the MAC of every message before it calls
:func:`decode`).

Objects that travel by reference: a subclass of :class:`Pickler` may override
``persistent_id`` to turn some objects into small ids (tuples: the ints are the tensors'),
and a subclass of :class:`Unpickler` resolves them in ``persistent_load``; pass the pickler
class to :func:`encode` and call the unpickler's ``load`` instead of :func:`decode`. The
parameter-server closures use this (:mod:`stratagem.ps.closures`).

Example::

    >>> import torch
    >>> from stratagem.rpc.codec import decode, encode
    >>> message = encode({"w": torch.arange(6.).reshape(2, 3), "step": 7, "f": lambda x: x + 1})
    >>> out = decode(message)
    >>> out["w"].shape, out["step"], out["f"](1)
    (torch.Size([2, 3]), 7, 2)
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
import threading
import types
import warnings
from collections import ChainMap
from typing import TYPE_CHECKING, Any

import cloudpickle

from stratagem.rpc.errors import CodecError

if TYPE_CHECKING:
    import torch

__all__ = ["Pickler", "Unpickler", "decode", "encode", "encode_parts"]

MAGIC = b"SGR1"
_PREFIX = struct.Struct("<4sIQ")   # magic, header length, pickle length
_ALIGN = 64
_REQUIRES_GRAD, _PARAMETER = 1, 2
_PADDING = bytes(_ALIGN)


class _NoTensor:
    """Stands for torch.Tensor while torch is not imported (then no object is a tensor)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _code_in_file(rebuild: Any, args: tuple, filename: str) -> types.CodeType:
    return rebuild(*args).replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> tuple:
    """cloudpickle's reduction of a code object, keeping its file name."""
    rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return _code_in_file, (rebuild, args, code.co_filename)


class Pickler(cloudpickle.Pickler):
    """cloudpickle, except that tensors become persistent ids (indices into ``tensors``),
    and code keeps its file name."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file: io.BytesIO, tensor_type: type) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensor_type = tensor_type
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}   # id(tensor) -> index; tensors keeps them alive

    def persistent_id(self, obj: Any) -> int | None:  # called for every object pickled
        if not isinstance(obj, self.tensor_type):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def _tensor_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The tensor as sent (detached, CPU, contiguous) and a buffer over its bytes."""
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise CodecError(
            f"cannot send a {tensor.layout} / quantized / nested tensor of shape "
            f"{tuple(tensor.shape)}; send tensor.to_dense() (or its components) instead.")
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg().contiguous()
    if data.numel() == 0:
        return data, b""
    return data, data.reshape(-1).view(torch.uint8).numpy()


def encode(obj: Any, *, pickler: type[Pickler] = Pickler) -> bytes:
    """Frames ``obj`` (any picklable structure; functions via cloudpickle) as one message,
    pickled by ``pickler`` (a :class:`Pickler` subclass sends some objects by reference)."""
    return b"".join(encode_parts(obj, pickler=pickler))


def encode_parts(obj: Any, *, pickler: type[Pickler] = Pickler) -> list[Any]:
    """:func:`encode`'s message as the buffers to write one after the other, unjoined: the
    tensors' are views of their memory (a socket sends them without a copy; they must not
    change until sent)."""
    torch = sys.modules.get("torch")   # no torch imported: no tensor can be in obj
    tensor_type = torch.Tensor if torch is not None else _NoTensor
    buffer = io.BytesIO()
    pickler = pickler(buffer, tensor_type)
    try:
        pickler.dump(obj)
    except CodecError:
        raise
    except Exception as err:   # pickle raises anything: TypeError, PicklingError, AttributeError
        raise CodecError(f"cannot send {type(obj).__name__} object: {type(err).__name__}: {err}; "
                         "only picklable objects can be sent (cloudpickle handles functions "
                         "and closures; open files, locks and sockets cannot travel).") from err
    pickled = buffer.getbuffer()
    entries: list[list[Any]] = []
    chunks: list[Any] = []
    offset = 0
    for tensor in pickler.tensors:
        data, raw = _tensor_bytes(tensor)
        flags = (_REQUIRES_GRAD if tensor.requires_grad else 0) | (
            _PARAMETER if isinstance(tensor, torch.nn.Parameter) else 0)
        nbytes = len(raw) if isinstance(raw, bytes) else raw.nbytes
        entries.append([str(data.dtype).removeprefix("torch."), list(data.shape), offset,
                        nbytes, flags])
        chunks.append(raw)
        padded = _aligned(nbytes)
        if padded > nbytes:
            chunks.append(_PADDING[:padded - nbytes])
        offset += padded
    header = json.dumps(entries, separators=(",", ":")).encode() if entries else b""
    start = _PREFIX.size + len(header) + len(pickled)
    lead_padding = (_PADDING[:_aligned(start) - start]) if entries else b""
    return [_PREFIX.pack(MAGIC, len(header), len(pickled)), header, pickled, lead_padding, *chunks]


_quiet_lock = threading.Lock()
_quiet = False


def _frombuffer_readonly(region: Any, **kwargs: Any) -> Any:
    """torch.frombuffer over a read-only buffer, without torch's (once per process) warning
    that such tensors must not be written: :func:`decode` only does this when asked to."""
    global _quiet
    import torch

    if not _quiet:
        with _quiet_lock:
            if not _quiet:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    torch.frombuffer(bytes(8), dtype=torch.uint8)   # spends the warning
                _quiet = True
    return torch.frombuffer(region, **kwargs)


def _build_tensors(entries: Any, region: Any) -> list[Any]:
    import torch

    make = _frombuffer_readonly if region.readonly else torch.frombuffer

    if not isinstance(entries, list):
        raise CodecError("malformed tensor header")
    tensors = []
    for entry in entries:
        try:
            dtype_name, shape, offset, nbytes, flags = entry
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise CodecError(f"{dtype_name!r} is not a torch dtype")
            numel = 1
            for size in shape:
                numel *= size
            if numel * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > len(region):
                raise CodecError(f"tensor of shape {shape} and dtype {dtype_name} does not fit "
                                 "the message")
            if nbytes == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                tensor = make(region, dtype=dtype, count=numel, offset=offset)
                tensor = tensor.reshape(shape)
        except CodecError:
            raise
        except (TypeError, ValueError, AttributeError, RuntimeError) as err:
            raise CodecError(f"malformed tensor header entry {entry!r}: {err}") from err
        if flags & _PARAMETER:
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(flags & _REQUIRES_GRAD))
        elif flags & _REQUIRES_GRAD:   # only floating-point and complex tensors have it set
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


class Unpickler(pickle.Unpickler):
    """Reads one message that :func:`encode` framed: ``Unpickler(data).load()`` is the object.

    ``writable=False``: the caller will only read the tensors, so a read-only ``data`` is
    not copied either (writing such a tensor is undefined behaviour). Only read bytes from
    an authenticated peer: it unpickles.
    """

    def __init__(self, data: bytes | bytearray | memoryview, *, writable: bool = True) -> None:
        view = memoryview(data).cast("B")
        if len(view) < _PREFIX.size:
            raise CodecError(f"a message has at least {_PREFIX.size} bytes, got {len(view)}")
        magic, header_size, pickle_size = _PREFIX.unpack_from(view)
        if magic != MAGIC:
            raise CodecError(f"not a stratagem message (starts with {bytes(view[:4])!r}, expected "
                             f"{MAGIC!r}); is the peer a different version of stratagem?")
        pickle_start = _PREFIX.size + header_size
        pickle_end = pickle_start + pickle_size
        if pickle_end > len(view):
            raise CodecError(f"message truncated: {len(view)} bytes, header announces {pickle_end}")
        self.tensors: list[Any] = []
        if header_size:
            try:
                entries = json.loads(bytes(view[_PREFIX.size:pickle_start]))
            except ValueError as err:
                raise CodecError(f"malformed tensor header: {err}") from err
            region = view[_aligned(pickle_end):]
            if region.readonly and writable:
                region = memoryview(bytearray(region))   # one copy: tensors must be writable
            self.tensors = _build_tensors(entries, region)
        super().__init__(io.BytesIO(view[pickle_start:pickle_end]))

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, int) or not 0 <= pid < len(self.tensors):
            raise CodecError(f"message refers to tensor {pid!r}, but it carries "
                             f"{len(self.tensors)} tensor(s)")
        return self.tensors[pid]


def decode(data: bytes | bytearray | memoryview, *, writable: bool = True) -> Any:
    """The object that :func:`encode` framed; tensors are views of ``data`` when it is writable.

    ``writable=False``: the caller will only read the tensors, so a read-only ``data`` is
    not copied either (writing such a tensor is undefined behaviour). Only call this on
    bytes from an authenticated peer: it unpickles.
    """
    return Unpickler(data, writable=writable).load()

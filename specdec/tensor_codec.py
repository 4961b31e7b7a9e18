"""Tensors on the wire: raw little-endian bytes with explicit dtype and shape.

The receiving side validates everything it is sent before reading it, so a
malformed or mismatched message fails with a ValueError that names the
problem instead of producing a silently wrong tensor. Nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from specdec.pb import common_pb2

# numpy has no bfloat16, so bfloat16 travels through numpy as the int16 with
# the same bits; the little-endian numpy dtype fixes the byte order on the
# wire whatever the host's.
_WIRE_FORMATS: dict[int, tuple[torch.dtype, np.dtype]] = {
    common_pb2.DTYPE_FLOAT32: (torch.float32, np.dtype("<f4")),
    common_pb2.DTYPE_FLOAT16: (torch.float16, np.dtype("<f2")),
    common_pb2.DTYPE_BFLOAT16: (torch.bfloat16, np.dtype("<i2")),
    common_pb2.DTYPE_FLOAT64: (torch.float64, np.dtype("<f8")),
}
_DTYPE_ENUM: dict[torch.dtype, int] = {
    torch_dtype: enum for enum, (torch_dtype, _) in _WIRE_FORMATS.items()
}
_BITS_DTYPE: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The DType enum value of a torch dtype the wire supports (ValueError otherwise)."""
    if dtype not in _DTYPE_ENUM:
        raise ValueError(f"dtype {dtype} cannot travel as a Tensor; use one of {list(_DTYPE_ENUM)}")
    return _DTYPE_ENUM[dtype]


def dtype_from_proto(value: int) -> torch.dtype:
    """The torch dtype of a DType enum value (ValueError for UNSPECIFIED or unknown)."""
    if value not in _WIRE_FORMATS:
        raise ValueError(f"unsupported tensor dtype enum {value}")
    return _WIRE_FORMATS[value][0]


def encode_tensor(t: torch.Tensor) -> common_pb2.Tensor:
    """Serialize a float32/float16/bfloat16/float64 tensor (any device, any strides)."""
    if t.dtype not in _DTYPE_ENUM:
        supported = ", ".join(str(d) for d in _DTYPE_ENUM)
        raise ValueError(f"cannot encode a {t.dtype} tensor; supported: {supported}")
    enum = _DTYPE_ENUM[t.dtype]
    wire = _WIRE_FORMATS[enum][1]
    flat = t.detach().to("cpu").contiguous().view(_BITS_DTYPE.get(t.dtype, t.dtype))
    data = flat.numpy().astype(wire, copy=False).tobytes()
    return common_pb2.Tensor(dtype=enum, shape=list(t.shape), data=data)


def decode_tensor(
    msg: common_pb2.Tensor,
    *,
    expected_dtype: torch.dtype | None = None,
    expected_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Validate a Tensor message and return it as a new CPU tensor.

    expected_shape may use -1 for a dimension of any size.
    """
    if msg.dtype not in _WIRE_FORMATS:
        if msg.dtype == common_pb2.DTYPE_UNSPECIFIED:
            raise ValueError("tensor dtype is not set (DTYPE_UNSPECIFIED)")
        raise ValueError(f"unknown tensor dtype {msg.dtype}")
    torch_dtype, wire = _WIRE_FORMATS[msg.dtype]
    shape = list(msg.shape)
    if any(dim < 0 for dim in shape):
        raise ValueError(f"tensor shape {shape} has a negative dimension")
    if expected_dtype is not None and torch_dtype != expected_dtype:
        raise ValueError(f"tensor dtype is {torch_dtype}, expected {expected_dtype}")
    if expected_shape is not None and not _shape_matches(shape, expected_shape):
        raise ValueError(
            f"tensor shape {shape} does not match expected {list(expected_shape)} (-1 = any)"
        )
    expected_bytes = math.prod(shape) * wire.itemsize
    if len(msg.data) != expected_bytes:
        raise ValueError(
            f"tensor data is {len(msg.data)} bytes, but shape {shape} of {torch_dtype} "
            f"needs {expected_bytes}"
        )
    # astype copies into native byte order, so the tensor owns writable memory
    # instead of aliasing the (immutable) message bytes.
    array = np.frombuffer(msg.data, dtype=wire).astype(wire.newbyteorder("="))
    return torch.from_numpy(array).view(torch_dtype).reshape(shape)


def _shape_matches(shape: Sequence[int], expected: Sequence[int]) -> bool:
    return len(shape) == len(expected) and all(
        want == -1 or got == want for got, want in zip(shape, expected, strict=True)
    )

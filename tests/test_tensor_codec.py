"""Tensor wire format: exact round trips and loud validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.pb import common_pb2
from specdec.tensor_codec import decode_tensor, encode_tensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit equality, so NaN payloads and -0.0 count too.
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dtype):
    t = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    t[0, 0, 0] = float("nan")
    t[0, 0, 1] = float("-inf")
    t[0, 0, 2] = -0.0

    decoded = decode_tensor(encode_tensor(t), expected_dtype=dtype, expected_shape=[3, -1, 7])

    assert _same_bits(decoded, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wire_bytes_are_little_endian(dtype):
    msg = encode_tensor(torch.tensor([1.0, -2.5], dtype=dtype))
    if dtype == torch.bfloat16:
        # bfloat16 is the high half of the float32 bit pattern.
        assert msg.data == bytes.fromhex("803f 20c0")
    else:
        wire = {torch.float32: "<f4", torch.float16: "<f2", torch.float64: "<f8"}[dtype]
        assert msg.data == np.array([1.0, -2.5], dtype=wire).tobytes()


def test_non_contiguous_input():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:, ::2]
    assert not view.is_contiguous()

    decoded = decode_tensor(encode_tensor(view))

    assert torch.equal(decoded, view)
    assert list(encode_tensor(view).shape) == [5, 2]


def test_scalar_and_empty():
    scalar = torch.tensor(3.25, dtype=torch.float64)
    assert _same_bits(decode_tensor(encode_tensor(scalar)), scalar)
    empty = torch.empty(0, 4, dtype=torch.float16)
    assert decode_tensor(encode_tensor(empty)).shape == (0, 4)


def test_decoded_tensor_is_writable_and_independent():
    msg = encode_tensor(torch.zeros(2))
    decoded = decode_tensor(msg)
    decoded += 1
    assert torch.equal(decode_tensor(msg), torch.zeros(2))


def test_requires_grad_input():
    t = torch.ones(2, requires_grad=True)
    assert torch.equal(decode_tensor(encode_tensor(t)), torch.ones(2))


def test_wrong_byte_length():
    msg = encode_tensor(torch.zeros(2, 3))
    msg.data = msg.data[:-1]
    with pytest.raises(ValueError, match="23 bytes.*needs 24"):
        decode_tensor(msg)


def test_unknown_dtype():
    msg = encode_tensor(torch.zeros(2))
    msg.dtype = 99
    with pytest.raises(ValueError, match="unknown tensor dtype 99"):
        decode_tensor(msg)


def test_unset_dtype():
    msg = common_pb2.Tensor(shape=[0])
    with pytest.raises(ValueError, match="DTYPE_UNSPECIFIED"):
        decode_tensor(msg)


def test_negative_dimension():
    msg = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[-1, -4], data=b"\0" * 16)
    with pytest.raises(ValueError, match="negative dimension"):
        decode_tensor(msg)


@pytest.mark.parametrize("expected_shape", [[2, 4], [3], [2, 3, 1], [-1, 2]])
def test_shape_mismatch_with_expected(expected_shape):
    msg = encode_tensor(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \[2, 3\] does not match expected"):
        decode_tensor(msg, expected_shape=expected_shape)


def test_dtype_mismatch_with_expected():
    msg = encode_tensor(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="torch.float16, expected torch.float32"):
        decode_tensor(msg, expected_dtype=torch.float32)


def test_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(ValueError, match="cannot encode a torch.int64 tensor"):
        encode_tensor(torch.zeros(2, dtype=torch.int64))

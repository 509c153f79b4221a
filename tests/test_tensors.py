"""Tensors, codes and ids to and from protobuf bytes (services/common/tensors.py)."""

from __future__ import annotations

import struct

import pytest
import torch

from services.common.tensors import (
    DTYPES,
    codes_from_wire,
    codes_to_wire,
    ids_from_bytes,
    ids_to_bytes,
    tensor_from_bytes,
    tensor_to_bytes,
)


@pytest.mark.parametrize("name", list(DTYPES))
def test_tensor_round_trip_every_dtype(name):
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[name]
    if dtype.is_floating_point:
        t = torch.randn(3, 5, generator=gen).to(dtype)
    else:
        t = torch.randint(0, 100, (3, 5), generator=gen).to(dtype)
    data = tensor_to_bytes(t)
    assert len(data) == t.numel() * t.element_size()
    back = tensor_from_bytes(data, name, [3, 5])
    assert back.dtype == dtype and torch.equal(back, t)


def test_bytes_are_little_endian_and_c_order():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t()   # non-contiguous input
    assert tensor_to_bytes(t) == struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)
    bf = torch.tensor([1.0], dtype=torch.bfloat16)    # bf16 1.0 = 0x3F80
    assert tensor_to_bytes(bf) == b"\x80\x3f"


def test_tensor_from_bytes_refuses_wrong_length_and_dtype():
    with pytest.raises(ValueError, match=r"12 bytes do not hold a float32 tensor of shape \[2, 2\]"):
        tensor_from_bytes(b"\x00" * 12, "float32", (2, 2))
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        tensor_from_bytes(b"", "float8", (0,))


def test_tensor_from_bytes_result_is_writable_copy():
    data = tensor_to_bytes(torch.ones(4))
    t = tensor_from_bytes(data, "float32", (4,))
    t += 1                                             # would fail on a read-only buffer view
    assert tensor_from_bytes(data, "float32", (4,)).tolist() == [1.0] * 4


def test_codes_wire_is_int16_frame_major():
    codes = torch.tensor([[1, 2, 3], [10, 20, 30]])    # [N=2, T=3]
    data = codes_to_wire(codes)
    assert data == struct.pack("<6h", 1, 10, 2, 20, 3, 30)
    back = codes_from_wire(data, n_codebooks=2)
    assert back.dtype == torch.int64 and torch.equal(back, codes)


def test_codes_from_wire_refuses_partial_frame():
    with pytest.raises(ValueError, match="whole number of frames of 10"):
        codes_from_wire(b"\x00" * 22, n_codebooks=10)
    assert codes_from_wire(b"", n_codebooks=10).shape == (10, 0)


def test_codes_to_wire_refuses_overflow_and_bad_rank():
    with pytest.raises(ValueError, match="int16"):
        codes_to_wire(torch.tensor([[40000]]))
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        codes_to_wire(torch.zeros(3, dtype=torch.int64))


def test_ids_round_trip():
    ids = [0, 5, 351, 2 ** 31 - 1]
    data = ids_to_bytes(ids)
    assert data == struct.pack("<4i", *ids)
    back = ids_from_bytes(data)
    assert back.dtype == torch.int64 and back.tolist() == ids
    assert ids_to_bytes(torch.tensor(ids)) == data
    with pytest.raises(ValueError, match="int32"):
        ids_from_bytes(b"\x00" * 5)


def test_integer_casts_on_the_way_match_torch():
    """tensor_to_bytes(t, dtype) and tensor_from_bytes(..., cast=) cast integers by numpy: the
    same bytes and values as torch's `.to`, wrapping included; floats still cast by torch."""
    codes = torch.tensor([[-1, 0, 7], [1023, 2 ** 15, -(2 ** 15) - 1]])
    assert tensor_to_bytes(codes, torch.int16) == tensor_to_bytes(codes.to(torch.int16))
    data = tensor_to_bytes(codes, torch.int16)
    back = tensor_from_bytes(data, "int16", (2, 3), cast=torch.int64)
    assert back.dtype == torch.int64 and torch.equal(back, codes.to(torch.int16).to(torch.int64))
    hidden = torch.randn(2, 4)
    assert tensor_to_bytes(hidden, torch.bfloat16) == tensor_to_bytes(hidden.to(torch.bfloat16))
    with pytest.raises(ValueError, match="integer dtypes only"):
        tensor_from_bytes(tensor_to_bytes(hidden), "float32", (2, 4), cast=torch.int64)

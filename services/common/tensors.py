"""Tensors, codes and token ids to and from protobuf `bytes` fields (DEVELOPING.md conventions).

Everything on the wire is little-endian and contiguous:
- tensors: raw elements in the named dtype (bfloat16 travels as its 16 bits);
- codes: int16 frame-major `[T, N]` (so a stream appends whole frames); Python APIs use int64 `[N, T]`;
- token ids: int32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# numpy has no bfloat16: those bytes go through int16 with the same 16 bits.
_NUMPY_CARRIER = {
    torch.bfloat16: (torch.int16, np.dtype("<i2")), torch.float16: (torch.float16, np.dtype("<f2")),
    torch.float32: (torch.float32, np.dtype("<f4")), torch.int16: (torch.int16, np.dtype("<i2")),
    torch.int32: (torch.int32, np.dtype("<i4")), torch.int64: (torch.int64, np.dtype("<i8")),
    torch.uint8: (torch.uint8, np.dtype("u1")),
}
# each carrier in this machine's byte order, what tensor_from_bytes copies into (made once: a
# numpy call fewer per decoded tensor on the hops)
_NATIVE = {dtype: np_dtype.newbyteorder("=") for dtype, (_, np_dtype) in _NUMPY_CARRIER.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def tensor_to_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """Raw little-endian bytes of `t` (any shape, C order) in its own dtype, or in `dtype`.

    Between integer dtypes numpy casts (wrapping as torch's `.to` does): a torch call fewer on the
    Step stream's hops, where each costs ~0.05 ms on a CPU that has just woken from a wait."""
    if dtype is not None and dtype != t.dtype:
        if t.dtype.is_floating_point or dtype.is_floating_point:
            t = t.to(dtype)
        elif dtype not in _NUMPY_CARRIER:
            raise ValueError(f"dtype {dtype} cannot go on the wire; expected one of {', '.join(DTYPES)}")
        else:
            return _host_array(t).astype(_NUMPY_CARRIER[dtype][1], copy=False).tobytes()
    return _host_array(t).tobytes()


def _host_array(t: torch.Tensor) -> np.ndarray:
    """`t` as a little-endian C-order numpy array (bfloat16 as its int16 bits)."""
    if t.dtype not in _NUMPY_CARRIER:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire; expected one of {', '.join(DTYPES)}")
    carrier, np_dtype = _NUMPY_CARRIER[t.dtype]
    if t.is_cpu and carrier == t.dtype and not t.requires_grad:
        # A host tensor numpy can read as it is (any strides: tobytes writes C order): one torch
        # call instead of five (detach, cpu, contiguous, view, numpy), ~4 µs less per tensor on
        # the Step stream's hops, where each torch call costs far more on a CPU just woken up.
        array = t.numpy()
    elif t.is_cpu and not t.requires_grad and t.is_contiguous():
        # A contiguous host bfloat16 tensor (the backbone's rows on every frame): its int16 view,
        # two torch calls instead of five.
        array = t.view(carrier).numpy()
    else:
        array = t.detach().cpu().contiguous().view(carrier).numpy()
    return array.astype(np_dtype, copy=False)


def tensor_from_bytes(data: bytes, dtype: str, shape: Sequence[int], *,
                      cast: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of tensor_to_bytes: a new (writable) tensor of `shape` and dtype name `dtype`, or
    of integer dtype `cast` when `dtype` is an integer one (cast by numpy, see tensor_to_bytes)."""
    torch_dtype = dtype_from_name(dtype)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    carrier, np_dtype = _NUMPY_CARRIER[torch_dtype]
    expected = math.prod(shape) * np_dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes do not hold a {dtype} tensor of shape {list(shape)} "
                         f"({expected} bytes expected)")
    if cast is not None and cast != torch_dtype:
        if torch_dtype.is_floating_point or cast.is_floating_point or cast not in _NUMPY_CARRIER:
            raise ValueError(f"cast from {dtype} to {cast}: integer dtypes only")
        torch_dtype = carrier = cast
        target = _NATIVE[cast]
    else:
        target = _NATIVE[torch_dtype]
    # shaped by numpy and viewed by torch only for bfloat16: each torch call costs on the hops
    array = np.frombuffer(data, dtype=np_dtype).astype(target, copy=True).reshape(shape)
    tensor = torch.from_numpy(array)
    return tensor if carrier == torch_dtype else tensor.view(torch_dtype)


def codes_to_wire(codes: torch.Tensor) -> bytes:
    """Codes [N, T] (codebook-major, any int dtype) -> int16 frame-major [T, N] bytes."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be [N, T], got shape {list(codes.shape)}")
    if codes.numel() and (codes.min() < -(2 ** 15) or codes.max() >= 2 ** 15):
        raise ValueError("codes do not fit int16")
    return tensor_to_bytes(codes.t().to(torch.int16))


def codes_from_wire(data: bytes, n_codebooks: int) -> torch.Tensor:
    """int16 frame-major [T, N] bytes -> int64 codes [N, T]."""
    if n_codebooks <= 0:
        raise ValueError(f"n_codebooks must be positive, got {n_codebooks}")
    frame_bytes = 2 * n_codebooks
    if len(data) % frame_bytes:
        raise ValueError(f"{len(data)} bytes are not a whole number of frames of {n_codebooks} "
                         f"int16 codes ({frame_bytes} bytes each)")
    frames = tensor_from_bytes(data, "int16", (len(data) // frame_bytes, n_codebooks))
    return frames.t().to(torch.int64).contiguous()


def ids_to_bytes(ids: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids -> int32 little-endian bytes."""
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() and (ids.min() < -(2 ** 31) or ids.max() >= 2 ** 31):
        raise ValueError("token ids do not fit int32")
    return tensor_to_bytes(ids.to(torch.int32))


def ids_from_bytes(data: bytes) -> torch.Tensor:
    """int32 little-endian bytes -> int64 ids [L]."""
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes are not a whole number of int32 token ids")
    return tensor_from_bytes(data, "int32", (len(data) // 4,)).to(torch.int64)


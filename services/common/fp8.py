"""Block-FP8 math of MODEL.md §4.7, each fast function beside a plain-loop float64 reference.

Shape letters: N = output rows of a weight, K = input columns (the reduction axis), M = rows of
activations (any leading dims flattened), [b0, b1] = weight_block_size (128x128 in Drama 3).

    dequantize_block_fp8(W_q [N,K], S [ceil(N/b0), ceil(K/b1)])  -> W [N,K]
    quantize_block_fp8(W [N,K], block_size)                      -> (W_q, S)   the tiny generator's quantiser
    quantize_activation_fp8(x [..,K], group)                     -> (x_q [..,K], a [.., ceil(K/group)])
    fp8_linear_reference(x [..,K], W_q, S, block_size)           -> y [..,N]   (§4.7 arithmetic, F32 accumulate)

The naive_* siblings take the same arguments and loop over blocks/groups in float64 (the
activation quantiser loops but keeps the float32 arithmetic that defines the rounding).
Trailing partial blocks (N or K not a multiple of the block) use their own scale.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0              # largest finite e4m3fn value; the format has no infinities
WEIGHT_SCALE_FLOOR = 1e-12   # §4.7: an all-zero weight block still gets a finite scale
ACTIVATION_SCALE_FLOOR = 1e-10


def scale_shape(shape: tuple[int, int], block_size: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """[ceil(N/b0), ceil(K/b1)]: the `weight_scale_inv` shape of an [N, K] weight."""
    (n, k), (b0, b1) = shape, block_size
    return (math.ceil(n / b0), math.ceil(k / b1))


def _check_block_args(weight: torch.Tensor, scale_inv: torch.Tensor, block_size) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    b0, b1 = (int(b) for b in block_size)
    expected = scale_shape(tuple(weight.shape), (b0, b1))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} with blocks {(b0, b1)}: expected {expected}")
    return b0, b1


def _expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], b0: int, b1: int) -> torch.Tensor:
    """[ceil(N/b0), ceil(K/b1)] -> [N, K] float32, each scale repeated over its block (cropped at the edge)."""
    n, k = shape
    full = scale_inv.float().repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    return full[:n, :k]


def dequantize_block_fp8(weight_fp8: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[n,k] = float(W_q[n,k]) * S[n//b0, k//b1], computed in float32, returned as `dtype`.

    weight_fp8: [N, K] float8_e4m3fn; scale_inv: [ceil(N/b0), ceil(K/b1)] float32 or bfloat16.
    """
    b0, b1 = _check_block_args(weight_fp8, scale_inv, block_size)
    scales = _expand_scales(scale_inv, tuple(weight_fp8.shape), b0, b1)
    return (weight_fp8.float() * scales).to(dtype)


def naive_dequantize_block_fp8(weight_fp8: torch.Tensor, scale_inv: torch.Tensor,
                               block_size: tuple[int, int] = (128, 128),
                               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Reference for dequantize_block_fp8: a loop over blocks in float64."""
    b0, b1 = _check_block_args(weight_fp8, scale_inv, block_size)
    n, k = weight_fp8.shape
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(0, n, b0):
        for j in range(0, k, b1):
            scale = float(scale_inv[i // b0, j // b1].double())
            out[i:i + b0, j:j + b1] = weight_fp8[i:i + b0, j:j + b1].double() * scale
    return out.to(dtype)


def quantize_block_fp8(w: torch.Tensor, block_size: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: S = max(|W_block|, 1e-12) / 448, W_q = e4m3(W / S) (round to nearest even).

    w: [N, K] any float dtype (math in float32). Returns (W_q [N, K] float8_e4m3fn,
    S [ceil(N/b0), ceil(K/b1)] float32), the `weight` / `weight_scale_inv` pair.
    """
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    b0, b1 = (int(b) for b in block_size)
    n, k = w.shape
    rows, cols = scale_shape((n, k), (b0, b1))
    w32 = w.float()
    # Pad to whole blocks with zeros (they never raise a block's max) so amax is one reduction.
    padded = torch.zeros(rows * b0, cols * b1, dtype=torch.float32)
    padded[:n, :k] = w32
    amax = padded.abs().view(rows, b0, cols, b1).amax(dim=(1, 3))
    scale_inv = amax.clamp_min(WEIGHT_SCALE_FLOOR) / FP8_MAX
    # The clamp only guards against w/S landing a rounding step above 448 (which would be NaN).
    w_q = (w32 / _expand_scales(scale_inv, (n, k), b0, b1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_q, scale_inv


def quantize_activation_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic 1 x `group` quantisation along the last dim (§4.7).

    For each row and group g (the last one may be shorter): a_g = max(max|x_g|, 1e-10) / 448,
    x_q = e4m3(clamp(x / a_g, -448, 448)) with round-to-nearest-even.
    x: [..., K] -> (x_q [..., K] float8_e4m3fn, scales [..., ceil(K/group)] float32).
    """
    k = x.shape[-1]
    groups = math.ceil(k / group)
    x32 = x.float().reshape(-1, k)
    padded = torch.zeros(x32.shape[0], groups * group, dtype=torch.float32)
    padded[:, :k] = x32
    amax = padded.abs().view(-1, groups, group).amax(dim=-1)
    scales = amax.clamp_min(ACTIVATION_SCALE_FLOOR) / FP8_MAX
    per_column = scales.repeat_interleave(group, dim=1)[:, :k]
    x_q = (x32 / per_column).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.reshape(x.shape), scales.reshape(*x.shape[:-1], groups)


def naive_quantize_activation_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for quantize_activation_fp8: loops over rows and groups.

    The arithmetic stays float32 on purpose: the result is defined by float32 division and one
    e4m3 rounding, so the reference must round at the same point to be comparable bit for bit.
    """
    k = x.shape[-1]
    rows = x.float().reshape(-1, k)
    groups = math.ceil(k / group)
    x_q = torch.empty(rows.shape, dtype=FP8_DTYPE)
    scales = torch.empty(rows.shape[0], groups, dtype=torch.float32)
    for r in range(rows.shape[0]):
        for g in range(groups):
            chunk = rows[r, g * group:(g + 1) * group]
            a = torch.clamp_min(chunk.abs().max(), ACTIVATION_SCALE_FLOOR) / FP8_MAX
            scales[r, g] = a
            x_q[r, g * group:(g + 1) * group] = (chunk / a).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.reshape(x.shape), scales.reshape(*x.shape[:-1], groups)


def fp8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int] = (128, 128),
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y[n] = sum_g a_g * S[n//b0, g] * sum_{j in g} x_q[j] * W_q[n, j]  (§4.7), F32 accumulate.

    x: [..., K] (activations, quantised here per 1 x b1 group); w_q: [N, K] float8_e4m3fn;
    scale_inv: [ceil(N/b0), ceil(K/b1)] float32 or bfloat16. Returns [..., N] in `out_dtype`.
    The activation group equals the weight's column block b1, so group g meets scale column g.
    """
    b0, b1 = _check_block_args(w_q, scale_inv, block_size)
    n, k = w_q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, weight expects {k}")
    x_q, a = quantize_activation_fp8(x, group=b1)
    xq = x_q.float().reshape(-1, k)              # [M, K]
    a = a.reshape(-1, a.shape[-1])               # [M, G]
    wq = w_q.float()                             # [N, K]
    row_scales = scale_inv.float().repeat_interleave(b0, dim=0)[:n]   # [N, G]
    y = torch.zeros(xq.shape[0], n, dtype=torch.float32)
    for g in range(row_scales.shape[1]):
        cols = slice(g * b1, (g + 1) * b1)
        partial = xq[:, cols] @ wq[:, cols].T    # [M, N]: integer-ish fp8 products, exact in F32
        y += partial * a[:, g:g + 1] * row_scales[:, g]
    return y.reshape(*x.shape[:-1], n).to(out_dtype)


def naive_fp8_linear(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor,
                     block_size: tuple[int, int] = (128, 128),
                     out_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Reference for fp8_linear_reference: plain loops over rows, outputs and groups in float64."""
    b0, b1 = _check_block_args(w_q, scale_inv, block_size)
    n, k = w_q.shape
    x_q, a = naive_quantize_activation_fp8(x, group=b1)
    xq = x_q.double().reshape(-1, k)
    a = a.double().reshape(xq.shape[0], -1)
    wq, scales = w_q.double(), scale_inv.double()
    y = torch.zeros(xq.shape[0], n, dtype=torch.float64)
    for m in range(xq.shape[0]):
        for out in range(n):
            total = 0.0
            for g in range(a.shape[1]):
                cols = slice(g * b1, (g + 1) * b1)
                dot = float(torch.dot(xq[m, cols], wq[out, cols]))
                total += float(a[m, g]) * float(scales[out // b0, g]) * dot
            y[m, out] = total
    return y.reshape(*x.shape[:-1], n).to(out_dtype)

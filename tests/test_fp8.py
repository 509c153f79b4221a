"""Block-FP8 math (MODEL.md §4.7): fast functions against their float64 plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.fp8 import (
    FP8_DTYPE,
    dequantize_block_fp8,
    fp8_linear_reference,
    naive_dequantize_block_fp8,
    naive_fp8_linear,
    naive_quantize_activation_fp8,
    quantize_activation_fp8,
    quantize_block_fp8,
    scale_shape,
)

# Awkward on purpose: partial edge blocks in one or both dims, a single element, exact multiples.
SHAPES = [(160, 64), (64, 160), (300, 257), (1, 1), (128, 256), (129, 129)]


def _ids(shapes):
    return [f"{n}x{k}" for n, k in shapes]


def _random_fp8_pair(n, k, seed, scale_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    rows, cols = scale_shape((n, k))
    scale_inv = (torch.rand(rows, cols, generator=gen) + 0.01).to(scale_dtype)
    return w_q, scale_inv


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dequantize_matches_float64_reference(shape, scale_dtype):
    """Each element is scaled by its own block's scale, edge blocks included."""
    w_q, scale_inv = _random_fp8_pair(*shape, seed=1, scale_dtype=scale_dtype)
    fast = dequantize_block_fp8(w_q, scale_inv)
    ref = naive_dequantize_block_fp8(w_q, scale_inv)
    assert fast.dtype == torch.float32 and fast.shape == shape
    # One correctly rounded float32 product per element equals the float64 product rounded once.
    assert torch.equal(fast, ref.float())
    if scale_dtype == torch.bfloat16:   # 4 x 8 significant bits: exact even in float32
        assert torch.equal(fast.double(), ref)


def test_dequantize_edge_block_uses_its_own_scale():
    """A [160, 64] weight has two row blocks; rows 128..159 must use scale row 1, not row 0."""
    w_q = torch.ones(160, 64).to(FP8_DTYPE)
    scale_inv = torch.tensor([[2.0], [3.0]])
    out = dequantize_block_fp8(w_q, scale_inv)
    assert torch.all(out[:128] == 2.0) and torch.all(out[128:] == 3.0)


def test_dequantize_output_dtype_and_bad_scale_shape():
    w_q, scale_inv = _random_fp8_pair(160, 64, seed=2)
    assert dequantize_block_fp8(w_q, scale_inv, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_block_fp8(w_q, torch.ones(1, 1))


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_quantize_block_round_trip(shape):
    """Scale = block amax / 448, and dequant(quant(W)) is within e4m3's relative precision."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=gen) / math.sqrt(shape[1])
    w_q, scale_inv = quantize_block_fp8(w)
    assert w_q.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == scale_shape(shape)
    # Block max maps to exactly +-448 after quantisation.
    b = 128
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[i * b:(i + 1) * b, j * b:(j + 1) * b]
            assert scale_inv[i, j] == torch.clamp_min(block.abs().max(), 1e-12) / 448
            assert w_q[i * b:(i + 1) * b, j * b:(j + 1) * b].float().abs().max() == 448.0
    back = dequantize_block_fp8(w_q, scale_inv)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals; subnormals are absolute.
    tol = (w.abs() * 2 ** -4).clamp_min(scale_inv.max() * 2 ** -9)
    assert torch.all((back - w).abs() <= tol)
    assert not torch.isnan(back).any()


def test_quantize_block_zero_block_is_finite():
    w_q, scale_inv = quantize_block_fp8(torch.zeros(130, 5))
    assert torch.all(scale_inv == torch.tensor(1e-12) / 448)
    assert torch.all(w_q.float() == 0)


def test_activation_quant_rounds_to_nearest_even():
    """e4m3 near 1 has steps of 1/8: 1.0625 (a tie) goes to 1.0, 1.1875 (a tie) to 1.25."""
    # amax 448 makes the scale exactly 1, so the values are quantised as written.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 1.07]])
    x_q, scales = quantize_activation_fp8(x)
    assert scales.tolist() == [[1.0]]
    assert x_q.float().tolist() == [[448.0, 1.0, 1.25, -1.0, 1.125]]


@pytest.mark.parametrize("shape", [(3, 257), (2, 5, 128), (1, 1), (4, 300)],
                         ids=["3x257", "2x5x128", "1x1", "4x300"])
def test_activation_quant_matches_loop_reference(shape):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(*shape, generator=gen) * 3
    x[..., :7] *= 50   # one group with a much larger range than the others
    x_q, scales = quantize_activation_fp8(x)
    ref_q, ref_scales = naive_quantize_activation_fp8(x)
    groups = math.ceil(shape[-1] / 128)
    assert scales.shape == (*shape[:-1], groups) and x_q.shape == x.shape
    assert torch.equal(scales, ref_scales)
    assert torch.equal(x_q.float(), ref_q.float())
    # Each group's largest magnitude lands on 448 and x_q * a reconstructs x to 2^-4 relative.
    back = x_q.float() * scales.repeat_interleave(128, dim=-1)[..., :shape[-1]]
    assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scales.max() * 2 ** -9)


def test_activation_quant_zero_row_and_bf16_input():
    x = torch.zeros(2, 130, dtype=torch.bfloat16)
    x[1, 129] = 3.0
    x_q, scales = quantize_activation_fp8(x)
    assert scales[0].tolist() == pytest.approx([1e-10 / 448] * 2)
    assert scales[1, 1].item() == pytest.approx(3.0 / 448)
    assert x_q[1, 129].float().item() == 448.0


@pytest.mark.parametrize("n,k", [(160, 64), (64, 160), (300, 257), (1, 1)],
                         ids=["160x64", "64x160", "300x257", "1x1"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_linear_matches_float64_reference(n, k, scale_dtype):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_q, scale_inv = quantize_block_fp8(w)
    scale_inv = scale_inv.to(scale_dtype)
    x = torch.randn(3, k, generator=gen)
    y = fp8_linear_reference(x, w_q, scale_inv, out_dtype=torch.float32)
    ref = naive_fp8_linear(x, w_q, scale_inv)
    err = (y.double() - ref).abs()
    rel_rms = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()
    assert rel_rms < 1e-6, f"relative RMS {rel_rms:.3g}, max abs {err.max().item():.3g}"
    # Default output is BF16, the same numbers rounded once.
    y_bf16 = fp8_linear_reference(x, w_q, scale_inv)
    assert y_bf16.dtype == torch.bfloat16 and torch.equal(y_bf16, y.to(torch.bfloat16))


def test_fp8_linear_close_to_dequantised_matmul():
    """The block formula approximates x @ dequant(W).T (the looser naive reference of §4.7)."""
    gen = torch.Generator().manual_seed(6)
    w_q, scale_inv = quantize_block_fp8(torch.randn(160, 64, generator=gen) / 8)
    x = torch.randn(2, 7, 64, generator=gen)
    y = fp8_linear_reference(x, w_q, scale_inv, out_dtype=torch.float32)
    assert y.shape == (2, 7, 160)
    dense = x @ dequantize_block_fp8(w_q, scale_inv).T
    rel = (y - dense).norm() / dense.norm()
    assert rel < 0.05, f"relative error {rel:.3g}"


def test_fp8_linear_rejects_mismatched_input():
    w_q, scale_inv = quantize_block_fp8(torch.randn(160, 64))
    with pytest.raises(ValueError, match="input features"):
        fp8_linear_reference(torch.randn(2, 65), w_q, scale_inv)

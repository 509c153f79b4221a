"""The decoder's wide causal convs as one implicit-GEMM Triton kernel, channels-first in and out.

    packed = pack_weight(conv.weight)                       # [C_out, C_in, k] -> [k, C_out, C_in]
    y = implicit_conv1d(window, packed, bias, C_out, k, d)  # [B, C_in, W] -> [B, C_out, L]

A valid (unpadded) stride-1 dilated conv of window[..., start:], L = W - start - (k-1)·d:
    y[b, o, t] = bias[o] + Σ_j Σ_c weight[o, c, j] · window[b, c, start + t + j·d]
the same numbers as conv.shifted_gemm_conv1d's default-layout branch and F.conv1d of the window
(`naive_implicit_conv1d`, the reference beside it).

Why: in the H200 profile of the graphed F16 10 s decode, cuDNN spends ~13% of the time
transposing NCHW <-> NHWC around its F16 convs (torch's default layout is channels-first; its
tensor-core kernels are NHWC), and the wide stride-1 convs (the first conv and every residual
unit's k 7 dilated conv: 768/384/192/96 channels at up to 441k samples) are the biggest part of
the decode. The shifted GEMM avoids the transposes but writes and reads k outputs' worth of
partial sums. Here one program computes a [BLOCK_CO, BLOCK_L] tile of y: for each tap j and each
block of input channels it loads W_j[CO, CI] (the packed weight, C_in contiguous) and the input
tile X[CI, t + start + j·d] (time contiguous: coalesced along time, the layout the decoder
already has) and accumulates W_j @ X with tl.dot in float32. Nothing is transposed or
materialised but y; the bias is added in float32 and y rounded once to the window's dtype.

Tiles: tl.dot wants every dim a power of two >= 16, and the decoder's channels are not all
powers of two (96, 768), so the channel blocks are masked (zeros past C_in / C_out add nothing).
The config is autotuned per (C_in, C_out, dilation, kernel, dtypes), never per length: the
server captures CUDA graphs at many lengths, and a retune inside a capture would break it. So the
first call of a shape must be eager and should be at a length that matters (Codec.prepare:
Decoder.choose_conv_methods times it at a 128-frame piece, Decoder.tune_triton otherwise).

Triton's CPU interpreter (TRITON_INTERPRET=1 when this module is imported) runs the same kernel
with one fixed small config (no autotuning: it times on CUDA), so the kernel is tested without a
GPU (tests/test_codec_conv_triton.py). There the dot runs in float32 for bf16 inputs (the
interpreter multiplies bf16 as raw bits; see services/backbone/kernels.bf16_dot_args).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs have no Triton
    triton = None

# Read once, as triton.jit does when it decorates the kernel below.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The autotuned configs (BLOCK_L output positions x BLOCK_CO output channels per program, BLOCK_CI
# input channels per dot). Wide tiles for the 768/384-channel blocks, narrow BLOCK_CO = 32 ones
# for 96 and 192 channels (3 and 6 exact blocks, no masked rows) whose long lengths need many
# positions per program.
CONFIGS = (
    dict(BLOCK_L=128, BLOCK_CO=128, BLOCK_CI=32, num_warps=8, num_stages=3),
    dict(BLOCK_L=128, BLOCK_CO=64, BLOCK_CI=64, num_warps=4, num_stages=3),
    dict(BLOCK_L=256, BLOCK_CO=64, BLOCK_CI=32, num_warps=8, num_stages=3),
    dict(BLOCK_L=64, BLOCK_CO=128, BLOCK_CI=64, num_warps=4, num_stages=4),
    dict(BLOCK_L=256, BLOCK_CO=32, BLOCK_CI=32, num_warps=4, num_stages=3),
    dict(BLOCK_L=128, BLOCK_CO=32, BLOCK_CI=32, num_warps=4, num_stages=4),
)
# The interpreter's config: small tiles (BLOCK_CI the smallest tl.dot takes), so that small test
# shapes span several blocks along every dim and hit every mask, at a cost the interpreter (one
# numpy op per tile op) keeps to a second or two per test.
INTERPRET_CONFIG = dict(BLOCK_L=64, BLOCK_CO=32, BLOCK_CI=16, num_warps=4, num_stages=1)


def available() -> bool:
    """True where the kernel can run on CUDA tensors: Triton importable and a CUDA device."""
    return triton is not None and torch.cuda.is_available()


def can_run(device) -> bool:
    """True where implicit_conv1d runs on tensors of `device`: CUDA with Triton, or the CPU
    under Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    kind = torch.device(device).type
    return triton is not None and ((kind == "cuda" and torch.cuda.is_available())
                                   or (kind == "cpu" and INTERPRET))


def pack_weight(weight: Tensor) -> Tensor:
    """weight [C_out, C_in, k] -> [k, C_out, C_in] contiguous: W_j's rows of C_in channels are
    what each program loads per tap (a [BLOCK_CO, BLOCK_CI] tile, coalesced along C_in)."""
    return weight.permute(2, 0, 1).contiguous()


def naive_implicit_conv1d(window: Tensor, packed_weight: Tensor, bias: Tensor | None,
                          out_channels: int, kernel: int, dilation: int = 1, start: int = 0) -> Tensor:
    """The reference: F.conv1d of window[..., start:] (a valid conv), same arguments as
    implicit_conv1d, in float64 on CPU (float32 on CUDA); returns [B, C_out, L] in that dtype."""
    dtype = torch.float32 if window.is_cuda else torch.float64
    weight = packed_weight.permute(1, 2, 0)                           # [C_out, C_in, k]
    if weight.shape[0] != out_channels or weight.shape[2] != kernel:
        raise ValueError(f"packed weight {list(packed_weight.shape)} is not [{kernel}, {out_channels}, C_in]")
    return F.conv1d(window[..., start:].to(dtype), weight.to(dtype),
                    None if bias is None else bias.to(dtype), dilation=dilation)


if triton is not None:
    @triton.jit
    def _implicit_conv1d_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, C_in, C_out, L, start, DILATION,
                                stride_xb, stride_xc, stride_yb, stride_yc,
                                KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                                PRECISION: tl.constexpr, BLOCK_L: tl.constexpr,
                                BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr):
        """Program (l block, co block, batch row): y[b, co, l] for BLOCK_CO x BLOCK_L outputs.

        x [B, C_in, W] with time stride 1; w [k, C_out, C_in] contiguous; y [B, C_out, L] with
        time stride 1. K loop: taps j (outer) x input-channel blocks (inner), one flat loop so
        that Triton's software pipelining overlaps the next tiles' loads with this dot.
        """
        pid_l = tl.program_id(0)
        pid_co = tl.program_id(1)
        pid_b = tl.program_id(2).to(tl.int64)        # B·C·W passes 2^31 for large ticks
        offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_co = pid_co * BLOCK_CO + tl.arange(0, BLOCK_CO)
        offs_ci = tl.arange(0, BLOCK_CI)
        in_l = offs_l < L
        in_co = offs_co < C_out
        x_row = x_ptr + pid_b * stride_xb + start
        acc = tl.zeros((BLOCK_CO, BLOCK_L), dtype=tl.float32)
        ci_blocks = tl.cdiv(C_in, BLOCK_CI)
        for step in range(0, KERNEL * ci_blocks):
            j = step // ci_blocks
            ci = (step - j * ci_blocks) * BLOCK_CI + offs_ci
            in_ci = ci < C_in
            # W_j[co, ci]; masked rows and columns are zeros and add nothing
            w = tl.load(w_ptr + (j * C_out + offs_co[:, None]) * C_in + ci[None, :],
                        mask=in_co[:, None] & in_ci[None, :], other=0.0)
            # X[ci, start + l + j·d]: l + j·d < W - start for every l < L, so only l is masked
            x = tl.load(x_row + ci[:, None] * stride_xc + (j * DILATION + offs_l)[None, :],
                        mask=in_ci[:, None] & in_l[None, :], other=0.0)
            if DOT_F32:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_co, mask=in_co, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + pid_b * stride_yb + offs_co[:, None] * stride_yc + offs_l[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=in_co[:, None] & in_l[None, :])

    def _tuning_bench(fn, quantiles=None):
        # Shorter than do_bench's default 25 + 100 ms per config: prepare tunes ~13 shapes x 6
        # configs, and the configs differ by far more than the noise of 20 ms of calls.
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    _TUNING = dict(
        configs=[triton.Config({k: v for k, v in c.items() if k.startswith("BLOCK")},
                               num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in CONFIGS],
        key=["C_in", "C_out", "DILATION", "KERNEL"],      # not L: see the module docstring
    )
    try:
        _implicit_conv1d_tuned = triton.autotune(**_TUNING, do_bench=_tuning_bench)(_implicit_conv1d_kernel)
    except TypeError:  # pragma: no cover - a Triton older than autotune's do_bench argument
        _implicit_conv1d_tuned = triton.autotune(**_TUNING, warmup=5, rep=20)(_implicit_conv1d_kernel)


def implicit_conv1d(window: Tensor, packed_weight: Tensor, bias: Tensor | None, out_channels: int,
                    kernel: int, dilation: int = 1, start: int = 0, config: dict | None = None) -> Tensor:
    """The valid stride-1 conv of window[..., start:] in one Triton kernel (module docstring).

    window [B, C_in, W] (time contiguous; made so otherwise), packed_weight [k, C_out, C_in]
    from `pack_weight` in the window's dtype, bias [C_out] or None -> [B, C_out, L] contiguous,
    L = W - start - (k-1)·d, in the window's dtype (float32 accumulation, one rounding).
    `start` skips inputs a stream keeps only for alignment (as shifted_gemm_conv1d's).
    config: one of CONFIGS to run instead of the autotuned choice (tests, benchmarks).
    """
    if window.dim() != 3:
        raise ValueError(f"window must be [B, C_in, W], got {list(window.shape)}")
    batch, c_in, width = window.shape
    length = width - start - (kernel - 1) * dilation
    if tuple(packed_weight.shape) != (kernel, out_channels, c_in) or length < 0 or start < 0:
        raise ValueError(f"packed weight {list(packed_weight.shape)} for {out_channels} x {kernel} "
                         f"taps (dilation {dilation}) does not fit a window of {c_in} x {width} "
                         f"from {start}")
    if packed_weight.dtype != window.dtype or packed_weight.device != window.device:
        raise ValueError(f"packed weight {packed_weight.dtype} on {packed_weight.device}, window "
                         f"{window.dtype} on {window.device}: pack the weight in the window's")
    if not can_run(window.device):
        raise RuntimeError(f"implicit_conv1d runs on CUDA with Triton, or on the CPU under Triton's "
                           f"interpreter (TRITON_INTERPRET=1); here: {window.device}, Triton "
                           f"{'installed' if triton is not None else 'not installed'}")
    if window.stride(-1) != 1:
        window = window.contiguous()
    packed_weight = packed_weight.contiguous()
    y = torch.empty(batch, out_channels, length, dtype=window.dtype, device=window.device)
    if y.numel() == 0:
        return y
    # float32 operands: IEEE products (no TF32), like the reference; bf16 in the interpreter: float32
    dot_f32 = window.dtype == torch.float32 or (INTERPRET and window.dtype == torch.bfloat16)
    args = (window, packed_weight, packed_weight if bias is None else bias, y, c_in, out_channels,
            length, start, dilation, window.stride(0), window.stride(1), y.stride(0), y.stride(1))
    flags = dict(KERNEL=kernel, HAS_BIAS=bias is not None, DOT_F32=dot_f32,
                 PRECISION="ieee" if dot_f32 else None)
    if config is None and INTERPRET:
        config = INTERPRET_CONFIG
    if config is None:
        def grid(meta):
            return (triton.cdiv(length, meta["BLOCK_L"]), triton.cdiv(out_channels, meta["BLOCK_CO"]), batch)

        _implicit_conv1d_tuned[grid](*args, **flags)
        return y
    grid = (triton.cdiv(length, config["BLOCK_L"]), triton.cdiv(out_channels, config["BLOCK_CO"]), batch)
    _implicit_conv1d_kernel[grid](*args, **flags, **config)
    return y

"""Snake in one GPU kernel (Triton): y = x + sin²(αx)/(α + 1e-9), α per channel (MODEL.md §7.2).

The torch reference, `conv.snake`, is five elementwise kernels (mul, sin, pow, mul, add) that each
read and write the whole activation; the decoder's largest activations (96 channels × 2048
samples per frame) make that a large share of a long decode, and in a streaming step the five
launches are a share of the ~1000 kernels. Here each element is read once and written once, with
the math in float32 (the reference rounds to F16 after every op, so the two agree within F16
rounding, which the GPU tests check on random inputs).

x may be contiguous ([B, C, L] or [B, C, 1, L]) or 4-D channels_last (the decoder's GPU layout):
the channel of a flat offset is (offset // channel_stride) % C, with channel_stride = the
product of the spatial dims for contiguous and 1 for channels_last. Other layouts are copied to
contiguous first.

`fused_snake_window` is the same kernel writing into the next causal conv's input window
[stream tail | snake(x + bias)] (conv.snake_window is its torch reference): the output offset of
each row of x (a (batch, channel) row of length L, or a batch of L·C in channels_last) is moved
past the `pad` elements the tail takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs have no Triton
    triton = None

BLOCK = 2048


def available() -> bool:
    """True where fused_snake can run: Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _snake_kernel(x_ptr, alpha_ptr, bias_ptr, out_ptr, n_elements, channels, channel_stride,
                      row_size, pad, HAS_BIAS: tl.constexpr, PADDED: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        channel = (offsets // channel_stride) % channels
        alpha = tl.load(alpha_ptr + channel, mask=inside, other=1.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        s = tl.sin(alpha * x)
        y = x + s * s / (alpha + 1e-9)
        if PADDED:
            # every row of x (row_size elements) lands after `pad` elements kept for the tail
            offsets = offsets + (offsets // row_size + 1) * pad
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


def _channel_stride(x: Tensor) -> tuple[Tensor, int]:
    """(x in a layout the kernel reads, channel_stride)."""
    if x.is_contiguous():
        return x, x[0, 0].numel()
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return x, 1
    x = x.contiguous()
    return x, x[0, 0].numel()


def _launch(x: Tensor, alpha: Tensor, bias: Tensor | None, out: Tensor, channel_stride: int,
            row_size: int = 1, pad: int = 0) -> None:
    alpha = alpha.reshape(-1)
    grid = (triton.cdiv(x.numel(), BLOCK),)
    _snake_kernel[grid](x, alpha, alpha if bias is None else bias, out, x.numel(), alpha.numel(),
                        channel_stride, row_size, pad, HAS_BIAS=bias is not None, PADDED=pad > 0,
                        BLOCK_SIZE=BLOCK)


def fused_snake(x: Tensor, alpha: Tensor) -> Tensor:
    """snake(x, alpha) for x [B, C, ...] on CUDA; alpha [1, C, 1]. Same layout out as in."""
    if x.numel() == 0:
        return x.clone()
    x, channel_stride = _channel_stride(x)
    out = torch.empty_like(x)        # preserve_format: channels_last stays channels_last
    _launch(x, alpha, None, out, channel_stride)
    return out


def fused_snake_window(x: Tensor, alpha: Tensor, bias: Tensor | None = None,
                       tail: Tensor | None = None) -> Tensor:
    """conv.snake_window in one kernel (plus a small copy of the tail): [tail | snake(x + bias)].

    x [B, C, L] (made contiguous) or 4-D [B, C, 1, L] (made channels_last, the decoder's GPU
    layout); bias [C] or None; tail [B, C, T] / [B, C, 1, T] or None. The result is a new
    window in x's layout family. Why: the decoder's causal convs take [tail | input] windows;
    made with torch.cat that is one more read and write of the whole activation per conv, and
    a conv's bias is one more again; here the Snake that feeds the conv writes straight into
    the window, with the previous conv's bias added on the way in.
    """
    if bias is None and tail is None:
        return fused_snake(x, alpha)
    four_d = x.dim() == 4
    x = x.contiguous(memory_format=torch.channels_last) if four_d else x.contiguous()
    batch, channels, length = x.shape[0], x.shape[1], x.shape[-1]
    history = 0 if tail is None else tail.shape[-1]
    if four_d:
        out = torch.empty(batch, channels, 1, history + length, dtype=x.dtype, device=x.device,
                          memory_format=torch.channels_last)        # physically [B, T + L, C]
        channel_stride, row_size, pad = 1, length * channels, history * channels
    else:
        out = torch.empty(batch, channels, history + length, dtype=x.dtype, device=x.device)
        channel_stride, row_size, pad = length, length, history
    if history:
        out[..., :history].copy_(tail)
    if x.numel():
        _launch(x, alpha, bias, out, channel_stride, row_size, pad)
    return out

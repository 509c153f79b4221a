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
    def _snake_kernel(x_ptr, alpha_ptr, out_ptr, n_elements, channels, channel_stride,
                      BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        channel = (offsets // channel_stride) % channels
        alpha = tl.load(alpha_ptr + channel, mask=inside, other=1.0).to(tl.float32)
        s = tl.sin(alpha * x)
        y = x + s * s / (alpha + 1e-9)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


def _channel_stride(x: Tensor) -> tuple[Tensor, int]:
    """(x in a layout the kernel reads, channel_stride)."""
    if x.is_contiguous():
        return x, x[0, 0].numel()
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return x, 1
    x = x.contiguous()
    return x, x[0, 0].numel()


def fused_snake(x: Tensor, alpha: Tensor) -> Tensor:
    """snake(x, alpha) for x [B, C, ...] on CUDA; alpha [1, C, 1]. Same layout out as in."""
    if x.numel() == 0:
        return x.clone()
    x, channel_stride = _channel_stride(x)
    out = torch.empty_like(x)        # preserve_format: channels_last stays channels_last
    alpha = alpha.reshape(-1)
    grid = (triton.cdiv(x.numel(), BLOCK),)
    _snake_kernel[grid](x, alpha, out, x.numel(), alpha.numel(), channel_stride, BLOCK_SIZE=BLOCK)
    return out

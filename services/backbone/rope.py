"""Partial NeoX rotary embedding (MODEL.md §4.4 step 2).

Only the first r = head_dim · partial_rotary_factor dims of a head rotate; dim i pairs with
dim i + r/2 (NeoX "rotate half", not interleaved). Angles are F32: ω_i = θ^(−2i/r), angle p·ω_i.

    rope_inv_freq(r, theta)                   -> ω [r/2] F32, computed exactly as transformers does
    apply_rope(x [T, n, d], cos, sin [T, r/2]) -> x rotated on [..., :r]
    naive_apply_rope(...)                      the same in float64 with a loop over pairs
    RotaryTable(r, theta).lookup(pos [T])      -> cos, sin [T, r/2]
"""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """ω_i = 1 / θ^(2i/r), i = 0..r/2−1, F32 (same expression as transformers' default RoPE)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+r/2}) of the first r dims by the angle whose cos/sin are given.

    x [T, n, d]; cos, sin [T, r/2] F32. Math in F32, result in x's dtype.
    """
    half = cos.shape[-1]
    rot = 2 * half
    x32 = x.float()
    x1, x2, rest = x32[..., :half], x32[..., half:rot], x32[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def naive_apply_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Reference: float64 angles and a loop over rotated pairs. x [T, n, d], positions [T]."""
    out = x.double().clone()
    half = rotary_dim // 2
    for i in range(half):
        omega = 1.0 / theta ** (2 * i / rotary_dim)
        angle = positions.double() * omega
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., i].double(), x[..., i + half].double()
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


class RotaryTable:
    """cos/sin of p·ω for every position, grown on demand in fixed blocks of positions.

    Each block is computed by one elementwise call over positions [k·B, (k+1)·B), so the value
    for position p is always produced at the same place of the same-shaped tensor; a lookup is
    then a gather, and a row's angles never depend on which rows were processed with it.
    """

    BLOCK = 1024

    def __init__(self, rotary_dim: int, theta: float, device=None):
        self.inv_freq = rope_inv_freq(rotary_dim, theta, device)
        self.cos = torch.empty(0, rotary_dim // 2, device=device)
        self.sin = torch.empty(0, rotary_dim // 2, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, sin) [T, r/2] F32."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        while self.cos.shape[0] < needed:
            start = self.cos.shape[0]
            pos = torch.arange(start, start + self.BLOCK, device=self.inv_freq.device).float()
            freqs = pos[:, None] * self.inv_freq[None, :]
            self.cos = torch.cat([self.cos, freqs.cos()])
            self.sin = torch.cat([self.sin, freqs.sin()])
        return self.cos[positions], self.sin[positions]

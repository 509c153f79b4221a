"""The windowed causal transformer of the codec (MODEL.md §7.2): pre/post module and the
encoder-block transformer.

Shape letters: B batch, T frames (time steps), C model dim, H heads, h head dim, W window.

`n_layer` blocks of  x ← x + γ_a ⊙ Attn(RMSNorm(x)),  x ← x + γ_f ⊙ w2(silu(w1 x) ⊙ w3 x),
then a final RMSNorm (no outer residual). Attention is causal and sees only the last W
positions; RoPE rotates interleaved pairs with cos/sin rounded to BF16, as the reference's BF16
table does. Positions count from the first frame of the stream.

Offline (`forward`) attends over the sequence itself in query blocks (so memory is O(T·W), not
O(T²)). Streaming (`step`) keeps, per layer, K (after RoPE) and V of the last W-1 frames in the
stream state; slot j of that cache holds position `position - (W-1) + j` (negative = empty).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.codec.state import StreamState


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------

def rope_inverse_frequencies(head_dim: int, base: float) -> Tensor:
    """ω_i = base^(-2i/h) for i < h/2, float32 [h/2] (computed as the reference does)."""
    exponents = torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim
    return 1.0 / (base ** exponents)


_INVERSE_FREQUENCIES: dict[tuple[int, float, torch.device], Tensor] = {}


def _inverse_frequencies_on(head_dim: int, base: float, device: torch.device) -> Tensor:
    """rope_inverse_frequencies, kept per device: a host-to-device copy inside a CUDA graph
    capture would be illegal, and per call it is a sync the decode step does not need."""
    key = (head_dim, float(base), torch.device(device))
    if key not in _INVERSE_FREQUENCIES:
        _INVERSE_FREQUENCIES[key] = rope_inverse_frequencies(head_dim, base).to(device)
    return _INVERSE_FREQUENCIES[key]


def rope_cos_sin(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin of position·ω_i, computed in float32 then rounded to BF16 (§7.2).

    positions: int64 [...]; returns two float32 tensors [..., h/2] holding BF16 values.
    """
    inv_freq = _inverse_frequencies_on(head_dim, base, positions.device)
    angles = positions.float()[..., None] * inv_freq
    rotation = torch.polar(torch.ones_like(angles), angles)
    return rotation.real.to(torch.bfloat16).float(), rotation.imag.to(torch.bfloat16).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x_2i, x_2i+1) of x [B, T, H, h] by cos/sin [B or 1, T, h/2].

    Computed in float32, returned in x's dtype.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain-gain RMSNorm over the last dim; statistics in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)).type_as(x) * weight


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """True where query position i may see key position j: 0 <= i - j < window and j >= 0.

    q_pos [B, Tq], k_pos [B, Tk] (int64) -> bool [B, 1, Tq, Tk].
    """
    distance = q_pos[:, :, None] - k_pos[:, None, :]
    visible = (distance >= 0) & (distance < window) & (k_pos[:, None, :] >= 0)
    return visible[:, None]


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
                       window: int, visible: Tensor | None = None) -> Tensor:
    """Causal window-limited attention, scale h^-1/2, scores and softmax in float32.

    q [B, H, Tq, h], k/v [B, H, Tk, h], q_pos [B, Tq], k_pos [B, Tk] -> [B, H, Tq, h] (q's dtype).
    Every query must see at least one key (its own position). `visible`: window_mask(q_pos,
    k_pos, window) when the caller already has it (the same for every layer of a step).
    """
    if visible is None:
        visible = window_mask(q_pos, k_pos, window)
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).type_as(q)


def fused_windowed_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """The GPU step's windowed_attention: one fused SDPA kernel (memory-efficient backend: F32
    accumulation and softmax) instead of ~10 separate ops; equal to it within F16 rounding.

    q [B, H, Tq, h], k/v [B, H, Tk, h] in the decode dtype, visible bool [B, 1, Tq, Tk].
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Pinned to memory-efficient (or math): cuDNN attention plans per shape and has been seen
    # rebuilding them on every call; flash takes no mask.
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def apply_rope_qk(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope on q and k at once: qk [B, T, 2, H, h], cos/sin [B, T, h/2] (F32 math, same
    per-element ops as apply_rope, half the launches)."""
    pairs = qk.float().reshape(*qk.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, None, :], sin[:, :, None, None, :]
    rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)
    return rotated.flatten(-2).type_as(qk)


def blocked_windowed_attention(q: Tensor, k: Tensor, v: Tensor, window: int,
                               block: int | None = None) -> Tensor:
    """Offline windowed attention over one sequence (positions 0…T-1), in query blocks.

    A block of queries [s, e) needs only keys [s-W+1, e), so memory stays O(T·W).
    """
    length = q.shape[2]
    block = block or max(window, 64)
    positions = torch.arange(length, device=q.device)[None]
    outputs = []
    for start in range(0, length, block):
        end = min(length, start + block)
        first_key = max(0, start - window + 1)
        outputs.append(windowed_attention(q[:, :, start:end], k[:, :, first_key:end],
                                          v[:, :, first_key:end], positions[:, start:end],
                                          positions[:, first_key:end], window))
    return torch.cat(outputs, dim=2)


# --------------------------------------------------------------------------------------------
# modules (names match the checkpoint: layers.{l}.attention.wqkv, …)
# --------------------------------------------------------------------------------------------

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]   # (q, k, v) [B, H, T, h] -> [B, H, T, h]


class RMSNorm(nn.Module):
    fused = False           # GPU: torch's fused F.rms_norm (set by Codec.prepare)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            # One kernel instead of ~7; statistics in F32 as rms_norm, the gain applied before
            # the single rounding (rms_norm rounds twice), so equal within one F16 ulp.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)

    fused_rope = False      # GPU step: rotate q and k in one go (set by Codec.prepare)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """x [B, T, C] -> [B, T, C]; `attend` supplies the keys (offline or from the cache)."""
        batch, length, _ = x.shape
        qkv = self.wqkv(x).view(batch, length, 3, self.n_head, self.head_dim)
        if self.fused_rope:
            q, k = apply_rope_qk(qkv[:, :, :2], cos, sin).unbind(2)
            v = qkv[:, :, 2]
        else:
            q, k, v = qkv.unbind(2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(y.transpose(1, 2).reshape(batch, length, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate_size, bias=False)
        self.w3 = nn.Linear(dim, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int, intermediate_size: int, eps: float):
        super().__init__()
        self.attention = Attention(dim, n_head, head_dim)
        self.feed_forward = FeedForward(dim, intermediate_size)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), cos, sin, attend))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowedTransformer(nn.Module):
    """Channels-first windowed causal transformer: x [B, C, T] -> [B, C, T]."""

    def __init__(self, dim: int, n_layer: int, n_head: int, head_dim: int, intermediate_size: int,
                 window: int, rope_base: float, norm_eps: float):
        super().__init__()
        self.window, self.head_dim, self.rope_base = window, head_dim, rope_base
        self.n_head = n_head
        self.layers = nn.ModuleList(TransformerBlock(dim, n_head, head_dim, intermediate_size, norm_eps)
                                    for _ in range(n_layer))
        self.norm = RMSNorm(dim, norm_eps)
        self.state_key = ""   # set by the model; cache keys are f"{state_key}.layers.{l}/k" and "/v"
        self.fused_attention = False     # GPU step: fused_windowed_attention (set by Codec.prepare)

    def forward(self, x: Tensor) -> Tensor:
        """Offline: the whole sequence, positions 0…T-1."""
        x = x.transpose(1, 2)
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_base)
        attend = lambda q, k, v: blocked_windowed_attention(q, k, v, self.window)  # noqa: E731
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.norm(x).transpose(1, 2)

    # -- streaming ---------------------------------------------------------------------------

    def cache_keys(self, layer: int) -> tuple[str, str]:
        return f"{self.state_key}.layers.{layer}/k", f"{self.state_key}.layers.{layer}/v"

    def initial_state(self, batch: int, device, dtype) -> dict[str, Tensor]:
        shape = (batch, self.n_head, self.window - 1, self.head_dim)
        out = {}
        for layer in range(len(self.layers)):
            for key in self.cache_keys(layer):
                out[key] = torch.zeros(shape, device=device, dtype=dtype)
        return out

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        """Streaming: x [B, C, t], the next t frames of each stream, at state.position."""
        x = x.transpose(1, 2)
        t, cached = x.shape[1], self.window - 1
        q_pos = state.position[:, None] + torch.arange(t, device=x.device)
        k_pos = state.position[:, None] + torch.arange(-cached, t, device=x.device)
        cos, sin = rope_cos_sin(q_pos, self.head_dim, self.rope_base)
        visible = window_mask(q_pos, k_pos, self.window)        # the same for every layer
        for index, layer in enumerate(self.layers):
            k_key, v_key = self.cache_keys(index)

            def attend(q, k, v, k_key=k_key, v_key=v_key):
                k_all = torch.cat([state.tensors[k_key], k], dim=2)
                v_all = torch.cat([state.tensors[v_key], v], dim=2)
                state.tensors[k_key] = k_all[:, :, k_all.shape[2] - cached:].clone()
                state.tensors[v_key] = v_all[:, :, v_all.shape[2] - cached:].clone()
                if self.fused_attention:
                    return fused_windowed_attention(q, k_all, v_all, visible)
                return windowed_attention(q, k_all, v_all, q_pos, k_pos, self.window, visible)

            x = layer(x, cos, sin, attend)
        return self.norm(x).transpose(1, 2)

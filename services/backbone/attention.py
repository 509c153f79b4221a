"""Gated full attention with a KV cache (MODEL.md §4.4).

Shape letters: R rows, n_q query heads, n_kv KV heads (GQA: query head h uses KV head
h // (n_q/n_kv)), d head dim, r rotary dims, L keys visible to a row (its position + 1).

    split_query_gate(qg [R, n_q·2d], n_q, d) -> q [R, n_q, d], gate [R, n_q·d]   (per head: d query, d gate)
    attend_row(q [n_q, d], keys, values [n_kv, L, d], scale)  -> [n_q, d]   one query row, F32 softmax
    attend_rows(q [n, n_q, d], keys, values [n_kv, L, d], start, scale) -> [n, n_q, d]   batched, masked
    naive_attention(q [T, n_q, d], k, v [T, n_kv, d], scale)  -> [T, n_q, d]   float64 causal reference

    attend_slots(q [B, n_q, d], k_pool, v_pool [S, n_kv, L_max, d], slots, positions [B], context, scale)
        -> [B, n_q, d]   one row per session, each over its own slot's keys ≤ its position
                         (CUDA: Triton flash-decoding over the pool, kernels/attention.py; else SDPA + mask)
    attend_segment(q [n, n_q, d], keys, values [n_kv, L_max, d], start, scale) -> [n, n_q, d]
                         SDPA, causal (lower right), flash / memory-efficient backends on CUDA

The exact (CPU) path attends one query row at a time over exactly its L keys, so the shapes a row
sees (and with them the reduction order) depend only on its position, never on how many rows
arrived in the same call; the batched form is for the GPU path. The kernel path (Backbone.kernels)
fuses q|k|v into one GEMM, does q/k norm + RoPE + the KV write in one Triton launch
(kernels/decode_graph.attention_prologue); a decode step attends in one Triton call over the slot
pool (`attend_slots`), other steps per segment through SDPA (`attend_segment`). Neither lets torch
pick cuDNN, whose SDPA re-plans for every new key length.
Batch invariance (issue #8): both GEMMs go through services/common/invariant.linear_rows (on
CUDA decode steps through kernels/decode_gemm.decode_linear unless DRAMA_DECODE_GEMM=cublas); the
prologue works per row; decode attention's split size comes from the pool length (not from the
step's longest row); a prefill segment's SDPA call sees only that session's rows and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from services.common import invariant
from services.common.config import TextConfig

from .kernels import attention as kattn
from .kernels import decode_gemm
from .kernels import decode_graph as dg
from .layers import Linear, RowBatch, Weight, fuse_linears, per_row, rms_norm_plus
from .rope import apply_rope


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------

def split_query_gate(qg: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj output [R, n_q·2d] -> query [R, n_q, d] and output gate [R, n_q·d]."""
    per_head = qg.reshape(qg.shape[0], num_heads, 2 * head_dim)
    return per_head[..., :head_dim], per_head[..., head_dim:].reshape(qg.shape[0], -1)


def attend_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scale) V for one query row over all given keys, in F32.

    q [n_q, d], keys/values [n_kv, L, d]. Products and sums are plain elementwise ops and
    reductions on fresh tensors whose shapes depend only on L.
    """
    n_kv, _, d = keys.shape
    group = q.shape[0] // n_kv
    qg = q.float().reshape(n_kv, group, 1, d)
    scores = (qg * keys.float()[:, None]).sum(-1) * scale                  # [n_kv, group, L]
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * values.float()[:, None]).sum(-2)              # [n_kv, group, d]
    return out.reshape(n_kv * group, d).to(q.dtype)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                scale: float) -> torch.Tensor:
    """Causal attention of n query rows at positions start..start+n−1 over keys [n_kv, L, d]."""
    n, n_q, d = q.shape
    n_kv, length, _ = keys.shape
    group = n_q // n_kv
    qg = q.float().reshape(n, n_kv, group, d).permute(1, 2, 0, 3)           # [n_kv, group, n, d]
    scores = qg @ keys.float().transpose(-1, -2)[:, None] * scale           # [n_kv, group, n, L]
    pos = torch.arange(start, start + n, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.float()[:, None]           # [n_kv, group, n, d]
    return out.permute(2, 0, 1, 3).reshape(n, n_q, d).to(q.dtype)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention in float64 with loops over rows and heads. q [T, n_q, d], k/v [T, n_kv, d]."""
    length, n_q, d = q.shape
    group = n_q // k.shape[1]
    out = torch.zeros(length, n_q, d, dtype=torch.float64)
    for t in range(length):
        for h in range(n_q):
            keys, vals = k[:t + 1, h // group].double(), v[:t + 1, h // group].double()
            out[t, h] = torch.softmax(keys @ q[t, h].double() * scale, dim=0) @ vals
    return out


def attend_slots(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, context: int, scale: float, gate: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per session: row b (slot slots[b], position positions[b]) attends over keys
    0..positions[b] of its slot. On CUDA the Triton flash-decoding kernel reads the pool where it
    lies, lengths from the positions tensor (kernels/attention.py: no gather, no cuDNN re-planning,
    one CUDA graph for every position); elsewhere (and as its reference) one SDPA call over the
    gathered keys [0, context) with a length mask. GQA: head h uses KV head h // (n_q/n_kv).
    gate, out: the output gate o ⊙ σ(gate) applied in the same launch, written into out."""
    return kattn.decode_attention(q, k_pool, v_pool, slots, positions, context, scale, gate, out)


def attend_segment(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float
                   ) -> torch.Tensor:
    """n query rows at positions start..start+n−1 of one session over its keys [n_kv, L_max, d]
    (rows 0..start+n−1 valid), causal, through SDPA (KV heads repeated to n_q).

    Causal with the diagonal at the bottom right (row i sees keys ≤ start + i) through torch's
    `causal_lower_right` bias rather than a boolean mask, and on CUDA only the flash and
    memory-efficient backends: with a mask torch picks cuDNN on the H200, which builds a new plan
    for every key length (milliseconds of host time per call); flash and efficient take the causal
    offset natively and never re-plan."""
    n, n_q, d = q.shape
    end = start + n
    group = n_q // keys.shape[0]
    k = keys[:, :end].repeat_interleave(group, dim=0)[None]                                # [1, n_q, end, d]
    v = values[:, :end].repeat_interleave(group, dim=0)[None]
    qh = q.transpose(0, 1)[None]                                                          # [1, n_q, n, d]
    if not q.is_cuda:
        return _sdpa_lower_right(qh, k, v, n, end, scale)[0].transpose(0, 1)
    with sdpa_kernel(_PREFILL_BACKENDS):
        return _sdpa_lower_right(qh, k, v, n, end, scale)[0].transpose(0, 1)


_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _sdpa_lower_right(qh, k, v, n: int, end: int, scale: float) -> torch.Tensor:
    if n == end:
        return F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(n, end), scale=scale)


# --------------------------------------------------------------------------------------------
# cache and module
# --------------------------------------------------------------------------------------------

@dataclass
class KVCache:
    """Post-norm, post-RoPE keys and values of one attention layer: k, v [S, n_kv, max_context, d].
    Rows at or past a slot's length are never read, so opening a slot need not clear them."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: TextConfig, slots: int, max_context: int, dtype, device) -> "KVCache":
        shape = (slots, cfg.num_key_value_heads, max_context, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def reset_views(self, slot: int) -> list[torch.Tensor]:
        """Nothing to zero: a slot's keys past its length are never read."""
        return []

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class GatedAttention(nn.Module):
    """`self_attn` of a full-attention layer; parameter names are the checkpoint's."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.eps, self.scale = cfg.rms_norm_eps, d ** -0.5
        kw = dict(dtype=dtype, device=device)
        self.q_proj = Linear(h, 2 * self.num_heads * d, **kw)
        self.k_proj = Linear(h, self.num_kv_heads * d, **kw)
        self.v_proj = Linear(h, self.num_kv_heads * d, **kw)
        self.o_proj = Linear(self.num_heads * d, h, **kw)
        self.q_norm = Weight(d, **kw)
        self.k_norm = Weight(d, **kw)
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta

    def _project(self, u, cos, sin):
        """u [R, H] -> q [R, n_q, d], gate [R, n_q·d], k, v [R, n_kv, d] (q, k normed and rotated)."""
        q, gate = split_query_gate(self.q_proj(u), self.num_heads, self.head_dim)
        k = self.k_proj(u).reshape(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(u).reshape(-1, self.num_kv_heads, self.head_dim)
        q = apply_rope(rms_norm_plus(q, self.q_norm.weight, self.eps), cos, sin)
        k = apply_rope(rms_norm_plus(k, self.k_norm.weight, self.eps), cos, sin)
        return q, gate, k, v

    def _output(self, o, gate):
        """o [R, n_q, d], gate [R, n_q·d] -> o_proj(o ⊙ σ(gate)) [R, H]."""
        return self.o_proj(o.reshape(o.shape[0], -1) * torch.sigmoid(gate))

    def forward(self, u: torch.Tensor, batch: RowBatch, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """u [R, H] normed layer input, cos/sin [R, r/2] of each row's position -> [R, H]."""
        q, gate, k, v = per_row(self._project, u, cos, sin, exact=batch.exact)
        outs = []
        for seg in batch.segments:
            end = seg.start + seg.count
            cache.k[seg.slot, :, seg.start:end] = k[seg.rows].transpose(0, 1)
            cache.v[seg.slot, :, seg.start:end] = v[seg.rows].transpose(0, 1)
            keys, values = cache.k[seg.slot, :, :end], cache.v[seg.slot, :, :end]
            if batch.exact:
                outs += [attend_row(q[seg.offset + t], keys[:, :seg.start + t + 1],
                                    values[:, :seg.start + t + 1], self.scale)[None]
                         for t in range(seg.count)]
            else:
                outs.append(attend_rows(q[seg.rows], keys, values, seg.start, self.scale))
        return per_row(self._output, torch.cat(outs), gate, exact=batch.exact)

    # kernel path (Backbone.kernels) ----------------------------------------------------------
    def pack_kernels(self) -> None:
        """Load-time layout of the kernel path: [q_proj | k_proj | v_proj] as one weight, o_proj dense."""
        self.qkv_fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.o_weight = self.o_proj.dense_weight()

    def forward_kernels(self, u: torch.Tensor, x: torch.Tensor, batch: RowBatch, cache: KVCache,
                        x_owned: bool = False, post_norm: tuple[torch.Tensor, float] | None = None):
        """x + o_proj(attention(u)) [R, H] for u = RMSNorm⁺(x), BF16; writes the rows' k/v into the pool.
        post_norm (w, eps), on decode steps that take decode_linear: (that, its RMSNorm⁺) from
        decode_linear's `norm`."""
        plan = batch.plan
        rows, n_q, d = u.shape[0], self.num_heads, self.head_dim
        linear = decode_gemm.dense_linear(plan.decode, u, plan.gemm_rows)  # decode_linear on CUDA decode steps
        qkv = linear(u, self.qkv_fused)                                  # [R, 2·n_q·d + 2·n_kv·d]
        q = dg.attention_prologue(qkv, self.q_norm.weight, self.k_norm.weight, cache.k, cache.v,
                                  plan.row_slots, plan.positions, n_q=n_q, n_kv=self.num_kv_heads, d_h=d,
                                  rotary_dim=self.rotary_dim, theta=self.rope_theta, eps=self.eps)
        gate = qkv[:, :2 * n_q * d].view(rows, n_q, 2 * d)[..., d:]
        y = invariant.empty_rows(rows, n_q * d, dtype=q.dtype, device=q.device)   # o_proj reads it in place
        if plan.row_mask is not None and kattn.PIECE_ATTENTION == "tiled" and kattn.piece_supported(q, cache.k):
            # padded prefill pieces, a block of a piece's rows sharing its keys
            # (kernels/attention.piece_attention; DRAMA_PIECE_ATTENTION=rows: the branch below)
            pieces = plan.seg_slots.shape[0]
            kattn.piece_attention(q, cache.k, cache.v, plan.seg_slots, plan.positions, plan.seg_rows,
                                  rows // pieces, self.scale, gate=gate, out=y.view(rows, n_q, d))
        elif plan.decode or plan.row_mask is not None:
            # each row over keys [0, its position] of its slot: decode rows, and the rows of a
            # padded prefill piece (their keys were all written by the prologue above).
            # plan.context: the pool length in a graph, and eagerly too with batch invariance on
            # (the split size follows it; Backbone._eager_kernels). The gate is applied in the
            # attention's last launch.
            attend_slots(q, cache.k, cache.v, plan.row_slots, plan.positions, plan.context, self.scale,
                         gate=gate, out=y.view(rows, n_q, d))
        else:
            o = torch.cat([attend_segment(q[seg.rows], cache.k[seg.slot], cache.v[seg.slot], seg.start, self.scale)
                           for seg in batch.segments])
            kattn.gate_output(o, gate, out=y.view(rows, n_q, d))
        if post_norm is not None:      # decode_linear: the next norm in its split reduce's launch
            return decode_gemm.decode_linear(y, self.o_weight, x, norm=post_norm)
        return linear(y, self.o_weight, x, residual_out=x_owned)        # x + y·W_oᵀ, one rounding

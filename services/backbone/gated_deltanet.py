"""Gated DeltaNet, the backbone's linear-attention mixer (MODEL.md §4.3).

Shape letters: T rows, C = 64 chunk rows, H value heads (q/k heads already repeated to H), K key
head dim d_k, V value head dim d_v, c conv width. States S are [H, K, V] F32.

Math first (pure functions), then references, then the module:

    causal_conv_taps(window [n+K_c−1, c], w [c, K_c])  -> pre-activation conv output [n, c]
    l2_normalize(x, eps=1e-6)                           -> x / sqrt(Σx² + eps) over the last dim
    gdn_gates(a, b, A_log, dt_bias)                     -> g = −exp(A_log)·softplus(a+dt_bias), β = σ(b)
    gdn_chunk(q, k, v, g, beta, S) [H, C, ·]            -> (o [H, C, V], S_end, [U | W]): one 64-row chunk
    chunk_gated_delta_rule(q, k, v, g, beta, S0) [T, H, ·]      chunk by chunk from position 0
    recurrent_gated_delta_rule(q, k, v, g, beta, S0) [T, H, ·]  the recurrence, one row at a time
    naive_recurrent_gated_delta_rule / naive_chunk_gated_delta_rule   float64, loops, for tests

Why the engine path always uses the chunk form, even for one decode row: a row's output must be
bit-identical however the prompt was cut into append calls (issue #4), and a one-row append is
the same call whether the caller thinks of it as prefill or decode. Chunks are aligned to
absolute positions (multiples of 64 from the sequence start) and always computed at the full
padded size C, so a row's arithmetic depends only on the rows before it in its chunk and on the
state at the chunk start. The cache keeps that state plus the chunk's earlier rows (k̂, g and
their solved rows of [U | W]); a call solves only its new rows, redoes the chunk-size GEMMs, and
advances the state when the chunk is complete. A decode row thus costs the chunk-size GEMMs
(O(C·d_k·d_v) per head instead of the recurrence's O(d_k·d_v)), nothing on the tiny CPU model.
Zero padding (β = g = 0, q = k = v = 0) is exact, and not-yet-arrived rows j > i enter row i only
through exact zeros of the causal masks.

The batched path (`Backbone.exact` False, the GPU default, chosen once) keeps the state after the
last row instead, and runs the recurrence for a one-row call and the chunk form from the call's
first row otherwise: the same math (tests/test_backbone_parts.py holds the two forms equal), not
the same bits across splits.

The kernel path (`Backbone.kernels`: CUDA, Triton, BF16) is the batched path on the GPU kernels
of services/backbone/kernels/gdn.py: one fused [qkv | z | b | a] GEMM; a decode step (one row per
session) runs the conv update and the in-place recurrence on the slot pool directly (conv state
[S, c, K_c−1] BF16, state [S, H, K, V] F32); any other step packs all sessions' rows into one
GDN front (`kernels.gdn.prefill_front`: conv, silu, gates and the new conv states in two
launches) and one fla chunk call, with cu_seqlens eagerly, or one fla sequence per piece for the
padded pieces of the prefill graphs (StepPlan.row_mask).
Batch invariance (issue #8): the GEMMs go through services/common/invariant.linear_rows (on
CUDA decode steps through kernels/decode_gemm.decode_linear unless DRAMA_DECODE_GEMM=cublas); the
conv, gates, decode recurrence and gated norm work per row (or per slot and head) with fixed
launch configs; fla's varlen chunk kernels give each sequence its own chunks (chunk_indices from
cu_seqlens), and their autotuning keys hold head counts and sizes, not T or the number of
sequences (checked on fla's main branch), so a session's rows get the same kernels alone or
packed with others. One exception: fla's q/k l2norm keys its config on NB = ⌈T·n_k/65536⌉,
which is 1 for every step of up to 65536/n_k rows (4096 at the full geometry), above the
scheduler's prefill row budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common import invariant
from services.common.config import TextConfig

from .kernels import decode_gemm
from .kernels import gdn as kgdn
from .layers import Linear, RowBatch, Segment, Weight, fuse_linears, per_row, rms_norm

CHUNK = 64
L2_EPS = 1e-6   # fixed in the kernel, whatever rms_norm_eps is (§4.2)


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------

def causal_conv_taps(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv, before the activation: out[t] = Σ_j w[:, j] · window[t + j].

    window [n + K_c − 1, c] = the K_c − 1 previous inputs followed by the n new ones;
    weight [c, K_c]. Returns [n, c]. Taps are summed in a fixed order with separate elementwise
    multiplies and adds (both exact IEEE ops), so each row's result is independent of n.
    """
    taps = weight.shape[1]
    n = window.shape[0] - taps + 1
    out = window[0:n] * weight[:, 0]
    for j in range(1, taps):
        out = out + window[j:j + n] * weight[:, j]
    return out


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x · (Σx² + eps)^(−1/2) over the last dim (fla's / transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """g = −exp(A_log)·softplus(a + dt_bias) (≤ 0, log decay), β = σ(b); both F32, [.., H]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


_MASKS: dict = {}


def _masks(size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[size, size] bool masks j > i and j ≥ i, made once per size and device."""
    key = (size, str(device))
    if key not in _MASKS:
        ones = torch.ones(size, size, dtype=torch.bool, device=device)
        _MASKS[key] = (ones.triu(1), ones.triu(0))
    return _MASKS[key]


def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, *, known: torch.Tensor | None = None, rows: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of the delta rule in the UT-transform form of §4.3, all F32.

    q, k [H, C, K] (q already scaled by K^−1/2), v [H, C, V], g, beta [H, C], state [H, K, V]
    (the state before the chunk's first row). Returns (o [H, C, V], state after row C−1,
    solved [H, C, V+K] = [U | W]). Row i of every output reads only rows ≤ i, so a chunk padded
    with zeros gives the real rows exactly.

    known: rows [0, f) of `solved` from an earlier call on the same chunk (row i of [U | W]
    depends only on rows ≤ i, so they are reused instead of re-solved); rows: the number of real
    rows (solved rows past it are the exact zeros padding would give, and are not computed).
    """
    heads, size, _ = k.shape
    rows = size if rows is None else rows
    future, upper = _masks(size, k.device)
    gamma = g.cumsum(dim=-1)                                          # γ_i = Σ_{j≤i} g_j
    gamma_exp = gamma.exp()
    decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(future, float("-inf")).exp()  # Γ
    # A_ij = β_i (k̂_i·k̂_j) Γ_ij below the diagonal; T = (I + A)^−1 is applied by forward
    # substitution on [U | W] = T [diag(β) V | diag(β e^γ) K̂], one row at a time, so row i only
    # ever reads rows < i (a blocked triangular solver could mix in rows it has not got yet).
    a = (beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0.0)
    rhs = torch.cat([beta[..., None] * v, (beta * gamma_exp)[..., None] * k], dim=-1)
    solved = torch.zeros_like(rhs)
    first = 0 if known is None else known.shape[1]
    if first:
        solved[:, :first] = known
    for i in range(first, rows):
        solved[:, i] = rhs[:, i] if i == 0 else rhs[:, i] - (a[:, i:i + 1, :i] @ solved[:, :i])[:, 0]
    u, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    v_new = u - w @ state                                             # V' = U − W S
    o = (q * gamma_exp[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    last = gamma[:, -1:]                                              # γ_ℓ, [H, 1]
    state_end = last.exp()[..., None] * state + (k * (last - gamma).exp()[..., None]).transpose(-1, -2) @ v_new
    return o, state_end, solved


def _to_chunk(x: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows [start, start+size) of x [T, H, ..] as a zero-padded head-major [H, size, ..] tensor."""
    part = x[start:start + size]
    padded = x.new_zeros((size,) + tuple(x.shape[1:]))
    padded[:part.shape[0]] = part
    return padded.movedim(0, 1).contiguous()


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK):
    """The chunked form over a whole sequence starting at position 0.

    q, k [T, H, K] (q scaled, both L2-normalised), v [T, H, V], g, beta [T, H], initial_state
    [H, K, V] or None (zeros). Returns (o [T, H, V] F32, final state [H, K, V] F32).
    """
    length, heads, kdim = k.shape
    vdim = v.shape[-1]
    state = (torch.zeros(heads, kdim, vdim, device=k.device) if initial_state is None
             else initial_state.float())
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs = []
    for start in range(0, length, chunk_size):
        o, state, _ = gdn_chunk(*(_to_chunk(x, start, chunk_size) for x in (q, k, v, g, beta)), state)
        outs.append(o.movedim(1, 0)[:min(chunk_size, length - start)])
    o = torch.cat(outs) if outs else v.new_zeros(0, heads, vdim)
    return o, state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The recurrence of §4.3 step 5, one row at a time (same arguments and returns as the chunk form)."""
    length, heads, kdim = k.shape
    state = (torch.zeros(heads, kdim, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs = []
    for t in range(length):
        state = state * g[t].exp()[:, None, None]
        recalled = (state * k[t][:, :, None]).sum(dim=1)                 # Sᵀk̂  [H, V]
        delta = (v[t] - recalled) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(dim=1))
    return torch.stack(outs) if outs else v.new_zeros(0, heads, v.shape[-1]), state


# --------------------------------------------------------------------------------------------
# float64 references (plain loops over time and heads)
# --------------------------------------------------------------------------------------------

def naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """S_t = e^{g_t}(I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ, o_t = S_tᵀ q̂_t, in float64."""
    length, heads, kdim = k.shape
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state = (torch.zeros(heads, kdim, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double().clone())
    out = torch.zeros(length, heads, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(kdim, dtype=torch.float64)
    for t in range(length):
        for h in range(heads):
            kt = k[t, h][:, None]
            state[h] = torch.exp(g[t, h]) * (eye - beta[t, h] * kt @ kt.T) @ state[h] + beta[t, h] * kt @ v[t, h][None, :]
            out[t, h] = state[h].T @ q[t, h]
    return out, state


def naive_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK):
    """The §4.3 chunk formulas written literally in float64, with T = (I + A)^−1 by matrix inverse."""
    length, heads, kdim = k.shape
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state = (torch.zeros(heads, kdim, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double().clone())
    out = torch.zeros(length, heads, v.shape[-1], dtype=torch.float64)
    for start in range(0, length, chunk_size):
        rows = slice(start, min(start + chunk_size, length))
        for h in range(heads):
            Q, K, V, G, B = q[rows, h], k[rows, h], v[rows, h], g[rows, h], beta[rows, h]
            n = K.shape[0]
            gamma = torch.cumsum(G, 0)
            Gam = torch.tril(torch.exp(gamma[:, None] - gamma[None, :]))
            A = torch.tril(B[:, None] * (K @ K.T) * Gam, -1)
            T = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            U = T @ (B[:, None] * V)
            W = T @ ((B * torch.exp(gamma))[:, None] * K)
            Vp = U - W @ state[h]
            out[rows, h] = torch.exp(gamma)[:, None] * (Q @ state[h]) + ((Q @ K.T) * Gam) @ Vp
            state[h] = torch.exp(gamma[-1]) * state[h] + (torch.exp(gamma[-1] - gamma)[:, None] * K).T @ Vp
    return out, state


# --------------------------------------------------------------------------------------------
# cache and module
# --------------------------------------------------------------------------------------------

@dataclass
class GDNCache:
    """Per-slot state of one GDN layer (all preallocated, indexed by slot).

    conv   [S, K_c−1, c]      the last K_c−1 pre-activation conv inputs m (time-major; the kernel
                              path keeps [S, c, K_c−1], channels first)
    state  [S, H, K, V]       F32 recurrent state: exact path, at the start of the current 64-row
                              chunk; batched path, after the last row
    k, g   [S, 64, n_k, K], [S, 64, H]   the current chunk's earlier rows: k̂ and the log decay
    solved [S, 64, H, V+K]    their rows of [U | W] (see gdn_chunk), so a call only solves new rows
    Only the first (position % 64) rows of k, g, solved are meaningful; the batched path does not
    use them (they are allocated with no slots).
    """
    conv: torch.Tensor
    state: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor
    solved: torch.Tensor

    @classmethod
    def allocate(cls, cfg: TextConfig, slots: int, dtype: torch.dtype, device, exact: bool = True,
                 channels_first: bool = False) -> "GDNCache":
        """channels_first: conv as [S, c, K_c−1] (the kernel path's layout) instead of [S, K_c−1, c]."""
        f32 = dict(dtype=torch.float32, device=device)
        taps = cfg.linear_conv_kernel_dim - 1
        conv = (torch.zeros(slots, cfg.conv_dim, taps, dtype=dtype, device=device) if channels_first
                else torch.zeros(slots, taps, cfg.conv_dim, dtype=dtype, device=device))
        hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
        kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        rows = slots if exact else 0
        return cls(
            conv=conv,
            state=torch.zeros(slots, hv, kd, vd, **f32),
            k=torch.zeros(rows, CHUNK, hk, kd, **f32),
            g=torch.zeros(rows, CHUNK, hv, **f32),
            solved=torch.zeros(rows, CHUNK, hv, vd + kd, **f32))

    def reset_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's state in each per-slot tensor: what a fresh session starts from zeroed."""
        return [t[slot] for t in self.tensors() if t.shape[0]]

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.state, self.k, self.g, self.solved]


class GatedDeltaNet(nn.Module):
    """`linear_attn` of a GDN layer; parameter names are the checkpoint's."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if cfg.linear_conv_kernel_dim < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2")
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.in_proj_qkv = Linear(h, cfg.conv_dim, **kw)
        self.in_proj_z = Linear(h, cfg.linear_value_dim, **kw)
        self.in_proj_b = Linear(h, self.num_v_heads, **kw)
        self.in_proj_a = Linear(h, self.num_v_heads, **kw)
        self.conv1d = Weight(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim, **kw)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                    requires_grad=False)
        self.norm = Weight(self.v_dim, **kw)
        self.out_proj = Linear(cfg.linear_value_dim, h, **kw)

    # row-wise pieces ------------------------------------------------------------------------
    def _project(self, u):
        """u [R, H_model] -> m [R, c], z [R, n_v·d_v], b [R, n_v], a [R, n_v]."""
        return self.in_proj_qkv(u), self.in_proj_z(u), self.in_proj_b(u), self.in_proj_a(u)

    def _activate(self, pre, b, a):
        """Conv output -> q̂ (scaled), k̂ [R, n_k, d_k], v [R, n_v, d_v], g, β [R, n_v], all F32."""
        m = F.silu(pre.float())
        key_dim = self.num_k_heads * self.k_dim
        q, k, v = m.split([key_dim, key_dim, self.num_v_heads * self.v_dim], dim=-1)
        q = l2_normalize(q.reshape(-1, self.num_k_heads, self.k_dim)) * self.k_dim ** -0.5
        k = l2_normalize(k.reshape(-1, self.num_k_heads, self.k_dim))
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        return q, k, v.reshape(-1, self.num_v_heads, self.v_dim), g, beta

    def _output(self, o, z):
        """o [R, n_v, d_v] F32, z [R, n_v·d_v] -> out_proj(RMSNorm(o) ⊙ silu(z)) [R, H_model]."""
        dtype = z.dtype
        y = rms_norm(o.to(dtype), self.norm.weight, self.eps).float()
        y = y * F.silu(z.float().reshape(o.shape))
        return self.out_proj(y.reshape(o.shape[0], -1).to(dtype))

    # sequence pieces -------------------------------------------------------------------------
    def _conv(self, m: torch.Tensor, seg: Segment, cache: GDNCache) -> torch.Tensor:
        window = torch.cat([cache.conv[seg.slot], m])
        out = causal_conv_taps(window, self.conv1d.weight[:, 0, :])
        cache.conv[seg.slot] = window[-cache.conv.shape[1]:]
        return out

    def _delta_rule(self, q, k, v, g, beta, seg: Segment, cache: GDNCache) -> torch.Tensor:
        """One session's rows through chunks aligned to absolute positions; returns o [n, H, V].

        Each chunk is computed at full size from the cached state at its start, its earlier rows
        (k̂, g and their solved [U | W] rows from the cache) and the new rows; later rows are zero.
        Everything handed to the GEMMs is a fresh tensor: CPU GEMM bits can depend on alignment,
        and a slot's offset in the pool must not matter.
        """
        s, outs = seg.slot, []
        done, pos = 0, seg.start
        while done < seg.count:
            fill = pos % CHUNK                        # rows of this chunk that earlier calls added
            take = min(CHUNK - fill, seg.count - done)
            new, end = slice(done, done + take), fill + take
            qc, vc, bc = (x.new_zeros((CHUNK,) + tuple(x.shape[1:])) for x in (q, v, beta))
            qc[fill:end], vc[fill:end], bc[fill:end] = q[new], v[new], beta[new]
            kc, gc = torch.zeros_like(cache.k[s]), torch.zeros_like(cache.g[s])
            kc[:fill], gc[:fill] = cache.k[s, :fill], cache.g[s, :fill]
            kc[fill:end], gc[fill:end] = k[new], g[new]
            heads = lambda x: x.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)  # noqa: E731
            o, state_end, solved = gdn_chunk(
                *(x.movedim(0, 1).contiguous() for x in (heads(qc), heads(kc), vc, gc, bc)),
                cache.state[s].clone(), known=cache.solved[s, :fill].movedim(0, 1), rows=end)
            outs.append(o.movedim(1, 0)[fill:end])
            if end == CHUNK:
                cache.state[s] = state_end
            else:
                cache.k[s, fill:end], cache.g[s, fill:end] = k[new], g[new]
                cache.solved[s, fill:end] = solved.movedim(1, 0)[fill:end]
            done, pos = done + take, pos + take
        return torch.cat(outs)

    def _delta_rule_batched(self, q, k, v, g, beta, seg: Segment, cache: GDNCache) -> torch.Tensor:
        """The batched path: the recurrence for one row, the chunk form (chunks from this call's
        first row) otherwise, continuing from and replacing the slot's current state."""
        repeat = self.num_v_heads // self.num_k_heads
        rule = recurrent_gated_delta_rule if seg.count == 1 else chunk_gated_delta_rule
        o, state = rule(q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1), v, g, beta,
                        cache.state[seg.slot])
        cache.state[seg.slot] = state
        return o

    def forward(self, u: torch.Tensor, batch: RowBatch, cache: GDNCache) -> torch.Tensor:
        """u [R, H_model] (normed layer input) -> mixer output [R, H_model]; advances the cache."""
        m, z, b, a = per_row(self._project, u, exact=batch.exact)
        pre = torch.cat([self._conv(m[seg.rows], seg, cache) for seg in batch.segments])
        q, k, v, g, beta = per_row(self._activate, pre, b, a, exact=batch.exact)
        delta_rule = self._delta_rule if batch.exact else self._delta_rule_batched
        o = torch.cat([delta_rule(q[seg.rows], k[seg.rows], v[seg.rows], g[seg.rows], beta[seg.rows], seg, cache)
                       for seg in batch.segments])
        return per_row(self._output, o, z, exact=batch.exact)

    # kernel path (Backbone.kernels) ----------------------------------------------------------
    def pack_kernels(self) -> None:
        """Load-time layout of the kernel path: [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]
        as one weight (one GEMM per step), the conv kernel as [c, K_c], out_proj dense."""
        self.in_proj_fused = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self.conv_weight = self.conv1d.weight[:, 0, :].contiguous()
        self.out_weight = self.out_proj.dense_weight()

    def forward_kernels(self, u: torch.Tensor, x: torch.Tensor, batch: RowBatch, cache: GDNCache,
                        x_owned: bool = False, post_norm: tuple[torch.Tensor, float] | None = None):
        """x + out_proj(GDN(u)) [R, H_model] for u = RMSNorm⁺(x), BF16; advances the slot pool.
        x_owned: x is the caller's to give up (the result may be written over it). post_norm
        (w, eps), on decode steps that take decode_linear: (that, its RMSNorm⁺) from
        decode_linear's `norm`."""
        plan = batch.plan
        rows, channels = u.shape[0], self.conv_weight.shape[0]
        hv, hk, dk, dv = self.num_v_heads, self.num_k_heads, self.k_dim, self.v_dim
        linear = decode_gemm.dense_linear(plan.decode, u, plan.gemm_rows)  # decode_linear on CUDA decode steps
        proj = linear(u, self.in_proj_fused)                             # [R, c + n_v·d_v + 2·n_v]
        z = proj[:, channels:channels + hv * dv].view(rows, hv, dv)
        b = proj[:, channels + hv * dv:channels + hv * dv + hv]
        a = proj[:, channels + hv * dv + hv:]
        if plan.decode:       # one row per session: conv and recurrence in place on the pool
            mixed = kgdn.causal_conv1d_update(proj[:, :channels], self.conv_weight, cache.conv, slots=plan.seg_slots)
            q, k, v = self._heads(mixed)
            o = kgdn.gdn_decode_inplace(q, k, v, a, b, self.A_log, self.dt_bias, cache.state, slots=plan.seg_slots)
        else:                 # all sessions' rows packed: the front in two launches, one fla call
            # padded pieces (row_mask): a padding row's gates are zeroed, and decay exp(0) = 1 with
            # β = 0 makes its update S ← (I − 0·kkᵀ)·S + 0·kvᵀ = S: the state leaves a piece as
            # after its last real row
            front = kgdn.prefill_front(proj, self.conv_weight, cache.conv, self.A_log, self.dt_bias,
                                       plan.seg_slots, plan.seg_first, plan.seg_rows, plan.row_seg,
                                       (hk, dk, hv, dv), row_mask=plan.row_mask)
            if plan.row_mask is None:       # segments packed along one sequence (fla's varlen)
                o, state = kgdn.chunk_gated_delta_rule(*(t[None] for t in front),
                                                       initial_state=cache.state.index_select(0, plan.seg_slots),
                                                       cu_seqlens=plan.cu_seqlens)
                o = o[0]
            else:                           # padded pieces: one sequence per piece, fla's batch
                pieces = (plan.seg_slots.shape[0], rows // plan.seg_slots.shape[0])
                o, state = kgdn.chunk_gated_delta_rule(*(t.unflatten(0, pieces) for t in front),
                                                       initial_state=cache.state.index_select(0, plan.seg_slots))
                o = o.flatten(0, 1)
            # index_select / index_copy_ rather than indexing: the same copies, ~0.3-0.7 µs less
            # each for a piece's 2 MB state (H200, bench/prefill_parts.py); the slots are distinct
            cache.state.index_copy_(0, plan.seg_slots, state)
        y = invariant.empty_rows(rows, hv * dv, dtype=torch.bfloat16, device=u.device)  # out_proj reads it in place
        # off CUDA the reference returns a new tensor rather than filling `out`: take what it returns
        y = kgdn.gated_rms_norm(o.contiguous(), z, self.norm.weight, self.eps, out=y.view(rows, hv, dv))
        if post_norm is not None:      # decode_linear: the next norm in its split reduce's launch
            return decode_gemm.decode_linear(y.view(rows, hv * dv), self.out_weight, x, norm=post_norm)
        return linear(y.view(rows, hv * dv), self.out_weight, x, residual_out=x_owned)  # x + y·W_outᵀ

    def _heads(self, mixed: torch.Tensor):
        """Conv output [R, c] -> q, k [R, n_k, d_k], v [R, n_v, d_v] (views; l2 norm and scale in the kernels)."""
        rows, key_dim = mixed.shape[0], self.num_k_heads * self.k_dim
        q = mixed[:, :key_dim].view(rows, self.num_k_heads, self.k_dim)
        k = mixed[:, key_dim:2 * key_dim].view(rows, self.num_k_heads, self.k_dim)
        v = mixed[:, 2 * key_dim:].view(rows, self.num_v_heads, self.v_dim)
        return q, k, v

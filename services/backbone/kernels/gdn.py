"""Gated DeltaNet core on the GPU (MODEL.md §4.3), beside float32 references that run anywhere.

Shape letters (fla's layout): B sequences, T rows, Hk key/query heads, Hv value heads (value head
h uses key head h // (Hv/Hk), consecutive grouping), K key head dim, V value head dim, C conv
channels (2·Hk·K + Hv·V), Kc conv taps. States are [B, Hv, K, V] float32.

    causal_conv1d(x [B,T,C], w [C,Kc], state [B,C,Kc-1])   -> (silu(conv) [B,T,C], state')   torch, any device
    causal_conv1d_update(x [B,C], w, state)                -> silu(conv) [B,C]; state updated in place (Triton)
    gdn_gates(a, b, A_log, dt_bias)                        -> g (log decay), beta  (F32)
    chunk_gated_delta_rule(q,k,v,g,beta, initial_state)    -> (o, S)   fla chunk kernel on CUDA, else reference
    recurrent_gated_delta_rule(q,k,v,g,beta, initial_state)-> (o, S)   fla fused_recurrent on CUDA, else reference
    gdn_decode_inplace(q,k,v,a,b,A_log,dt_bias, state)     -> o [B,Hv,V]: one row, gates fused, state in place
    gated_rms_norm(o [..,V], z [..,V], w [V], eps)         -> RMSNorm(o)·w ⊙ silu(z), bf16
    naive_recurrent_gated_delta_rule / naive_causal_conv1d / naive_gated_rms_norm: plain loops, float32

q and k go in un-normalised: the l2 norm (eps 1e-6) and the d_k^-1/2 scale are applied inside
(`use_qk_l2norm_in_kernel=True` for fla), as in Qwen3.5's transformers code.

Why an own decode kernel beside fla's fused_recurrent: fla's launcher allocates a new final
state and needs contiguous q/k/v/g/beta, so a decode step through it pays five copies plus a state
copy back (2 MB per layer and sequence, twice). `gdn_decode_inplace` is fla's recurrence for one
row, reading strided views of the projection output and updating the state where it lies.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import HAS_TRITON, INTERPRET, PDL_PRELOAD, pdl_args, use_triton

L2_EPS = 1e-6

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue


def _fla():
    """fla's gated delta rule ops, or None (CPU machines, or fla not installed)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # ImportError, or fla failing to import without a GPU
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


# --------------------------------------------------------------------------------------------
# short conv
# --------------------------------------------------------------------------------------------

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + silu over time (§4.3 step 2), F32 math, taps summed in order.

    x [B, T, C]; weight [C, Kc] (conv1d.weight squeezed); conv_state [B, C, Kc-1] = the last
    Kc-1 pre-activation inputs (zeros at sequence start when None). Returns
    (y [B, T, C] in x.dtype, new_state [B, C, Kc-1] in x.dtype).
    """
    b, t, c = x.shape
    taps = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(b, c, taps - 1)
    window = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1).float()   # [B, Kc-1+T, C]
    w = weight.float()
    out = window[:, 0:t] * w[:, 0]
    for j in range(1, taps):
        out = out + window[:, j:j + t] * w[:, j]
    new_state = window[:, -(taps - 1):].transpose(1, 2).to(x.dtype).contiguous()
    return F.silu(out).to(x.dtype), new_state


def naive_causal_conv1d(x, weight, conv_state=None):
    """Reference for causal_conv1d: loops over rows, channels' taps, float32."""
    b, t, c = x.shape
    taps = weight.shape[1]
    state = (torch.zeros(b, c, taps - 1, device=x.device) if conv_state is None else conv_state.float()).clone()
    y = torch.empty(b, t, c, dtype=torch.float32, device=x.device)
    for s in range(t):
        window = torch.cat([state, x[:, s, :, None].float()], dim=2)           # [B, C, Kc]
        acc = torch.zeros(b, c, device=x.device)
        for j in range(taps):
            acc = acc + window[:, :, j] * weight[:, j].float()
        y[:, s] = acc * torch.sigmoid(acc)
        state = window[:, :, 1:]
    return y.to(x.dtype), state.to(x.dtype)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         out: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode row: x [B, C] (row stride free, unit channel stride), weight [C, Kc],
    conv_state [B, C, Kc-1] contiguous, updated in place. Returns silu(conv) [B, C] in x.dtype.

    slots: int [B], the row of conv_state that x row b continues (conv_state is then a slot pool
    [S, C, Kc-1]); None means row b."""
    if not use_triton(x, conv_state):
        state = conv_state if slots is None else conv_state[slots.long()]
        y, new_state = causal_conv1d(x[:, None], weight, state)
        if slots is None:
            conv_state.copy_(new_state)
        else:
            conv_state[slots.long()] = new_state
        return y[:, 0] if out is None else out.copy_(y[:, 0])
    b, c = x.shape
    taps = weight.shape[1]
    if out is None:
        out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    block = 1024
    _conv_update_kernel[(b, triton.cdiv(c, block))](
        x, weight, conv_state, out, slots if slots is not None else x, c, x.stride(0), out.stride(0),
        TAPS=taps, BLOCK=block, HAS_SLOTS=slots is not None, PRELOAD=CONV_PRELOAD and taps == 4, num_warps=4,
        **pdl_args())
    return out


# --------------------------------------------------------------------------------------------
# prefill front: the packed rows' conv, silu and gates in two launches
# --------------------------------------------------------------------------------------------

class PrefillFront(NamedTuple):
    """What fla's chunk kernel takes, for R packed rows: q, k [R, Hk, K] and v [R, Hv, V]
    (contiguous, so fla's input guard copies nothing), g [R, Hv] F32 and beta [R, Hv] in v's dtype."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def _front_split(y: torch.Tensor, hk: int, dk: int, hv: int, dv: int):
    rows, key_dim = y.shape[0], hk * dk
    return (y[:, :key_dim].reshape(rows, hk, dk).contiguous(),
            y[:, key_dim:2 * key_dim].reshape(rows, hk, dk).contiguous(),
            y[:, 2 * key_dim:].reshape(rows, hv, dv).contiguous())


def prefill_front_reference(proj, weight, conv_state, A_log, dt_bias, seg_slots, seg_first, seg_rows, row_seg,
                            heads: tuple[int, int, int, int], row_mask=None) -> PrefillFront:
    """`prefill_front` with torch ops (any device): the taps gathered row by row, summed in order
    in F32 with separate multiplies and adds (the CPU kernel path's arithmetic), silu, the gates."""
    hk, dk, hv, dv = heads
    rows, channels, taps = proj.shape[0], weight.shape[0], weight.shape[1]
    m = proj[:, :channels]
    idx = torch.arange(rows, device=proj.device)
    local = idx - seg_first[row_seg]                       # each row's index in its segment
    slot = seg_slots[row_seg][:, None]
    chans = torch.arange(channels, device=proj.device)[None, :]
    w = weight.float()
    out = None
    for j in range(taps):
        back = taps - 1 - j                                # tap j reads the row `back` rows earlier
        from_rows = m[(idx - back).clamp(min=0)]
        from_state = conv_state[slot, chans, (local + j).clamp(max=taps - 2)[:, None]]
        x = torch.where((local >= back)[:, None], from_rows, from_state.to(m.dtype)).float()
        out = x * w[:, j] if out is None else out + x * w[:, j]
    # each segment's new state: its last K_c−1 inputs (older ones from the old state when shorter)
    t = torch.arange(taps - 1, device=proj.device)
    last = seg_rows[:, None] - (taps - 1) + t              # [N, K_c−1] positions in the segment
    from_rows = m[(seg_first[:, None] + last).clamp(min=0)]                       # [N, K_c−1, c]
    from_state = conv_state[seg_slots[:, None], :, (seg_rows[:, None] + t).clamp(max=taps - 2)]
    tail = torch.where((last >= 0)[..., None], from_rows, from_state.to(m.dtype))
    conv_state[seg_slots] = tail.transpose(1, 2).to(conv_state.dtype)
    q, k, v = _front_split(F.silu(out).to(m.dtype), hk, dk, hv, dv)
    b = proj[:, channels + hv * dv:channels + hv * dv + hv]
    a = proj[:, channels + hv * dv + hv:]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    if row_mask is not None:
        g, beta = g * row_mask[:, None], beta * row_mask[:, None]
    return PrefillFront(q, k, v, g, beta.to(v.dtype))


# The front's rows x channels per program. A tap's rows are contiguous loads, and the taps'
# overlapping rows come from L1/L2. H200, 256 rows (bench/prefill_parts.py, session 14 run 6):
# 32 x 128 10.4 µs per layer, 16 x 256 11.1 (11.8 in session 8), 16 x 512 223; any tile gives the
# same bits (elementwise per row and channel, taps in order). The first version, a program per
# row and 1024 channels, took 23.7 for ~8 MB of traffic.
FRONT_TILE = (32, 128)


def prefill_front(proj, weight, conv_state, A_log, dt_bias, seg_slots, seg_first, seg_rows, row_seg,
                  heads: tuple[int, int, int, int], row_mask=None) -> PrefillFront:
    """The GDN front of a non-decode step (§4.3 steps 2-3) for R rows of N segments packed in order.

    proj [R, c + Hv·V + 2·Hv] (unit stride along columns) = [m | z | b | a], the fused
    projection; weight [c, K_c]; conv_state [S, c, K_c−1] slot pool, read for each segment's
    slot and replaced by its last K_c−1 inputs; seg_slots, seg_first, seg_rows int [N]: each
    segment's slot, first row in R and real rows (a padded piece has more rows in R than real
    ones; its padding rows are computed and ignored); row_seg int [R]: each row's segment;
    heads = (Hk, K, Hv, V); row_mask F32 [R] (padded pieces): 0 zeroes a padding row's gates.

    Row r's taps are the K_c−1 inputs before it in its segment, from the old state where the
    segment has none yet: per row the same F32 sum in tap order as the decode step's
    `causal_conv1d_update`, so a row's bits do not depend on the other rows of the step. Two
    launches (conv + silu + gates, then the new states, which the first reads the old values of),
    where the torch ops took about 30 per layer (the prefill profile's gathers and elementwise
    kernels)."""
    hk, dk, hv, dv = heads
    if not (HAS_TRITON and (proj.is_cuda or INTERPRET)):    # the interpreter runs the kernels on the CPU (tests)
        return prefill_front_reference(proj, weight, conv_state, A_log, dt_bias, seg_slots, seg_first, seg_rows,
                                       row_seg, heads, row_mask)
    rows, channels, taps = proj.shape[0], weight.shape[0], weight.shape[1]
    if proj.stride(1) != 1 or not conv_state.is_contiguous() or not weight.is_contiguous():
        raise ValueError("prefill_front needs proj with unit column stride, a contiguous conv state and weight")
    if channels != 2 * hk * dk + hv * dv or proj.shape[1] != channels + hv * dv + 2 * hv:
        raise ValueError(f"proj [{rows}, {proj.shape[1]}] does not hold m [{channels}] | z | b | a for heads {heads}")
    dev, dtype = proj.device, proj.dtype
    q = torch.empty(rows, hk, dk, dtype=dtype, device=dev)
    k = torch.empty(rows, hk, dk, dtype=dtype, device=dev)
    v = torch.empty(rows, hv, dv, dtype=dtype, device=dev)
    g = torch.empty(rows, hv, dtype=torch.float32, device=dev)
    beta = torch.empty(rows, hv, dtype=dtype, device=dev)
    b_col = channels + hv * dv
    br, bc = FRONT_TILE
    _prefill_conv_kernel[(triton.cdiv(rows, br), triton.cdiv(channels, bc) + 1)](
        proj, proj.stride(0), weight, conv_state, seg_slots, seg_first, row_seg, q, k, v,
        proj[:, b_col:], proj[:, b_col + hv:], A_log, dt_bias, row_mask if row_mask is not None else g, g, beta,
        rows, channels, hk * dk, hv, TAPS=taps, BR=br, BC=bc, BH=triton.next_power_of_2(hv),
        HAS_MASK=row_mask is not None, num_warps=4)
    block = 1024
    _conv_tail_kernel[(seg_slots.shape[0], triton.cdiv(channels, block))](
        proj, proj.stride(0), conv_state, seg_slots, seg_first, seg_rows, channels,
        TAPS=taps, TP=triton.next_power_of_2(taps - 1), BLOCK=block, num_warps=4)
    return PrefillFront(q, k, v, g, beta)


# --------------------------------------------------------------------------------------------
# gates, references
# --------------------------------------------------------------------------------------------

def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """g = -exp(A_log)·softplus(a + dt_bias) (log decay, <= 0), beta = σ(b); both float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     dtype: torch.dtype = torch.float32):
    """§4.3 steps 4-5 one row at a time, in `dtype` (float32 here, float64 for CPU checks).

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; initial_state [B, Hv, K, V].
    Returns (o [B, T, Hv, V] `dtype`, S [B, Hv, K, V] `dtype`).
    """
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk ** -0.5 if scale is None else scale
    rep = hv // hk
    q = q.to(dtype).repeat_interleave(rep, dim=2)
    k = k.to(dtype).repeat_interleave(rep, dim=2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    state = (torch.zeros(bsz, hv, dk, dv, dtype=dtype, device=q.device) if initial_state is None
             else initial_state.to(dtype).clone())
    o = torch.empty(bsz, t, hv, dv, dtype=dtype, device=q.device)
    for s in range(t):
        state = state * g[:, s, :, None, None].exp()
        kv = (state * k[:, s, :, :, None]).sum(2)                            # Sᵀk  [B, Hv, V]
        delta = beta[:, s, :, None] * (v[:, s] - kv)
        state = state + k[:, s, :, :, None] * delta[:, :, None, :]
        o[:, s] = (state * q[:, s, :, :, None]).sum(2)
    return o, state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, output_final_state=True,
                           cu_seqlens: torch.Tensor | None = None):
    """Prefill: fla's chunk kernel on CUDA (native GVA, l2 norm in kernel), else the reference.
    Same arguments and layout as naive_recurrent_gated_delta_rule; o comes back in v.dtype.

    cu_seqlens: int64 [N+1] row offsets of N sequences packed along T (B must be 1; fla's varlen
    mode, chunks start at each sequence's first row); initial_state is then [N, Hv, K, V]."""
    ops = _fla() if q.is_cuda else None
    if ops is None:
        if cu_seqlens is None:
            o, s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state)
            return o.to(v.dtype), s
        bounds = cu_seqlens.tolist()
        outs, states = [], []
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, s = naive_recurrent_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                                                    beta[:, lo:hi], scale, h0)
            outs.append(o.to(v.dtype))
            states.append(s)
        return torch.cat(outs, dim=1), torch.cat(states)
    return ops[0](q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, output_final_state=True):
    """Decode (few rows): fla's fused_recurrent kernel on CUDA, else the reference."""
    ops = _fla() if q.is_cuda else None
    if ops is None:
        o, s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state)
        return o.to(v.dtype), s
    # keywords, not positions: fused_recurrent's 5th positional parameter is `gk` (per-key decay),
    # not beta; passing beta there reads [B, T, Hv, K] out of a [B, T, Hv] tensor (NaNs seen on the H200)
    return ops[1](q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


def gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, state, scale: float | None = None,
                       out: torch.Tensor | None = None, block_v: int = 64,
                       slots: torch.Tensor | None = None, num_warps: int = 4,
                       preload: bool | None = None) -> torch.Tensor:
    """One decode row per sequence with the gates fused and the state updated where it lies.

    q, k [B, Hk, K] and v [B, Hv, V] (any batch stride, heads contiguous: views of the conv
    output are fine); a, b [B, Hv] raw projections (any batch stride); A_log, dt_bias [Hv];
    state [B, Hv, K, V] float32 contiguous. Returns o [B, Hv, V] in v.dtype.
    slots: int [B], the row of `state` that sequence b continues (state is then a slot pool
    [S, Hv, K, V]); None means row b.
    block_v / num_warps: each program updates a [K, block_v] stripe of one head's state. On the
    H200 (`python3 bench/gdn_decode.py`) 64 columns with 4 warps read and write the state at
    3.8 TB/s at batch 128 (143 µs per layer; 16 columns and 2 warps: 274 µs) and take 7.6 µs at
    batch 1. A row's result does not depend on the batch whatever the stripe.
    preload: the state read before the kernel's PDL wait (STATE_PRELOAD unless given); the same bits.
    """
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    if not use_triton(q, state):
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        rows = state if slots is None else state[slots.long()]
        o, s = naive_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                scale, rows)
        if slots is None:
            state.copy_(s)
        else:
            state[slots.long()] = s
        return o[:, 0].to(v.dtype)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} needs contiguous heads (strides [*, {t.shape[2]}, 1]), got {t.stride()}")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("state must be contiguous float32 [B, Hv, K, V]")
    if out is None:
        out = torch.empty(bsz, hv, dv, dtype=v.dtype, device=v.device)
    _gdn_decode_kernel[(bsz * hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, out, slots if slots is not None else out, scale,
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0),
        HK=hk, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=block_v, HAS_SLOTS=slots is not None,
        PRELOAD=STATE_PRELOAD if preload is None else preload, num_warps=num_warps, **pdl_args())
    return out


# --------------------------------------------------------------------------------------------
# gated RMSNorm (§4.3 step 6)
# --------------------------------------------------------------------------------------------

def naive_gated_rms_norm(o, z, weight, eps: float = 1e-6):
    """y = RMSNorm(o; weight) ⊙ silu(z) per head over the last dim, F32 math, bf16 result."""
    o32, z32 = o.float(), z.float()
    y = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z32)).to(torch.bfloat16)


# Heads per program of the gated norm, one warp each (HV must be a multiple; gcd otherwise). One
# warp sums a head's V squares in the same lanes and order whatever the head count, so the bits
# are those of one head per program (tests/test_kernels_gpu.py); at 256 rows x 32 heads 8192
# one-warp programs took 6.35 µs, 2048 four-warp ones 3.01 (H200, bench/prefill_parts.py,
# session 14 run 6; 2 warps for 4 heads changed bits).
GATED_NORM_HEADS = 4
# the recurrence's state, and the conv update's state and weights, loaded before their PDL waits
# (DRAMA_PDL_PRELOAD, see kernels/__init__)
STATE_PRELOAD = CONV_PRELOAD = PDL_PRELOAD


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """naive_gated_rms_norm in one launch: o [B, Hv, V] (contiguous), z [B, Hv, V] (any batch
    stride, contiguous heads), weight [V]. Returns [B, Hv, V] bf16."""
    if not use_triton(o, z) or o.dim() != 3:
        return naive_gated_rms_norm(o, z, weight, eps)
    bsz, hv, dv = o.shape
    if out is None:
        out = torch.empty(bsz, hv, dv, dtype=torch.bfloat16, device=o.device)
    heads = math.gcd(hv, GATED_NORM_HEADS)
    _gated_norm_kernel[(bsz * hv // heads,)](o, z, weight, out, eps, o.stride(0), z.stride(0), out.stride(0),
                                             HV=hv, V=dv, BV=triton.next_power_of_2(dv), HB=heads, num_warps=heads,
                                             **pdl_args())
    return out


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _conv_update_kernel(x_ptr, w_ptr, state_ptr, out_ptr, slot_ptr, C, stride_x, stride_o,
                            TAPS: tl.constexpr, BLOCK: tl.constexpr, HAS_SLOTS: tl.constexpr,
                            PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
        """PRELOAD (TAPS 4): the conv state, the taps' weights and the slot loaded before the PDL
        wait (only the step's in_proj, which writes x, runs before it; see
        kernels/__init__.PDL_PRELOAD); the same arithmetic, so the same bits."""
        b = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = ch < C
        if PRELOAD:
            tl.static_assert(TAPS == 4, "PRELOAD is written for 4 taps")
            row = _conv_row(slot_ptr, b, HAS_SLOTS)
            s_base = state_ptr + (row * C + ch) * (TAPS - 1)
            s0 = tl.load(s_base, mask=ok, other=0.0, cache_modifier=".cg")     # .cg: as the GDN state
            s1 = tl.load(s_base + 1, mask=ok, other=0.0, cache_modifier=".cg")
            s2 = tl.load(s_base + 2, mask=ok, other=0.0, cache_modifier=".cg")
            w0 = tl.load(w_ptr + ch * TAPS, mask=ok, other=0.0).to(tl.float32)
            w1 = tl.load(w_ptr + ch * TAPS + 1, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + ch * TAPS + 2, mask=ok, other=0.0).to(tl.float32)
            w3 = tl.load(w_ptr + ch * TAPS + 3, mask=ok, other=0.0).to(tl.float32)
            pdl_prologue(PDL)
            x_ptr += b * stride_x
            x_new = tl.load(x_ptr + ch, mask=ok, other=0.0)
            # _conv_channels' sum and shifts, its loop written out
            acc = tl.zeros(ch.shape, dtype=tl.float32)
            acc += s0.to(tl.float32) * w0
            acc += s1.to(tl.float32) * w1
            tl.store(s_base, s1, mask=ok)
            acc += s2.to(tl.float32) * w2
            tl.store(s_base + 1, s2, mask=ok)
            acc += x_new.to(tl.float32) * w3
            tl.store(s_base + 2, x_new.to(state_ptr.dtype.element_ty), mask=ok)
            y = (acc * tl.sigmoid(acc)).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            pdl_prologue(PDL)
            row = _conv_row(slot_ptr, b, HAS_SLOTS)
            y = _conv_channels(x_ptr + b * stride_x, w_ptr, state_ptr, row, C, ch, ok, TAPS)
        tl.store(out_ptr + b * stride_o + ch, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _conv_row(slot_ptr, b, HAS_SLOTS: tl.constexpr):
        """The conv state row of sequence b: its slot, or b."""
        if HAS_SLOTS:
            return tl.load(slot_ptr + b, cache_modifier=".cg").to(tl.int64)
        else:
            return b.to(tl.int64)

    @triton.jit
    def _prefill_conv_kernel(x_ptr, stride_x, w_ptr, state_ptr, slot_ptr, first_ptr, seg_ptr, q_ptr, k_ptr, v_ptr,
                             b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, mask_ptr, g_ptr, beta_ptr, R, C, KD, HV,
                             TAPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
                             HAS_MASK: tl.constexpr):
        """Rows r0..r0+BR−1, channel block cb: silu(Σ_j x[r − (TAPS−1−j)]·w[:, j]), the taps
        before a segment's first row from its slot's conv state, into q | k | v. The block after
        the last channel block: the rows' gates (as _gdn_decode_kernel computes them)."""
        pid_r, cb = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)
        r_ok = rows < R
        if cb == tl.cdiv(C, BC):
            h = tl.arange(0, BH)
            ok = r_ok[:, None] & (h < HV)[None, :]
            at = rows.to(tl.int64)[:, None] * stride_x + h[None, :]
            x = (tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(dt_bias_ptr + h, mask=h < HV, other=0.0).to(tl.float32)[None, :])
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            g = -tl.exp(tl.load(A_log_ptr + h, mask=h < HV, other=0.0).to(tl.float32))[None, :] * softplus
            beta = tl.sigmoid(tl.load(b_ptr + at, mask=ok, other=0.0).to(tl.float32))
            if HAS_MASK:
                keep = tl.load(mask_ptr + rows, mask=r_ok, other=0.0)[:, None]
                g, beta = g * keep, beta * keep
            out = rows[:, None] * HV + h[None, :]
            tl.store(g_ptr + out, g, mask=ok)
            tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=ok)
            return
        seg = tl.load(seg_ptr + rows, mask=r_ok, other=0)
        local = rows - tl.load(first_ptr + seg, mask=r_ok, other=0)
        slot = tl.load(slot_ptr + seg, mask=r_ok, other=0).to(tl.int64)
        ch = cb * BC + tl.arange(0, BC)
        ok = r_ok[:, None] & (ch < C)[None, :]
        s_base = state_ptr + (slot[:, None] * C + ch[None, :]) * (TAPS - 1)
        acc = tl.zeros([BR, BC], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            back = TAPS - 1 - j
            in_rows = (local >= back)[:, None]
            xr = tl.load(x_ptr + (rows - back).to(tl.int64)[:, None] * stride_x + ch[None, :],
                         mask=ok & in_rows, other=0.0)
            xs = tl.load(s_base + (local + j)[:, None], mask=ok & ~in_rows, other=0.0)
            x = tl.where(in_rows, xr.to(tl.float32), xs.to(tl.float32))
            acc += x * tl.load(w_ptr + ch * TAPS + j, mask=ch < C, other=0.0).to(tl.float32)[None, :]
        y = (acc * tl.sigmoid(acc)).to(q_ptr.dtype.element_ty)
        row = rows.to(tl.int64)[:, None]
        c2 = ch[None, :]
        tl.store(q_ptr + row * KD + c2, y, mask=ok & (c2 < KD))
        tl.store(k_ptr + row * KD + c2 - KD, y, mask=ok & (c2 >= KD) & (c2 < 2 * KD))
        tl.store(v_ptr + row * (C - 2 * KD) + c2 - 2 * KD, y, mask=ok & (c2 >= 2 * KD))

    @triton.jit
    def _conv_tail_kernel(x_ptr, stride_x, state_ptr, slot_ptr, first_ptr, rows_ptr, C,
                          TAPS: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr):
        """Segment s's new conv state: its last TAPS−1 inputs, older ones from its old state when
        it has fewer rows (all loaded before any store: the old state is overwritten)."""
        s, cb = tl.program_id(0), tl.program_id(1)
        ch = cb * BLOCK + tl.arange(0, BLOCK)
        t = tl.arange(0, TP)
        slot = tl.load(slot_ptr + s).to(tl.int64)
        first = tl.load(first_ptr + s)
        n = tl.load(rows_ptr + s)
        last = n - (TAPS - 1) + t                                      # position in the segment
        ok = (ch[None, :] < C) & (t[:, None] < TAPS - 1)
        in_rows = last[:, None] >= 0
        xr = tl.load(x_ptr + (first + last).to(tl.int64)[:, None] * stride_x + ch[None, :], mask=ok & in_rows, other=0.0)
        s_base = state_ptr + (slot * C + ch[None, :]) * (TAPS - 1)
        xs = tl.load(s_base + (n + t)[:, None], mask=ok & ~in_rows, other=0.0)
        new = tl.where(in_rows, xr.to(state_ptr.dtype.element_ty), xs)
        tl.store(s_base + t[:, None], new, mask=ok)

    @triton.jit
    def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, h_ptr, o_ptr, slot_ptr, scale,
                           stride_q, stride_k, stride_v, stride_a, stride_b,
                           HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, HAS_SLOTS: tl.constexpr, PRELOAD: tl.constexpr = False,
                           PDL: tl.constexpr = False):
        """fla's fused_recurrent_gated_delta_rule_fwd_kernel for T = 1, gates fused, state in place.
        PRELOAD: the state stripe (and the slot) loaded before the PDL wait: only this layer's
        kernel of the step before wrote them, never the kernel just before this one (see
        kernels/__init__.PDL_PRELOAD). The same arithmetic, so the same bits."""
        i_bh, i_v = tl.program_id(0), tl.program_id(1)
        i_b, i_hv = i_bh // HV, i_bh % HV
        i_h = i_hv // (HV // HK)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mk, mv = o_k < K, o_v < V
        mh = mk[:, None] & mv[None, :]
        if PRELOAD:
            p_h = _state_stripe(h_ptr, slot_ptr, i_b, i_hv, i_bh, o_k, o_v, HV, K, V, HAS_SLOTS)
            # from L2 (.cg): another SM wrote it a step ago, and this SM's L1 may hold an older copy
            h_old = tl.load(p_h, mask=mh, other=0.0, cache_modifier=".cg")
            pdl_prologue(PDL)
        else:
            pdl_prologue(PDL)
            p_h = _state_stripe(h_ptr, slot_ptr, i_b, i_hv, i_bh, o_k, o_v, HV, K, V, HAS_SLOTS)
        bq = tl.load(q_ptr + i_b * stride_q + i_h * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bk = tl.load(k_ptr + i_b * stride_k + i_h * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bv = tl.load(v_ptr + i_b * stride_v + i_hv * V + o_v, mask=mv, other=0.0).to(tl.float32)
        bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6) * scale
        bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        x = tl.load(a_ptr + i_b * stride_a + i_hv).to(tl.float32) + tl.load(dt_bias_ptr + i_hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32)) * softplus
        beta = tl.sigmoid(tl.load(b_ptr + i_b * stride_b + i_hv).to(tl.float32))
        if PRELOAD:
            bh = h_old * tl.exp(g)
        else:
            bh = tl.load(p_h, mask=mh, other=0.0) * tl.exp(g)
        bv = beta * (bv - tl.sum(bh * bk[:, None], 0))
        bh += bk[:, None] * bv[None, :]
        bo = tl.sum(bh * bq[:, None], 0)
        tl.store(o_ptr + (i_b * HV + i_hv) * V + o_v, bo.to(o_ptr.dtype.element_ty), mask=mv)
        tl.store(p_h, bh, mask=mh)

    @triton.jit
    def _state_stripe(h_ptr, slot_ptr, i_b, i_hv, i_bh, o_k, o_v, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, HAS_SLOTS: tl.constexpr):
        """Pointers [BK, BV] to the program's stripe of its sequence's state (slot i_b's, or row i_b's)."""
        if HAS_SLOTS:
            i_sh = tl.load(slot_ptr + i_b, cache_modifier=".cg").to(tl.int64) * HV + i_hv
        else:
            i_sh = i_bh.to(tl.int64)
        return h_ptr + i_sh * K * V + o_k[:, None] * V + o_v[None, :]

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, eps, stride_o, stride_z, stride_out,
                           HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
                           PDL: tl.constexpr = False):
        """HB heads of one row per program, one warp per head (see GATED_NORM_HEADS)."""
        pdl_prologue(PDL)
        pid = tl.program_id(0)
        i_b, h = pid // (HV // HB), (pid % (HV // HB)) * HB + tl.arange(0, HB)
        offs = tl.arange(0, BV)
        ok = (offs < V)[None, :]
        at = h[:, None] * V + offs[None, :]
        o = tl.load(o_ptr + i_b * stride_o + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + i_b * stride_z + at, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)[None, :]
        y = o * tl.rsqrt(tl.sum(o * o, axis=1) / V + eps)[:, None] * w * (z * tl.sigmoid(z))
        tl.store(out_ptr + i_b * stride_out + at, y.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _conv_channels(row_ptr, w_ptr, conv_ptr, slot, C, ch, ok, TAPS: tl.constexpr):
        """silu(conv) of one row's channels `ch` (row_ptr: the row's first input), their conv state
        at `slot` shifted in place: the taps in order 0..K_c−2 from the state, then the new input
        (causal_conv1d's sum order), rounded to the row's dtype as causal_conv1d_update stores
        it, returned in F32."""
        x_new = tl.load(row_ptr + ch, mask=ok, other=0.0)
        s_base = conv_ptr + (slot * C + ch) * (TAPS - 1)
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for j in tl.static_range(TAPS - 1):
            s_j = tl.load(s_base + j, mask=ok, other=0.0)
            acc += s_j.to(tl.float32) * tl.load(w_ptr + ch * TAPS + j, mask=ok, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(s_base + j - 1, s_j, mask=ok)
        acc += x_new.to(tl.float32) * tl.load(w_ptr + ch * TAPS + TAPS - 1, mask=ok, other=0.0).to(tl.float32)
        tl.store(s_base + TAPS - 2, x_new.to(conv_ptr.dtype.element_ty), mask=ok)
        y = acc * tl.sigmoid(acc)
        return y.to(row_ptr.dtype.element_ty).to(tl.float32)

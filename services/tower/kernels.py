"""GPU fast paths of the tower's per-frame step (issue #7), each beside its reference.

Why these exist: a batch-1 decode step of the full tower reads ~2.9 GB of weights (~0.7 ms on
an H200), but the eager step took 79 ms: cuDNN's SDPA built a new execution plan for every new
key length (13 layers x 3.7 ms of host time), and the sampler's splitmix64 noise was ~1000 tiny
int64 kernels. So:

    decode_attention(q [T, H, d], k_cache, v_cache [S, K, L, d], slots [T], positions [T])
        causal GQA attention of each row over positions 0..p of its own slot, read straight
        from the cache pool (no gather), lengths read on the device: one compiled kernel for
        every length, so nothing is re-planned per step and the call is CUDA-graph safe.
        Split-K ("flash decoding"): each (row, kv head) is cut into pieces of its own history
        (how many depends on its length only, so rows stay batch invariant), each piece keeps
        an online softmax in float32, and a second kernel merges the pieces. The 8 query
        heads of a kv head share one program (one K/V read).
        Reference: model.attend_rowwise (run it on float64 inputs for a float64 reference).

    draw(logits [R, M], temperature=, top_p=, top_k=, seeds=, takes=, frames=, draw_index=)
        sampling.draw in one Triton kernel per draw, one program per row (so a row's draw cannot
        depend on the batch): softmax, the top-p/top-k cut, the splitmix64 key and noise (§6.3),
        the race with IEEE division, the greedy argmax. The cut takes no sort: both top-p and
        top-k keep a prefix of the ranking, and the prefix's last probability is found by
        bisection over the float32 bits (the kernel's docstring). Most draws need no cut at all:
        when the race's winner over every candidate lies inside it, that winner is the answer
        (RACE_FIRST). It replaced ~25 kernels per draw, a radix sort among them (~0.9 ms of a
        3.5 ms batch-1 frame step on the H200).
        Reference: sampling.draw, equal on every row whose outcome is not within rounding of a
        boundary (a cumulative sum at top_p, two race scores), which a float64 analysis flags
        (tests/test_tower_kernels_draw.py). On the CPU: `sampling.draw` itself.

    FusedFrameDraws(history, slots=, temperature=, ..., defaults=, eos=)
        a frame step's ten draws as model.FrameDraws, each draw one launch that also does its
        bookkeeping (the RAS switch, the repetition penalty, EOS, the code writes, the RAS
        window's advance), where the torch path around `draw` took ~85 small launches per step.
        Reference: engine.torch_sampler + model.FrameDraws + engine.advance_ras_windows, the
        same codes bit for bit (tests/test_tower_frame_draws.py).

    rms_norm_plus(x [T, D], w, eps), norm_rope(x [T, heads, d], w, eps, cos, sin)
        RMSNorm+ in one kernel instead of ~8, and the attention's q/k norm + partial NeoX RoPE
        in one instead of ~20. References: model.rms_norm_plus, model.apply_rotary.

Every function imports and runs on a machine without Triton or CUDA (then the torch reference
path is taken); `use_triton` is the one dispatch rule.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from services.backbone.kernels import pdl_args
from services.common import invariant
from services.common.grpcutil import env_switch
from services.tower import sampling
from services.tower.model import FrameDraws

try:  # Triton ships with CUDA builds of torch only; CPU CI has none.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from services.backbone.kernels import pdl_prologue

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

# Triton's CPU interpreter (TRITON_INTERPRET=1, for checking the kernels without a GPU) has no
# libdevice; there the noise takes numpy's log, which may differ from CUDA's logf in the last bit.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Programmatic dependent launch for these kernels, as the backbone's decode step has it
# (services/backbone/kernels: pdl_prologue first in every kernel, launched with pdl_args; off where
# DRAMA_PDL=0 turns the backbone's off, and with it the decode GEMM's that the tower's projections
# use). On by default; DRAMA_TOWER_PDL=0 turns it off for these kernels
# (tests/test_tower_gpu.py demands the same codes on and off). With cuBLAS between these kernels it
# lost at batch 1 (session 10); with the projections on the Triton decode GEMM as well
# (model.TOWER_DECODE_GEMM) every kernel of a step starts while the one before drains: H200 graphed
# step 2.10 -> 1.77 ms at batch 1, 4.46 -> 4.33-4.49 at 128 (docs/perf.md, session 19).
TOWER_PDL = env_switch("DRAMA_TOWER_PDL") is not False


def _pdl_args() -> dict:
    return pdl_args() if TOWER_PDL else {}


def use_triton(*tensors: Tensor) -> bool:
    """True when Triton is importable and every tensor is on CUDA (or Triton interprets)."""
    return HAS_TRITON and (_INTERPRET or all(t.is_cuda for t in tensors))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --------------------------------------------------------------------------------------------
# decode attention
# --------------------------------------------------------------------------------------------

_MOST_SPLITS = 32
_SPLIT_POSITIONS = 128      # a row's history is cut into pieces of at least this many positions


def attention_splits(max_context: int) -> int:
    """The grid's pieces per (row, kv head), from the pool length only: a row of length n uses
    min(this, ceil(n / 128)) of them, so its arithmetic depends on nothing but n (batch
    invariance), and a batch-1 step over 1000 positions still runs 8 x 2 programs."""
    return max(1, min(_MOST_SPLITS, -(-max_context // _SPLIT_POSITIONS)))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                     splits: int | None = None, gate: Tensor | None = None) -> Tensor:
    """o [T, H, d] in q's dtype: row t attends over positions 0..positions[t] of slot slots[t].

    q [T, H, d] (any strides with a unit last stride); caches [S, K, L, d] with the row's key and
    value already written at its position. Without Triton/CUDA: the SDPA-free torch reference.
    gate [T, H, d] (unit last stride): return model.gate_output(o, gate), the §4.4 output gate, applied
    in the merge's launch with the same bits as torch's (three launches fewer per layer).
    """
    if not use_triton(q, k_cache, v_cache):
        from services.tower.model import gate_output

        o = reference_decode_attention(q, k_cache, v_cache, slots, positions)
        return o if gate is None else gate_output(o, gate)
    t, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    if q.stride(-1) != 1:
        q = q.contiguous()
    splits = splits or attention_splits(k_cache.shape[2])
    block_d = _next_pow2(head_dim)
    block_g = max(16, _next_pow2(group))          # tl.dot wants >= 16 rows
    block_n = 32 if block_d >= 256 else 64
    part_o = torch.empty(t, num_kv, splits, block_g, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(t, num_kv, splits, block_g, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(t, num_kv, splits)](
        q, k_cache, v_cache, slots, positions, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim ** -0.5, head_dim, splits,
        G=group, BG=block_g, BD=block_d, BN=block_n, SPLIT_POSITIONS=_SPLIT_POSITIONS, num_warps=4, num_stages=2, **_pdl_args())
    out = torch.empty(t, num_heads, head_dim, dtype=q.dtype, device=q.device)
    has_gate = gate is not None
    if has_gate and (gate.shape != q.shape or gate.stride(-1) != 1):
        raise ValueError(f"gate must be {tuple(q.shape)} with a unit last stride")
    _merge_splits_kernel[(t, num_heads)](
        part_o, part_lse, out, gate if has_gate else out, gate.stride(0) if has_gate else 0,
        gate.stride(1) if has_gate else 0, head_dim, splits, G=group, BG=block_g, BD=block_d,
        BS=max(_MOST_SPLITS, _next_pow2(splits)), HAS_GATE=has_gate, PRECISE=not _INTERPRET, num_warps=4, **_pdl_args())
    return out


def reference_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                               positions: Tensor) -> Tensor:
    """One row at a time, float32 softmax (model.attend_rowwise's arithmetic, any device)."""
    from services.tower.model import RowBatch, attend_rowwise

    segments = [(s, p, 1) for s, p in zip(slots.tolist(), positions.tolist())]
    return attend_rowwise(q, k_cache, v_cache, RowBatch.from_segments(segments, q.device))


if HAS_TRITON:

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, part_o_ptr, part_lse_ptr,
                                 stride_qt, stride_qh, stride_cs, stride_ch, stride_cl, scale, D, SPLITS,
                                 G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                                 SPLIT_POSITIONS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        length = tl.load(pos_ptr + row).to(tl.int32) + 1
        # This row's pieces (by its own length only), of whole BN blocks; the grid's other
        # pieces are empty (then m = -inf, l = 0, and the merge gives them weight 0).
        pieces = tl.minimum(tl.cdiv(length, SPLIT_POSITIONS), SPLITS)
        chunk = tl.cdiv(tl.cdiv(length, pieces), BN) * BN
        start = split * chunk
        end = tl.minimum(start + chunk, length)

        g = tl.arange(0, BG)
        d = tl.arange(0, BD)
        n = tl.arange(0, BN)
        g_ok = g < G
        d_ok = d < D
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + (kv * G + g)[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)                          # [BG, BD]
        base = slot * stride_cs + kv.to(tl.int64) * stride_ch
        m_i = tl.full([BG], float("-inf"), tl.float32)
        l_i = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, BD], tl.float32)
        for first in range(start, end, BN):
            pos = first + n
            ok = pos < end
            offsets = base + pos.to(tl.int64)[:, None] * stride_cl + d[None, :]
            k = tl.load(k_ptr + offsets, mask=ok[:, None] & d_ok[None, :], other=0.0)   # [BN, BD]
            scores = tl.dot(q, tl.trans(k)) * scale                                     # [BG, BN] f32
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offsets, mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        filled = l_i > 0
        o = acc / tl.where(filled, l_i, 1.0)[:, None]
        lse = tl.where(filled, m_i + tl.log(tl.where(filled, l_i, 1.0)), float("-inf"))
        piece = (row * tl.num_programs(1) + kv) * SPLITS + split
        tl.store(part_o_ptr + (piece.to(tl.int64) * BG + g[:, None]) * D + d[None, :], o,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + piece * BG + g, lse, mask=g_ok)

    @triton.jit
    def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, gate_ptr, stride_gt, stride_gh, D, SPLITS,
                             G: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                             HAS_GATE: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv = head // G
        g = head % G
        s = tl.arange(0, BS)
        s_ok = s < SPLITS
        d = tl.arange(0, BD)
        pieces = (row * (tl.num_programs(1) // G) + kv) * SPLITS + s                   # [BS]
        lse = tl.load(part_lse_ptr + pieces * BG + g, mask=s_ok, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, axis=0))                                     # empty: 0
        o = tl.load(part_o_ptr + (pieces.to(tl.int64)[:, None] * BG + g) * D + d[None, :],
                    mask=s_ok[:, None] & (d[None, :] < D), other=0.0)
        merged = tl.sum(weights[:, None] * o, axis=0) / tl.sum(weights, axis=0)
        dtype = out_ptr.dtype.element_ty
        if HAS_GATE:
            # gate_output bit for bit: σ = 1 / (1 + expf(-g)) in F32 as torch's CUDA sigmoid
            # (libdevice expf, IEEE division), rounded to o's dtype, then one rounded product
            g_val = tl.load(gate_ptr + row.to(tl.int64) * stride_gt + head * stride_gh + d,
                            mask=d < D, other=0.0).to(tl.float32)
            if PRECISE:
                sig = tl.math.div_rn(tl.full([BD], 1.0, tl.float32), 1.0 + libdevice.exp(-g_val))
            else:         # Triton's interpreter has no libdevice (numpy's exp there)
                sig = 1.0 / (1.0 + tl.exp(-g_val))
            merged = merged.to(dtype).to(tl.float32) * sig.to(dtype).to(tl.float32)
        tl.store(out_ptr + (row.to(tl.int64) * tl.num_programs(1) + head) * D + d,
                 merged.to(dtype), mask=d < D)


# --------------------------------------------------------------------------------------------
# RMSNorm+ and the attention prologue's q/k norm + RoPE
# --------------------------------------------------------------------------------------------

def rms_norm_plus(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """model.rms_norm_plus in one kernel (one program per row): x [T, D] -> x.dtype.
    Torch's version is ~8 launches (upcast, square, mean, add, rsqrt, two products, downcast)."""
    from services.tower.model import rms_norm_plus as reference

    if not use_triton(x) or x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] == 0:
        return reference(x, weight, eps)
    rows, dim = x.shape
    # storage padded to invariant.linear_rows' tile: the projections after the norm read it in place
    out = invariant.empty_rows(rows, dim, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), dim, eps, BD=_next_pow2(dim), num_warps=4, **_pdl_args())
    return out


def norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rotary(rms_norm_plus(x), cos, sin) per head in one kernel: x [T, heads, d] (any row
    and head strides), cos/sin float32 [T, r/2] -> contiguous [T, heads, d] in x's dtype. The
    normed value is rounded to x's dtype before the rotation, as the two-step version does."""
    from services.tower.model import apply_rotary, rms_norm_plus as reference

    if not use_triton(x) or x.stride(-1) != 1 or x.shape[0] == 0:
        return apply_rotary(reference(x, weight, eps), cos, sin)
    rows, heads, dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(rows, heads)](x, weight, cos, sin, out, x.stride(0), x.stride(1), dim, eps,
                                     x, out, 0, 0, x, x, 0, 0, 0,
                                     HALF=cos.shape[-1], BD=_next_pow2(dim), TO_CACHE=False, num_warps=1, **_pdl_args())
    return out


def fusion_input(codes: Tensor, table: Tensor, offset: int, hidden: Tensor, w_embedding: Tensor,
                 w_hidden: Tensor, eps: float) -> Tensor:
    """[RMSNorm⁺(e) | RMSNorm⁺(h)] [T, 2D], the fusion's fc input (model.fuse), in one kernel:
    e = table[offset + codes[t]] (exact zeros where codes[t] < 0, whose norm is zero too), h =
    hidden [T, D]. One program per row, the norms as `rms_norm_plus` computes them. It replaces
    ~9 launches per residual layer (the code's index arithmetic, the gather, the zero mask, two
    norms and the concat)."""
    from services.tower.model import rms_norm_plus as reference

    rows, dim = hidden.shape
    if not use_triton(codes, table, hidden) or hidden.stride(-1) != 1 or table.stride(-1) != 1 or rows == 0:
        known = codes >= 0
        e = table[offset + codes.clamp(min=0)]
        e = torch.where(known[:, None], e, torch.zeros_like(e))
        return torch.cat([reference(e, w_embedding, eps), reference(hidden, w_hidden, eps)], dim=-1)
    out = invariant.empty_rows(rows, 2 * dim, dtype=hidden.dtype, device=hidden.device)   # fc's GEMM input
    _fusion_input_kernel[(rows,)](codes, codes.stride(0), table, table.stride(0), offset, hidden, hidden.stride(0),
                                  w_embedding, w_hidden, out, dim, eps, BD=_next_pow2(dim), num_warps=4, **_pdl_args())
    return out


def norm_rope_to_cache(k: Tensor, v: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                       k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor) -> None:
    """k_cache[slots[t], :, positions[t]] = norm_rope(k)[t] and v_cache[...] = v[t] for every row t,
    in one kernel (k, v [T, K, d], any row and head strides, unit last stride; caches [S, K, L, d]).
    The same values as norm_rope and two index_put writes: three launches become one."""
    from services.tower.model import apply_rotary, rms_norm_plus as reference

    if (not use_triton(k, v, k_cache) or k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[0] == 0
            or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride()):
        k_cache[slots, :, positions] = apply_rotary(reference(k, weight, eps), cos, sin)
        v_cache[slots, :, positions] = v
        return
    rows, heads, dim = k.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    _norm_rope_kernel[(rows, heads)](k, weight, cos, sin, k_cache, k.stride(0), k.stride(1), dim, eps,
                                     v, v_cache, v.stride(0), v.stride(1), slots, positions,
                                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                     HALF=cos.shape[-1], BD=_next_pow2(dim), TO_CACHE=True, num_warps=1, **_pdl_args())


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, D, eps, BD: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        d = tl.arange(0, BD)
        ok = d < D
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(out_ptr + row.to(tl.int64) * D + d, (normed * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _fusion_input_kernel(codes_ptr, stride_c, table_ptr, stride_table, offset, h_ptr, stride_h, we_ptr, wh_ptr,
                             out_ptr, D, eps, BD: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        d = tl.arange(0, BD)
        ok = d < D
        dtype = out_ptr.dtype.element_ty
        code = tl.load(codes_ptr + row.to(tl.int64) * stride_c)
        index = (offset + tl.maximum(code, 0)).to(tl.int64)
        e = tl.load(table_ptr + index * stride_table + d, mask=ok, other=0.0).to(tl.float32)
        e = tl.where(code >= 0, e, 0.0)                # no target: exact zeros (the row read is unused)
        we = tl.load(we_ptr + d, mask=ok, other=0.0).to(tl.float32)
        normed = e * tl.rsqrt(tl.sum(e * e, axis=0) / D + eps)
        tl.store(out_ptr + row.to(tl.int64) * 2 * D + d, (normed * (1.0 + we)).to(dtype), mask=ok)
        h = tl.load(h_ptr + row.to(tl.int64) * stride_h + d, mask=ok, other=0.0).to(tl.float32)
        wh = tl.load(wh_ptr + d, mask=ok, other=0.0).to(tl.float32)
        normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        tl.store(out_ptr + row.to(tl.int64) * 2 * D + D + d, (normed * (1.0 + wh)).to(dtype), mask=ok)

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_h, D, eps,
                          v_ptr, vc_ptr, stride_vt, stride_vh, slot_ptr, pos_ptr, stride_cs, stride_ch, stride_cl,
                          HALF: tl.constexpr, BD: tl.constexpr, TO_CACHE: tl.constexpr, PDL: tl.constexpr = False):
        """out[row, head] = rope(norm(x[row, head])); TO_CACHE: out is the key cache, the row goes
        to [slot, head, pos] and v[row, head] to the value cache there too."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, BD)
        ok = d < D
        base = x_ptr + row.to(tl.int64) * stride_t + head * stride_h
        x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        dtype = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        y = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
        # NeoX pairs (i, i + r/2) of the first r = 2 * HALF dims: the partner of each rotated dim.
        first = d < HALF
        rotated = d < 2 * HALF
        partner = tl.where(first, d + HALF, d - HALF)
        partner = tl.where(rotated, partner, d)
        xp = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        j = tl.where(first, d, d - HALF)
        c = tl.load(cos_ptr + row.to(tl.int64) * HALF + j, mask=rotated, other=1.0)
        s = tl.load(sin_ptr + row.to(tl.int64) * HALF + j, mask=rotated, other=0.0)
        out = tl.where(first, y * c - yp * s, y * c + yp * s)
        out = tl.where(rotated, out, y)
        if TO_CACHE:
            at = (tl.load(slot_ptr + row).to(tl.int64) * stride_cs + head * stride_ch
                  + tl.load(pos_ptr + row).to(tl.int64) * stride_cl)
            tl.store(out_ptr + at + d, out.to(dtype), mask=ok)
            v = tl.load(v_ptr + row.to(tl.int64) * stride_vt + head * stride_vh + d, mask=ok)
            tl.store(vc_ptr + at + d, v, mask=ok)
        else:
            tl.store(out_ptr + (row.to(tl.int64) * tl.num_programs(1) + head) * D + d, out.to(dtype), mask=ok)


# --------------------------------------------------------------------------------------------
# the draw: one kernel per draw (softmax, top-p/top-k cut, noise, race, greedy)
# --------------------------------------------------------------------------------------------

# A row's candidates live in one program's registers; above this the draw takes the torch path.
FUSED_DRAW_MAX_CANDIDATES = 16384

# The race first (_draw_row's docstring): a draw whose race winner is inside the top-p/top-k cut
# needs no bisection. On by default; DRAMA_DRAW_RACE_FIRST=0 always bisects (the same codes).
# Read at every launch, so bench/step_settings.py can switch it inside one process.
RACE_FIRST = env_switch("DRAMA_DRAW_RACE_FIRST") is not False


def draw(logits: Tensor, *, temperature: Tensor, top_p: Tensor, top_k: Tensor, seeds: Tensor,
         takes: Tensor, frames: Tensor, draw_index: int) -> Tensor:
    """`sampling.draw` with keys `noise_key(seeds, takes, frames, draw_index)`: int64 [R].

    temperature/top_p/top_k/seeds/takes/frames are [R] tensors on the logits' device.
    """
    rows, m = logits.shape
    if not use_triton(logits) or m > FUSED_DRAW_MAX_CANDIDATES:
        keys = sampling.noise_key(seeds, takes, frames, draw_index)
        return sampling.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, keys=keys)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _draw_kernel[(rows,)](
        logits, logits.stride(0), temperature.to(torch.float32), top_p.to(torch.float32),
        top_k.to(torch.int64), seeds, takes, frames, out, m, draw_index, **_draw_launch(m), **_pdl_args())
    return out


# A step's draws with their bookkeeping, one launch each (model.FrameDraws, served frames). On by
# default where the draws run on Triton; DRAMA_TOWER_FUSED_DRAWS=0 keeps the torch bookkeeping
# around kernels.draw (tests/test_tower_gpu.py demands the same codes either way).
FUSED_FRAME_DRAWS = env_switch("DRAMA_TOWER_FUSED_DRAWS") is not False


class FusedFrameDraws(FrameDraws):
    """model.FrameDraws for the engine on Triton: each draw is one launch that also does what
    the torch path does around kernels.draw. The semantic draw (_semantic_draw_kernel) reads
    its row's RAS window from the engine's pool, picks the RAS parameters (§6.2), applies the
    repetition penalty, draws, marks EOS, writes the code and advances the window; each residual
    draw (_residual_draw_kernel) takes the parameters the semantic draw chose and writes its
    code, -1 for a stopped row. The same codes as the torch path (sampling.ras_active,
    sampling.apply_repetition_penalty, kernels.draw, the engine's window update), in 10 launches
    where that path takes ~85 per frame step.

    history int64 [S, W]: the RAS windows of every pool slot (advanced in place); the rest are
    the draw rows' [R] parameters on the device, as the engine's graphs stage them."""
    float32_logits = False       # the draws read the heads' bf16 logits and widen them exactly

    def __init__(self, history: Tensor, *, slots: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                 penalty: Tensor, seeds: Tensor, takes: Tensor, frames: Tensor, defaults, eos: int):
        super().__init__(sample=None, eos=eos)
        self.history = history
        self.slots, self.temperature, self.top_p, self.top_k, self.penalty = (
            t.contiguous() for t in (slots, temperature, top_p, top_k, penalty))
        self.seeds, self.takes, self.frames = (t.contiguous() for t in (seeds, takes, frames))
        self.defaults = defaults                 # config.SamplingDefaults: the RAS parameters
        self.drawn: tuple[Tensor, Tensor, Tensor] | None = None   # the semantic draw's parameters

    @staticmethod
    def fits(num_candidates: int) -> bool:
        """Can a draw over this many candidates take the fused kernels?"""
        return FUSED_FRAME_DRAWS and HAS_TRITON and num_candidates <= FUSED_DRAW_MAX_CANDIDATES

    def semantic(self, logits: Tensor, codes: Tensor, draw_rows: Tensor) -> Tensor:
        rows, m = logits.shape
        stopped = torch.empty(rows, dtype=torch.bool, device=logits.device)
        self.drawn = (torch.empty_like(self.temperature), torch.empty_like(self.top_p), torch.empty_like(self.top_k))
        if rows == 0:
            return stopped
        window = self.history.shape[1]
        defaults = self.defaults
        _semantic_draw_kernel[(rows,)](
            logits, logits.stride(0), m, self.eos, self.slots, self.history, self.penalty,
            self.temperature, self.top_p, self.top_k,
            _float32(defaults.ras_temperature), _float32(defaults.ras_top_p), defaults.ras_top_k,
            self.seeds, self.takes, self.frames, codes, *codes.stride(), draw_rows, stopped.view(torch.uint8),
            *self.drawn, W=window, BW=_next_pow2(window), RECENT=min(defaults.ras_recent, window),
            **_draw_launch(m), **_pdl_args())
        return stopped

    def residual(self, column: int, logits: Tensor, codes: Tensor, draw_rows: Tensor, stopped: Tensor) -> None:
        rows, m = logits.shape
        if rows == 0:
            return
        _residual_draw_kernel[(rows,)](
            logits, logits.stride(0), m, column, *self.drawn, self.seeds, self.takes, self.frames,
            codes, *codes.stride(), draw_rows, stopped.view(torch.uint8), **_draw_launch(m), **_pdl_args())


def _float32(value: float) -> float:
    """`value` rounded to float32, as torch.where rounds a Python float beside a float32 tensor
    (a kernel's float argument may be wider: the interpreter keeps float64)."""
    return torch.tensor(value, dtype=torch.float32).item()


def _draw_launch(num_candidates: int) -> dict:
    """The launch arguments every draw kernel takes for a row of this many candidates."""
    return dict(BM=max(16, _next_pow2(num_candidates)), PRECISE_LOG=not _INTERPRET, RACE_FIRST=RACE_FIRST,
                num_warps=_draw_warps(num_candidates))


def _draw_warps(num_candidates: int) -> int:
    """Warps of a draw's program. The draw is a chain of block reductions over one row, so more
    threads (fewer candidates each) shorten every link: H200, 4097 candidates (8192 lanes), top_p
    0.9, µs per draw with 4 / 8 / 16 warps: 76.1 / 38.6 / 33.2; the semantic draw with its
    bookkeeping 103.6 / 66.5 / 50.4 (session 20, `python3 bench/draws.py --warps 8 16 4`)."""
    return 16 if _next_pow2(num_candidates) >= 4096 else 4


if HAS_TRITON:

    # how far below top_p the race winner's float64 cumulative probability must lie for the race
    # first to answer (_draw_row): ~10^6 times the sums' worst rounding
    CUT_MARGIN = tl.constexpr(1e-9)

    @triton.jit
    def _splitmix64(x):
        z = x + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _as_float64(bits):
        """The probability whose float32 bits are `bits` (a key), widened exactly."""
        return bits.to(tl.float32, bitcast=True).to(tl.float64)

    @triton.jit
    def _draw_row(x, i, ok, M, temperature, top_p, top_k, seed, take, frame, draw_index,
                  PRECISE_LOG: tl.constexpr, RACE_FIRST: tl.constexpr = False):
        """One row's draw (§6.1) -> the drawn index: x float32 [BM] its logits (-inf past M), its
        M <= BM candidates held in one program's registers.

        The race first (RACE_FIRST): the answer is the best race score among the kept
        candidates, and the kept set is a prefix of the ranking (probability descending, ties to
        the lower index). So when the race's winner over every candidate lies inside the cut, it
        is the answer, and the cut itself is never needed. Checking that takes three reductions:
        the winner's rank r (at most top_k) and its cumulative probability c_r (r = 1, or
        c_r <= top_p). c_r is summed in float64 and must clear top_p by CUT_MARGIN, far above
        any float64 rounding of the bisection's sums below (<= ~1e-15 for 16384 probabilities of
        at most 1). So wherever the race first answers, the bisection would keep the winner too
        and give the same index. Otherwise the draw bisects as before: when the winner lies past
        the top-p cut (the winner is a sample of p, so ~1 - top_p of the draws) or past top_k.
        A greedy draw (temperature <= 0) is its argmax alone: no softmax, noise or race.

        The top-p/top-k cut needs no sort. Both keep a prefix of the ranking, so the kept set is
        "the first R ranks" for R = max(1, min(R_p, R_k)), and the first R ranks are every
        candidate above the R-th rank's probability v plus the lowest-indexed of those equal to
        v. Probabilities are >= 0, so their float32 bits (`key`) order like the values, and v is
        found by bisection over the bits: count(key >= x) >= R holds up to x = v. R_p is found
        the same way: c(v), the cumulative probability at the first rank of value v,
        Σ_{p > v} p + v, falls as v rises, so the smallest value with c(v) <= top_p is a
        bisection too, and its tie group keeps floor((top_p - Σ_{p > v} p) / v) members. The sums
        are float64 over the float32 probabilities: sampling.draw's float32 cumsum and the naive
        reference's float64 one may differ from it only where a cumulative sum is within
        rounding of top_p.
        """
        drawn = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)      # greedy: the first maximum
        if (temperature <= 0) == 0:        # (a NaN temperature samples, as before: no index is lost)
            drawn = _sampled_index(x, i, ok, M, temperature, top_p, top_k, seed, take, frame, draw_index,
                                   PRECISE_LOG, RACE_FIRST)
        return drawn

    @triton.jit
    def _sampled_index(x, i, ok, M, temperature, top_p, top_k, seed, take, frame, draw_index,
                       PRECISE_LOG: tl.constexpr, RACE_FIRST: tl.constexpr):
        """_draw_row's draw at a temperature that is not <= 0: softmax, cut, noise and race."""
        z = tl.math.div_rn(x, temperature)
        e = tl.exp(z - tl.max(z, axis=0))                       # padding: exp(-inf) = 0
        p = tl.math.div_rn(e, tl.sum(e, axis=0))
        # a NaN (from NaN or all -inf logits) counts as 0: every key is then in [0, +inf's bits],
        # so the bisections' differences never overflow and their loops always end
        p = tl.where(p == p, p, 0.0)
        key = tl.where(ok, p.to(tl.int32, bitcast=True), -1)    # padding ranks below every p >= 0
        top_p = top_p.to(tl.float64)
        rank_k = tl.where(top_k <= 0, M, tl.minimum(top_k, M).to(tl.int32))

        # §6.3 noise: h = sm(seed), then h = sm(h ^ v) for take, frame, draw; uint64 arithmetic.
        h = _splitmix64(seed.to(tl.uint64, bitcast=True))
        h = _splitmix64(h ^ take.to(tl.uint64, bitcast=True))
        h = _splitmix64(h ^ frame.to(tl.uint64, bitcast=True))
        h = _splitmix64(h ^ (draw_index + tl.zeros([], tl.int64)).to(tl.uint64, bitcast=True))
        w = _splitmix64(h ^ i.to(tl.uint64))
        u = (((w >> 11).to(tl.float64) + 0.5) * (2.0 ** -53)).to(tl.float32)
        if PRECISE_LOG:
            q = -libdevice.log(u)          # CUDA's logf: the same bits as torch.log
        else:
            q = -tl.log(u)
        # the race: p > 0 scores p / q (IEEE division, as torch; q = 0 gives +inf), p = 0 scores
        # 0; below, a dropped candidate -1; padding -2 never wins; ties go to the lowest index.
        score = tl.where(ok, tl.where(p > 0, tl.math.div_rn(p, q), 0.0), -2.0)

        drawn = tl.zeros([], tl.int64)
        need_cut = True
        if RACE_FIRST:
            winner = tl.argmax(score, axis=0, tie_break_left=True)
            p_winner = tl.sum(tl.where(i == winner, p, 0.0), axis=0)
            key_winner = p_winner.to(tl.int32, bitcast=True)
            ahead = (key > key_winner) | ((key == key_winner) & (i < winner))   # the ranks before it
            rank = tl.sum(ahead.to(tl.int32), axis=0) + 1
            cumulative = tl.sum(tl.where(ahead, p, 0.0).to(tl.float64), axis=0) + p_winner.to(tl.float64)
            inside_p = (rank == 1) | ~(top_p < 1.0) | (cumulative <= top_p - CUT_MARGIN)
            inside = (p_winner > 0) & inside_p & (rank <= rank_k)
            need_cut = ~inside
            drawn = winner.to(tl.int64)
        if need_cut:
            kept = _cut(key, p, ok, M, top_p, rank_k)
            drawn = tl.argmax(tl.where(kept | ~ok, score, -1.0), axis=0, tie_break_left=True).to(tl.int64)
        return drawn

    @triton.jit
    def _cut(key, p, ok, M, top_p, rank_k):
        """The kept mask [BM] of _draw_row's top-p/top-k cut (its docstring): the first
        max(1, min(R_p, rank_k)) ranks, found by bisection over the probabilities' bits `key`."""
        key_max = tl.max(key, axis=0)
        big = 2147483647
        # R_p: the smallest present value v with c(v) <= top_p, then how many of v's tie
        # group fit. One reduction per bisection step: S(x) = Σ_{key >= x} p falls as x
        # rises; for x_A, the least x with S(x) <= top_p, and v_A (the least key >= x_A)
        # c(v_A) <= S(x_A) <= top_p, while every value below v_prev (the largest key < x_A)
        # has c >= S(v_prev) > top_p. So v is v_prev when c(v_prev) = S(x_A) + v_prev <=
        # top_p, else v_A (else, no v_A: the top tie group alone exceeds top_p, v = key_max,
        # and only rank 1 survives below). The sums are over the same masked vectors as c's
        # own formula (no key lies between v_prev and x_A), so this is the bisection over c
        # with half the reductions, each step waiting on one.
        key_min = tl.min(tl.where(ok, key, big), axis=0)
        cut = key_min                  # top_p >= 1 keeps every rank: the cut is the last one
        rank_p = M
        if top_p < 1.0:
            lo = key_min
            hi = key_max + 1           # S(key_max + 1) = 0 <= top_p
            while lo < hi:
                mid = lo + (hi - lo) // 2
                if tl.sum(tl.where(key >= mid, p, 0.0).to(tl.float64), axis=0) <= top_p:
                    hi = mid
                else:
                    lo = mid + 1
            v_prev = tl.max(tl.where(ok & (key < lo), key, -1), axis=0)
            c_prev = tl.sum(tl.where(key > v_prev, p, 0.0).to(tl.float64), axis=0) + _as_float64(v_prev)
            v = tl.where((v_prev >= 0) & (c_prev <= top_p), v_prev,
                         tl.minimum(tl.min(tl.where(key >= lo, key, big), axis=0), key_max))
            above = tl.sum(tl.where(key > v, p, 0.0).to(tl.float64), axis=0)
            count_above = tl.sum((key > v).to(tl.int32), axis=0)
            count_equal = tl.sum((key == v).to(tl.int32), axis=0)
            v64 = _as_float64(v)
            room = tl.where(v64 > 0, tl.floor((top_p - above) / tl.where(v64 > 0, v64, 1.0)),
                            count_equal.to(tl.float64))
            room = tl.minimum(tl.maximum(room, 1.0), count_equal.to(tl.float64))
            first_fits = above + v64 <= top_p                # else only rank 1 survives
            rank_p = tl.where(first_fits, count_above + room.to(tl.int32), 1)
            cut = v
        ranks = tl.maximum(tl.minimum(rank_p, rank_k), 1)
        if ranks < rank_p:
            # top-k cuts first: its cut is the largest x with count(key >= x) >= ranks
            lo = key_min
            hi = key_max
            while lo < hi:
                mid = hi - (hi - lo) // 2
                if tl.sum((key >= mid).to(tl.int32), axis=0) >= ranks:
                    lo = mid
                else:
                    hi = mid - 1
            cut = lo
        # the first `ranks` ranks: every key above the cut, and the lowest-indexed of its ties
        tie = key == cut
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1           # 0-based among the ties
        kept = (key > cut) | (tie & (tie_rank < ranks - tl.sum((key > cut).to(tl.int32), axis=0)))
        return kept

    @triton.jit(do_not_specialize=["draw_index"])
    def _draw_kernel(logits_ptr, stride_row, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, take_ptr,
                     frame_ptr, out_ptr, M, draw_index, BM: tl.constexpr, PRECISE_LOG: tl.constexpr,
                     RACE_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
        """kernels.draw: one program per row, its draw into out[row]."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        drawn = _draw_row_at(logits_ptr, stride_row, row, M, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr,
                             take_ptr, frame_ptr, draw_index, BM, PRECISE_LOG, RACE_FIRST)
        tl.store(out_ptr + row, drawn)

    @triton.jit
    def _draw_row_at(logits_ptr, stride_row, row, M, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, take_ptr,
                     frame_ptr, draw_index, BM: tl.constexpr, PRECISE_LOG: tl.constexpr, RACE_FIRST: tl.constexpr):
        """_draw_row of row `row`: its logits and parameters loaded from [R] arrays."""
        i = tl.arange(0, BM)
        ok = i < M
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + i, mask=ok, other=float("-inf")).to(tl.float32)
        return _draw_row(x, i, ok, M, tl.load(temperature_ptr + row), tl.load(top_p_ptr + row),
                         tl.load(top_k_ptr + row), tl.load(seed_ptr + row), tl.load(take_ptr + row),
                         tl.load(frame_ptr + row), draw_index, PRECISE_LOG, RACE_FIRST)

    @triton.jit
    def _write_code(codes_ptr, stride_codes, stride_column, draw_rows_ptr, row, column, drawn, stopped):
        """codes[draw_rows[row], column] = -1 if the row stopped, else the drawn code."""
        dest = tl.load(draw_rows_ptr + row)
        tl.store(codes_ptr + dest * stride_codes + column * stride_column, tl.where(stopped, -1, drawn))

    @triton.jit
    def _semantic_draw_kernel(logits_ptr, stride_row, M, eos, slot_ptr, history_ptr, penalty_ptr,
                              temperature_ptr, top_p_ptr, top_k_ptr, ras_temperature, ras_top_p, ras_top_k,
                              seed_ptr, take_ptr, frame_ptr, codes_ptr, stride_codes, stride_column, draw_rows_ptr,
                              stopped_ptr, drawn_temperature_ptr, drawn_top_p_ptr, drawn_top_k_ptr,
                              BM: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, RECENT: tl.constexpr,
                              PRECISE_LOG: tl.constexpr, RACE_FIRST: tl.constexpr = False,
                              PDL: tl.constexpr = False):
        """FrameDraws.semantic for one row: everything the engine's torch sampler does around
        draw 0 (sampling.ras_active, the RAS parameters, apply_repetition_penalty, the draw, EOS,
        the code write, the RAS window's advance), in one program.

        The RAS switch reads the row's window before this draw's code enters it, as the torch
        path reads its snapshot; the residual draws take the parameters it chose from
        drawn_temperature/top_p/top_k, so they never read the window this program rewrites."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        i = tl.arange(0, BM)
        ok = i < M
        window = tl.arange(0, BW)
        in_window = window < W
        history_row = history_ptr + tl.load(slot_ptr + row) * W

        temperature = tl.load(temperature_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        # §6.2's RAS switch: two or more codes so far, and a repeat among the last RECENT
        history = tl.load(history_row + window, mask=in_window, other=-1)
        recent = in_window & (window >= W - RECENT) & (history >= 0)
        repeats = tl.zeros([], tl.int32)
        for a in tl.static_range(RECENT):
            code_a = tl.load(history_row + W - RECENT + a)
            same = recent & (history == code_a) & (window != W - RECENT + a) & (code_a >= 0)
            repeats += tl.sum(same.to(tl.int32), axis=0)
        ras = (repeats > 0) & (tl.sum((history >= 0).to(tl.int32), axis=0) >= 2)
        temperature = tl.where(ras, ras_temperature, temperature)
        top_p = tl.where(ras, ras_top_p, top_p)
        top_k = tl.where(ras, ras_top_k, top_k)

        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + i, mask=ok, other=float("-inf")).to(tl.float32)
        # the repetition penalty on the semantic codes of the window (never on EOS)
        seen = i < 0
        for w in tl.static_range(BW):
            if w < W:
                seen = seen | (i == tl.load(history_row + w))
        penalty = tl.load(penalty_ptr + row)
        penalised = tl.where(x > 0, tl.math.div_rn(x, penalty), x * penalty)
        x = tl.where(seen & (i < eos), penalised, x)

        drawn = _draw_row(x, i, ok, M, temperature, top_p, top_k, tl.load(seed_ptr + row),
                          tl.load(take_ptr + row), tl.load(frame_ptr + row), 0, PRECISE_LOG, RACE_FIRST)
        stopped = drawn == eos
        _write_code(codes_ptr, stride_codes, stride_column, draw_rows_ptr, row, 0, drawn, stopped)
        tl.store(stopped_ptr + row, stopped.to(tl.uint8))
        tl.store(drawn_temperature_ptr + row, temperature)
        tl.store(drawn_top_p_ptr + row, top_p)
        tl.store(drawn_top_k_ptr + row, top_k.to(tl.int64))
        # the window advances by the semantic code unless EOS (read again here: nothing of it
        # stays live across the draw); every load is used before the barrier, so no thread
        # overwrites an entry another has yet to read
        history = tl.load(history_row + window, mask=in_window, other=-1)
        shifted = tl.load(history_row + window + 1, mask=window + 1 < W, other=-1)
        advanced = tl.where(stopped, history, tl.where(window + 1 < W, shifted, drawn))
        tl.debug_barrier()
        tl.store(history_row + window, advanced, mask=in_window)

    @triton.jit(do_not_specialize=["column"])
    def _residual_draw_kernel(logits_ptr, stride_row, M, column, temperature_ptr, top_p_ptr, top_k_ptr,
                              seed_ptr, take_ptr, frame_ptr, codes_ptr, stride_codes, stride_column, draw_rows_ptr,
                              stopped_ptr, BM: tl.constexpr, PRECISE_LOG: tl.constexpr,
                              RACE_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
        """FrameDraws.residual for one row: draw `column` (codebook `column`) with the parameters
        the semantic draw chose, its code written into codes (-1 for a stopped row)."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        drawn = _draw_row_at(logits_ptr, stride_row, row, M, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr,
                             take_ptr, frame_ptr, column, BM, PRECISE_LOG, RACE_FIRST)
        stopped = tl.load(stopped_ptr + row) != 0
        _write_code(codes_ptr, stride_codes, stride_column, draw_rows_ptr, row, column, drawn, stopped)

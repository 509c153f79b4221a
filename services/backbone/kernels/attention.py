"""Decode attention over the KV slot pool (MODEL.md §4.4 step 3), one row per session.

    decode_attention(q [B, n_q, d], k_pool, v_pool [S, n_kv, L_max, d], slots [B], positions [B],
                     context, scale) -> [B, n_q, d] bf16
        row b attends over keys 0..positions[b] of slot slots[b], read where they lie in the pool
    naive_decode_attention(same arguments) -> the same, by gathering the slots and one masked
        torch SDPA call (the reference; what the kernel path ran before this kernel)

Why a kernel of our own: torch's SDPA with a mask picks cuDNN on the H200, and cuDNN builds a new
execution plan for every new key length, i.e. every decode step (3.7 ms of host time per call,
measured on the tower, docs/perf.md); and the masked call needs the batch's keys gathered out of
the pool first ([B, n_kv, context, d] per layer, which inside a CUDA graph means max_context rows
per session). This kernel reads the pool by (slot, position), takes the lengths from a device
tensor (so one CUDA graph serves every position) and never re-plans.

Flash-decoding in two launches: programs (b, kv head, split) each take the query heads of one KV
head (GQA: head h uses KV head h // (n_q/n_kv), padded to 16 rows for tl.dot) over one range of
`split` keys with an online softmax in F32, and write a partial output with its max and sum; a
second launch combines the splits that hold keys (⌈(position+1)/split⌉, from the tensor). Loops
have fixed trip counts with masks (a block or split past a row's length adds exact zeros), so the
kernels also run in Triton's interpreter (TRITON_INTERPRET=1; tests/test_backbone_attention_gpu.py
holds them to the reference on CUDA).
The number of splits comes from `context` (the largest length the call may see: max position + 1
eagerly, max_context in a graph), so programs past a row's length do nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAS_TRITON, INTERPRET, pdl_args, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue
    from triton.language.extra import libdevice

TARGET_SPLITS = 32      # at most this many key ranges per (row, KV head); a range holds >= MIN_SPLIT keys
MIN_SPLIT = 64
BLOCK_N = 64            # keys per inner iteration


def naive_decode_attention(q, k_pool, v_pool, slots, positions, context: int, scale: float) -> torch.Tensor:
    """Gather keys [0, context) of the rows' slots and run one SDPA call with a length mask."""
    b, n_q, d = q.shape
    n_kv = k_pool.shape[1]
    keys = k_pool[:, :, :context].index_select(0, slots)
    values = v_pool[:, :, :context].index_select(0, slots)
    visible = torch.arange(context, device=q.device)[None, :] <= positions[:, None]       # [B, context]
    o = F.scaled_dot_product_attention(q.view(b, n_kv, n_q // n_kv, d), keys, values,
                                       attn_mask=visible[:, None, None, :], scale=scale)
    return o.reshape(b, n_q, d)


def split_size(context: int) -> int:
    """Keys per split for a call that may see up to `context` keys (a power of two >= MIN_SPLIT)."""
    want = -(-context // TARGET_SPLITS)
    return max(MIN_SPLIT, 1 << (want - 1).bit_length())


def supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    d, n_q, n_kv = q.shape[-1], q.shape[1], k_pool.shape[1]
    return (use_triton(q, k_pool) and d >= 16 and d & (d - 1) == 0 and n_q % n_kv == 0
            and k_pool.stride(-1) == 1 and q.stride(-1) == 1 and q.dtype == k_pool.dtype == torch.bfloat16)


def gate_output(o: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """§4.4's output gate, o ⊙ σ(gate) in bf16 (σ rounded to bf16 first, as torch computes it)."""
    return torch.mul(o, torch.sigmoid(gate), out=out)


def decode_attention(q, k_pool, v_pool, slots, positions, context: int, scale: float,
                     gate: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. q [B, n_q, d] (heads contiguous); pools [S, n_kv, L_max, d];
    slots, positions int [B] on the device; context >= every positions[b] + 1.
    gate [B, n_q, d] (any row stride, heads contiguous): return gate_output(o, gate), the gate
    applied in the combine launch; out [B, n_q, d]: where to write the result."""
    if not supported(q, k_pool):
        o = naive_decode_attention(q, k_pool, v_pool, slots, positions, context, scale)
        if gate is not None:
            return gate_output(o, gate, out)
        return o if out is None else out.copy_(o)
    b, n_q, d = q.shape
    n_kv = k_pool.shape[1]
    group = n_q // n_kv
    split = split_size(context)
    n_splits = -(-context // split)
    part_o = torch.empty(b, n_kv, n_splits, group, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, n_kv, n_splits, group, 2, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(b, n_kv, n_splits)](
        q, k_pool, v_pool, slots, positions, part_o, part_ml, scale, split, n_splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        G=group, GP=max(16, triton.next_power_of_2(group)), D=d, BN=BLOCK_N, num_warps=4, num_stages=2, **pdl_args())
    if out is None:
        out = torch.empty(b, n_q, d, dtype=q.dtype, device=q.device)
    has_gate = gate is not None
    if has_gate and gate.stride(2) != 1:
        raise ValueError("gate needs unit stride along d")
    _decode_combine_kernel[(b, n_q)](part_o, part_ml, positions, out, gate if has_gate else out, split, n_splits,
                                     out.stride(0), out.stride(1), gate.stride(0) if has_gate else 0,
                                     gate.stride(1) if has_gate else 0, G=group, D=d, HAS_GATE=has_gate,
                                     PRECISE=not INTERPRET, num_warps=4, **pdl_args())
    return out


if HAS_TRITON:

    @triton.jit
    def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, ml_ptr, scale, split, n_splits,
                               stride_qb, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh,
                               stride_vl, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                               PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(pos_ptr + b).to(tl.int32) + 1
        start = sp * split
        if start < length:
            end = tl.minimum(start + split, length)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            g = tl.arange(0, GP)
            d = tl.arange(0, D)
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :],
                        mask=(g < G)[:, None], other=0.0)
            k_base = k_ptr + slot * stride_ks + kvh * stride_kh
            v_base = v_ptr + slot * stride_vs + kvh * stride_vh
            m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            for i in range(0, tl.cdiv(split, BN)):     # fixed trip count; keys past `end` masked out
                n = start + i * BN + tl.arange(0, BN)
                ok = n < end
                k = tl.load(k_base + n.to(tl.int64)[:, None] * stride_kl + d[None, :], mask=ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale                               # [GP, BN] f32
                s = tl.where(ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + n.to(tl.int64)[:, None] * stride_vl + d[None, :], mask=ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            row = ((b * tl.num_programs(1) + kvh) * n_splits + sp).to(tl.int64) * G
            keep = g < G
            tl.store(o_ptr + (row + g)[:, None] * D + d[None, :], acc, mask=keep[:, None])
            tl.store(ml_ptr + (row + g) * 2, m_i, mask=keep)
            tl.store(ml_ptr + (row + g) * 2 + 1, l_i, mask=keep)

    @triton.jit
    def _decode_combine_kernel(o_ptr, ml_ptr, pos_ptr, out_ptr, gate_ptr, split, n_splits, stride_ob, stride_oh,
                               stride_gb, stride_gh, G: tl.constexpr, D: tl.constexpr, HAS_GATE: tl.constexpr,
                               PRECISE: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        b, h = tl.program_id(0), tl.program_id(1)
        n_q = tl.num_programs(1)
        kvh, g = h // G, h % G
        length = tl.load(pos_ptr + b).to(tl.int32) + 1
        used = (length + split - 1) // split
        d = tl.arange(0, D)
        m_all = tl.full([D], float("-inf"), dtype=tl.float32)    # kept as vectors: one layout for all
        l_all = tl.zeros([D], dtype=tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        base = (b * (n_q // G) + kvh).to(tl.int64) * n_splits
        for sp in range(0, n_splits):               # splits past the row's length are masked out
            row = (base + sp) * G + g
            live = (d * 0 + sp) < used
            m = tl.load(ml_ptr + row * 2 + d * 0, mask=live, other=float("-inf"))
            l_ = tl.load(ml_ptr + row * 2 + 1 + d * 0, mask=live, other=0.0)
            o = tl.load(o_ptr + row * D + d, mask=live, other=0.0)
            m_new = tl.maximum(m_all, m)
            a_old = tl.exp(m_all - m_new)
            a_new = tl.exp(m - m_new)
            l_all = l_all * a_old + l_ * a_new
            acc = acc * a_old + o * a_new
            m_all = m_new
        y = (acc / l_all).to(out_ptr.dtype.element_ty)
        if HAS_GATE:
            # gate_output as torch computes it, bit for bit: σ = 1 / (1 + expf(−g)) in F32 with
            # libdevice's expf and IEEE division (tl.sigmoid's fast exp and division differ in the
            # last bits, which moves bf16 roundings: a prefill piece's rows then differed from the
            # eager path's), rounded to bf16; then bf16(o)·σ rounded once more
            gate = tl.load(gate_ptr + b.to(tl.int64) * stride_gb + h * stride_gh + d).to(tl.float32)
            if PRECISE:
                sig = tl.math.div_rn(tl.full([D], 1.0, tl.float32), 1.0 + libdevice.exp(-gate))
            else:         # Triton's interpreter has no libdevice (numpy's exp there)
                sig = 1.0 / (1.0 + tl.exp(-gate))
            sig = sig.to(out_ptr.dtype.element_ty)
            y = (y.to(tl.float32) * sig.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, y)

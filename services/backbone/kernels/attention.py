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

    piece_attention(q [P·B, n_q, d], pools, piece_slots [P], positions [P·B], piece_rows [P], B,
                    scale) -> [P·B, n_q, d]
        padded prefill pieces (Backbone.prefill_graphs): piece j's row i attends over keys
        0..positions[j·B] + i of slot piece_slots[j]; rows past piece_rows[j] give zeros
    naive_piece_attention(same arguments) -> the same through naive_decode_attention (reference)

Why a second kernel: a piece's rows are consecutive positions of one slot, so a block of rows can
share every key it loads. The decode kernel reads each row's keys on its own: in a 1024-row
prefill its two launches took 229 + 86 µs per attention layer (H200, session 9), each key read
~1000 times. One program here takes BQ rows x the G query heads of one KV head (BQ·G = 64 rows of
one tl.dot) over the keys up to the block's last real row, with an online softmax in F32: a key
is read once per 64 query vectors instead of once per 16 (the decode kernel's G heads padded).
A row's bits depend on its own position and keys only (blocks past it add exact zeros; the dot's
tile shape is fixed), not on the bucket or the other pieces. The backbone runs pieces through it by
default; DRAMA_PIECE_ATTENTION=rows takes the decode kernel instead. H200 (session 10, run 1,
`bench/backbone.py --prefill 256 512 1024`): 1024 rows 35.1 -> 33.6 ms, 256 and 512 rows within
0.2 ms of the decode kernel (16.7 / 16.9, 23.1 / 23.0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.grpcutil import env_choice

from . import HAS_TRITON, INTERPRET, bf16_dot_args, pdl_args, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue
    from triton.language.extra import libdevice

PIECE_ATTENTION = env_choice("DRAMA_PIECE_ATTENTION", ("tiled", "rows"))   # read once at import
PIECE_QUERY_ROWS = 64   # query vectors (rows x heads of one KV head) per program of piece_attention
PIECE_BLOCK_N = 64      # keys per inner iteration of piece_attention

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


def naive_piece_attention(q, k_pool, v_pool, piece_slots, positions, piece_rows, bucket: int, scale: float,
                          gate: torch.Tensor | None = None) -> torch.Tensor:
    """piece_attention's reference: the real rows through naive_decode_attention (each row over its
    own keys), padding rows zero; the gate as gate_output."""
    rows = torch.arange(q.shape[0], device=q.device)
    piece = rows // bucket
    real = (rows % bucket) < piece_rows[piece]
    out = torch.zeros_like(q)
    idx = real.nonzero(as_tuple=True)[0]
    if idx.numel():
        context = int(positions[idx].max()) + 1
        o = naive_decode_attention(q[idx], k_pool, v_pool, piece_slots[piece[idx]], positions[idx], context, scale)
        out[idx] = o if gate is None else gate_output(o, gate[idx])
    return out


def _piece_shapes_ok(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """G = n_q / n_kv a power of two of at most PIECE_QUERY_ROWS (BQ = PIECE_QUERY_ROWS / G rows, so
    every program's operand has PIECE_QUERY_ROWS rows), d a power of two >= 16, unit inner strides."""
    d, n_q, n_kv = q.shape[-1], q.shape[1], k_pool.shape[1]
    group = n_q // n_kv
    return (n_q % n_kv == 0 and group & (group - 1) == 0 and group <= PIECE_QUERY_ROWS and d >= 16
            and d & (d - 1) == 0 and q.stride(-1) == 1 and k_pool.stride(-1) == 1)


def piece_supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether piece_attention runs its kernel here: on CUDA with Triton and bf16 operands (as the
    decode kernel, `supported`), or in Triton's interpreter (tests), when the shapes allow it."""
    if not _piece_shapes_ok(q, k_pool):
        return False
    return (INTERPRET and HAS_TRITON) or supported(q, k_pool)


def piece_attention(q, k_pool, v_pool, piece_slots, positions, piece_rows, bucket: int, scale: float,
                    gate: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. q [P·bucket, n_q, d] (heads contiguous); pools [S, n_kv, L_max, d];
    piece_slots, piece_rows int [P] and positions int [P·bucket] on the device (row i of piece j at
    positions[j·bucket] + i: only each piece's first position is read); gate and out as
    decode_attention's. Off CUDA (and where `piece_supported` fails): naive_piece_attention."""
    if not piece_supported(q, k_pool):
        o = naive_piece_attention(q, k_pool, v_pool, piece_slots, positions, piece_rows, bucket, scale, gate)
        return o if out is None else out.copy_(o)
    total, n_q, d = q.shape
    n_kv = k_pool.shape[1]
    group = n_q // n_kv
    pieces = total // bucket
    if pieces * bucket != total:
        raise ValueError(f"piece_attention: {total} rows are not pieces of {bucket}")
    block_q = max(1, PIECE_QUERY_ROWS // group)
    if out is None:
        out = torch.empty_like(q)
    has_gate = gate is not None
    if has_gate and gate.stride(2) != 1:
        raise ValueError("gate needs unit stride along d")
    _piece_attention_kernel[(pieces, triton.cdiv(bucket, block_q), n_kv)](
        q, k_pool, v_pool, piece_slots, positions, piece_rows, out, gate if has_gate else out, scale, bucket,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
        gate.stride(0) if has_gate else 0, gate.stride(1) if has_gate else 0,
        G=group, BQ=block_q, D=d, BN=PIECE_BLOCK_N, HAS_GATE=has_gate, PRECISE=not INTERPRET,
        **bf16_dot_args(), num_warps=8, num_stages=2, **pdl_args())
    return out


if HAS_TRITON:

    @triton.jit
    def _gate_output(y, gate, PRECISE: tl.constexpr):
        """gate_output as torch computes it, bit for bit, for y in the output dtype: σ = 1 / (1 +
        expf(−g)) in F32 with libdevice's expf and IEEE division (tl.sigmoid's fast exp and
        division differ in the last bits, which moves bf16 roundings: a prefill piece's rows then
        differed from the eager path's), rounded to y's dtype; then y·σ rounded once more."""
        gate = gate.to(tl.float32)
        if PRECISE:
            sig = tl.math.div_rn(tl.zeros_like(gate) + 1.0, 1.0 + libdevice.exp(-gate))
        else:         # Triton's interpreter has no libdevice (numpy's exp there)
            sig = 1.0 / (1.0 + tl.exp(-gate))
        return (y.to(tl.float32) * sig.to(y.dtype).to(tl.float32)).to(y.dtype)

    @triton.jit
    def _piece_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, rows_ptr, out_ptr, gate_ptr, scale, bucket,
                                stride_qr, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh,
                                stride_vl, stride_or, stride_oh, stride_gr, stride_gh,
                                G: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                                HAS_GATE: tl.constexpr, PRECISE: tl.constexpr, DOT: tl.constexpr,
                                PREC: tl.constexpr, PDL: tl.constexpr = False):
        """Program (piece j, block of BQ rows, KV head): the block's rows x the KV head's G query
        heads as one [BQ·G, D] operand, over keys 0..the block's last real position."""
        pdl_prologue(PDL)
        j, qb, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        real_rows = tl.load(rows_ptr + j).to(tl.int32)
        first = qb * BQ
        mq = tl.arange(0, BQ * G)
        i = first + mq // G                       # the row in the piece
        h = kvh * G + mq % G                      # its query head
        r = (j * bucket + i).to(tl.int64)         # the row in the step
        d = tl.arange(0, D)
        in_piece = i < bucket
        real = i < real_rows
        y = tl.zeros([BQ * G, D], dtype=out_ptr.dtype.element_ty)
        if first < real_rows:
            slot = tl.load(slot_ptr + j).to(tl.int64)
            start = tl.load(pos_ptr + j * bucket).to(tl.int32)
            pos = start + i
            end = start + tl.minimum(first + BQ, real_rows)        # keys [0, end) cover the block's real rows
            q = tl.load(q_ptr + r[:, None] * stride_qr + h[:, None] * stride_qh + d[None, :],
                        mask=real[:, None], other=0.0).to(DOT)
            k_base = k_ptr + slot * stride_ks + kvh * stride_kh
            v_base = v_ptr + slot * stride_vs + kvh * stride_vh
            m_i = tl.full([BQ * G], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BQ * G], dtype=tl.float32)
            acc = tl.zeros([BQ * G, D], dtype=tl.float32)
            # key 0 is in every row's range, so after the first block every m_i is finite and a
            # block past a row's position adds exact zeros (p = 0, alpha = 1)
            for b0 in range(0, tl.cdiv(end, BN)):
                n = b0 * BN + tl.arange(0, BN)
                ok = n < end
                k = tl.load(k_base + n.to(tl.int64)[:, None] * stride_kl + d[None, :], mask=ok[:, None],
                            other=0.0).to(DOT)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                 # [BQ·G, BN] f32
                s = tl.where(ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + n.to(tl.int64)[:, None] * stride_vl + d[None, :], mask=ok[:, None],
                            other=0.0).to(DOT)
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PREC)
                m_i = m_new
            y = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
            if HAS_GATE:
                gate = tl.load(gate_ptr + r[:, None] * stride_gr + h[:, None] * stride_gh + d[None, :],
                               mask=real[:, None], other=0.0)
                y = _gate_output(y, gate, PRECISE)
            y = tl.where(real[:, None], y, 0.0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * stride_or + h[:, None] * stride_oh + d[None, :], y, mask=in_piece[:, None])

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
            y = _gate_output(y, tl.load(gate_ptr + b.to(tl.int64) * stride_gb + h * stride_gh + d), PRECISE)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, y)

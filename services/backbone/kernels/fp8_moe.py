"""Routed FP8 experts on the GPU (MODEL.md §4.5 routing, §4.7 block-FP8 arithmetic).

Shape letters: T token rows, H hidden size, E experts, k experts per token (top-k), I expert
intermediate size, n = T·k (token, slot) pairs, BM rows per block of a grouped GEMM.

Expert weights, stacked over experts (checkpoint tensors `experts.{e}.{gate,up,down}_proj.*`):

    w_gate_up [E, 2I, H] float8_e4m3fn   rows 0..I-1 = gate_proj, rows I..2I-1 = up_proj
    s_gate_up [E, 2·⌈I/128⌉, ⌈H/128⌉]    gate's weight_scale_inv rows, then up's (kept apart so a
                                          partial last 128-row block of gate never shares a scale
                                          with up when I is not a multiple of 128)
    w_down    [E, H, I] float8_e4m3fn
    s_down    [E, ⌈H/128⌉, ⌈I/128⌉]

`pack_gate_up` builds the first pair from the separate checkpoint tensors.

One expert applied to an activation row u, with the rounding points this module defines:

    gate = bf16(fp8_linear(u, gate_proj))           §4.7: dynamic 1x128 quantisation of u,
    up   = bf16(fp8_linear(u, up_proj))             F32 accumulation, per-block scales
    h    = bf16(silu(gate) · up)                    (silu and product in F32)
    E(u) = fp8_linear(h, down_proj)   in F32        §4.7 again, quantising h per 1x128 group
    MoE(u) = Σ_j w_j · E_{e_j}(u)  in F32, rounded once by the caller after adding the shared expert

Public functions:

    router_topk(logits [T, E], k)                        -> ids int32 [T, k], weights bf16 [T, k]
    moe_fp8(x, ids, weights, w_gate_up, s_gate_up, w_down, s_down) -> y [T, H]
    moe_fp8_grouped(...)  same, always through the sorted/padded grouped GEMM (prefill)
    naive_moe_fp8(...)    same arguments: plain loops over tokens and experts on dequantised
                          weights with §4.7's activation quantisation, float32 (the test reference)

How the decode step reads each selected expert once: the (token, slot) pairs are grouped by
expert into blocks of BM rows (one launch of `_route_kernel`, no host sync, so the step can be
captured in a CUDA graph); each program of the two GEMM kernels takes one block and one stripe
of output columns, so an expert's weights are streamed by exactly one block row of programs.
Activations are quantised once per step by `_quant_rows_kernel` (x before gate/up, h before
down), not inside the GEMM loops: five launches per layer (route, quant, gate_up, quant, down).
Weights are converted fp8 -> bf16 in registers and multiplied with a bf16 `tl.dot`: fp8 values
are exact in bf16 and products of two are exact in F32, so this is the §4.7 arithmetic, not an
approximation of it (decode is bound by weight bytes, not by tensor-core rate).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from services.common import invariant

from . import HAS_TRITON, pdl_args, use_triton

FP8_MAX = 448.0
ACTIVATION_SCALE_FLOOR = 1e-10   # §4.7: a_g = max(max|x_g|, 1e-10) / 448
GROUP = 128                      # activation group = weight block (weight_block_size [128, 128])
DECODE_MAX_PAIRS = 1024          # above this many (token, slot) pairs the torch-sorted grouped path is used

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue


# --------------------------------------------------------------------------------------------
# torch helpers and references (any device)
# --------------------------------------------------------------------------------------------

def quantize_rows_fp8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.7 dynamic quantisation along the last dim, on x's device (services.common.fp8's
    quantize_activation_fp8 is the CPU original; a CPU test checks they agree bit for bit).

    x [..., K] -> (x_q [..., K] float8_e4m3fn, a [..., ⌈K/group⌉] float32).
    """
    k = x.shape[-1]
    groups = math.ceil(k / group)
    x32 = x.float().reshape(-1, k)
    padded = F.pad(x32, (0, groups * group - k))
    amax = padded.abs().view(-1, groups, group).amax(dim=-1)
    # a tensor divisor, not the Python scalar: torch's CUDA kernel turns `t / 448.0` into a multiply by
    # the reciprocal (one ulp off IEEE division now and then), the CPU kernel divides; §4.7 means division
    a = amax.clamp_min(ACTIVATION_SCALE_FLOOR) / torch.full_like(amax, FP8_MAX)
    x_q = (x32 / a.repeat_interleave(group, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q.reshape(x.shape), a.reshape(*x.shape[:-1], groups)


def dequantize_weight(w_q: torch.Tensor, s: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """W[n, j] = float(W_q[n, j]) · S[n // 128, j // 128] in float32. w_q [N, K], s [⌈N/128⌉, ⌈K/128⌉]."""
    n, k = w_q.shape
    full = s.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return w_q.float() * full


def fp8_linear_dequant(x: torch.Tensor, w_q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """§4.7 linear through dequantised operands, float32: (x_q·a) @ (W_q·S)ᵀ. x [..., K] -> [..., N]."""
    x_q, a = quantize_rows_fp8(x)
    x_deq = x_q.float() * a.repeat_interleave(GROUP, dim=-1)[..., :x.shape[-1]]
    return x_deq @ dequantize_weight(w_q, s).T


def pack_gate_up(w_gate: torch.Tensor, s_gate: torch.Tensor, w_up: torch.Tensor, s_up: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, I, H] gate/up weights and [E, ⌈I/128⌉, ⌈H/128⌉] scales -> (w_gate_up [E, 2I, H], s_gate_up)."""
    return torch.cat([w_gate, w_up], dim=1).contiguous(), torch.cat([s_gate, s_up], dim=1).float().contiguous()


def _check_moe_args(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down):
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    t, h = x.shape
    e, i2, h2 = w_gate_up.shape
    i = i2 // 2
    if h2 != h or i2 % 2:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} does not fit x {tuple(x.shape)}: expected [E, 2I, {h}]")
    if tuple(w_down.shape) != (e, h, i):
        raise ValueError(f"w_down {tuple(w_down.shape)}: expected {(e, h, i)}")
    sg, kg = math.ceil(i / GROUP), math.ceil(h / GROUP)
    if tuple(s_gate_up.shape) != (e, 2 * sg, kg):
        raise ValueError(f"s_gate_up {tuple(s_gate_up.shape)}: expected {(e, 2 * sg, kg)}")
    if tuple(s_down.shape) != (e, kg, sg):
        raise ValueError(f"s_down {tuple(s_down.shape)}: expected {(e, kg, sg)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)}: expected [{t}, k]")
    return t, h, e, i


def naive_moe_fp8(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down) -> torch.Tensor:
    """Reference for moe_fp8: loops over tokens and their experts, float32. Returns [T, H] float32."""
    t_rows, h, _, i = _check_moe_args(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down)
    sg = s_gate_up.shape[1] // 2
    y = torch.zeros(t_rows, h, dtype=torch.float32, device=x.device)
    for t in range(t_rows):
        u = x[t:t + 1]
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate = fp8_linear_dequant(u, w_gate_up[e, :i], s_gate_up[e, :sg]).to(torch.bfloat16)
            up = fp8_linear_dequant(u, w_gate_up[e, i:], s_gate_up[e, sg:]).to(torch.bfloat16)
            act = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
            y[t] += topk_weights[t, j].float() * fp8_linear_dequant(act, w_down[e], s_down[e])[0]
    return y


def router_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.5: softmax over E in F32, the k largest (lower index first on ties), renormalised, BF16.

    logits [T, E] -> (ids int32 [T, k], weights bf16 [T, k]). A stable descending sort gives
    the lower index first among equal probabilities, which torch.topk does not promise.
    """
    p = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    w, ids = w[:, :k], ids[:, :k]
    return ids.to(torch.int32), (w / w.sum(dim=-1, keepdim=True)).to(torch.bfloat16)


def align_blocks_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group the n = T·k (token, slot) pairs by expert into blocks of `block_m` rows, with torch ops
    only (no host sync). Pair p = t·k + j. Blocks are ordered by expert id, rows by pair index.

    Returns (block_expert int32 [max_blocks] (−1 = unused block), block_rows int32
    [max_blocks·block_m] (pair index, n = padding), max_blocks). Σ_e ⌈c_e/BM⌉ < n/BM + min(E, n)
    bounds the number of blocks, so max_blocks is fixed by the shapes alone.
    """
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    max_blocks = math.ceil(n / block_m) + min(num_experts, n)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    nblk = (counts + block_m - 1) // block_m
    blk_end = nblk.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_ids]
    dest = (blk_end - nblk)[sorted_ids] * block_m + rank
    block_rows = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    block_rows[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(blk_end, torch.arange(max_blocks, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return block_expert, block_rows, max_blocks


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _quant_tile(x):
        """x [BM, 128] float32 (masked columns 0) -> (x_q as bf16 values, a [BM]) per §4.7.

        div_rn: Triton's default float32 division is approximate; §4.7's rounding is defined by
        IEEE division (torch's), and one ulp can move an e4m3 rounding decision.
        """
        amax = tl.max(tl.abs(x), axis=1)
        a = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
        xq = tl.math.div_rn(x, a[:, None])
        xq = tl.minimum(tl.maximum(xq, -448.0), 448.0)
        return xq.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.bfloat16), a

    @triton.jit
    def _quant_rows_kernel(x_ptr, xq_ptr, a_ptr, M, K, stride_xm, BM: tl.constexpr):
        """Standalone §4.7 activation quantiser (tests check `_quant_tile` bit for bit with it)."""
        pid_m, g = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = g * 128 + tl.arange(0, 128)
        ok = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        xq, a = _quant_tile(x)
        tl.store(xq_ptr + rows[:, None] * K + cols[None, :], xq.to(tl.float8e4nv), mask=ok)
        tl.store(a_ptr + rows * tl.cdiv(K, 128) + g, a, mask=rows < M)

    @triton.jit
    def _route_kernel(ids_ptr, nblk_ptr, block_expert_ptr, block_rows_ptr, n, max_blocks,
                      NP: tl.constexpr, QC: tl.constexpr, BM: tl.constexpr, FILL: tl.constexpr):
        """One program: the block table of align_blocks_torch for n <= NP pairs, in one launch.

        For each pair p: before[p] = #{q < p: id_q = id_p}, total[p] = #{q: id_q = id_p}; the
        first occurrence of an expert publishes its block count, and an expert's first block is
        the sum of the block counts of all smaller expert ids present. O(n²) compares, fine for
        a decode step (n <= 1024).
        """
        for f0 in range(0, max_blocks * BM, FILL):
            offs = f0 + tl.arange(0, FILL)
            tl.store(block_rows_ptr + offs, tl.full([FILL], 0, tl.int32) + n, mask=offs < max_blocks * BM)
        for f0 in range(0, max_blocks, FILL):
            offs = f0 + tl.arange(0, FILL)
            tl.store(block_expert_ptr + offs, tl.full([FILL], -1, tl.int32), mask=offs < max_blocks)
        p = tl.arange(0, NP)
        p_ok = p < n
        ids_p = tl.load(ids_ptr + p, mask=p_ok, other=-1).to(tl.int32)
        before = tl.zeros([NP], dtype=tl.int32)
        total = tl.zeros([NP], dtype=tl.int32)
        for q0 in range(0, n, QC):
            q = q0 + tl.arange(0, QC)
            ids_q = tl.load(ids_ptr + q, mask=q < n, other=-2).to(tl.int32)
            eq = ids_p[:, None] == ids_q[None, :]
            total += tl.sum(eq.to(tl.int32), axis=1)
            before += tl.sum((eq & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
        nblk = (total + BM - 1) // BM
        tl.store(nblk_ptr + p, tl.where((before == 0) & p_ok, nblk, 0), mask=p_ok)
        tl.debug_barrier()
        start = tl.zeros([NP], dtype=tl.int32)
        for q0 in range(0, n, QC):
            q = q0 + tl.arange(0, QC)
            ids_q = tl.load(ids_ptr + q, mask=q < n, other=-2).to(tl.int32)
            nb_q = tl.load(nblk_ptr + q, mask=q < n, other=0)
            start += tl.sum(tl.where(ids_q[None, :] < ids_p[:, None], nb_q[None, :], 0), axis=1)
        blk = start + before // BM
        r = before % BM
        tl.debug_barrier()
        tl.store(block_rows_ptr + blk * BM + r, p, mask=p_ok)
        tl.store(block_expert_ptr + blk, ids_p, mask=p_ok & (r == 0))

    @triton.jit
    def _moe_gate_up_kernel(xq_ptr, xa_ptr, w_ptr, s_ptr, h_ptr, ws_ptr, block_expert_ptr, block_rows_ptr,
                            n_pairs, top_k, H, I, SG,
                            stride_we, stride_wn, stride_se, stride_sn,
                            BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
        """h[p, n] = bf16(silu(gate) · up) for the BM pairs of one block and BN intermediate columns.

        x comes pre-quantised (x_q [T, H] fp8, a [T, ⌈H/128⌉]): quantising inside the K loop put a
        row reduction and IEEE divisions on every iteration's critical path and made the decode
        step latency-bound (3.5 ms for 40 layers at T = 1 on the H200, 15x the byte floor).
        """
        pid_b, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert < 0:
            return
        rows = tl.load(block_rows_ptr + pid_b * BM + tl.arange(0, BM))
        row_ok = rows < n_pairs
        tokens = tl.where(row_ok, rows // top_k, 0).to(tl.int64)
        G = tl.cdiv(H, 128)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < I
        offs_k = tl.arange(0, 128)
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        w_up = w_gate + I * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        pid_k = tl.program_id(2)
        per = tl.cdiv(G, SPLIT)
        for kb in range(pid_k * per, tl.minimum(G, pid_k * per + per)):
            kk = kb * 128 + offs_k
            k_ok = kk < H
            xq = tl.load(xq_ptr + tokens[:, None] * H + kk[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.bfloat16)
            a = tl.load(xa_ptr + tokens * G + kb, mask=row_ok, other=0.0)
            wm = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_gate + kk[None, :], mask=wm, other=0.0).to(tl.bfloat16)
            wu = tl.load(w_up + kk[None, :], mask=wm, other=0.0).to(tl.bfloat16)
            sg = tl.load(s_base + kb).to(tl.float32)
            su = tl.load(s_base + SG * stride_sn + kb).to(tl.float32)
            acc_g += tl.dot(xq, tl.trans(wg)) * a[:, None] * sg
            acc_u += tl.dot(xq, tl.trans(wu)) * a[:, None] * su
        out_mask = row_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            gate = acc_g.to(tl.bfloat16).to(tl.float32)
            up = acc_u.to(tl.bfloat16).to(tl.float32)
            act = gate * tl.sigmoid(gate) * up
            tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + offs_n[None, :], act.to(tl.bfloat16), mask=out_mask)
        else:
            # split-K: F32 partial sums to ws [SPLIT, n, 2I]; _split_reduce_quant_kernel finishes
            ws = ws_ptr + (pid_k * n_pairs + rows.to(tl.int64)[:, None]) * (2 * I) + offs_n[None, :]
            tl.store(ws, acc_g, mask=out_mask)
            tl.store(ws + I, acc_u, mask=out_mask)

    @triton.jit
    def _split_swiglu(ws_ptr, rows, cols, n_rows, I, SPLIT: tl.constexpr, BM: tl.constexpr, CACHE: tl.constexpr):
        """(h, ok) for the tile rows x cols: the split-K partials ws [SPLIT, n_rows, 2I] (gate
        columns, then up) summed in split order, h = bf16(silu(bf16 gate)·bf16 up) as F32 values,
        0 outside the tile's valid part. CACHE: the loads' cache modifier (".cg": from L2, past
        this SM's L1, for partials other programs of the same launch wrote; such a caller is
        another kernel, so the loads then go two splits at a time)."""
        ok = (rows[:, None] < n_rows) & (cols[None, :] < I)
        base = ws_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
        gate = tl.zeros([BM, 128], dtype=tl.float32)
        up = tl.zeros([BM, 128], dtype=tl.float32)
        if CACHE == "":
            for j in tl.static_range(SPLIT):
                gate += tl.load(base + j * n_rows * 2 * I, mask=ok, other=0.0)
                up += tl.load(base + j * n_rows * 2 * I + I, mask=ok, other=0.0)
        else:
            # inside another kernel (moe_decode's gate/up): two splits' loads at a time, not all of
            # them, or the registers they hold cost that kernel programs per SM; the same sum order
            for j in range(0, SPLIT - 1, 2):
                g0 = tl.load(base + j * n_rows * 2 * I, mask=ok, other=0.0, cache_modifier=CACHE)
                u0 = tl.load(base + j * n_rows * 2 * I + I, mask=ok, other=0.0, cache_modifier=CACHE)
                g1 = tl.load(base + (j + 1) * n_rows * 2 * I, mask=ok, other=0.0, cache_modifier=CACHE)
                u1 = tl.load(base + (j + 1) * n_rows * 2 * I + I, mask=ok, other=0.0, cache_modifier=CACHE)
                gate = gate + g0 + g1
                up = up + u0 + u1
            if SPLIT % 2 == 1:
                gate += tl.load(base + (SPLIT - 1) * n_rows * 2 * I, mask=ok, other=0.0, cache_modifier=CACHE)
                up += tl.load(base + (SPLIT - 1) * n_rows * 2 * I + I, mask=ok, other=0.0, cache_modifier=CACHE)
        gate = gate.to(tl.bfloat16).to(tl.float32)
        up = up.to(tl.bfloat16).to(tl.float32)
        act = (gate * tl.sigmoid(gate) * up).to(tl.bfloat16).to(tl.float32)
        return tl.where(ok, act, 0.0), ok

    @triton.jit
    def _split_reduce_quant_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, pid_m, g, SPLIT: tl.constexpr,
                                 BM: tl.constexpr, CACHE: tl.constexpr):
        """Rows pid_m·BM.. and 128-group g: _split_swiglu, then §4.7-quantise h into hq, ha."""
        rows = pid_m * BM + tl.arange(0, BM)
        cols = g * 128 + tl.arange(0, 128)
        act, ok = _split_swiglu(ws_ptr, rows, cols, n_pairs, I, SPLIT, BM, CACHE)
        xq, a = _quant_tile(act)
        tl.store(hq_ptr + rows[:, None] * I + cols[None, :], xq.to(tl.float8e4nv), mask=ok)
        tl.store(ha_ptr + rows * tl.cdiv(I, 128) + g, a, mask=rows < n_pairs)

    @triton.jit
    def _split_reduce_quant_kernel(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, SPLIT: tl.constexpr, BM: tl.constexpr,
                                   PDL: tl.constexpr = False):
        """Sum the split-K partials in order, h = bf16(silu(bf16 gate)·bf16 up), then §4.7-quantise h."""
        pdl_prologue(PDL)
        _split_reduce_quant_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, tl.program_id(0), tl.program_id(1), SPLIT, BM, "")

    @triton.jit
    def _moe_down_kernel(hq_ptr, ha_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, block_expert_ptr, block_rows_ptr,
                         n_pairs, H, I,
                         stride_we, stride_wn, stride_se, stride_sn,
                         BM: tl.constexpr, BN: tl.constexpr):
        """out[p, n] = w_p · fp8_linear(h[p], down_e)[n] in F32 for one block and BN hidden columns
        (h pre-quantised per 1x128 group: h_q [n, I] fp8, a [n, ⌈I/128⌉])."""
        pid_b, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert < 0:
            return
        rows = tl.load(block_rows_ptr + pid_b * BM + tl.arange(0, BM))
        row_ok = rows < n_pairs
        rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
        G = tl.cdiv(I, 128)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < H
        offs_k = tl.arange(0, 128)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, G):
            kk = kb * 128 + offs_k
            k_ok = kk < I
            hq = tl.load(hq_ptr + rows64[:, None] * I + kk[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.bfloat16)
            a = tl.load(ha_ptr + rows64 * G + kb, mask=row_ok, other=0.0)
            w = tl.load(w_base + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.bfloat16)
            s = tl.load(s_base + kb).to(tl.float32)
            acc += tl.dot(hq, tl.trans(w)) * a[:, None] * s
        rw = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows64[:, None] * H + offs_n[None, :], acc * rw[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _softmax(logit, ok):
        """One row's softmax over its E logits in F32 (`ok` masks the padding of BE, whose p is 0)."""
        logit = tl.where(ok, logit, -float("inf"))
        m = tl.max(logit, axis=0)
        e = tl.where(ok, tl.exp(logit - m), 0.0)
        return e / tl.sum(e, axis=0)

    @triton.jit
    def _softmax_topk_argmax(logit, offs, ok, E, K, KP: tl.constexpr, BE: tl.constexpr):
        """_softmax_topk as first written, two block reductions per pick (the largest p, then the
        lowest index holding it). Kept as the plain form the keyed one must equal bit for bit
        (moe_decode.route_decode(route_config=dict(KEYED_TOPK=False)), bench/router_decode.py).
        A NaN row matches nothing and takes id E-1 k times."""
        p = _softmax(logit, ok)
        slots = tl.arange(0, KP)
        ids = tl.zeros([KP], dtype=tl.int32)
        ws = tl.zeros([KP], dtype=tl.float32)
        for j in range(0, K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, offs, BE), axis=0)
            idx = tl.minimum(idx, E - 1)   # a NaN row matches nothing: keep its ids in range anyway
            ids = tl.where(slots == j, idx, ids)
            ws = tl.where(slots == j, best, ws)
            p = tl.where(offs == idx, -1.0, p)
        return ids, ws / tl.sum(ws, axis=0)

    @triton.jit
    def _softmax_topk(logit, offs, ok, E, K, KP: tl.constexpr, BE: tl.constexpr):
        """One row's routing (§4.5): softmax over the E logits (F32; `ok` masks the padding of
        BE), the k largest (lowest index on ties), renormalised -> (ids [KP] int32, weights [KP] F32).

        One block reduction per pick, where _softmax_topk_argmax takes two: p >= 0, and the bits
        of a non-negative float read as an int32 order as the floats do, so the int64 key
        bits(p) << 32 | (BE-1-e) orders by p, then by the lower index e, and one max of it gives
        the pick and its p (the same p bits, so the same ids and weights as the argmax form).
        The key's low half always holds BE-1-e: a picked entry or the padding gets a negative
        high half, below every live key, and still names its index (so a pick is in range even
        for k > E). A NaN (or +inf) logit makes the whole row NaN: every p gets one NaN key above
        +inf, and the row takes experts 0, 1, .., k-1 with NaN weights, as router_topk_reference's
        stable sort puts NaN first. p = -0.0 does not arise (e >= +0); it would key as +0."""
        p = _softmax(logit, ok)
        low = (BE - 1 - offs).to(tl.int64)
        bits = tl.where(p > 0.0, p.to(tl.int32, bitcast=True), 0)
        bits = tl.where(p != p, 0x7FC00000, bits)                 # a quiet NaN's bits: above +inf
        dead = low - (1 << 32)
        key = tl.where(ok, (bits.to(tl.int64) << 32) | low, dead)
        slots = tl.arange(0, KP)
        ids = tl.zeros([KP], dtype=tl.int32)
        ws = tl.zeros([KP], dtype=tl.float32)
        for j in range(0, K):
            best = tl.max(key, axis=0)
            idx = BE - 1 - best.to(tl.int32)                      # the low half (truncation)
            ids = tl.where(slots == j, idx, ids)
            ws = tl.where(slots == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), ws)
            key = tl.where(offs == idx, dead, key)
        return ids, ws / tl.sum(ws, axis=0)

    @triton.jit
    def _router_kernel(logits_ptr, ids_ptr, w_ptr, E, K, stride_t,
                       KP: tl.constexpr, BE: tl.constexpr):
        """One row per program: _softmax_topk of the row's logits; weights rounded to bf16."""
        t = tl.program_id(0)
        offs = tl.arange(0, BE)
        ok = offs < E
        logit = tl.load(logits_ptr + t * stride_t + offs, mask=ok, other=-float("inf")).to(tl.float32)
        ids, ws = _softmax_topk(logit, offs, ok, E, K, KP, BE)
        slots = tl.arange(0, KP)
        tl.store(ids_ptr + t * K + slots, ids, mask=slots < K)
        tl.store(w_ptr + t * K + slots, ws.to(tl.bfloat16), mask=slots < K)


# --------------------------------------------------------------------------------------------
# launchers and public API
# --------------------------------------------------------------------------------------------

# BM rows per block, BN columns per program (gate_up / down), SPLIT = K split of gate_up (partials
# reduced by _split_reduce_quant_kernel); bench/kernels.py sweeps these on the H200.
DECODE_CONFIG = dict(BM=16, BN_GU=32, BN_DOWN=64, num_warps=4, num_stages=4)
# Fastest at T = 1 in the H200 sweep of 2026-11-29 (1.57 vs 1.86 ms for 40 layers; docs/perf.md). The
# default stays DECODE_CONFIG until test_moe_fp8_split_k_matches_naive[fast] has run on a GPU.
FAST_DECODE_CONFIG = dict(BM=16, BN_GU=64, BN_DOWN=64, num_warps=4, num_stages=4, SPLIT=4)
PREFILL_CONFIG = dict(BM=64, BN_GU=64, BN_DOWN=128, num_warps=8, num_stages=3)


def kernel_config(grouped: bool) -> dict:
    """The GEMM kernels' config for a call: DECODE_CONFIG, or PREFILL_CONFIG for the grouped path
    when batch invariance is off (DRAMA_BATCH_INVARIANT=0).

    Why one config (issue #8): a pair's output is a sum over H (gate/up) or I (down) in 128-wide
    steps of `tl.dot` with F32 accumulation. Inside one compiled kernel the MMA computes each row
    of a block from that row alone, in a K order fixed by the constexprs, so neither the other
    pairs of the block, nor the block table, nor n changes a pair's bits. A different config is a
    different kernel (on the H200, BM = 16 lowers `tl.dot` to mma.sync, BM = 64 with 8 warps most
    likely to wgmma), and nothing promises that two kernels accumulate a row bit for bit alike.
    The decode/grouped choice follows the step's pair count (T·k > DECODE_MAX_PAIRS), i.e. the
    other sessions' rows: a session's prompt rows would take one kernel alone and the other
    inside a large prefill step. So the grouped
    path keeps the decode kernels (its blocks are then 16 rows: more blocks and weight reads for
    long prefills, fewer padded rows for short ones). Everything else here is per row already:
    the router (one row per program, fixed BE), the activation quantiser (a row's 128-groups;
    max and IEEE division do not depend on BM), the split-K reduce (fixed SPLIT, in order), and
    the route tables (`_route_kernel`'s NP changes the table's construction, not its contents).
    """
    return PREFILL_CONFIG if grouped and not invariant.ENABLED else DECODE_CONFIG


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-kernel §4.7 quantiser run on its own: x [M, K] (CUDA) -> (x_q [M, K] fp8, a [M, ⌈K/128⌉])."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    a = torch.empty(m, math.ceil(k / GROUP), dtype=torch.float32, device=x.device)
    bm = 16 if m <= 64 else 64
    _quant_rows_kernel[(triton.cdiv(m, bm), triton.cdiv(k, GROUP))](x, xq, a, m, k, x.stride(0), BM=bm, num_warps=4)
    return xq, a


def route_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """align_blocks_torch in one Triton launch (n = T·k <= DECODE_MAX_PAIRS); same tables."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    if n > DECODE_MAX_PAIRS:
        raise ValueError(f"route_blocks handles at most {DECODE_MAX_PAIRS} pairs, got {n}")
    max_blocks = math.ceil(n / block_m) + min(num_experts, n)
    dev = flat.device
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    block_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    scratch = torch.empty(n, dtype=torch.int32, device=dev)
    np_ = max(16, triton.next_power_of_2(n))
    _route_kernel[(1,)](flat, scratch, block_expert, block_rows, n, max_blocks,
                        NP=np_, QC=16, BM=block_m, FILL=1024, num_warps=8 if np_ >= 256 else 4)
    return block_expert, block_rows, max_blocks


def warm_route_blocks(device, num_experts: int, top_k: int, block_m: int) -> None:
    """Compile `_route_kernel` for every specialisation a prefill piece can need before serving:
    every piece of 1…DECODE_MAX_PAIRS/k rows, i.e. every NP (pairs rounded up to a power of two)
    with every divisibility of n and max_blocks that Triton specialises integer arguments on.
    Decode steps route through moe_decode, so the decode-graph captures no longer compile these;
    without this, prompts of new sizes each waited ~1 s for a compile (kernel_watch logged
    `_route_kernel` after SERVING on the H200, twice with only NP and n%16 covered). ~128 tiny
    launches, a few ms once compiled."""
    for r in range(1, DECODE_MAX_PAIRS // top_k + 1):
        ids = torch.arange(r * top_k, device=device, dtype=torch.int32).remainder(num_experts).view(r, top_k)
        route_blocks(ids, num_experts, block_m)


def router_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk_reference in one launch on CUDA. logits [T, E] (rows may be strided)."""
    if not use_triton(logits):
        return router_topk_reference(logits, k)
    if logits.stride(-1) != 1:
        raise ValueError("router_topk needs unit stride along E")
    t, e = logits.shape
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    w = torch.empty(t, k, dtype=torch.bfloat16, device=logits.device)
    _router_kernel[(t,)](logits, ids, w, e, k, logits.stride(0), KP=triton.next_power_of_2(k),
                         BE=triton.next_power_of_2(e), num_warps=4)
    return ids, w


def _moe_pairs(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down,
               block_expert, block_rows, max_blocks, cfg) -> torch.Tensor:
    """Run the two GEMM kernels over a block table; returns per-pair outputs [T, k, H] float32."""
    t, h = x.shape
    e, i2, _ = w_gate_up.shape
    i, k = i2 // 2, topk_ids.shape[1]
    n = t * k
    if x.stride(1) != 1:
        x = x.contiguous()
    act = torch.empty(n, i, dtype=torch.bfloat16, device=x.device)
    bm, bn1, bn2 = cfg["BM"], cfg["BN_GU"], cfg["BN_DOWN"]
    if GROUP % bn1 or GROUP % bn2:
        raise ValueError("BN must divide 128 so a program's columns share one scale block")
    split = cfg.get("SPLIT", 1)
    xq, xa = quantize_rows_fp8_triton(x)
    ws = torch.empty(split, n, 2 * i, dtype=torch.float32, device=x.device) if split > 1 else act
    _moe_gate_up_kernel[(max_blocks, triton.cdiv(i, bn1), split)](
        xq, xa, w_gate_up, s_gate_up, act, ws, block_expert, block_rows, n, k, h, i, s_gate_up.shape[1] // 2,
        w_gate_up.stride(0), w_gate_up.stride(1), s_gate_up.stride(0), s_gate_up.stride(1),
        BM=bm, BN=bn1, SPLIT=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        hq = torch.empty(n, i, dtype=torch.float8_e4m3fn, device=x.device)
        ha = torch.empty(n, math.ceil(i / GROUP), dtype=torch.float32, device=x.device)
        _split_reduce_quant_kernel[(triton.cdiv(n, 16), triton.cdiv(i, GROUP))](
            ws, hq, ha, n, i, SPLIT=split, BM=16, num_warps=4, **pdl_args())
    else:
        hq, ha = quantize_rows_fp8_triton(act)
    out = torch.empty(n, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1)
    _moe_down_kernel[(max_blocks, triton.cdiv(h, bn2))](
        hq, ha, w_down, s_down, out, weights, block_expert, block_rows, n, h, i,
        w_down.stride(0), w_down.stride(1), s_down.stride(0), s_down.stride(1),
        BM=bm, BN=bn2, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out.view(t, k, h)


def moe_fp8_pairs(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, *,
                  grouped: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """CUDA only: the weighted per-pair expert outputs w_j·E_{e_j}(x_t), [T, k, H] float32, for a
    caller that fuses the final sum (decode_graph.moe_combine). grouped=None picks the decode
    path (one-launch router table) for T·k <= DECODE_MAX_PAIRS, the torch-sorted one above."""
    _, _, e, _ = _check_moe_args(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down)
    if grouped is None:
        grouped = topk_ids.numel() > DECODE_MAX_PAIRS
    cfg = config or kernel_config(grouped)
    tables = (align_blocks_torch if grouped else route_blocks)(topk_ids, e, cfg["BM"])
    return _moe_pairs(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, *tables, cfg)


def moe_fp8(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, *,
            shared: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
            config: dict | None = None, grouped: bool | None = None) -> torch.Tensor:
    """Routed experts for x [T, H] bf16 with top-k ids/weights [T, k]; returns [T, H] `out_dtype`.

    `shared` ([T, H], optional) is added in F32 before the single rounding (the shared expert's
    σ(gate)·E_s(u), §4.5). CUDA: decode path (one-launch router table, BM = 16) for T·k <=
    DECODE_MAX_PAIRS, else the grouped prefill path (`grouped` forces either). CPU: naive_moe_fp8.
    """
    _check_moe_args(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down)
    if use_triton(x, w_gate_up, w_down):
        y = moe_fp8_pairs(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down,
                          grouped=grouped, config=config).sum(1)
    else:
        y = naive_moe_fp8(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down)
    if shared is not None:
        y = y + shared.float()
    return y.to(out_dtype)


def moe_fp8_grouped(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, **kwargs) -> torch.Tensor:
    """Prefill path: pairs sorted by expert with torch ops, padded to BM rows (kernel_config: 16,
    or 64 with batch invariance off), grouped GEMM."""
    return moe_fp8(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, grouped=True, **kwargs)

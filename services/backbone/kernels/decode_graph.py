"""Small fused kernels of the backbone decode step, and a CUDA-graph wrapper for a fixed-shape step.

Why these exist: at batch 1 the step moves ~3.9 GB in ~0.9 ms, so every extra launch (a few µs)
matters; an eager RMSNorm is five kernels, an attention prologue (q/k norm, RoPE, KV write)
twenty. Each fused kernel sits beside its torch reference (same arguments).

    rms_norm_plus(x [M, H], w [H], eps)                    -> x̂·(1 + w) bf16 (MODEL.md §0 RMSNorm⁺)
    silu_mul(gate [M, N], up [M, N])                        -> silu(gate)·up bf16 (shared expert)
    attention_prologue(qkv, q_norm, k_norm, k_cache, v_cache, seq, pos, ...) -> q [M, n_q, d_h]
        §4.4 steps 1-2 for one row per program: RMSNorm⁺ per head on q and k, partial NeoX RoPE,
        k and v written to the caches [S, n_kv, L, d_h] at (seq[m], pos[m])
    moe_combine(pairs [T, k, H] f32, residual, shared, shared_gate_logit) -> residual + bf16(Σ pairs + σ(g)·shared)
    moe_combine(..., norm_weight=w)                         -> (that sum h, rms_norm_plus(h, w)): the next
        layer's input norm (or the final norm) in the same launch, one program per row
    embed_rows(token_ids, frames, table, codebooks, ...)   -> input rows [R, H] (MODEL.md §4.1; Backbone.embed's
        torch code is the reference): one launch where the eager embed took ~25 and a host sync
    GraphedStep(fn, *static_inputs)                         capture once, .replay() per step

Batch invariance (issue #8): every kernel here runs one row per program (or one row and one
column block) with launch constants fixed by the hidden/head sizes, never by the row count, and
`moe_combine` adds a row's k pairs in slot order, then the gated shared expert: a row's bits do
not depend on the other rows of the step. The dense GEMMs around them go through
services/common/invariant.linear_rows; the outputs that feed a GEMM (or become a residual) are
allocated with invariant.empty_rows, so the GEMM reads them in place, with no padding copy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from services.common import cuda_graphs
from services.common.invariant import empty_rows

from . import HAS_TRITON, PDL_PRELOAD, pdl_args, use_triton

# the MoE combine + norm launch's residual, shared gate logit and gain read before its PDL wait
# (DRAMA_PDL_PRELOAD, see kernels/__init__)
COMBINE_PRELOAD = PDL_PRELOAD

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------

def naive_rms_norm_plus(x, w, eps: float = 1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(torch.bfloat16)


def naive_silu_mul(gate, up):
    return (F.silu(gate.float()) * up.float()).to(torch.bfloat16)


def naive_attention_prologue(qkv, q_norm, k_norm, k_cache, v_cache, seq, pos, *, n_q, n_kv, d_h,
                             rotary_dim, theta, eps=1e-6):
    """qkv [M, 2·n_q·d_h + 2·n_kv·d_h] = q_proj (per head: d_h query, d_h gate), k_proj, v_proj.
    Writes k/v rows into the caches, returns q [M, n_q, d_h] bf16 (normed, rotated)."""
    m = qkv.shape[0]
    q = qkv[:, :2 * n_q * d_h].view(m, n_q, 2 * d_h)[..., :d_h]
    k = qkv[:, 2 * n_q * d_h:2 * n_q * d_h + n_kv * d_h].view(m, n_kv, d_h)
    v = qkv[:, 2 * n_q * d_h + n_kv * d_h:].view(m, n_kv, d_h)
    q, k = naive_rms_norm_plus(q, q_norm, eps).float(), naive_rms_norm_plus(k, k_norm, eps).float()
    half = rotary_dim // 2
    inv = theta ** (-torch.arange(half, device=qkv.device, dtype=torch.float32) * 2 / rotary_dim)
    ang = pos.float()[:, None] * inv                                   # [M, half]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)

    q, k = rope(q).to(torch.bfloat16), rope(k).to(torch.bfloat16)
    k_cache[seq.long(), :, pos.long()] = k
    v_cache[seq.long(), :, pos.long()] = v.to(k_cache.dtype)
    return q


def naive_moe_combine(pairs, residual, shared=None, shared_gate_logit=None):
    y = pairs.float().sum(1)
    if shared is not None:
        y = y + torch.sigmoid(shared_gate_logit.float()).reshape(-1, 1) * shared.float()
    return (residual.float() + y.to(torch.bfloat16).float()).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------

def rms_norm_plus(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, widened: bool = False):
    """RMSNorm⁺(x) in bf16; with `widened`, (that, the same values as F32) from the one launch:
    the cuBLAS F32 router's input without a copy kernel (moe.SparseMoE.forward_kernels on steps
    that are not decode steps)."""
    if not use_triton(x) or x.dim() != 2 or x.stride(1) != 1:
        out = naive_rms_norm_plus(x, w, eps)
        return (out, out.float()) if widened else out
    m, h = x.shape
    out = empty_rows(m, h, dtype=torch.bfloat16, device=x.device)      # a GEMM input: padded storage
    out32 = empty_rows(m, h, dtype=torch.float32, device=x.device) if widened else out
    _rms_norm_kernel[(m,)](x, w, out, out32, eps, h, x.stride(0), BH=triton.next_power_of_2(h), WIDE=widened,
                           num_warps=8, **pdl_args())
    return (out, out32) if widened else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate) or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        return naive_silu_mul(gate, up)
    m, n = gate.shape
    out = empty_rows(m, n, dtype=torch.bfloat16, device=gate.device)
    # columns in blocks of at most 1024: the tower's 12288-wide MLP in one program per row took
    # 6.2 us on the H200 (one SM); elementwise, so the blocking never changes a value
    block = min(triton.next_power_of_2(n), 1024)
    _silu_mul_kernel[(m, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BN=block,
                                                 num_warps=4, **pdl_args())
    return out


def attention_prologue(qkv, q_norm, k_norm, k_cache, v_cache, seq, pos, *, n_q, n_kv, d_h,
                       rotary_dim, theta, eps=1e-6):
    if not use_triton(qkv, k_cache):
        return naive_attention_prologue(qkv, q_norm, k_norm, k_cache, v_cache, seq, pos, n_q=n_q, n_kv=n_kv,
                                        d_h=d_h, rotary_dim=rotary_dim, theta=theta, eps=eps)
    m = qkv.shape[0]
    q = torch.empty(m, n_q, d_h, dtype=torch.bfloat16, device=qkv.device)
    _attn_prologue_kernel[(m, n_q + 2 * n_kv)](
        qkv, q_norm, k_norm, k_cache, v_cache, seq, pos, q, qkv.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps, theta,
        NQ=n_q, NKV=n_kv, D=d_h, R=rotary_dim, num_warps=2, **pdl_args())
    return q


def moe_combine(pairs, residual, shared=None, shared_gate_logit=None, norm_weight=None, eps: float = 1e-6):
    """The layer's output h (see the module docstring); with `norm_weight`, (h, RMSNorm⁺(h)) from
    one launch: the norm that follows every combine (the next layer's input norm, or the final
    norm) costs no launch of its own."""
    if not use_triton(pairs, residual):
        out = naive_moe_combine(pairs, residual, shared, shared_gate_logit)
        return out if norm_weight is None else (out, naive_rms_norm_plus(out, norm_weight, eps))
    t, k, h = pairs.shape
    out = empty_rows(t, h, dtype=torch.bfloat16, device=pairs.device)  # the next layer's residual
    has_shared = shared is not None
    if norm_weight is not None:
        normed = empty_rows(t, h, dtype=torch.bfloat16, device=pairs.device)   # a GEMM input
        _moe_combine_norm_kernel[(t,)](
            pairs, residual, shared if has_shared else residual, shared_gate_logit if has_shared else residual,
            out, norm_weight, normed, eps, h, residual.stride(0), shared.stride(0) if has_shared else 0,
            shared_gate_logit.stride(0) if has_shared else 0,
            K=k, HAS_SHARED=has_shared, BH=triton.next_power_of_2(h), PRELOAD=COMBINE_PRELOAD, num_warps=8,
            **pdl_args())
        return out, normed
    _moe_combine_kernel[(t, triton.cdiv(h, 1024))](
        pairs, residual, shared if has_shared else residual, shared_gate_logit if has_shared else residual, out,
        h, residual.stride(0), shared.stride(0) if has_shared else 0,
        shared_gate_logit.stride(0) if has_shared else 0,
        K=k, HAS_SHARED=has_shared, BLOCK=1024, num_warps=4, **pdl_args())
    return out


@functools.cache
def _inv_sqrt_f32(n: int) -> float:
    """1 / √n as torch's CUDA kernel divides by the Python scalar √n: the F32 reciprocal of F32 √n."""
    return float(torch.tensor(1.0) / torch.tensor(float(n) ** 0.5))


def embed_rows(token_ids: torch.Tensor, frames: torch.Tensor | None, table: torch.Tensor,
               codebooks: torch.Tensor | None, semantic_start: int, codebook_vocab: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA: Backbone.embed in one launch, one program per row and column block. token_ids int64 [R];
    frames int64 [R, N] (a row whose c_0 < 0 is a text row) or None. Bit for bit the torch code's
    result on the GPU: the same F32 sum order, and the division by √(N+1) done as torch's CUDA
    kernel does a division by a Python scalar, a product with the F32 reciprocal. `out`: a
    contiguous [R, hidden] tensor of the table's dtype to write (a decode graph's input rows)."""
    rows, hidden = token_ids.shape[0], table.shape[1]
    if out is None:
        out = torch.empty(rows, hidden, dtype=table.dtype, device=table.device)
    elif tuple(out.shape) != (rows, hidden) or out.dtype != table.dtype or not out.is_contiguous():
        raise ValueError(f"embed_rows: out must be a contiguous {table.dtype} [{rows}, {hidden}] tensor")
    if rows == 0:
        return out
    token_ids, table = token_ids.contiguous(), table.contiguous()          # no-ops for the model's own
    if frames is not None:
        frames, codebooks = frames.contiguous(), codebooks.contiguous()
    n = frames.shape[1] if frames is not None else 0
    _embed_kernel[(rows, triton.cdiv(hidden, 1024))](
        token_ids, frames if frames is not None else token_ids, table, codebooks if codebooks is not None else table,
        out, hidden, semantic_start, codebook_vocab, _inv_sqrt_f32(n + 1), NCB=n, BLOCK=1024, num_warps=4, **pdl_args())
    return out


class GraphedStep:
    """Capture `fn(*static_inputs)` in a CUDA graph (after warm-up on a side stream, as torch's
    docs require); `replay()` reruns it on whatever the static input tensors now hold. Tensors
    that fn mutates (caches, states) are mutated by each replay too."""

    def __init__(self, fn, *static_inputs, warmup: int = 2, pool=None, stream=None):
        """pool, stream: see services/common/cuda_graphs.capture (graphs that may replay
        concurrently need different capture streams; graphs that never do may share a pool)."""
        self.graph, self.output = cuda_graphs.capture(lambda: fn(*static_inputs), pool=pool, stream=stream,
                                                      warmup=warmup)

    def replay(self):
        self.graph.replay()
        return self.output


class EagerStep:
    """GraphedStep's interface without a graph: `replay()` calls fn (off CUDA, where the same
    fixed-shape function is run to test its math)."""

    def __init__(self, fn, *static_inputs):
        self.fn, self.static_inputs = fn, static_inputs

    def replay(self):
        return self.fn(*self.static_inputs)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, out32_ptr, eps, H, stride_x, BH: tl.constexpr,
                         WIDE: tl.constexpr = False, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BH)
        ok = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps) * (1.0 + w)).to(tl.bfloat16)
        tl.store(out_ptr + row * H + offs, y, mask=ok)
        if WIDE:     # the bf16 values widened (exact): what u.float() holds
            tl.store(out32_ptr + row * H + offs, y.to(tl.float32), mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, BN: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BN + tl.arange(0, BN)
        ok = offs < N
        g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + offs, (g * tl.sigmoid(g) * u).to(tl.bfloat16), mask=ok)

    @triton.jit
    def _attn_prologue_kernel(qkv_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, q_ptr,
                              stride_row, stride_cs, stride_ch, stride_cl, eps, theta,
                              NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                              PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        m, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, D)
        half: tl.constexpr = R // 2
        seq = tl.load(seq_ptr + m).to(tl.int64)
        pos = tl.load(pos_ptr + m).to(tl.int64)
        row = qkv_ptr + m.to(tl.int64) * stride_row
        if head < NQ + NKV:
            if head < NQ:
                src = row + head * 2 * D
                w = tl.load(qn_ptr + d).to(tl.float32)
            else:
                src = row + 2 * NQ * D + (head - NQ) * D
                w = tl.load(kn_ptr + d).to(tl.float32)
            x = tl.load(src + d).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            partner = tl.where(d < half, d + half, d - half)
            partner = tl.where(d < R, partner, d)
            xp = tl.load(src + partner).to(tl.float32)
            wp_q = tl.load(qn_ptr + partner).to(tl.float32)
            wp_k = tl.load(kn_ptr + partner).to(tl.float32)
            wp = tl.where(head < NQ, wp_q, wp_k)
            xn = x * rstd * (1.0 + w)
            xpn = xp * rstd * (1.0 + wp)
            i = tl.where(d < half, d, d - half).to(tl.float32)
            ang = pos.to(tl.float32) * tl.exp2(-(2.0 * i / R) * tl.log2(theta))
            c, s = tl.cos(ang), tl.sin(ang)
            rot = tl.where(d < half, xn * c - xpn * s, xn * c + xpn * s)
            y = tl.where(d < R, rot, xn).to(tl.bfloat16)
            if head < NQ:
                tl.store(q_ptr + (m.to(tl.int64) * NQ + head) * D + d, y)
            else:
                tl.store(kc_ptr + seq * stride_cs + (head - NQ) * stride_ch + pos * stride_cl + d, y)
        else:
            kvh = head - NQ - NKV
            v = tl.load(row + 2 * NQ * D + NKV * D + kvh * D + d)
            tl.store(vc_ptr + seq * stride_cs + kvh * stride_ch + pos * stride_cl + d, v)

    @triton.jit
    def _combine_rows(pairs_ptr, sh_ptr, r, gl, t, offs, ok, H, stride_sh,
                      K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
        """Row t's columns `offs` of the combine: bf16(residual + bf16(Σ_j pairs_j + σ(g)·shared)),
        given the residual's columns r and the shared gate's logit gl (_combine_inputs)."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(pairs_ptr + (t * K + j) * H + offs, mask=ok, other=0.0)
        if HAS_SHARED:
            acc += tl.sigmoid(gl) * tl.load(sh_ptr + t * stride_sh + offs, mask=ok, other=0.0).to(tl.float32)
        return (r + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)

    @triton.jit
    def _combine_inputs(res_ptr, shg_ptr, t, offs, ok, stride_res, stride_shg, HAS_SHARED: tl.constexpr):
        """Row t's residual columns (F32) and shared gate logit (F32; 0 without HAS_SHARED). Both
        come from launches before the experts' (the out-projection's, the routing's), and are read
        from L2 (.cg) so that reading them before the PDL wait never takes a stale L1 line."""
        r = tl.load(res_ptr + t * stride_res + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        gl = 0.0
        if HAS_SHARED:
            gl = tl.load(shg_ptr + t * stride_shg, cache_modifier=".cg").to(tl.float32)
        return r, gl

    @triton.jit
    def _moe_combine_kernel(pairs_ptr, res_ptr, sh_ptr, shg_ptr, out_ptr, H, stride_res, stride_sh, stride_shg,
                            K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        r, gl = _combine_inputs(res_ptr, shg_ptr, t, offs, ok, stride_res, stride_shg, HAS_SHARED)
        y = _combine_rows(pairs_ptr, sh_ptr, r, gl, t, offs, ok, H, stride_sh, K, HAS_SHARED, BLOCK)
        tl.store(out_ptr + t * H + offs, y, mask=ok)

    @triton.jit
    def _moe_combine_norm_kernel(pairs_ptr, res_ptr, sh_ptr, shg_ptr, out_ptr, w_ptr, normed_ptr, eps, H,
                                 stride_res, stride_sh, stride_shg,
                                 K: tl.constexpr, HAS_SHARED: tl.constexpr, BH: tl.constexpr,
                                 PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
        """_moe_combine_kernel for a whole row, then _rms_norm_kernel's RMSNorm⁺ of the bf16 result.
        PRELOAD: the residual, the shared gate logit and the norm's gain read before the PDL wait
        (only the down launch, which writes the pairs and the shared output, runs just before;
        kernels/__init__.PDL_PRELOAD). The same arithmetic, so the same bits."""
        t = tl.program_id(0)
        offs = tl.arange(0, BH)
        ok = offs < H
        if PRELOAD:
            r, gl = _combine_inputs(res_ptr, shg_ptr, t, offs, ok, stride_res, stride_shg, HAS_SHARED)
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            pdl_prologue(PDL)
        else:
            pdl_prologue(PDL)
            r, gl = _combine_inputs(res_ptr, shg_ptr, t, offs, ok, stride_res, stride_shg, HAS_SHARED)
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = _combine_rows(pairs_ptr, sh_ptr, r, gl, t, offs, ok, H, stride_sh, K, HAS_SHARED, BH)
        tl.store(out_ptr + t * H + offs, y, mask=ok)
        x = tl.where(ok, y.to(tl.float32), 0.0)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps) * (1.0 + w)
        tl.store(normed_ptr + t * H + offs, normed.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _embed_kernel(ids_ptr, frames_ptr, table_ptr, cb_ptr, out_ptr, H, semantic_start, vocab, inv,
                      NCB: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_prologue(PDL)
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        tok = tl.load(ids_ptr + r)
        y = tl.load(table_ptr + tok * H + offs, mask=ok, other=0.0)             # a text row
        if NCB > 0:
            c0 = tl.load(frames_ptr + r * NCB)
            if c0 >= 0:                                                        # an audio row
                acc = tl.load(table_ptr + (semantic_start + c0) * H + offs, mask=ok, other=0.0).to(tl.float32)
                for k in tl.static_range(NCB):
                    code = tl.load(frames_ptr + r * NCB + k)
                    acc += tl.load(cb_ptr + (k * vocab + code) * H + offs, mask=ok, other=0.0).to(tl.float32)
                y = (acc * inv).to(y.dtype)
        tl.store(out_ptr + r * H + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

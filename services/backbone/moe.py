"""Sparse MoE with a sigmoid-gated shared expert (MODEL.md §4.5).

Shape letters: R rows, H hidden, E experts, k experts per row, I expert intermediate.

    route(logits [R, E], k)            -> weights [R, k] F32 (renormalised), experts [R, k] int64
    swiglu(x [R, H], w_gate, w_up [I, H], w_down [H, I]) -> down(silu(gate(x)) ⊙ up(x)) [R, H]
    naive_moe(x, router, experts, shared, shared_gate, k) -> [R, H] float64, loops over rows and experts

Routed expert weights are kept as stacked tensors `gate_proj`/`up_proj` [E, I, H] and `down_proj`
[E, H, I], each either in the compute dtype (BF16/F32 checkpoints, per-expert or fused) or
float8_e4m3fn with `*_scale_inv` [E, ⌈N/b0⌉, ⌈K/b1⌉] exactly as stored. FP8 experts are
dequantised on the fly, once per step for each expert the step routes to.

The kernel path (Backbone.kernels) stacks gate|up at load (`w_gate_up` [E, 2I, H] FP8 +
`s_gate_up`, kernels/fp8_moe.pack_gate_up; gate_proj/up_proj become views into it), routes with
the one-launch top-k kernel on F32 router logits and runs the §4.7 FP8 expert kernels (decode
block table for T·k <= 1024 pairs, grouped prefill above); a decode step instead routes with
kernels/moe_decode.route_decode (its own F32 router GEMV, then one launch that routes and
quantises u, and gives the shared expert's gate logit) and computes the BF16 shared expert in the
routed experts' own launches (moe_decode_pairs(shared=)); a padded prefill piece routes and
quantises in route_decode's one launch from the eager prefill's cuBLAS logits; elsewhere the
shared expert's gate, up and its scalar gate are one BF16 GEMM. One combine kernel adds everything to the residual (and
applies the norm that follows, when given).
Batch invariance (issue #8): the router, shared-expert and BF16-expert GEMMs of the kernel path go
through services/common/invariant.linear_rows (router and shared expert on CUDA decode steps
through kernels/decode_gemm.decode_linear unless DRAMA_DECODE_GEMM=cublas); the routed FP8 experts use one kernel config for
every pair count (fp8_moe.kernel_config); top-k and combine work one row per program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import TextConfig
from services.common import invariant
from services.common.invariant import empty_rows, linear_rows
from services.common.fp8 import dequantize_block_fp8

from .kernels import decode_gemm
from .kernels import decode_graph as dg
from .kernels import moe_decode
from .kernels import fp8_moe
from .kernels import use_triton
from .layers import Linear, fuse_linears, per_row


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------

def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in F32, the k largest (ties: lower expert index first, by a
    stable sort), weights renormalised to sum 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) ⊙ up(x)); weights [I, H], [I, H], [H, I]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _swiglu_rows(x, w_gate, w_up, w_down):
    """swiglu through invariant.linear_rows (kernel path: an expert's rows are whichever rows of
    the step routed to it, so a plain GEMM's kernel would follow that count)."""
    return linear_rows(F.silu(linear_rows(x, w_gate)) * linear_rows(x, w_up), w_down)


def naive_moe(x, router, experts, shared, shared_gate, k: int) -> torch.Tensor:
    """Float64 reference. router [E, H]; experts: list of (gate, up, down) dense weights;
    shared: (gate, up, down); shared_gate [1, H]. Ties in the top-k pick the lower index."""
    x = x.double()
    out = torch.zeros_like(x)
    act = lambda t: t * torch.sigmoid(t)  # noqa: E731
    for r in range(x.shape[0]):
        probs = torch.softmax(router.double() @ x[r], dim=0)
        chosen = sorted(range(len(probs)), key=lambda e: (-float(probs[e]), e))[:k]
        total = sum(float(probs[e]) for e in chosen)
        for e in chosen:
            wg, wu, wd = (w.double() for w in experts[e])
            out[r] += float(probs[e]) / total * (wd @ (act(wg @ x[r]) * (wu @ x[r])))
        sg, su, sd = (w.double() for w in shared)
        out[r] += torch.sigmoid(shared_gate.double() @ x[r]) * (sd @ (act(sg @ x[r]) * (su @ x[r])))
    return out


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------

class Router(nn.Module):
    """`mlp.gate`: the router weight [E, H] (kept in F32: the router runs in F32)."""

    def __init__(self, num_experts: int, hidden: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device),
                                   requires_grad=False)


class Experts(nn.Module):
    """Routed experts, stacked: gate_proj, up_proj [E, I, H], down_proj [E, H, I] (+ FP8 scales)."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype=torch.float32, device=None):
        super().__init__()
        self.compute_dtype = dtype
        self.block_size: tuple[int, int] = (128, 128)
        shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                  "down_proj": (hidden, intermediate)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(num_experts, *shape, dtype=dtype, device=device),
                                             requires_grad=False))
            self.register_buffer(f"{name}_scale_inv", None)   # [E, ⌈N/b0⌉, ⌈K/b1⌉] when FP8

    @property
    def is_fp8(self) -> bool:
        return self.gate_proj.dtype == torch.float8_e4m3fn

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's (gate, up, down) in the compute dtype, dequantised when stored FP8."""
        out = []
        for name in self.PROJECTIONS:
            w = getattr(self, name)[e]
            if w.dtype == torch.float8_e4m3fn:
                w = dequantize_block_fp8(w, getattr(self, f"{name}_scale_inv")[e], self.block_size,
                                         self.compute_dtype)
            out.append(w)
        return out[0], out[1], out[2]


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype=torch.float32, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, device=device)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, device=device)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """`mlp` of every layer: Σ_topk w_e E_e(u) + σ(shared_expert_gate(u)) · E_s(u)."""

    def __init__(self, cfg: TextConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Router(cfg.num_experts, cfg.hidden_size, device=device)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype, device=device)

    def _route(self, u):
        return route(F.linear(u.float(), self.gate.weight), self.top_k)

    def _shared(self, u):
        return (torch.sigmoid(self.shared_expert_gate(u)) * self.shared_expert(u)).float()

    def forward(self, u: torch.Tensor, exact: bool) -> torch.Tensor:
        """u [R, H] -> [R, H]. Expert outputs are added into an F32 zero buffer in ascending expert
        order (one add per row and expert), then the gated shared expert; a row's sum never
        depends on the other rows."""
        weights, experts = per_row(self._route, u, exact=exact)
        out = torch.zeros(u.shape[0], u.shape[1], dtype=torch.float32, device=u.device)
        for e in torch.unique(experts).tolist():
            rows, rank = torch.nonzero(experts == e, as_tuple=True)
            w_gate, w_up, w_down = self.experts.weights(e)
            y = per_row(lambda x: swiglu(x, w_gate, w_up, w_down), u[rows], exact=exact)
            # rows are distinct within one expert: one exact add per row (index_add_ is avoided,
            # its CPU kernel stalls on thread wake-ups for tiny inputs)
            out[rows] = out[rows] + y.float() * weights[rows, rank, None]
        out = out + per_row(self._shared, u, exact=exact)
        return out.to(u.dtype)

    # kernel path (Backbone.kernels) ----------------------------------------------------------
    def pack_kernels(self) -> None:
        """Load-time layout of the kernel path (see the module docstring); FP8 stays FP8."""
        ex = self.experts
        self.fp8_kernels = ex.is_fp8 and tuple(ex.block_size) == (fp8_moe.GROUP, fp8_moe.GROUP)   # the kernels' block
        if ex.is_fp8:
            inter = ex.gate_proj.shape[1]
            scale_rows = ex.gate_proj_scale_inv.shape[1]
            packed = getattr(ex, "packed_gate_up", None)
            if packed is not None:    # the loader read gate and up into the halves (weights.py)
                self.w_gate_up, self.s_gate_up = packed
            else:
                self.w_gate_up, self.s_gate_up = fp8_moe.pack_gate_up(ex.gate_proj, ex.gate_proj_scale_inv,
                                                                      ex.up_proj, ex.up_proj_scale_inv)
            # the checkpoint tensors become views of the stacked ones: the experts are held once
            ex.gate_proj = nn.Parameter(self.w_gate_up[:, :inter], requires_grad=False)
            ex.up_proj = nn.Parameter(self.w_gate_up[:, inter:], requires_grad=False)
            ex.gate_proj_scale_inv = self.s_gate_up[:, :scale_rows]
            ex.up_proj_scale_inv = self.s_gate_up[:, scale_rows:]
            self.w_down = ex.down_proj.contiguous()
            self.s_down = ex.down_proj_scale_inv.float().contiguous()
        shared = self.shared_expert
        fused = fuse_linears([shared.gate_proj, shared.up_proj, self.shared_expert_gate])
        # zero rows up to a multiple of 64 outputs: at N = 2·I_s + 1 = 1025 cuBLAS picked an sm75
        # 128x128 kernel (16.7 µs per layer at 128 padded rows on the H200, the shared-expert GEMM
        # was the slowest of the decode step); the extra outputs are never read
        rows = -(-fused.shape[0] // 64) * 64
        self.shared_fused = torch.cat([fused, fused.new_zeros(rows - fused.shape[0], fused.shape[1])])
        self.shared_down = shared.down_proj.dense_weight()

    def _shared_kernels(self, u: torch.Tensor, dense_decode: bool,
                        gemm_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(E_s(u) [R, H], its gate logit [R]) from two GEMMs: gate, up and the scalar gate in
        one, then silu(gate)·up and the down projection."""
        i_s = self.shared_down.shape[1]
        linear = decode_gemm.dense_linear(dense_decode, u, gemm_rows)    # decode_linear on CUDA decode steps
        fused = linear(u, self.shared_fused)                             # [R, 2·I_s + 1 (+ zero pad)]
        shared = linear(dg.silu_mul(fused[:, :i_s], fused[:, i_s:2 * i_s]), self.shared_down)
        return shared, fused[:, 2 * i_s]

    def _router_logits(self, u: torch.Tensor, dense_decode: bool, gemm_rows: int | None = None,
                       u32: torch.Tensor | None = None) -> torch.Tensor:
        """F32 router logits [R, E] (§4.6) through the dense GEMM path. u32: u as F32, when the
        caller has it (DecoderLayer: the norm's second output), else copied here."""
        linear = decode_gemm.dense_linear(dense_decode, u, gemm_rows)    # decode_linear on CUDA decode steps
        if decode_gemm.enabled(dense_decode, u):
            # F32 weight: decode_linear widens bf16 u to F32 in registers (exact), no copy
            return linear(u, self.gate.weight)
        if u32 is None:
            u32 = empty_rows(u.shape[0], u.shape[1], dtype=torch.float32, device=u.device).copy_(u)
        return linear(u32, self.gate.weight)

    def forward_kernels(self, u: torch.Tensor, h: torch.Tensor, decode: bool = False,
                        config: dict | None = None, dense_decode: bool = False, gemm_rows: int | None = None,
                        norm_weight: torch.Tensor | None = None, eps: float = 1e-6, u32: torch.Tensor | None = None):
        """h + MoE(u) [R, H] BF16 for u = RMSNorm⁺(h): routed sum and gated shared expert in F32,
        rounded once, then added to the residual (decode_graph.moe_combine).

        `decode` (a step whose every segment is one row: a decode step, graphed or not; and
        padded prefill pieces, which must not sync with the host) takes kernels/moe_decode.py's
        routing launch and expert-major split-K kernels, every other (eager prefill) step
        fp8_moe's top-k and block tables. The choice follows the kind of a session's rows, never
        the other sessions' rows, so a row's bits do not depend on the batch either way (issue #8). `config`: moe_decode's tile
        config (padded pieces pass moe_decode.piece_config of their bucket; None: DECODE_CONFIG).
        `dense_decode` (a true decode step, plan.decode; not padded pieces): the dense GEMMs
        (router, shared expert) take kernels/decode_gemm on CUDA (unless DRAMA_DECODE_GEMM=cublas).
        `gemm_rows`: rows per dense GEMM call (StepPlan.gemm_rows; None: invariant.TILE).
        `norm_weight`: return (h', RMSNorm⁺(h')) with the norm in the combine's launch.
        `u32`: u as F32 (the same values), the cuBLAS router's input on steps that are not decode
        steps (eager prefill, pieces): the norm's second output saves a copy kernel per layer."""
        i_s = self.shared_down.shape[1]
        if self.fp8_kernels and decode and use_triton(u, self.w_gate_up):
            # a decode step or padded prefill pieces: top-k and u's quantisation in one launch
            # (moe_decode.route_decode), then the routed experts. A decode step computes its
            # router logits in route_decode's own GEMV, with the shared expert's gate logit, and,
            # with BF16 weights, the shared expert in the routed experts' launches
            # (moe_decode_pairs(shared=)). A piece takes cuBLAS F32 logits (as K-range partials,
            # moe_decode.router_partials) and the shared expert of an eager prefill, so a prompt
            # gives nearly the same rows on either prefill path: the GEMV took 44 µs per layer at
            # 256 rows against cuBLAS's 17 (H200), and the fused shared expert's other rounding,
            # through flipped near-ties in later layers' routing, took graphed against eager
            # decode rows to a cosine of 0.9995 (tests/test_backbone_gpu.py holds 0.9999).
            fuse_shared = dense_decode and u.dtype == self.shared_fused.dtype == self.shared_down.dtype == torch.bfloat16
            logits = None if dense_decode else moe_decode.router_partials(
                u if u32 is None else u32, self.gate.weight, gemm_rows or invariant.TILE)
            route = moe_decode.route_decode(u, self.gate.weight, self.top_k, logits=logits,
                                            shared_gate=self.shared_fused[2 * i_s] if fuse_shared else None)
            args = (u, route.ids, route.weights, self.w_gate_up, self.s_gate_up, self.w_down, self.s_down)
            if fuse_shared:
                pairs, shared = moe_decode.moe_decode_pairs(
                    *args, config=config, route=route, shared=(self.shared_fused[:2 * i_s], self.shared_down))
                return dg.moe_combine(pairs, h, shared, route.shared_gate_logit, norm_weight, eps)
            pairs = moe_decode.moe_decode_pairs(*args, config=config, route=route)
            shared, gate_logit = self._shared_kernels(u, dense_decode, gemm_rows)
            return dg.moe_combine(pairs, h, shared, gate_logit, norm_weight, eps)
        shared, gate_logit = self._shared_kernels(u, dense_decode, gemm_rows)
        logits = self._router_logits(u, dense_decode, gemm_rows, u32)
        if self.fp8_kernels:
            ids, weights = fp8_moe.router_topk(logits, self.top_k)
            args = (u, ids, weights, self.w_gate_up, self.s_gate_up, self.w_down, self.s_down)
            if use_triton(u, self.w_gate_up):                            # [R, k, H] F32, weighted
                pairs = (moe_decode.moe_decode_pairs(*args, config=config) if decode
                         else fp8_moe.moe_fp8_pairs(*args))
            else:
                pairs = fp8_moe.naive_moe_fp8(*args)[:, None]
        else:                 # BF16/F32 experts: the batched path's loop over routed experts
            weights, experts = route(logits, self.top_k)
            pairs = torch.zeros(u.shape[0], 1, u.shape[1], dtype=torch.float32, device=u.device)
            for e in torch.unique(experts).tolist():
                rows, rank = torch.nonzero(experts == e, as_tuple=True)
                y = _swiglu_rows(u[rows], *self.experts.weights(e)).float()
                pairs[rows, 0] += y * weights[rows, rank, None]
        return dg.moe_combine(pairs, h, shared, gate_logit, norm_weight, eps)

"""Sparse MoE with a sigmoid-gated shared expert (MODEL.md §4.5).

Shape letters: R rows, H hidden, E experts, k experts per row, I expert intermediate.

    route(logits [R, E], k)            -> weights [R, k] F32 (renormalised), experts [R, k] int64
    swiglu(x [R, H], w_gate, w_up [I, H], w_down [H, I]) -> down(silu(gate(x)) ⊙ up(x)) [R, H]
    naive_moe(x, router, experts, shared, shared_gate, k) -> [R, H] float64, loops over rows and experts

Routed expert weights are kept as stacked tensors `gate_proj`/`up_proj` [E, I, H] and `down_proj`
[E, H, I], each either in the compute dtype (BF16/F32 checkpoints, per-expert or fused) or
float8_e4m3fn with `*_scale_inv` [E, ⌈N/b0⌉, ⌈K/b1⌉] exactly as stored. FP8 experts are
dequantised on the fly, once per step for each expert the step routes to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import TextConfig
from services.common.fp8 import dequantize_block_fp8

from .layers import Linear, per_row


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

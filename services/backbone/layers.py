"""Building blocks shared by the backbone parts: norms, the linear layer, and row-exact dispatch.

    rms_norm_plus(x [.., D], w [D], eps)  -> x̂ ⊙ (1 + w)    Qwen3.5 unit-offset norm (MODEL.md §0)
    rms_norm(x [.., D], w [D], eps)       -> x̂ ⊙ w          plain gain (the GDN gated norm)
    Linear                                   y = x Wᵀ with W stored F32/BF16 or block-FP8 + scale_inv
    per_row(fn, *tensors, exact=)            apply a row-wise function so each row's bits never
                                             depend on how many rows were batched with it

Why `per_row` exists: on CPU, torch's GEMM results for a row change with the number of rows M
(MKL picks different kernels and blockings), and its vectorised elementwise kernels compute the
tail of a tensor with a scalar fallback whose sigmoid/softplus/silu differ from the SIMD ones in
the last bit. Prompt-split and batch invariance (issue #4) need a row's arithmetic fixed, so on
the exact path every row-wise function runs on one fresh, contiguous [1, ..] row: same shapes,
same kernels, same bits, however the rows arrived. The batched path (GPU) calls `fn` once.
MKL's results also depend on operand alignment, so the loader copies every weight into fresh
(64-byte aligned) memory and the mixers hand GEMMs fresh tensors rather than views into the slot
pool. Elementwise multiplies/adds and torch's reductions were checked to be shape-stable per
element; tests/test_backbone_engine.py proves the end result bit for bit. The exact path is many
tiny ops: on a busy machine one intra-op thread is much faster than two (OpenMP wake-ups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.fp8 import dequantize_block_fp8
from services.common.invariant import linear_rows


def rms_norm_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm⁺: x̂ ⊙ (1 + w), statistics and product in F32, result in x's dtype. x [.., D], w [D]."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-gain RMSNorm: x̂ ⊙ w (x̂ in F32, rounded to x's dtype before the gain, as transformers)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


def per_row(fn: Callable, *tensors: torch.Tensor, exact: bool):
    """fn(*tensors) for row-wise `fn` (row i of each output depends only on row i of each input).

    exact=True runs fn on each row alone ([1, ..] clones, so shapes and alignment are always the
    same) and concatenates; fn may return a tensor or a tuple of tensors.
    """
    if not exact:
        return fn(*tensors)
    rows = tensors[0].shape[0]
    outs = [fn(*(t[i:i + 1].clone() for t in tensors)) for i in range(rows)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


class Linear(nn.Module):
    """y = x · Wᵀ, no bias. W [out, in] is stored in the compute dtype, or as block-FP8.

    FP8 storage keeps `weight` float8_e4m3fn and `weight_scale_inv` [⌈out/b0⌉, ⌈in/b1⌉] as loaded
    (never requantised). On CPU the weight is dequantised per call and multiplied in the compute
    dtype; the §4.7 FP8 GEMM with dynamic activation quantisation is the GPU path's job.
    On CUDA the product goes through `linear_rows` (each row's bits independent of the batch,
    services/common/invariant.py); on the CPU it is the plain product, as the exact path needs.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.block_size: tuple[int, int] = (128, 128)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", None)   # set when the weight is stored FP8

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == torch.float8_e4m3fn

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] in the compute dtype (dequantised when stored FP8)."""
        if self.is_fp8:
            return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block_size,
                                        self.compute_dtype)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return linear_rows(x, self.dense_weight())
        return F.linear(x, self.dense_weight())

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight.dtype}"


def fuse_linears(linears: list[Linear]) -> torch.Tensor:
    """[W_1; W_2; ..] [Σ out, in] in the compute dtype: one GEMM for several projections of one
    input (kernel path). FP8-stored parts are dequantised once here. When no part is FP8, each
    Linear's weight becomes a view into the fused tensor, so the weights are held once."""
    fused = torch.cat([lin.dense_weight() for lin in linears]).contiguous()
    if not any(lin.is_fp8 for lin in linears):
        offset = 0
        for lin in linears:
            lin.weight = nn.Parameter(fused[offset:offset + lin.out_features], requires_grad=False)
            offset += lin.out_features
    return fused


class Weight(nn.Module):
    """A module holding only `.weight` (norm gains, the conv kernel), so parameter names equal
    checkpoint names (`input_layernorm.weight`, `conv1d.weight`) without an nn.Conv1d or norm class."""

    def __init__(self, *shape: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True)
class Segment:
    """One session's rows inside a batched step: rows [offset, offset+count) of the batch are
    positions [start, start+count) of the session held in cache slot `slot`."""
    slot: int
    start: int
    count: int
    offset: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.count)


@dataclass(frozen=True)
class StepPlan:
    """Device-side index tensors of a step for the kernel path (Backbone.kernels), built once per
    step and shared by every layer. N segments, R rows.

    row_slots, positions  int64 [R]    cache slot and absolute position of each row
    seg_slots             int64 [N]    each segment's slot
    cu_seqlens            int64 [N+1]  row offsets of the segments (fla's varlen layout); None for
                                       padded prefill pieces (one fla sequence per piece)
    decode                bool         every segment has one row (R = N): the batched decode kernels
    context               int          keys an attention row may need to read: max position + 1
                                       (a captured graph uses max_context, fixed)
    """
    row_slots: torch.Tensor
    positions: torch.Tensor
    seg_slots: torch.Tensor
    cu_seqlens: torch.Tensor | None
    decode: bool
    context: int
    # non-decode steps only (the GDN front of all rows at once, kernels/gdn.prefill_front):
    seg_first: torch.Tensor | None = None        # int64 [N]: each segment's first row in the step
    seg_rows: torch.Tensor | None = None         # int64 [N]: each segment's real rows (padded pieces: fewer than its rows)
    row_seg: torch.Tensor | None = None          # int64 [R]: each row's segment
    # padded prefill pieces (Backbone._prefill_graphed): N pieces of one bucket each, R = N x
    # bucket, rows past a piece's length are padding. F32 [R], 1 on the pieces' rows, 0 on
    # padding rows. Set, the mixers take their row-wise kernels (attention per row over the pool,
    # one fla sequence per piece) and zero the GDN gates of padding rows so the recurrent state
    # passes them unchanged; the MoE takes the decode MoE.
    row_mask: torch.Tensor | None = None
    # padded prefill pieces: the decode MoE's tile config for the piece bucket
    # (kernels/moe_decode.piece_config); None: its DECODE_CONFIG
    moe_config: dict | None = None
    # rows per dense GEMM call (invariant.linear_rows' tile): padded pieces, model.piece_gemm_rows
    # of their bucket; None: invariant.TILE
    gemm_rows: int | None = None


@dataclass(frozen=True)
class RowBatch:
    """What every layer needs to know about a step: its segments, each row's absolute position
    (int64 [R]) and whether row-wise work runs on the exact per-row path (see `per_row`).
    `plan` is set on the kernel path only."""
    segments: tuple[Segment, ...]
    positions: torch.Tensor
    exact: bool
    plan: "StepPlan | None" = None

"""Batch-invariant dense projections (issue #8): a row's result never depends on the other rows.

    linear_rows(x [M, K], weight [N, K], residual [M, N] | None) -> x·Wᵀ (+ residual) [M, N]
    linear_rows_reference(...)   the same product one row at a time in float64 (tests)
    active(x) -> bool            does linear_rows pad for this tensor (CUDA and the switch on)
    empty_rows(rows, cols, ...)  an output buffer for a GEMM input's producer, padded in storage
    padded_input(x)              x in such a buffer (one copy for several projections of x)

Why: API.md's seed contract says the same request gives the same codes alone or inside any
batch. A GEMM computes each output element as one dot product, but cuBLAS (like MKL on the CPU)
picks its kernel from the problem shape, M included: tile sizes, split-K factor, stream-K
schedule. Another kernel sums the same products in another order, so a session's row changed its
last bits when 8 or 32 other sessions shared the step, and sampled codes drifted from there.

How: on CUDA the rows sit in a buffer padded to a multiple of TILE = 128 rows, and the product
runs as one GEMM per 128-row piece, always with the same call (`torch.mm`, or `torch.addmm` with
the residual; the pieces of a long prefill are concatenated). cuBLAS then always sees (M = 128,
N, K), the same dtypes and strides and 256-byte aligned operands, so it picks the same kernel
every time (its heuristics are a pure function of that descriptor and of the workspace size,
which torch fixes per stream), and each output row depends only on its own input row. The
padding rows are never zeroed: whatever they hold only reaches output rows that are dropped.
The padded buffer costs nothing when the input's producer allocated it (`empty_rows`: the
backbone's norms, gated norm, SwiGLU and attention output do) or when the input is itself an
output of linear_rows; any other input is copied once (`padded_input` shares one copy among
several projections of the same input: the tower's q/k/v and gate/up). A decode step (buckets 1..128 in CUDA
graphs) is one GEMM per projection, as before; an eager prefill step of R rows is ⌈R/128⌉ GEMMs
that each read the weight (weights are streamed once per 128 rows, which the prefill's
arithmetic intensity absorbs; the extra launches cost host time in eager prefill). Prefill
graphs of large pieces run larger GEMMs instead (`tile`, below). Everything is shapes
known on the host: no sync, capturable in a CUDA graph.

Why 128: the largest decode bucket, so a decode step never reads a weight twice; and 128 rows
are 128 flop per bf16 weight byte, still under the H200's ridge point (~200), so batch 1 pays
the padding in tensor-core time that the weight stream mostly hides. Smaller tiles would read
the weights several times per decode step at batch 128; larger ones would make every decode
step compute-bound.

What the padding does not settle, and how it is checked: a stream-K kernel gives different
output tiles different K splits, so with a 64-row tile inside M = 128 a row's bits could depend
on its position in the piece. tests/test_invariant_linear.py puts a row at every position of
the piece at the real model shapes on the GPU and demands identical bits.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction (default True) lets cuBLAS
reduce split-K partial sums in bf16, and allow_tf32 (default False) would let the F32 router
GEMM use TF32: both change precision, not invariance (with the shape fixed, the split and its
reduction order are fixed), so they are left as torch sets them. cuBLAS results are
reproducible run to run on one GPU model and library version (cuBLAS docs, "Results
reproducibility"); atomics-based reductions are off by default (CUBLAS_ATOMICS_NOT_ALLOWED).

On the CPU the exact path is invariant by its own means (layers.per_row; the tower's bmm mode),
so linear_rows is a plain product there unless a test forces the padded path (`force=True`,
MKL also picks kernels by M, so the test means the same thing there).

Switch: DRAMA_BATCH_INVARIANT (read once at import): 1 (default) pads on CUDA, 0 runs plain
GEMMs of the batch's own size (slightly faster at batch 1, not batch-invariant). The FP8 MoE
kernel config (backbone/kernels/fp8_moe.py) and the decode attention's split size
(backbone/attention.py) follow the same switch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

TILE = 128
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _read_switch() -> bool:
    value = os.environ.get("DRAMA_BATCH_INVARIANT", "1").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"DRAMA_BATCH_INVARIANT must be 1 or 0, got {value!r}")


ENABLED = _read_switch()


def active(x: torch.Tensor) -> bool:
    """True when linear_rows pads for x: CUDA tensors with the switch on."""
    return ENABLED and x.is_cuda


def padded_rows(rows: int, tile: int = TILE) -> int:
    """Rows of the buffer linear_rows multiplies: `rows` rounded up to a multiple of `tile`."""
    return -(-rows // tile) * tile


def empty_rows(rows: int, cols: int, *, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(rows, cols) whose storage holds padded_rows(rows) rows when padding is on for
    `device` (CUDA). Producers of a GEMM input allocate their output with it; linear_rows then
    multiplies that storage in place instead of copying the rows into a padded buffer."""
    device = torch.device(device)
    if not (ENABLED and device.type == "cuda"):
        return torch.empty(rows, cols, dtype=dtype, device=device)
    return torch.empty(padded_rows(rows), cols, dtype=dtype, device=device)[:rows]


def padded_input(x: torch.Tensor) -> torch.Tensor:
    """x [M, K], or a copy of it in an empty_rows buffer when linear_rows would otherwise copy it:
    for an input that several projections read (one copy instead of one per projection)."""
    if not active(x) or x.dim() != 2 or _padded_view(x, padded_rows(x.shape[0])) is not None:
        return x
    out = empty_rows(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def _padded_view(t: torch.Tensor, padded: int) -> torch.Tensor | None:
    """t [M, C] as the first M rows of a [padded, C] view of its own storage, or None.

    Possible when t is contiguous, starts 256-byte aligned (as a fresh buffer does: the same
    alignment class for cuBLAS either way) and its storage extends over `padded` rows (empty_rows,
    linear_rows' own outputs, leading rows of a bigger buffer). The rows past M hold whatever is
    there, possibly stale or non-finite values: a GEMM never mixes rows, and those rows' outputs
    are dropped."""
    rows, cols = t.shape
    if not t.is_contiguous() or t.data_ptr() % 256:
        return None
    if t.untyped_storage().nbytes() < (t.storage_offset() + padded * cols) * t.element_size():
        return None
    return t.as_strided((padded, cols), (cols, 1))


def linear_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, *,
                force: bool | None = None, tile: int = TILE, residual_out: bool = False) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ, plus residual [M, N] when given (added in the GEMM's epilogue,
    as torch.addmm: one rounding). Same dtype rules as torch.mm / addmm.

    force=None pads when `active(x)`; True pads on any device (tests); False never pads.
    tile: rows per GEMM call when padded (default TILE). Prefill graphs of large pieces pass 256,
    or the whole piece when the graph holds one (StepPlan.gemm_rows, backbone/model.piece_gemm_rows):
    each GEMM then holds rows of one piece at their positions in it, whatever else the replay
    holds, so a row's bits still depend on its session's own cut only, and the weight is read
    once per GEMM of those rows rather than once per 128.
    Returns a [M, N] tensor; when padded, the leading rows of a [M rounded up to `tile`, N] buffer
    (so a following linear_rows, or a residual, is read in place).
    Padding rows are not zeroed: each GEMM output row depends on its own input row only.
    residual_out: the caller gives up the residual, so the result may be written over it (when
    padded and the residual is a padded view: empty_rows, a GEMM's own output). addmm then skips
    its copy of the residual into a fresh result (one copy per out-projection; the same GEMM on
    the same values, so the same bits).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_rows wants x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if tile < 1:
        raise ValueError(f"linear_rows: tile must be at least 1 row, got {tile}")
    pad = active(x) if force is None else force
    rows, n = x.shape[0], weight.shape[0]
    if residual is not None and tuple(residual.shape) != (rows, n):
        raise ValueError(f"residual {tuple(residual.shape)}: expected {(rows, n)}")
    if not pad or rows == 0:
        return F.linear(x, weight) if residual is None else torch.addmm(residual, x, weight.T)
    padded = padded_rows(rows, tile)
    # On the CPU (tests only: serving never pads there) the padding rows are zeros in a fresh
    # buffer: oneDNN's bf16 GEMM on some x86 CPUs let NaN in a padding row reach the other rows
    # (seen on the H200 host's CPU), which cuBLAS never does (the GPU tests put NaN/Inf there).
    a = _padded_view(x, padded) if x.is_cuda else None
    if a is None:                                  # copy the rows into a fresh padded buffer
        a = x.new_empty(padded, x.shape[1]) if x.is_cuda else x.new_zeros(padded, x.shape[1])
        a[:rows].copy_(x)
    res, res_copied = None, False
    if residual is not None:
        # addmm copies its `self` into a fresh result before the GEMM, so the residual's layout
        # never reaches cuBLAS; it only has to cover the padded rows
        res = _padded_view(residual, padded) if residual.is_cuda else None
        if res is None:
            res = residual.new_empty(padded, n) if residual.is_cuda else residual.new_zeros(padded, n)
            res[:rows].copy_(residual)
            res_copied = True
    wt = weight.T
    # each tile's GEMM writes its rows of the result in place (a torch.cat of the tiles copied
    # every output once more: 200 copy kernels in a 256-row prefill), except under autograd,
    # which refuses out= forms (the tower's nn.Linear weights require grad)
    autograd = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual))
    out_dtype = torch.result_type(x, weight)
    if autograd:
        out = None
    elif res is not None and res.dtype == out_dtype and (residual_out or res_copied):
        out = res            # the caller's residual given up, or our own padded copy of it: no second copy
    else:
        out = torch.empty(padded, n, dtype=out_dtype, device=x.device)
    pieces = []
    for i in range(0, padded, tile):
        target = None if out is None else out[i:i + tile]
        if res is None:
            pieces.append(torch.mm(a[i:i + tile], wt, out=target))
        else:            # target is res's own slice when out is res: addmm then copies nothing first
            pieces.append(torch.addmm(target if out is res else res[i:i + tile], a[i:i + tile], wt, out=target))
    if out is None:
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:rows]


def linear_rows_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """The product one row at a time in float64 (what linear_rows approximates), on x's device."""
    w = weight.double()
    out = torch.stack([w @ row for row in x.double()]) if x.shape[0] else x.new_zeros(0, w.shape[0]).double()
    return out if residual is None else out + residual.double()

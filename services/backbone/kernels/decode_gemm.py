"""Batch-invariant dense GEMM for decode steps (issue #8), without padding to 128 rows.

    decode_linear(x [M, K], weight [N, K], residual [M, N] | None) -> x·Wᵀ (+ residual) [M, N]
    invariant.linear_rows_reference(...)   its reference: the product row by row in float64
    dense_linear(decode, x)        the GEMM a step's dense projections call: decode_linear for
                                   decode steps on CUDA (DRAMA_DECODE_GEMM=triton, the default),
                                   else invariant.linear_rows (the switch is read once at import)
    config_for(n, k, dtype)        the kernel's one config for a weight shape (never M)
    tiles_for(m, programs, bytes)  how M rows are dealt out to programs (bit-neutral, see below)

Dtypes as invariant.linear_rows: bf16 x and weight -> bf16, F32 accumulation, the residual added
in F32 and the sum rounded once. An F32 weight (the router, MODEL.md §4.6) gives F32 out with
IEEE F32 products and sums (never TF32: it changes the routing); x may then be F32 or bf16 (bf16
is widened exactly in registers, which saves the router its F32 copy of u).

Why: invariant.linear_rows buys invariance by padding every GEMM to M = 128 rows and calling
cuBLAS with that one shape. At batch 1 that runs 128-row tensor-core tiles over weights that a
decode step reads once: the H200 decode step spent ~1.9 ms per step in dense GEMMs that move
~2.9 GB (a 0.68 ms floor). Here the kernel is written so that a row's bits cannot depend on M.

Invariance by construction. The config (BM rows per MMA tile, BN output columns, BK reduction step,
SPLIT K ranges, num_warps) is a function of the weight's shape and dtype only (`config_for`), never
of M; so is the pipeline depth, except where TUNED gives a shape another one above one row group
(`wide_stages`: it schedules the loads, not the arithmetic). Every tl.dot is [BM, BK] x [BK, BN]
with an F32 accumulator: 64 rows for bf16 weights, which Triton lowers on Hopper to the warpgroup
MMA (wgmma, one instruction shape for every tile), 16 for the F32 router, whose IEEE dot is an FMA
chain over k. Each output element is then Σ over the fixed K ranges, each range summed in ascending
BK steps, each step by the same instruction sequence; nothing in that sequence looks at the other
rows (rows past M are masked to zero and never stored; storage past M is never read). With SPLIT > 1
the range partials go to an F32 workspace [SPLIT, M, N] and `_split_reduce_kernel` adds them in
range order 0, 1, .., then the residual: a fixed order, no atomic sums (LAST_REDUCES' tickets count
arrivals, they add nothing). With SPLIT = 1 the GEMM kernel adds the residual itself (the same
arithmetic: partial + residual, one rounding).

Why BM 64 for bf16 (session 17): the per-warp MMA (mma.sync, BM 16, as first written) is
Hopper's slower tensor-core path, and at 128 rows it made the kernel compute-bound where cuBLAS is
not. H200, µs per GEMM in a graph of distinct weights (bench/decode_gemm.py --variants, session
17 run 1), M = 1 / 128, BM 16 -> 64 (cuBLAS): GDN in_proj 14.6 / 26.7 -> 15.7 / 24.4 (16.4 /
16.9), out_proj 7.6 / 20.7 -> 8.0 / 14.2 (11.5 / 11.6), attention qkv 13.5 / 26.2 -> 13.5 / 22.9
(13.6 / 13.5). At M = 1 the 63 zero rows cost nothing the weight stream does not hide. The whole
graphed decode step (bench/backbone.py, run 2, one machine): cuBLAS 2.848 ms at batch 1 and
19.76 at 128; this kernel 2.682 and 20.16.

Rows are dealt out to programs in groups. A program owns one row group (BM·TILES rows, TILES <= 8
tiles of BM), BN columns and one K range: inside its K loop it loads each [BK, BN] weight tile
once and feeds it to its TILES dots, one F32 accumulator per tile. The grid is (row groups,
⌈N/BN⌉ column blocks, SPLIT), row groups fastest, so the programs that share a weight tile start
together and the later ones should find it in L2. TILES (`tiles_for`) is the one launch choice that
depends on M: one tile while M fits in it; with BM 64, one tile per program and 2 row groups at 128
rows (a program of 2 tiles needs 147 KB of shared memory at 3 stages, one program per SM; 1 and
2 tiles timed within 10% of each other); with BM 16 (the F32 router) up to 4 tiles per program,
finer for small weights, since re-reading a 2-17 MB weight from L2 costs less than leaving SMs
idle. The activations are re-read from L2 once per column block.

Why the row partition cannot change a row's bits: a row's output element is produced by one
program's accumulator for the tile holding that row, and that accumulator sees exactly the same
instructions whichever group the tile is in and however many sibling tiles the program carries:
the same [BM, BK] x [BK, BN] dot shapes and layouts (BM, BN, BK, num_warps are the config's), the
same K range and ascending BK steps, the same weight tile values. Tiles never exchange data (each has
its own accumulator, rows past M are masked to zero). Changing TILES only adds or removes whole
sibling dots, which is the same freedom the kernel always had (at BM 16, M = 1 ran 1 tile, M =
128 ran 8, and the GPU checks found the bits equal). BN, BK, SPLIT and the warps are kept fixed per
shape on purpose: under Triton's MMA lowering a different BN should leave each element's k order alone
too, but that is codegen detail; the row partition needs no such argument.

The split reduce in the GEMM launch (LAST_REDUCES, off unless `DRAMA_DECODE_GEMM_LAST_REDUCES=1`:
measured slower, see below): with SPLIT > 1 each program, after storing its partial, takes a ticket
for its (row group, column block) with an acq_rel atomic after a CTA barrier (CUTLASS's split-K
semaphore, as moe_decode's gate/up does at one row); the program that draws the last of the group's
SPLIT tickets zeroes it again and adds the partials in range order 0, 1, .., then the residual, with
_split_reduce_kernel's arithmetic (so the same bits), reading them from L2 (".cg"). A decode step
has ~40 such reduces in the backbone and ~44 in the tower, each a separate ~2 µs launch before. The
tickets are one zeroed int32 buffer per CUDA stream (`_tickets`), made on the stream's first eager
call: graphs are captured after an eager warm-up on their capture stream
(services/common/cuda_graphs.capture), and graph families that may replay at the same time are
captured on different streams (the same rule as cuBLAS's workspaces). A capture on a stream without
tickets takes the reduce launch instead, never a half-made buffer. Measured (H200, one process,
graphs recaptured per setting, `bench/backbone.py ... --settings tuned last-reduces`, session 21 run
5): the batch-1 decode step 2.62 / 2.61 ms with the reduce launch, 2.65 / 2.66 with the reduce in
the GEMM launch. The last program's reduce comes after its own K range, at the tail of the launch;
the separate launch's 2-µs programs start early under PDL and spread over every SM. Kept, off, for
other shapes and GPUs.

The norm after an out-projection (`norm=(w, eps)`, NORM_IN_REDUCE, on unless
`DRAMA_DECODE_GEMM_NORM_IN_REDUCE=0`): the layer's next op is RMSNorm⁺ of the projection's output
(x + y·W_oᵀ, then the post-attention norm). With SPLIT > 1 the split reduce already goes over
whole rows of partials, so it runs as one program per row (`_split_reduce_norm_kernel`): the
partials in range order, the residual, the row rounded and stored, then the norm of the rounded
row (decode_graph._rms_norm_kernel's arithmetic). That is one launch per layer instead of two,
40 per backbone decode step. The row's values are the reduce launch's bits; the norm's sum of
squares may be ordered differently from the norm kernel's (another register layout): last-bit
differences in u, the same for a row alone or in any batch.

Graph capture: everything is shapes known on the host (the workspace is a torch.empty of
[SPLIT, M, N]); no sync, no data-dependent allocation.

PDL: both launches wait for the kernel ahead in pdl_prologue (kernels/__init__.py). Asking L2 for
the first weight lines before that wait (the weights are no kernel's output) lost: 2.682 -> 2.785
ms at batch 1 and 20.16 -> 21.13 at 128 (run 2), so the kernel reads nothing before it.

Switch: DRAMA_DECODE_GEMM = triton (the default: decode steps on CUDA through decode_linear) or
cublas (every dense GEMM through invariant.linear_rows). A decode row and a prefill row may
differ in their last bits (different kernels); each stays invariant on its own: a decode row does
not depend on the batch, a prefill row does not depend on packing (linear_rows).
"""

from __future__ import annotations

import functools

import torch

from services.common import invariant
from services.common.grpcutil import env_choice, env_switch

from . import HAS_TRITON, INTERPRET, PDL_PRELOAD, bf16_dot_args, decode_graph, pdl_args

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton without host-side TMA descriptors
        TensorDescriptor = None
else:
    TensorDescriptor = None

ROWS = 16                   # rows per tl.dot of the F32 router: the per-warp MMA's smallest M
WIDE_ROWS = 64              # rows per tl.dot of bf16 weights: Hopper's warpgroup MMA
MAX_ROWS_PER_PROGRAM = 64   # default cap on a program's rows, tiles x BM (the kernel takes 8 tiles)
SMS = 132                   # H200 SMs: tiles_for aims at >= 4 programs per SM
BACKEND = env_choice("DRAMA_DECODE_GEMM", ("triton", "cublas"))   # read once at import
LAST_REDUCES = env_switch("DRAMA_DECODE_GEMM_LAST_REDUCES") is True   # read once at import; off by default
TICKETS = 4096              # tickets per stream: row groups x column blocks of one split launch
NORM_IN_REDUCE = env_switch("DRAMA_DECODE_GEMM_NORM_IN_REDUCE") is not False   # read once at import
# bf16 weights through TMA box loads, the same bits: off unless DRAMA_DECODE_GEMM_TMA=1 (H200, session 27
# run 5: no faster at one row, 3-9% faster for three of six shapes at 128 rows); a config's TMA key
# overrides it (bench/decode_gemm.py --try SHAPE:TMA=1)
TMA = env_switch("DRAMA_DECODE_GEMM_TMA") is True
# the split reduce's residual (and norm gain) read before its PDL wait (DRAMA_PDL_PRELOAD, see
# kernels/__init__)
REDUCE_PRELOAD = PDL_PRELOAD


def enabled(decode: bool, x: torch.Tensor) -> bool:
    """Whether a step's projections of x take decode_linear: a decode step (every segment one
    row; not padded prefill pieces) with x on CUDA, unless DRAMA_DECODE_GEMM=cublas."""
    return decode and BACKEND == "triton" and HAS_TRITON and x.is_cuda


def dense_linear(decode: bool, x: torch.Tensor, gemm_rows: int | None = None):
    """The dense GEMM for a step's projections of x: decode_linear when `enabled`, else
    invariant.linear_rows, with `gemm_rows` rows per GEMM call when given (StepPlan.gemm_rows).
    Both take (x, weight, residual=None)."""
    if enabled(decode, x):
        return decode_linear
    return invariant.linear_rows if gemm_rows is None else functools.partial(invariant.linear_rows, tile=gemm_rows)


# Shapes whose swept config differs from the rule below; still one summation order per shape,
# whatever M. `wide_stages` is the pipeline depth of launches with more than one row group (M >
# BM): bit-neutral like the row partition (it only moves the loads ahead; every accumulator sees
# the same dots in the same K order; tests/test_decode_gemm.py compares rows alone with rows
# inside 128 on the GPU). H200, µs per GEMM at M = 1 / 8 / 32 / 128, the rule's config -> this
# one (`bench/decode_gemm.py --sweep ... --try ...`, session 21 runs 1-3):
# - the tower's gate|up (24576 x 2048): 2 stages let 3 programs share an SM, so the 384 programs
#   run in one wave: 28.9 / 29.7 / 30.7 / 41.1 -> 26.7 / 27.3 / 28.0 (3 stages at 128 rows);
# - the tower's down (2048 x 12288): K in 4 ranges (session 19: SPLIT 8 16.7 / 26.9 at 1 / 128, 4
#   18.1 / 22.8), 4 stages at one row group: 18.0 / 18.6 / 19.4 / 22.7 -> 16.3 / 16.8 / 17.1 / 22.7;
# - out_proj, o_proj and the tower's fc (2048 x 4096): K in 4 ranges, 4 stages, 128 programs:
#   8.6 / 8.9 / 9.0 / 14.7 -> 8.0 / 8.2 / 8.3 / 12.5;
# - the tower's codebook heads (1024 x 2048): K in 4 ranges, 4 stages: 7.6 / 7.8 / 8.1 / 11.7 ->
#   5.4 / 5.5 / 5.5 / 6.0;
# - GDN in_proj (12352 x 2048): BN 32 (386 column blocks): 15.8 / 16.1 / 16.3 / 24.5 -> 14.7 /
#   14.8 / 15.2 / 25.5.
TUNED = {(12352, 2048, torch.bfloat16): dict(BN=32),
         (24576, 2048, torch.bfloat16): dict(num_stages=2, wide_stages=3),
         (2048, 12288, torch.bfloat16): dict(BN=64, BK=128, SPLIT=4, num_stages=4, wide_stages=3),
         (2048, 4096, torch.bfloat16): dict(SPLIT=4, num_stages=4),
         (1024, 2048, torch.bfloat16): dict(SPLIT=4, num_stages=4)}


def config_for(n: int, k: int, dtype: torch.dtype) -> dict:
    """The one launch config for a [n, k] weight of `dtype`, whatever the row count (issue #8).

    BN = 64 columns per program. Shapes with at least 128 column blocks (GDN in_proj N 12352: 193,
    attention qkv N 9216: 144) keep K whole: a split would add the reduce launch and an F32
    workspace that costs most at 128 rows. The others are latency-bound at M = 1 (too few weight
    bytes in flight), so K is split in 2, 4, .. ranges (each at least one BK step) until the grid
    has >= 256 programs (about 2 per SM); if the ranges run out first, BN = 32 doubles the column
    blocks. Result: shared gate|up|gate (1088 x 2048) 17 x 16 of 128, shared down (2048 x 512)
    BN 32: 64 x 4 of 128, the F32 router (256 x 2048, BK 64) BN 32: 8 x 32 of 64; TUNED overrides
    the rule for the shapes it names (out_proj/o_proj: 32 x 4 ranges of 1024).
    bench/decode_gemm.py --sweep times the alternatives."""
    f32 = dtype == torch.float32
    bk = 64 if f32 else 128           # F32: an FMA dot keeps [16, BK] and [BK, BN] in registers
    steps = _cdiv(k, bk)
    bn, split = 64, 1
    if _cdiv(n, bn) < 128:
        while _cdiv(n, bn) * split < 256 and steps >= 2 * split:
            split *= 2
        if _cdiv(n, bn) * split < 256:
            bn = 32
    rule = dict(BM=ROWS if f32 else WIDE_ROWS, BN=bn, BK=bk, SPLIT=split, num_warps=4, num_stages=3)
    return rule | TUNED.get((n, k, dtype), {})


def tiles_for(m: int, programs: int, weight_bytes: int, bm: int = ROWS) -> int:
    """bm-row tiles per program for M = m rows: how the rows are dealt out to programs, the one
    launch choice that may depend on M (it never changes a row's bits, see the module docstring).

    `programs` is the grid of one row group (column blocks x K ranges). At most
    MAX_ROWS_PER_PROGRAM rows (with 3 stages a program's shared memory then leaves room for 2 per
    SM; 8 tiles of 16 took ~98-144 KB and ran GDN in_proj's 193 programs at 128 rows in 2 waves),
    so one tile at BM 64. Fewer (more row groups, each re-reading its weight tiles from L2) while
    the grid has fewer than 4 programs per SM and the extra weight reads stay small (<= 64 MB
    through L2: the shared expert, router, out_proj at 32 rows; never GDN in_proj or attention
    qkv, whose weights alone are 38-51 MB)."""
    tiles = min(max(1, MAX_ROWS_PER_PROGRAM // bm), _pow2_tiles(m, bm))
    while tiles > 1:
        finer = _cdiv(_cdiv(m, bm), tiles // 2)
        if programs * _cdiv(_cdiv(m, bm), tiles) >= 4 * SMS or finer * weight_bytes > 64 << 20:
            break
        tiles //= 2
    return tiles


def _pow2_tiles(m: int, bm: int = ROWS) -> int:
    """bm-row tiles covering m rows, rounded up to a power of two: tiles_for halves it, and its
    answer must be 1, 2, 4 or 8 (33-48 rows, the decode bucket 48, started from 3 and were refused
    at launch; launch_plan then caps the tiles at the rows' own)."""
    return 1 << (max(1, _cdiv(m, bm)) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_plan(m: int, n: int, k: int, dtype: torch.dtype, config: dict | None = None,
                tiles: int | None = None) -> dict:
    """What decode_linear launches for M = m: the config plus `k_range` (reduction length per
    split) and `splits` (K ranges that are not empty), both functions of K only, and the
    M-dependent parts, none of which changes a row's bits: the row partition, `tiles` (BM-row
    tiles per program, tiles_for unless given) and `groups` (row groups of BM·tiles rows, one
    grid axis), and `num_stages` where the config gives `wide_stages` for M > BM."""
    cfg = dict(config or config_for(n, k, dtype))
    cfg.setdefault("BM", ROWS)
    bm = cfg["BM"]
    wide_stages = cfg.pop("wide_stages", None)
    if wide_stages is not None and m > bm:            # more than one row group: bit-neutral, see TUNED
        cfg["num_stages"] = wide_stages
    steps = _cdiv(k, cfg["BK"])
    k_range = _cdiv(steps, cfg["SPLIT"]) * cfg["BK"]
    splits = _cdiv(k, k_range)
    if tiles is None:
        itemsize = 4 if dtype == torch.float32 else 2
        tiles = tiles_for(m, _cdiv(n, cfg["BN"]) * splits, n * k * itemsize, bm)
    if tiles not in (1, 2, 4, 8):
        raise ValueError(f"tiles per program must be 1, 2, 4 or 8, got {tiles}")
    tiles = min(tiles, max(1, _cdiv(m, bm)))
    return dict(cfg, k_range=k_range, splits=splits, tiles=tiles, groups=max(1, _cdiv(m, bm * tiles)))


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """Validate the arguments; return the output dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"decode_linear wants x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype == torch.float32:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"an F32 weight takes F32 or bf16 x, got {x.dtype}")
        out_dtype = torch.float32
    elif weight.dtype == torch.bfloat16:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"a bf16 weight takes bf16 x, got {x.dtype}")
        out_dtype = torch.bfloat16
    else:
        raise ValueError(f"decode_linear supports bf16 and F32 weights, got {weight.dtype}")
    if residual is not None and tuple(residual.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)}: expected {(x.shape[0], weight.shape[0])}")
    return out_dtype


_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device) -> torch.Tensor | None:
    """The zeroed ticket buffer of the current stream on `device` (see the module docstring), made
    on the stream's first eager call; None while a graph captures on a stream that has none."""
    cuda = device.type == "cuda"
    key = (device.index, torch.cuda.current_stream(device).cuda_stream) if cuda else (str(device),)
    tickets = _TICKETS.get(key)
    if tickets is None and not (cuda and torch.cuda.is_current_stream_capturing()):
        tickets = _TICKETS[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return tickets


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, *,
                  config: dict | None = None, tiles: int | None = None, residual_out: bool = False,
                  norm: tuple[torch.Tensor, float] | None = None):
    """x [M, K] · weight [N, K]ᵀ (+ residual [M, N]) -> [M, N]; see the module docstring.
    With `norm` = (w [N], eps): (that, RMSNorm⁺(that; w) in bf16), the norm in the split reduce's
    launch where there is one (NORM_IN_REDUCE), else decode_graph.rms_norm_plus after it.

    Runs the Triton kernel on CUDA (or in Triton's interpreter, TRITON_INTERPRET=1, on the CPU);
    elsewhere it is invariant.linear_rows (a plain product on the CPU). `config` overrides
    config_for and `tiles` tiles_for (benchmarks and tests; serving passes neither); `residual_out`
    is linear_rows' hint and changes nothing here (the kernel adds the residual as it stores its
    own output, with no copy to save). The output is allocated with
    invariant.empty_rows, so a following linear_rows reads it in place."""
    out_dtype = _check(x, weight, residual)
    if norm is not None and (out_dtype != torch.bfloat16 or norm[0].shape != (weight.shape[0],)):
        raise ValueError(f"norm takes a bf16 output and a gain of [{weight.shape[0]}], got {out_dtype} and "
                         f"{tuple(norm[0].shape)}")
    if not (HAS_TRITON and (x.is_cuda or INTERPRET)):
        return _normed(invariant.linear_rows(x.to(weight.dtype), weight, residual), norm)
    m, k = x.shape
    n = weight.shape[0]
    out = invariant.empty_rows(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return _normed(out, norm)
    x, weight = _rows_contiguous(x), _rows_contiguous(weight)
    residual = None if residual is None else _rows_contiguous(residual)
    plan = launch_plan(m, n, k, weight.dtype, config, tiles)
    dot, prec = ((tl.float32, "ieee") if weight.dtype == torch.float32
                 else tuple(bf16_dot_args()[key] for key in ("DOT", "PREC")))
    splits = plan["splits"]
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else out          # never read without HAS_RESIDUAL
    # row groups on the fastest grid axis: the programs that share a weight tile start together,
    # so one reads it from HBM and the others find it in L2
    grid = (plan["groups"], triton.cdiv(n, plan["BN"]), splits)
    tickets = (_tickets(x.device) if splits > 1 and LAST_REDUCES
               and grid[0] * grid[1] <= TICKETS else None)
    tma = (plan.get("TMA", TMA) and weight.dtype == torch.bfloat16 and TensorDescriptor is not None
           and weight.data_ptr() % 16 == 0 and weight.stride(0) % 8 == 0)       # TMA's 16-byte alignment
    # made per call (host-side, a few fields): the graphs keep the one of their capture
    w_desc = TensorDescriptor.from_tensor(weight, [plan["BN"], plan["BK"]]) if tma else None
    _decode_gemm_kernel[grid](
        x, weight, res, part, out, tickets if tickets is not None else out, m, n, k, x.stride(0), weight.stride(0),
        res.stride(0), part.stride(-2), out.stride(0), plan["k_range"], weight if w_desc is None else w_desc,
        BM=plan["BM"], BN=plan["BN"], BK=plan["BK"], TILES=plan["tiles"], FINAL=splits == 1,
        HAS_RESIDUAL=residual is not None, LAST_REDUCES=tickets is not None, DOT=dot, PREC=prec, TMA=w_desc is not None,
        num_warps=plan["num_warps"], num_stages=plan["num_stages"], **pdl_args())
    if splits > 1 and tickets is None and norm is not None and NORM_IN_REDUCE:
        u = invariant.empty_rows(m, n, dtype=torch.bfloat16, device=x.device)   # a GEMM input: padded storage
        _split_reduce_norm_kernel[(m,)](
            part, res, out, norm[0], u, m, n, res.stride(0), out.stride(0), u.stride(0), norm[1], SPLIT=splits,
            HAS_RESIDUAL=residual is not None, BH=triton.next_power_of_2(n), PRELOAD=REDUCE_PRELOAD, num_warps=8,
            **pdl_args())
        return out, u
    if splits > 1 and tickets is None:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, res, out, m * n, n, res.stride(0), out.stride(0), SPLIT=splits,
            HAS_RESIDUAL=residual is not None, BLOCK=block, PRELOAD=REDUCE_PRELOAD, num_warps=4, **pdl_args())
    return _normed(out, norm)


def _normed(out: torch.Tensor, norm: tuple[torch.Tensor, float] | None):
    """out, or (out, RMSNorm⁺(out)) with `norm` = (w, eps), the norm in its own launch."""
    if norm is None:
        return out
    return out, decode_graph.rms_norm_plus(out, norm[0], norm[1])


if HAS_TRITON:

    @triton.jit
    def _tile_dot(acc, x_ptr, rows, M, stride_xm, kk, k_ok, w, DOT: tl.constexpr, PREC: tl.constexpr):
        """acc [BM, BN] + x[rows, kk] · w [BK, BN]: one MMA step of a BM-row tile, rows past M as zeros."""
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
        return tl.dot(x.to(DOT), w, acc, input_precision=PREC, out_dtype=tl.float32)

    @triton.jit
    def _tile_store(acc, rows, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm,
                    FINAL: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """FINAL: acc (+ residual, in F32) rounded once into out; else the F32 partial into the
        workspace slice at out_ptr."""
        mask = (rows < M)[:, None] & n_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        if FINAL:
            if HAS_RESIDUAL:
                acc = acc + tl.load(r_ptr + r64 * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + r64 * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + r64 * stride_om + offs_n[None, :], acc, mask=mask)

    @triton.jit
    def _decode_gemm_kernel(x_ptr, w_ptr, r_ptr, out_ptr, final_ptr, tickets_ptr, M, N, K, stride_xm, stride_wn,
                            stride_rm, stride_om, stride_fm, K_RANGE, w_desc,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
                            FINAL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LAST_REDUCES: tl.constexpr,
                            DOT: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr = False,
                            PDL: tl.constexpr = False):
        """Program (row group, column block, K range): out[rows, block] for the group's BM·TILES
        rows. FINAL: out is the result; else out is the workspace [SPLIT, M, N] (F32 partials),
        and with LAST_REDUCES the group's last program to finish adds them into final."""
        pdl_prologue(PDL)
        part_ptr = out_ptr
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        k_lo = pid_k * K_RANGE
        k_hi = tl.minimum(K, k_lo + K_RANGE)
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn        # [1, BN]: weight rows n
        offs_k = tl.arange(0, BK)
        rows0 = tl.arange(0, BM)
        out_ptr += pid_k.to(tl.int64) * M * N                            # this range's partials
        m0 = pid_m * (BM * TILES)                          # this program's first row
        # one accumulator per BM-row tile; tiles >= TILES are pruned at compile time
        acc0 = tl.zeros([BM, BN], dtype=tl.float32)
        acc1 = tl.zeros([BM, BN], dtype=tl.float32)
        acc2 = tl.zeros([BM, BN], dtype=tl.float32)
        acc3 = tl.zeros([BM, BN], dtype=tl.float32)
        acc4 = tl.zeros([BM, BN], dtype=tl.float32)
        acc5 = tl.zeros([BM, BN], dtype=tl.float32)
        acc6 = tl.zeros([BM, BN], dtype=tl.float32)
        acc7 = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):               # ascending K: the one summation order
            kk = k0 + offs_k
            k_ok = kk < k_hi
            if TMA:        # Hopper's tensor memory accelerator; past N or K a box reads zeros, as the mask
                w = tl.trans(w_desc.load([pid_n * BN, k0]))                                  # [BK, BN]
            else:
                w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
            w = w.to(DOT)
            acc0 = _tile_dot(acc0, x_ptr, m0 + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 1:
                acc1 = _tile_dot(acc1, x_ptr, m0 + BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 2:
                acc2 = _tile_dot(acc2, x_ptr, m0 + 2 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 3:
                acc3 = _tile_dot(acc3, x_ptr, m0 + 3 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 4:
                acc4 = _tile_dot(acc4, x_ptr, m0 + 4 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 5:
                acc5 = _tile_dot(acc5, x_ptr, m0 + 5 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 6:
                acc6 = _tile_dot(acc6, x_ptr, m0 + 6 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
            if TILES > 7:
                acc7 = _tile_dot(acc7, x_ptr, m0 + 7 * BM + rows0, M, stride_xm, kk, k_ok, w, DOT, PREC)
        _tile_store(acc0, m0 + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL, HAS_RESIDUAL)
        if TILES > 1:
            _tile_store(acc1, m0 + BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 2:
            _tile_store(acc2, m0 + 2 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 3:
            _tile_store(acc3, m0 + 3 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 4:
            _tile_store(acc4, m0 + 4 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 5:
            _tile_store(acc5, m0 + 5 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 6:
            _tile_store(acc6, m0 + 6 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if TILES > 7:
            _tile_store(acc7, m0 + 7 * BM + rows0, offs_n, n_ok, M, out_ptr, stride_om, r_ptr, stride_rm, FINAL,
                        HAS_RESIDUAL)
        if LAST_REDUCES:
            _last_program_reduces(part_ptr, r_ptr, final_ptr, tickets_ptr, M, N, stride_rm, stride_fm, m0, offs_n,
                                  n_ok, BM, TILES, HAS_RESIDUAL)

    @triton.jit
    def _last_program_reduces(part_ptr, r_ptr, final_ptr, tickets_ptr, M, N, stride_rm, stride_fm, m0, offs_n, n_ok,
                              BM: tl.constexpr, TILES: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """Take a ticket for this (row group, column block); the program that draws the group's
        last (of the launch's K ranges) zeroes it and reduces the group's rows x columns as
        _split_reduce_kernel would. Ordering (as moe_decode._last_program_reduces): the barrier
        puts every thread's partial stores before the ticket's release (acq_rel, GPU scope); the
        last program's acquire makes the others' stores visible, and it reads them from L2 (".cg")."""
        splits = tl.num_programs(2)
        slot = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            tl.store(tickets_ptr + slot, 0)
            for t in tl.static_range(TILES):
                rows = m0 + t * BM + tl.arange(0, BM)
                mask = (rows < M)[:, None] & n_ok[None, :]
                r64 = rows[:, None].to(tl.int64)
                p = part_ptr + r64 * N + offs_n[None, :]
                acc = tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in range(1, splits):
                    p += M * N                       # the next K range's partials
                    acc = acc + tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_RESIDUAL:
                    acc = acc + tl.load(r_ptr + r64 * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(final_ptr + r64 * stride_fm + offs_n[None, :], acc.to(final_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _split_reduce_kernel(part_ptr, r_ptr, out_ptr, MN, N, stride_rm, stride_om, SPLIT: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PRELOAD: tl.constexpr = False,
                             PDL: tl.constexpr = False):
        """out = ((p0 + p1) + ..) + residual, rounded once: the K ranges in order, for every element.
        PRELOAD: the residual read before the PDL wait (the kernel before this one is always its
        GEMM, which writes only the partials; see kernels/__init__.PDL_PRELOAD)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        row, col = offs // N, offs % N
        if HAS_RESIDUAL and PRELOAD:       # .cg: from L2, never a stale line of this SM's L1
            r = tl.load(r_ptr + row.to(tl.int64) * stride_rm + col, mask=ok, other=0.0, cache_modifier=".cg")
        pdl_prologue(PDL)
        acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc = acc + tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            if not PRELOAD:
                r = tl.load(r_ptr + row.to(tl.int64) * stride_rm + col, mask=ok, other=0.0)
            acc = acc + r.to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _split_reduce_norm_kernel(part_ptr, r_ptr, out_ptr, w_ptr, u_ptr, M, N, stride_rm, stride_om, stride_um, eps,
                                  SPLIT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BH: tl.constexpr,
                                  PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program per row: out = ((p0 + p1) + ..) + residual rounded once (_split_reduce_kernel's
        arithmetic), then u = RMSNorm⁺ of the rounded row (decode_graph._rms_norm_kernel's).
        PRELOAD: the residual and the norm's gain read before the PDL wait (as _split_reduce_kernel)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BH)
        ok = offs < N
        if PRELOAD:
            w = tl.load(w_ptr + offs, mask=ok, other=0.0)
            if HAS_RESIDUAL:               # .cg: from L2, never a stale line of this SM's L1
                r = tl.load(r_ptr + row * stride_rm + offs, mask=ok, other=0.0, cache_modifier=".cg")
        pdl_prologue(PDL)
        p = part_ptr + row * N + offs
        acc = tl.load(p, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc = acc + tl.load(p + s * M * N, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            if not PRELOAD:
                r = tl.load(r_ptr + row * stride_rm + offs, mask=ok, other=0.0)
            acc = acc + r.to(tl.float32)
        h = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_om + offs, h, mask=ok)
        x = h.to(tl.float32)
        if not PRELOAD:
            w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps) * (1.0 + w.to(tl.float32))).to(tl.bfloat16)
        tl.store(u_ptr + row * stride_um + offs, y, mask=ok)

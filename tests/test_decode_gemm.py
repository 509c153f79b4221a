"""kernels/decode_gemm.py (the decode step's batch-invariant dense GEMM) against its float64
reference, and the property it exists for: a row's bits never depend on the batch (issue #8).

The kernel runs on a CUDA GPU, or in Triton's CPU interpreter:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_decode_gemm.py
(there bf16 operands are multiplied as F32 with IEEE products: the same values, see
kernels.bf16_dot_args). Without either, the kernel tests skip; the config, dispatch and
reference tests run everywhere. The interpreter tests use small K and N (and the real shapes only
where the grid is small); the GPU runs every real decode-step shape.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.backbone.kernels import HAS_TRITON, decode_gemm
from services.common import invariant
from services.common.grpcutil import env_choice

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
kernel = pytest.mark.skipif(not (CUDA or INTERPRET),
                            reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with Triton")

# (name, N, K, weight dtype, residual): the decode step's dense GEMMs at the full preset
REAL = [("gdn_in_proj", 12352, 2048, torch.bfloat16, False),
        ("out_proj", 2048, 4096, torch.bfloat16, True),          # GDN out_proj and attention o_proj
        ("shared_fused", 1088, 2048, torch.bfloat16, False),
        ("shared_down", 2048, 512, torch.bfloat16, False),
        ("router", 256, 2048, torch.float32, False),
        ("attn_qkv", 9216, 2048, torch.bfloat16, False),
        # the tower's frame steps (services/tower/model.tower_linear): qkv and o_proj/fc as above
        ("tower_gate_up", 24576, 2048, torch.bfloat16, False),
        ("tower_down", 2048, 12288, torch.bfloat16, True),
        ("tower_head", 1024, 2048, torch.bfloat16, False)]
CHEAP_IN_INTERPRETER = {"shared_down", "router"}      # grids of a few hundred dots


def operands(m, n, k, dtype, residual, seed=0):
    """x [m, k], weight [n, k] (scaled so outputs are O(1)) and an optional residual, on DEVICE.
    An F32 weight takes bf16 x, as the router does on the decode path."""
    gen = torch.Generator().manual_seed(seed)
    x_dtype = torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    r = torch.randn(m, n, generator=gen).to(dtype) if residual else None
    return [None if t is None else t.to(DEVICE) for t in (x, w, r)]


def assert_matches_reference(got, x, w, r):
    ref = invariant.linear_rows_reference(x, w, r)
    assert got.shape == ref.shape and not torch.isnan(got).any()
    diff = (got.double() - ref).abs()
    worst, rel = float(diff.max() / ref.abs().max()), float(diff.norm() / ref.norm())
    # bf16 output: one rounding (2^-9 relative) of an exact-in-F32 sum; F32: summation error only
    limit = 1e-5 if got.dtype == torch.float32 else 8e-3
    assert worst < limit, f"max |diff| {float(diff.max()):.3g} ({worst:.3g} of the largest output), rel RMS {rel:.3g}"


# --- runs everywhere ---------------------------------------------------------------------------

def test_config_never_depends_on_the_row_count():
    """Everything that sets a row's summation order (BM, BN, BK, the K ranges, warps) is the same
    for M = 1..300; only the row partition (tiles per program, row groups) changes, and its
    groups cover every row, and the pipeline depth where TUNED names a `wide_stages` (one depth up
    to one row group, the other above: it schedules loads, not the arithmetic; the GPU tests
    below compare the bits). bf16 weights take the warpgroup MMA's 64-row tiles, the F32 router
    16-row ones."""
    for _, n, k, dtype, _ in REAL + [("odd", 80, 256, torch.bfloat16, False)]:
        rows = (1, 2, 3, 16, 17, 24, 33, 48, 64, 80, 96, 112, 127, 128, 300)    # the decode buckets among them
        plans = [decode_gemm.launch_plan(m, n, k, dtype) for m in rows]
        fixed = [{key: v for key, v in p.items() if key not in ("tiles", "groups", "num_stages")} for p in plans]
        assert all(f == fixed[0] for f in fixed), fixed
        tuned = decode_gemm.TUNED.get((n, k, dtype), {})
        for m, p in zip(rows, plans):
            wide = m > p["BM"] and "wide_stages" in tuned
            assert p["num_stages"] == (tuned["wide_stages"] if wide else plans[0]["num_stages"]), (m, p)
        bm = plans[0]["BM"]
        assert bm == (16 if dtype == torch.float32 else 64)
        for m, p in zip(rows, plans):
            assert 1 <= p["tiles"] <= max(1, decode_gemm.MAX_ROWS_PER_PROGRAM // bm), (m, p)
            assert p["groups"] * p["tiles"] * bm >= m > (p["groups"] - 1) * p["tiles"] * bm, (m, p)
        assert plans[0]["tiles"] == plans[3]["tiles"] == 1


def test_row_partition_is_a_power_of_two_at_every_decode_bucket():
    """tiles_for answers 1, 2, 4 or 8 tiles whatever the grid: 33-48 rows (the decode bucket 48)
    once started from 3 tiles, which launch_plan refuses, on grids wide enough to stop there
    (DRAMA_DECODE_GEMM=triton failed so at the full geometry on the H200, session 16)."""
    from services.backbone.model import DECODE_BUCKETS

    for m in DECODE_BUCKETS + (3, 33, 40, 300):
        for programs in (1, 64, 600, 5000):
            for weight_bytes in (1, 100 << 20):
                for bm in (16, 64):
                    assert decode_gemm.tiles_for(m, programs, weight_bytes, bm) in (1, 2, 4, 8), (m, programs, bm)


def test_forced_row_partition():
    """decode_linear(tiles=..) (benchmarks, tests) takes 1, 2, 4 or 8 tiles per program, capped at
    the tiles M needs; anything else is an error."""
    narrow = dict(decode_gemm.config_for(2048, 4096, torch.bfloat16), BM=16)
    plan = decode_gemm.launch_plan(128, 2048, 4096, torch.bfloat16, narrow, tiles=8)
    assert (plan["tiles"], plan["groups"]) == (8, 1)
    plan = decode_gemm.launch_plan(40, 2048, 4096, torch.bfloat16, narrow, tiles=8)
    assert (plan["tiles"], plan["groups"]) == (3, 1)
    plan = decode_gemm.launch_plan(128, 2048, 4096, torch.bfloat16, narrow, tiles=1)
    assert (plan["tiles"], plan["groups"]) == (1, 8)
    plan = decode_gemm.launch_plan(128, 2048, 4096, torch.bfloat16, tiles=8)       # BM 64
    assert (plan["BM"], plan["tiles"], plan["groups"]) == (64, 2, 1)
    plan = decode_gemm.launch_plan(128, 2048, 4096, torch.bfloat16)
    assert (plan["tiles"], plan["groups"]) == (1, 2)
    with pytest.raises(ValueError, match="tiles per program"):
        decode_gemm.launch_plan(128, 2048, 4096, torch.bfloat16, tiles=3)


def test_real_shapes_fill_the_gpu():
    """At M = 1 every real shape launches at least 128 programs (column blocks x K ranges), and a
    shape whose K is split by the rule at least 256 (2 per SM), so enough weight bytes are in
    flight; K is split only where the column blocks alone are too few. At M = 128 every shape has
    >= 2 programs per SM. TUNED's splits were timed instead (64-128 programs with 4 stages, fewer
    reduce reads): at least 64 programs at one row, 128 at 128 rows."""
    for name, n, k, dtype, _ in REAL:
        plan = decode_gemm.launch_plan(1, n, k, dtype)
        programs = -(-n // plan["BN"]) * plan["splits"]
        tuned = "SPLIT" in decode_gemm.TUNED.get((n, k, dtype), {})
        assert programs >= (64 if tuned else 128 if plan["splits"] == 1 else 256), (name, plan)
        assert plan["splits"] == 1 or -(-n // 64) < 128, (name, plan)
        assert plan["k_range"] * plan["splits"] >= k > plan["k_range"] * (plan["splits"] - 1), (name, plan)
        plan = decode_gemm.launch_plan(128, n, k, dtype)
        assert programs * plan["groups"] >= (128 if tuned else 2 * decode_gemm.SMS), (name, plan)


def test_reference_is_row_by_row_float64():
    x, w, r = (t.cpu() for t in operands(5, 24, 40, torch.bfloat16, True))
    ref = invariant.linear_rows_reference(x, w, r)
    assert ref.dtype == torch.float64
    torch.testing.assert_close(ref, x.double() @ w.double().T + r.double())


def test_rejects_bad_arguments():
    x, w, _ = (t.cpu() if t is not None else None for t in operands(2, 32, 64, torch.bfloat16, False))
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        decode_gemm.decode_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="residual"):
        decode_gemm.decode_linear(x, w, torch.zeros(3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 weight takes bf16"):
        decode_gemm.decode_linear(x.float(), w)
    with pytest.raises(ValueError, match="bf16 and F32 weights"):
        decode_gemm.decode_linear(x.half(), w.half())


def test_switch(monkeypatch):
    """triton (the default) only on a decode step with x on CUDA; cublas always gives
    invariant.linear_rows; a bad value is an error."""
    x = torch.zeros(1, 8)
    read = lambda: env_choice("DRAMA_DECODE_GEMM", ("triton", "cublas"))  # noqa: E731 (as decode_gemm reads it)
    monkeypatch.delenv("DRAMA_DECODE_GEMM", raising=False)
    assert read() == "triton"
    monkeypatch.setenv("DRAMA_DECODE_GEMM", "")
    assert read() == "triton"
    monkeypatch.setenv("DRAMA_DECODE_GEMM", "CUBLAS ")
    assert read() == "cublas"
    monkeypatch.setenv("DRAMA_DECODE_GEMM", "cutlass")
    with pytest.raises(ValueError, match="DRAMA_DECODE_GEMM"):
        read()
    monkeypatch.setattr(decode_gemm, "BACKEND", "cublas")
    assert decode_gemm.dense_linear(True, x) is invariant.linear_rows
    monkeypatch.setattr(decode_gemm, "BACKEND", "triton")
    assert decode_gemm.dense_linear(True, x) is invariant.linear_rows           # CPU tensor
    assert decode_gemm.dense_linear(False, x) is invariant.linear_rows
    if CUDA:
        assert decode_gemm.dense_linear(True, x.cuda()) is decode_gemm.decode_linear
        assert decode_gemm.dense_linear(False, x.cuda()) is invariant.linear_rows


# --- the kernel (GPU or interpreter) -----------------------------------------------------------

WHOLE_K = dict(BN=32, BK=128, SPLIT=1, num_warps=4, num_stages=3)      # the GEMM kernel rounds
WIDE = dict(WHOLE_K, BM=64)                                              # 64-row (warpgroup) tiles


@kernel
@pytest.mark.parametrize("m", [1, 3, 17, 128])
@pytest.mark.parametrize("n,k,dtype,residual,config", [
    (80, 256, torch.bfloat16, False, WHOLE_K),       # N % BN != 0
    (80, 256, torch.bfloat16, True, WHOLE_K),
    (72, 1024, torch.bfloat16, True, None),          # split K (8 ranges), N % BN != 0
    (40, 320, torch.float32, False, None),           # F32, split K, K % BK != 0
    (80, 256, torch.bfloat16, True, WIDE)],
    ids=["bf16", "bf16-residual", "bf16-split-residual", "f32-split", "bf16-wide-residual"])
def test_matches_reference(m, n, k, dtype, residual, config):
    x, w, r = operands(m, n, k, dtype, residual)
    got = decode_gemm.decode_linear(x, w, r, config=config)
    assert got.dtype == dtype
    assert_matches_reference(got, x, w, r)


@kernel
@pytest.mark.parametrize("m", [37, 128])
@pytest.mark.parametrize("n,k,dtype,residual,config", [
    (80, 256, torch.bfloat16, True, WHOLE_K),
    (72, 1024, torch.bfloat16, True, dict(BN=32, BK=128, SPLIT=4, num_warps=4, num_stages=3)),
    (40, 320, torch.float32, False, dict(BN=32, BK=64, SPLIT=2, num_warps=4, num_stages=3)),
    (80, 256, torch.bfloat16, True, WIDE)],
    ids=["bf16-residual", "bf16-split-residual", "f32-split", "bf16-wide-residual"])
def test_row_partition_keeps_bits(m, n, k, dtype, residual, config):
    """The rows dealt out as 1, 2 or 4 tiles per program (several row groups) give the same bits as
    a single program carrying all its tiles (tiles=8, one group up to 128 rows)."""
    x, w, r = operands(m, n, k, dtype, residual, seed=11)
    single = decode_gemm.decode_linear(x, w, r, config=config, tiles=8)
    assert decode_gemm.launch_plan(m, n, k, dtype, config, tiles=8)["groups"] == 1
    for tiles in (1, 2, 4):
        got = decode_gemm.decode_linear(x, w, r, config=config, tiles=tiles)
        assert torch.equal(got, single), f"tiles {tiles}: max |diff| {float((got - single).abs().max())}"
    assert_matches_reference(single, x, w, r)


@kernel
@pytest.mark.parametrize("name,n,k,dtype,residual", REAL, ids=[s[0] for s in REAL])
def test_real_shapes_match_reference(name, n, k, dtype, residual):
    if not CUDA and name not in CHEAP_IN_INTERPRETER:
        pytest.skip("a large grid: minutes in the interpreter (the GPU runs it)")
    for m in ((1, 8, 32, 128) if CUDA else (2,)):
        x, w, r = operands(m, n, k, dtype, residual)
        assert_matches_reference(decode_gemm.decode_linear(x, w, r), x, w, r)


def _row_alone_equals_row_in_batch(n, k, dtype, residual, positions, config=None, prefixes=(17,)):
    """Row p computed alone (M = 1), inside the first `prefixes` rows (M = 17, or 8 and 32) and
    inside the batch of 128: same bits."""
    x, w, r = operands(128, n, k, dtype, residual, seed=3)
    full = decode_gemm.decode_linear(x, w, r, config=config)
    for m in prefixes:
        part = decode_gemm.decode_linear(x[:m], w, None if r is None else r[:m], config=config)
        assert torch.equal(part, full[:m]), f"M = {m}: max |diff| {float((part - full[:m]).abs().max())}"
    for p in positions:
        alone = decode_gemm.decode_linear(x[p:p + 1], w, None if r is None else r[p:p + 1], config=config)
        assert torch.equal(alone[0], full[p]), f"row {p}: max |diff| {float((alone[0] - full[p]).abs().max())}"


SOME_POSITIONS = (0, 1, 7, 15, 16, 31, 47, 64, 100, 127)     # first/inner/last of several tiles


@kernel
@pytest.mark.parametrize("n,k,dtype,residual,config,positions", [
    (32, 256, torch.bfloat16, True, None, range(128)),
    (32, 256, torch.bfloat16, True, dict(BN=32, BK=128, SPLIT=2, num_warps=4, num_stages=3), SOME_POSITIONS),
    (24, 128, torch.float32, False, dict(BN=32, BK=64, SPLIT=2, num_warps=4, num_stages=3), SOME_POSITIONS),
    (32, 256, torch.bfloat16, True, dict(WIDE, BM=16), SOME_POSITIONS)],
    ids=["bf16-residual", "bf16-split-residual", "f32-split", "bf16-narrow-residual"])
def test_row_alone_equals_row_in_batch_of_128(n, k, dtype, residual, config, positions):
    """Issue #8, bit for bit: a row alone (M = 1) equals the same row inside the 128-row batch,
    at every position (both 64-row tiles, every place inside a tile) for the plain kernel, and
    at positions in several tiles for the split-K and F32 variants (interpreter time)."""
    _row_alone_equals_row_in_batch(n, k, dtype, residual, positions, config)


@kernel
def test_rows_past_m_are_never_read():
    """x and the residual as the leading rows of bigger buffers whose other rows hold NaN and Inf
    (as invariant.empty_rows' padding may): the result equals that of clean copies."""
    x, w, r = operands(128, 48, 256, torch.bfloat16, True, seed=5)
    dirty_x = torch.full((128, 256), float("nan"), dtype=x.dtype, device=x.device)
    dirty_r = torch.full((128, 48), float("inf"), dtype=r.dtype, device=r.device)
    dirty_x[:5], dirty_r[:5] = x[:5], r[:5]
    got = decode_gemm.decode_linear(dirty_x[:5], w, dirty_r[:5])
    assert torch.equal(got, decode_gemm.decode_linear(x[:5].clone(), w, r[:5].clone()))


@kernel
def test_strided_operands():
    """A column slice of a wider tensor as x (row stride != K) gives the same bits as a copy."""
    x, w, _ = operands(9, 48, 512, torch.bfloat16, False, seed=6)
    wide = torch.cat([x, x], dim=1)[:, :256]
    assert torch.equal(decode_gemm.decode_linear(wide, w[:, :256]),
                       decode_gemm.decode_linear(wide.contiguous(), w[:, :256].contiguous()))


@kernel
@pytest.mark.parametrize("m,residual", [(1, True), (5, False), (70, True)])
def test_last_program_reduce_equals_the_reduce_launch(monkeypatch, m, residual):
    """With K split, the reduce inside the GEMM launch (the last program of each row group and
    column block) gives the bits of the separate reduce launch, at one and at two row groups,
    and leaves every ticket at zero for the next launch."""
    x, w, r = operands(m, 48, 512, torch.bfloat16, residual, seed=9)
    config = dict(BM=64, BN=32, BK=128, SPLIT=4, num_warps=4, num_stages=3)
    monkeypatch.setattr(decode_gemm, "LAST_REDUCES", False)
    launch = decode_gemm.decode_linear(x, w, r, config=config)
    monkeypatch.setattr(decode_gemm, "LAST_REDUCES", True)
    inside = decode_gemm.decode_linear(x, w, r, config=config)
    assert torch.equal(inside, launch), f"max |diff| {float((inside - launch).abs().max())}"
    assert_matches_reference(inside, x, w, r)
    tickets = decode_gemm._tickets(x.device)
    assert tickets is not None and int(tickets.abs().sum()) == 0


@kernel
@pytest.mark.parametrize("m,residual", [(1, True), (5, False), (70, True)])
def test_norm_in_the_reduce_launch(monkeypatch, m, residual):
    """norm=(w, eps) with K split: the row program of the reduce gives the reduce launch's bits
    for the output and RMSNorm⁺ of that output (unit-offset gain) within a bf16 rounding; with
    NORM_IN_REDUCE off, the norm's own launch on the same output."""
    from services.backbone.kernels import decode_graph

    x, w, r = operands(m, 256, 512, torch.bfloat16, residual, seed=11)
    gain = (0.3 * torch.randn(256, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16).to(DEVICE)
    config = dict(BM=64, BN=32, BK=128, SPLIT=4, num_warps=4, num_stages=3)
    plain = decode_gemm.decode_linear(x, w, r, config=config)
    out, u = decode_gemm.decode_linear(x, w, r, config=config, norm=(gain, 1e-6))
    assert torch.equal(out, plain)
    ref = decode_graph.naive_rms_norm_plus(plain, gain, 1e-6).float()
    torch.testing.assert_close(u.float(), ref, rtol=8e-3, atol=8e-3)
    monkeypatch.setattr(decode_gemm, "NORM_IN_REDUCE", False)
    out2, u2 = decode_gemm.decode_linear(x, w, r, config=config, norm=(gain, 1e-6))
    assert torch.equal(out2, plain)
    assert torch.equal(u2, decode_graph.rms_norm_plus(plain, gain, 1e-6))
    torch.testing.assert_close(u2.float(), ref, rtol=8e-3, atol=8e-3)


@kernel
@pytest.mark.parametrize("m,residual,split", [(1, True, 1), (5, False, 4), (70, True, 2)])
def test_tma_loads_give_the_same_bits(m, residual, split):
    """The weight through TMA box loads (config TMA, DRAMA_DECODE_GEMM_TMA) gives the bits of the
    masked loads: the same tiles reach the same dots, N and K edges included (N 80 in column
    blocks of 32, K 320 in steps of 128: the boxes past them read zeros)."""
    if decode_gemm.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side TMA descriptors")
    x, w, r = operands(m, 80, 320, torch.bfloat16, residual, seed=15)
    config = dict(BM=64, BN=32, BK=128, SPLIT=split, num_warps=4, num_stages=3)
    plain = decode_gemm.decode_linear(x, w, r, config=config)
    tma = decode_gemm.decode_linear(x, w, r, config=dict(config, TMA=1))
    assert torch.equal(tma, plain), float((tma.float() - plain.float()).abs().max())
    assert_matches_reference(tma, x, w, r)


@kernel
@pytest.mark.parametrize("m,residual", [(1, True), (3, False), (2, True)])
def test_split_reduce_with_its_residual_read_before_the_wait_gives_the_same_bits(m, residual, monkeypatch):
    """The split reduce's residual and norm gain read before its PDL wait (REDUCE_PRELOAD,
    DRAMA_PDL_PRELOAD): the same sums, so the same bits, with the norm in the reduce or not."""
    x, w, r = operands(m, 96, 512, torch.bfloat16, residual, seed=17)
    gain = torch.randn(96).to(torch.bfloat16).to(x.device)
    config = dict(BM=64, BN=32, BK=128, SPLIT=4, num_warps=4, num_stages=3)
    outs = []
    for preload in (False, True):
        monkeypatch.setattr(decode_gemm, "REDUCE_PRELOAD", preload)
        outs.append((decode_gemm.decode_linear(x, w, r, config=config),
                     *decode_gemm.decode_linear(x, w, r, config=config, norm=(gain, 1e-6))))
    for plain, early in zip(*outs):
        assert torch.equal(plain, early)
    assert_matches_reference(outs[1][0], x, w, r)


def test_norm_wants_a_bf16_output_and_a_gain_of_its_width():
    x, w, r = operands(2, 64, 128, torch.bfloat16, True)
    with pytest.raises(ValueError, match="gain"):
        decode_gemm.decode_linear(x, w, r, norm=(torch.ones(32, dtype=torch.bfloat16, device=DEVICE), 1e-6))
    x32, w32, _ = operands(2, 64, 128, torch.float32, False)
    with pytest.raises(ValueError, match="bf16 output"):
        decode_gemm.decode_linear(x32, w32, norm=(torch.ones(64, device=DEVICE), 1e-6))


# --- GPU only ----------------------------------------------------------------------------------

@gpu
def test_norm_in_the_reduce_launch_rows_do_not_depend_on_the_batch():
    """out_proj's real shape with the post-attention norm (the decode step's use): each row alone
    gives the bits of itself inside 128 rows, output and norm."""
    x, w, r = operands(128, 2048, 4096, torch.bfloat16, True, seed=5)
    gain = (0.3 * torch.randn(2048, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16).cuda()
    out, u = decode_gemm.decode_linear(x, w, r, norm=(gain, 1e-6))
    for i in (0, 1, 63, 64, 127):
        alone, u_alone = decode_gemm.decode_linear(x[i:i + 1], w, r[i:i + 1], norm=(gain, 1e-6))
        assert torch.equal(alone[0], out[i]) and torch.equal(u_alone[0], u[i]), i


@gpu
@pytest.mark.parametrize("name,n,k,dtype,residual", REAL, ids=[s[0] for s in REAL])
def test_real_shapes_rows_do_not_depend_on_the_batch(name, n, k, dtype, residual):
    """Every real shape, the default launch: each of the 128 rows alone equals itself inside
    M = 128, and the first 8 and 32 rows as a batch equal theirs (each M with its own row
    partition: 1, 1 or 2 tiles per program at 8 and 32, 2 or 4 at 128)."""
    _row_alone_equals_row_in_batch(n, k, dtype, residual, range(128), prefixes=(8, 32))


@gpu
@pytest.mark.parametrize("name,n,k,dtype,residual", REAL, ids=[s[0] for s in REAL])
def test_real_shapes_row_partition_keeps_bits(name, n, k, dtype, residual):
    """Every real shape at M = 128 and M = 37: 1, 2 or 4 tiles per program give the bits of a
    single program with all its tiles."""
    for m in (37, 128):
        x, w, r = operands(m, n, k, dtype, residual, seed=12)
        single = decode_gemm.decode_linear(x, w, r, tiles=8)
        for tiles in (1, 2, 4):
            assert torch.equal(decode_gemm.decode_linear(x, w, r, tiles=tiles), single), (m, tiles)


@gpu
def test_close_to_padded_cublas():
    """Same math as invariant.linear_rows up to summation order (different bits allowed)."""
    for name, n, k, dtype, residual in REAL:
        x, w, r = operands(8, n, k, dtype, residual)
        x_in = x.float() if dtype == torch.float32 else x
        got, ref = decode_gemm.decode_linear(x, w, r), invariant.linear_rows(x_in, w, r)
        assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2, name


@gpu
def test_graph_capture():
    """Captured in a CUDA graph (split-K workspace included), a replay on new inputs equals an
    eager call on them."""
    x, w, r = operands(32, 2048, 4096, torch.bfloat16, True)
    out = decode_gemm.decode_linear(x, w, r)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_gemm.decode_linear(x, w, r)
    x2, _, r2 = operands(32, 2048, 4096, torch.bfloat16, True, seed=9)
    x.copy_(x2)
    r.copy_(r2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_gemm.decode_linear(x2, w, r2))


# --- wiring: the backbone's kernel path (CPU through the interpreter, or CUDA) -----------------

@kernel
def test_backbone_decode_steps_take_decode_linear(monkeypatch):
    """With the switch on (forced here: on CPU dense_linear would keep linear_rows), a decode
    step's dense projections (GDN in/out, attention qkv/o, router, shared expert) go through
    decode_linear and prefill steps never do; the decode rows stay within BF16 rounding of the
    linear_rows path."""
    from services.backbone.engine import BackboneEngine
    from services.backbone.weights import random_backbone
    from test_backbone_gpu import MID, copy_to

    calls = []

    def forced(decode, x, gemm_rows=None):      # decode_gemm.dense_linear's signature
        if not decode:
            return invariant.linear_rows
        def linear(x, weight, residual=None, **hints):     # residual_out= (linear_rows' hint)
            calls.append((x.shape[0], weight.dtype))
            return decode_gemm.decode_linear(x, weight, residual, **hints)
        return linear

    ref = random_backbone(MID, device="cpu", seed=4)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, MID.vocab_size, (n,), generator=gen) for n in (9, 6)]
    tokens = torch.randint(0, MID.vocab_size, (1, 2), generator=gen)      # one decode step
    out = {}
    monkeypatch.setattr(decode_gemm, "BACKEND", "cublas")       # the first engine: linear_rows throughout
    for name in ("linear_rows", "decode_linear"):
        if name == "decode_linear":
            monkeypatch.setattr(decode_gemm, "dense_linear", forced)
        engine = BackboneEngine(copy_to(ref, DEVICE, kernels=True), max_sessions=3, max_context=64)
        a, b = engine.open(), engine.open()
        engine.step([(a, prompts[0], None), (b, prompts[1], None)])
        assert not calls, "a prefill step took decode_linear"
        out[name] = torch.stack([torch.stack(engine.step([(a, t[0:1], None), (b, t[1:2], None)])) for t in tokens])
    layers = MID.num_hidden_layers
    assert {rows for rows, _ in calls} == {2}
    if CUDA:   # the MoE's decode kernels route (route_decode) and run the shared expert themselves
        assert len(calls) == 2 * layers, calls                  # the mixer's in and out projections
    else:
        # per layer: the mixer's in and out projections, the router, shared gate|up|gate, shared down
        assert len(calls) == 5 * layers, calls
        assert sum(dtype == torch.float32 for _, dtype in calls) == layers, "the router GEMM is F32"
    cos = torch.nn.functional.cosine_similarity(out["decode_linear"].double().flatten(0, -2),
                                                out["linear_rows"].double().flatten(0, -2), dim=-1)
    assert cos.min() > 0.999, f"min cosine {float(cos.min()):.6f}"

"""Batch invariance of the dense projections (issue #8, services/common/invariant.py).

CPU (fast, always run):
- linear_rows' padded path (forced on the CPU: MKL also picks its kernel by the row count) gives
  a row bit-identical results alone and inside batches of 1..300 rows of other data, at any
  position, with and without a residual; and it equals the float64 product within tolerance;
- an input whose storage already covers the padded rows is multiplied in place, and whatever
  those rows hold (NaN, Inf) never reaches the real rows;
- without the force, the CPU keeps the plain product (the exact path's numerics are unchanged);
- the switch's parsing, and the FP8 MoE kernel config following it.

CUDA (skipped without a GPU):
- the same bit-identity in BF16 (and F32 for the router) at every projection shape of the full
  Drama 3 backbone and tower, a row at every position of a 128-row piece, eagerly and inside a
  captured CUDA graph; the backbone kernels that feed GEMMs hand over padded buffers;
- a mid-size backbone on the kernel path: a session's hidden rows (a prefill piece, then decode
  steps) are bit-identical alone and with other sessions in the same steps, eagerly and from
  the decode graphs, and graphed equals eager;
- the tiny tower: a session's logits, bit for bit, alone and inside a batch.
"""

from __future__ import annotations

import importlib
import json
from importlib import resources

import pytest
import torch
import torch.nn.functional as F

from services.common import invariant
from services.common.invariant import TILE, linear_rows, linear_rows_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BATCHES = [1, 2, 3, 5, 7, 8, 16, 31, 64, 100, 127, 128, 129, 200, 255, 256, 257, 300]


def _probe_positions(batch: int) -> list[int]:
    return sorted({0, batch // 2, batch - 1})


def check_rows_invariant(weight: torch.Tensor, *, residual: bool, force: bool | None, dtype: torch.dtype,
                         batches=BATCHES, seed: int = 0) -> None:
    """A probe row's output alone equals its output at several positions in batches of other rows."""
    device = weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k = weight.shape

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    probe, probe_res = rand(1, k), rand(1, n)
    alone = linear_rows(probe, weight, probe_res if residual else None, force=force)
    for batch in batches:
        for pos in _probe_positions(batch):
            x, res = rand(batch, k), rand(batch, n)
            x[pos], res[pos] = probe[0], probe_res[0]
            got = linear_rows(x, weight, res if residual else None, force=force)
            assert got.shape == (batch, n)
            assert torch.equal(got[pos], alone[0]), (
                f"batch {batch}, row {pos}: max diff {float((got[pos].float() - alone[0].float()).abs().max())}")


# --------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_are_bit_identical_alone_and_in_any_batch_cpu(residual, dtype):
    weight = torch.randn(96, 200, generator=torch.Generator().manual_seed(1)).to(dtype)
    check_rows_invariant(weight, residual=residual, force=True, dtype=dtype)


def test_plain_cpu_product_is_not_batch_invariant():
    """What the padding is for: MKL's GEMM gives a row other bits at other row counts. A canary:
    it passes when that holds and skips (saying so) on a build where it does not, since the padded
    test above then proves nothing new."""
    gen = torch.Generator().manual_seed(2)
    weight, probe = torch.randn(96, 200, generator=gen), torch.randn(1, 200, generator=gen)
    alone = F.linear(probe, weight)[0]
    differs = [b for b in BATCHES if not torch.equal(
        F.linear(torch.cat([probe, torch.randn(b - 1, 200, generator=gen)]), weight)[0], alone)]
    if not differs:
        pytest.skip("this CPU GEMM happens to be row-count invariant at these sizes")


@pytest.mark.parametrize("rows", [0, 1, 5, TILE, TILE + 1, 300])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_padded_product_equals_the_float64_product(rows, residual):
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen)
    res = torch.randn(rows, 48, generator=gen) if residual else None
    got = linear_rows(x, weight, res, force=True)
    assert got.shape == (rows, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), linear_rows_reference(x, weight, res), rtol=1e-5, atol=1e-5)
    bf = linear_rows(x.bfloat16(), weight.bfloat16(), None if res is None else res.bfloat16(), force=True)
    torch.testing.assert_close(bf.double(), linear_rows_reference(x, weight, res), rtol=0.05, atol=0.1)


def test_cpu_keeps_the_plain_product():
    """Without force the CPU path is exactly F.linear / torch.addmm (the exact path's numerics)."""
    gen = torch.Generator().manual_seed(4)
    x, weight, res = torch.randn(7, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(7, 48, generator=gen)
    assert not invariant.active(x)
    assert torch.equal(linear_rows(x, weight), F.linear(x, weight))
    assert torch.equal(linear_rows(x, weight, res), torch.addmm(res, x, weight.T))
    assert torch.equal(linear_rows(x, weight, force=False), F.linear(x, weight))


def test_row_linear_and_backbone_linear_keep_cpu_numerics():
    """The tower's RowLinear (both modes) and the backbone's Linear give the bits they gave before."""
    from services.backbone.layers import Linear
    from services.tower.model import RowLinear

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 32, generator=gen)
    plain, exact = RowLinear(32, 24, False, "fc"), RowLinear(32, 24, True, "fc")
    exact.weight.data.copy_(plain.weight.data)
    assert torch.equal(plain(x), F.linear(x, plain.weight))
    bmm = torch.bmm(x[:, None, :], plain.weight.t().expand(9, 32, 24)).squeeze(1)
    assert torch.equal(exact(x), bmm)
    lin = Linear(32, 24)
    lin.weight.data.normal_(generator=gen)
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def _aligned_rows(rows: int, cols: int, storage_rows: int, fill: float) -> torch.Tensor:
    """A [rows, cols] float32 CPU tensor starting 256-byte aligned inside a storage that extends
    over `storage_rows` rows, the rows past `rows` filled with `fill` (the in-place case)."""
    big = torch.full((storage_rows * cols + 64,), fill)
    offset = (-big.data_ptr() % 256) // 4
    return big[offset:offset + storage_rows * cols].view(storage_rows, cols)[:rows]


@pytest.mark.parametrize("rows", [3, TILE, 200])
def test_padding_rows_read_in_place_never_reach_the_real_rows(rows):
    """An input (and residual) whose storage already covers the padded rows, whatever those rows
    hold (NaN here), gives the copied path's bits. On CUDA it is multiplied in place; on the CPU
    (tests only) linear_rows copies into zeroed padding, because oneDNN's bf16 GEMM on some CPUs
    let NaN padding reach real rows."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 64, generator=gen)
    padded = invariant.padded_rows(rows)
    x = _aligned_rows(rows, 64, padded, float("nan"))
    res = _aligned_rows(rows, 40, padded, float("inf"))
    x.copy_(torch.randn(rows, 64, generator=gen))
    res.copy_(torch.randn(rows, 40, generator=gen))
    assert invariant._padded_view(x, padded) is not None and invariant._padded_view(res, padded) is not None
    for r in (None, res):
        got = linear_rows(x, weight, r, force=True)
        copied = linear_rows(x.clone(), weight, None if r is None else r.clone(), force=True)
        assert torch.isfinite(got).all() and torch.equal(got, copied)
        # the output's own storage covers the padded rows: the next GEMM can read it in place too
        assert got.storage_offset() == 0 and got.untyped_storage().nbytes() >= padded * 40 * 4


def test_empty_rows_and_padded_input_are_plain_off_cuda():
    t = invariant.empty_rows(5, 7, dtype=torch.float32, device="cpu")
    assert t.shape == (5, 7) and t.untyped_storage().nbytes() == 5 * 7 * 4
    assert invariant.padded_input(t) is t


def test_padded_path_works_with_grad_enabled_weights():
    """nn.Linear weights require grad (the tower's RowLinear): the padded path must not use
    out= forms that autograd refuses, and must still give the plain product's value."""
    weight = torch.nn.Parameter(torch.randn(24, 32))
    x = torch.randn(130, 32)
    got = linear_rows(x, weight, torch.zeros(130, 24), force=True)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [1, 7, 256])
def test_any_tile_gives_the_float64_product(tile):
    """tile (rows per GEMM call: prefill graphs of large pieces pass 256) changes the calls, not
    the product."""
    gen = torch.Generator().manual_seed(4)
    x, weight, res = torch.randn(300, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(300, 48, generator=gen)
    got = linear_rows(x, weight, res, force=True, tile=tile)
    assert got.shape == (300, 48)
    torch.testing.assert_close(got.double(), linear_rows_reference(x, weight, res), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tile"):
        linear_rows(x, weight, force=True, tile=0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        linear_rows(torch.zeros(3, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="residual"):
        linear_rows(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, 4), force=True)


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False), ("off", False),
                                             (" True ", True), ("maybe", ValueError)])
def test_switch_is_read_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DRAMA_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("DRAMA_BATCH_INVARIANT", value)
    if expected is ValueError:
        with pytest.raises(ValueError, match="DRAMA_BATCH_INVARIANT"):
            invariant._read_switch()
    else:
        assert invariant._read_switch() is expected


def test_fp8_moe_uses_one_kernel_config_while_invariant(monkeypatch):
    from services.backbone.kernels import fp8_moe

    monkeypatch.setattr(invariant, "ENABLED", True)
    assert fp8_moe.kernel_config(grouped=False) == fp8_moe.kernel_config(grouped=True) == fp8_moe.DECODE_CONFIG
    monkeypatch.setattr(invariant, "ENABLED", False)
    assert fp8_moe.kernel_config(grouped=True) == fp8_moe.PREFILL_CONFIG
    assert fp8_moe.kernel_config(grouped=False) == fp8_moe.DECODE_CONFIG


def test_switch_off_means_plain_products_on_cuda_tensors(monkeypatch):
    """active() is the one rule: CUDA and the switch on (checked with a stand-in CUDA tensor)."""
    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(invariant, "ENABLED", True)
    assert invariant.active(FakeCuda())
    monkeypatch.setattr(invariant, "ENABLED", False)
    assert not invariant.active(FakeCuda())


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

def _full_shapes() -> list[tuple[str, int, int, torch.dtype]]:
    """(name, N, K, dtype) of every dense projection of the full backbone and tower."""
    from services.common.config import DramaConfig

    cfg = DramaConfig.from_dict(json.loads(resources.files("services.common").joinpath("presets/full.json").read_text()))
    t, tw = cfg.text, cfg.tower
    h, bf = t.hidden_size, torch.bfloat16
    gdn_in = t.conv_dim + t.linear_value_dim + 2 * t.linear_num_value_heads
    q_out = 2 * t.num_attention_heads * t.head_dim
    kv = t.num_key_value_heads * t.head_dim
    i_s = t.shared_expert_intermediate_size
    tq = 2 * tw.num_attention_heads * tw.head_dim
    tkv = tw.num_key_value_heads * tw.head_dim
    return [("gdn in", gdn_in, h, bf), ("gdn out", h, t.linear_value_dim, bf),
            ("attn qkv", q_out + 2 * kv, h, bf), ("attn o", h, t.num_attention_heads * t.head_dim, bf),
            ("router f32", t.num_experts, h, torch.float32), ("shared fused", 2 * i_s + 1, h, bf),
            ("shared down", h, i_s, bf),
            ("tower q", tq, tw.hidden_size, bf), ("tower kv", tkv, tw.hidden_size, bf),
            ("tower o", tw.hidden_size, tw.num_attention_heads * tw.head_dim, bf),
            ("tower gate/up", tw.intermediate_size, tw.hidden_size, bf),
            ("tower down", tw.hidden_size, tw.intermediate_size, bf),
            ("tower fc", tw.hidden_size, 2 * tw.hidden_size, bf),
            ("tower head", cfg.residual_codebook_size, tw.hidden_size, bf),
            ("semantic head", cfg.semantic_codebook_size + 1, tw.hidden_size, bf)]


@cuda
@pytest.mark.parametrize("shape", _full_shapes(), ids=lambda s: s[0])
def test_cuda_rows_are_bit_identical_at_the_model_shapes(shape, monkeypatch):
    monkeypatch.setattr(invariant, "ENABLED", True)
    _, n, k, dtype = shape
    gen = torch.Generator(device="cuda").manual_seed(6)
    weight = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype)
    probe = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
    alone = linear_rows(probe, weight)
    # every position of a 128-row piece (a stream-K kernel could treat row tiles differently)
    same = linear_rows(probe.expand(TILE, k).contiguous(), weight)
    assert torch.equal(same, alone.expand(TILE, n)), "a row's bits depend on its position in the piece"
    for residual in (False, True):
        check_rows_invariant(weight, residual=residual, force=None, dtype=dtype,
                             batches=[1, 2, 8, 33, 128, 129, 300])
    torch.testing.assert_close(alone.double(), linear_rows_reference(probe, weight),
                               rtol=0.02 if dtype == torch.bfloat16 else 1e-4, atol=0.02)


@cuda
def test_cuda_graph_replay_gives_the_eager_bits(monkeypatch):
    monkeypatch.setattr(invariant, "ENABLED", True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    weight = torch.randn(4096, 2048, generator=gen, device="cuda").bfloat16()
    res = torch.randn(5, 4096, generator=gen, device="cuda").bfloat16()
    static = torch.randn(5, 2048, generator=gen, device="cuda").bfloat16()
    eager = linear_rows(static, weight, res).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear_rows(static, weight, res)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_rows(static, weight, res)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_residual_out_gives_the_same_bits_cpu():
    """residual_out (the caller gives up its residual) changes where the result lies, never its
    bits; the caller's residual is only written when it said so."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    res = torch.randn(5, 32, generator=gen).bfloat16()
    kept = res.clone()
    plain = linear_rows(x, w, res, force=True)
    assert torch.equal(res, kept)
    assert torch.equal(linear_rows(x, w, res, force=True, residual_out=True), plain)


@cuda
def test_cuda_residual_out_adds_in_place_with_the_same_bits(monkeypatch):
    """On the GPU a padded residual given up (residual_out) takes the result in its own storage:
    no copy of it, and the same bits as into a fresh buffer, eagerly and in a graph."""
    monkeypatch.setattr(invariant, "ENABLED", True)
    gen = torch.Generator(device="cuda").manual_seed(10)
    weight = torch.randn(2048, 4096, generator=gen, device="cuda").bfloat16()
    x = torch.randn(3, 4096, generator=gen, device="cuda").bfloat16()
    res = invariant.empty_rows(3, 2048, dtype=torch.bfloat16, device="cuda")
    res.copy_(torch.randn(3, 2048, generator=gen, device="cuda").bfloat16())
    plain = linear_rows(x, weight, res).clone()
    kept = res.clone()
    out = linear_rows(x, weight, res, residual_out=True)
    assert out.data_ptr() == res.data_ptr() and torch.equal(out, plain)
    res.copy_(kept)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = linear_rows(x, weight, res, residual_out=True)
    res.copy_(kept)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


@cuda
def test_cuda_gemm_inputs_come_padded_from_their_producers(monkeypatch):
    """The backbone's norm, SwiGLU and combine kernels allocate with empty_rows, and linear_rows'
    own outputs cover the padded rows: the next GEMM reads them with no padding copy."""
    from services.backbone.kernels import decode_graph as dg

    monkeypatch.setattr(invariant, "ENABLED", True)
    rows, h = 5, 256
    x = torch.randn(rows, h, device="cuda").bfloat16()
    w = torch.randn(h, device="cuda").bfloat16()
    pairs = torch.randn(rows, 8, h, device="cuda")
    outputs = {"rms_norm_plus": dg.rms_norm_plus(x, w), "silu_mul": dg.silu_mul(x, x),
               "moe_combine": dg.moe_combine(pairs, x, x, x[:, 0]),
               "linear_rows": linear_rows(x, torch.randn(64, h, device="cuda").bfloat16()),
               "padded_input": invariant.padded_input(x)}
    for name, t in outputs.items():
        assert invariant._padded_view(t, TILE) is not None, name
    assert torch.equal(outputs["padded_input"], x)
    assert invariant.padded_input(outputs["rms_norm_plus"]) is outputs["rms_norm_plus"]   # no second copy


def _mid_backbone(decode_graphs: bool):
    import dataclasses

    from services.backbone.weights import random_backbone
    from test_backbone_gpu import MID

    mid = dataclasses.replace(MID, num_experts=16, moe_intermediate_size=256)   # more experts than k
    model = random_backbone(mid, device="cuda", dtype=torch.bfloat16, seed=8, exact=False, kernels=True,
                            decode_graphs=decode_graphs)
    model.prepare()
    return model


def _probe_rows(engine, others: int, prompt, other_prompt, steps, gen_seed: int) -> torch.Tensor:
    """The probe session's hidden rows: its prompt piece, then len(steps) decode rows. Alone, the
    probe is the only session (slot 0). With `others` > 0 it sits in slot 1, another session's
    prompt shares its prefill step (together above the MoE decode table's pair limit), and
    `others` sessions decode beside it, the probe in the middle of each step."""
    gen = torch.Generator().manual_seed(gen_seed)
    if not others:
        probe = engine.open()
        rows = [engine.step([(probe, prompt, None)])[0]]
        rows += [engine.step([(probe, t[None], None)])[0] for t in steps]
        return torch.cat(rows)
    first = engine.open()
    probe = engine.open()
    companions = [first] + [engine.open() for _ in range(others - 1)]
    rows = [engine.step([(first, other_prompt, None), (probe, prompt, None)])[1]]
    for c in companions[1:]:
        engine.step([(c, torch.randint(0, 512, (5,), generator=gen), None)])
    for t in steps:
        work = [(c, torch.randint(0, 512, (1,), generator=gen), None) for c in companions]
        middle = len(work) // 2
        work.insert(middle, (probe, t[None], None))
        rows.append(engine.step(work)[middle])
    return torch.cat(rows)


@cuda
def test_backbone_session_rows_are_bit_identical_alone_and_in_a_batch(monkeypatch):
    monkeypatch.setattr(invariant, "ENABLED", True)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 512, (100,), generator=gen)            # 800 pairs alone: decode table
    other_prompt = torch.randint(0, 512, (60,), generator=gen)       # 1280 together: grouped path
    steps = torch.randint(0, 512, (6,), generator=gen)
    from services.backbone.engine import BackboneEngine

    results, engines = {}, []       # engines stay alive: decode graphs are keyed by id(caches)
    for graphs in (False, True):
        model = _mid_backbone(graphs)
        for others in (0, 7, 40):
            engines.append(BackboneEngine(model, max_sessions=others + 1, max_context=256))
            results[graphs, others] = _probe_rows(engines[-1], others, prompt, other_prompt, steps, 10 + others)
    # Within each mode a row's bits must not depend on the batch. Between the modes they may
    # differ: with graphs a prompt runs as a padded piece whose attention reads the pool with the
    # decode kernel (keys split in 64s, splits combined), without them through SDPA; from the
    # second split on (row 64) the two round differently (test_backbone_serving_gpu compares them
    # within tolerance).
    for (graphs, others), rows in results.items():
        reference = results[graphs, 0]
        diff = (rows.float() - reference.float()).abs().amax(dim=-1)
        assert torch.equal(rows, reference), f"graphs={graphs} others={others}: rows differ {diff.tolist()}"


def tower_probe_logits(device: str, others: int) -> list[torch.Tensor]:
    """Every logits row drawn for one tower session (a 20-row prompt, then 5 frames), alone
    (others = 0, slot 0) or beside `others` sessions (their own prompts in the same prefill call,
    a draw row each in every frame step); argmax draws, so the same logits give the same codes."""
    with torch.inference_mode():                  # as the engine runs its steps
        return _tower_probe_logits(device, others)


def _tower_probe_logits(device: str, others: int) -> list[torch.Tensor]:
    from services.common.config import DramaConfig
    from services.tower.model import RowBatch, forward_rows
    from services.tower.weights import random_tower

    cfg = DramaConfig.from_dict(json.loads(resources.files("services.common").joinpath("presets/tiny.json").read_text()))
    model = random_tower(cfg, device=device, dtype=torch.bfloat16, seed=12, batch_invariant=False)
    model.setup_caches(48, 64)
    d, n = cfg.tower.hidden_size, cfg.num_codebooks
    gen = torch.Generator(device=device).manual_seed(13)
    prompt, frames = torch.randn(20, d, generator=gen, device=device), torch.randn(5, d, generator=gen, device=device)
    gen.manual_seed(100 + others)                  # the companions' rows differ from run to run
    slot = others // 2
    order = list(range(others + 1))                # slots in row order; the probe's is `slot`
    seen: list[torch.Tensor] = []
    probe_row = {"index": 0}

    def sample(draw_index, logits):
        seen.append(logits[probe_row["index"]].clone())
        return logits.argmax(dim=-1)

    def none(rows):
        return torch.full((rows, n), -1, dtype=torch.int64, device=device)

    companions = [s for s in order if s != slot]
    hidden = torch.cat([prompt] + [torch.randn(7, d, generator=gen, device=device) for _ in companions])
    segments = [(slot, 0, prompt.shape[0])] + [(s, 0, 7) for s in companions]
    forward_rows(model, hidden.bfloat16(), none(hidden.shape[0]), RowBatch.from_segments(segments, device),
                 torch.tensor([prompt.shape[0] - 1], device=device), sample)
    probe_row["index"] = order.index(slot)
    for i, frame in enumerate(frames):
        rows = torch.stack([frame if s == slot else torch.randn(d, generator=gen, device=device) for s in order])
        segments = [(s, (prompt.shape[0] if s == slot else 7) + i, 1) for s in order]
        forward_rows(model, rows.bfloat16(), none(len(order)), RowBatch.from_segments(segments, device),
                     torch.arange(len(order), device=device), sample)
    return seen


@cuda
def test_tower_session_logits_are_bit_identical_alone_and_in_a_batch(monkeypatch):
    monkeypatch.setattr(invariant, "ENABLED", True)
    alone = tower_probe_logits("cuda", 0)
    for others in (7, 40):
        batched = tower_probe_logits("cuda", others)
        assert len(batched) == len(alone) == 6 * 10
        for j, (a, b) in enumerate(zip(alone, batched)):
            assert torch.equal(a, b), f"{others} others, draw {j}: max diff {float((a - b).abs().max())}"


def test_module_reads_the_switch_at_import(monkeypatch):
    """DRAMA_BATCH_INVARIANT=0 at import turns the padding off (the lead's A/B switch)."""
    monkeypatch.setenv("DRAMA_BATCH_INVARIANT", "0")
    try:
        assert importlib.reload(invariant).ENABLED is False
    finally:
        monkeypatch.undo()
        importlib.reload(invariant)
    assert invariant.ENABLED is invariant._read_switch()

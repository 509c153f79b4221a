"""The tower's GPU fast paths (issue #7) against their references; skipped without CUDA.

- decode attention (kernels.decode_attention, Triton, split-K) against `attend_rowwise` on
  float64 copies of the same inputs, at awkward lengths (1, block edges, the pool's end) and
  slots out of order, for the full tower's heads (16 q / 2 kv of 256) and the tiny preset's;
  a row's result does not depend on the other rows;
- the fused RMSNorm+ and q/k norm + RoPE kernels against the torch functions and float64;
- a decode step replayed from the engine's CUDA graphs equals the eager step over the same rows
  exactly (codes and stop flags), at a bucket size and padded (5 real rows in bucket 8 against
  the eager step over the same 5 rows plus 3 companions: rows never affect each other);
- the engine's eager GPU path still equals the float64 from-scratch timeline's draws closely
  (test_tower_model covers the CPU path).
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from services.common.config import DramaConfig
from services.tower import kernels
from services.tower.engine import StepEntry, TowerEngine
from services.tower.model import RowBatch, attend_rowwise, gate_output
from services.tower.weights import random_tower
from tests.test_tower_graphs import _params

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not kernels.HAS_TRITON, reason="needs CUDA and Triton")


def _preset(name: str) -> DramaConfig:
    return DramaConfig.from_dict(json.loads(resources.files("services.common").joinpath(
        f"presets/{name}.json").read_text()))


# ------------------------------------------------------------------------------------------
# decode attention
# ------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 2, 256), (4, 2, 16), (8, 1, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3, 32])
def test_decode_attention_matches_rowwise_reference(heads, kv_heads, head_dim, splits):
    g = torch.Generator(device="cuda").manual_seed(heads * 1000 + head_dim + (splits or 0))
    slots_n, length = 6, 1100
    k_cache = torch.randn(slots_n, kv_heads, length, head_dim, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(slots_n, kv_heads, length, head_dim, device="cuda", generator=g).bfloat16()
    positions = torch.tensor([0, 1, 31, 32, 33, 63, 64, 255, 1023, 1099, 517, 2], device="cuda")
    slots = torch.tensor([3, 0, 5, 1, 1, 2, 4, 0, 5, 3, 2, 4], device="cuda")
    q = (torch.randn(len(slots), heads, head_dim, device="cuda", generator=g) * 2).bfloat16()
    out = kernels.decode_attention(q, k_cache, v_cache, slots, positions, splits=splits)
    rows = RowBatch.from_segments([(s, p, 1) for s, p in zip(slots.tolist(), positions.tolist())], "cuda")
    ref = attend_rowwise(q.double(), k_cache.double(), v_cache.double(), rows)
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    error = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert error.max() < 1e-2, error          # bf16 operands (q, K, V and the probabilities)
    # A row attends to nothing past its position: changing later cache entries changes nothing.
    k_cache[slots[0], :, 1:] = 100.0
    again = kernels.decode_attention(q, k_cache, v_cache, slots, positions, splits=splits)
    assert torch.equal(again[0], out[0])


@cuda
def test_decode_attention_reads_the_q_view_of_the_gated_projection():
    """In the model q is a strided view (q and gate interleaved per head)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    k_cache = torch.randn(2, 2, 64, 256, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(2, 2, 64, 256, device="cuda", generator=g).bfloat16()
    q_and_gate = torch.randn(3, 16, 512, device="cuda", generator=g).bfloat16()
    q = q_and_gate[..., :256]
    slots, positions = torch.tensor([1, 0, 1], device="cuda"), torch.tensor([40, 63, 7], device="cuda")
    assert torch.equal(kernels.decode_attention(q, k_cache, v_cache, slots, positions),
                       kernels.decode_attention(q.contiguous(), k_cache, v_cache, slots, positions))


@cuda
def test_decode_attention_is_batch_invariant():
    """A row's pieces depend on its own length only: the same row alone and among 40 others."""
    g = torch.Generator(device="cuda").manual_seed(9)
    k_cache = torch.randn(41, 2, 2048, 256, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(41, 2, 2048, 256, device="cuda", generator=g).bfloat16()
    q = torch.randn(41, 16, 256, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(41, device="cuda", generator=g)
    positions = torch.randint(0, 2048, (41,), device="cuda", generator=g)
    together = kernels.decode_attention(q, k_cache, v_cache, slots, positions)
    for row in (0, 17, 40):
        alone = kernels.decode_attention(q[row:row + 1], k_cache, v_cache, slots[row:row + 1], positions[row:row + 1])
        assert torch.equal(alone[0], together[row])


@cuda
def test_decode_attention_applies_the_gate_as_torch_does():
    """gate=: the output gate in the merge's launch gives gate_output's bits (σ as torch's)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    k_cache = torch.randn(4, 2, 300, 256, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(4, 2, 300, 256, device="cuda", generator=g).bfloat16()
    q_and_gate = (torch.randn(5, 16, 512, device="cuda", generator=g) * 4).bfloat16()
    q, gate = q_and_gate.split(256, dim=-1)                              # the model's strided views
    slots, positions = torch.tensor([1, 0, 3, 2, 1], device="cuda"), torch.tensor([40, 299, 7, 0, 128], device="cuda")
    plain = kernels.decode_attention(q, k_cache, v_cache, slots, positions)
    gated = kernels.decode_attention(q, k_cache, v_cache, slots, positions, gate=gate)
    assert torch.equal(gated, gate_output(plain, gate))
    with pytest.raises(ValueError, match="gate"):
        kernels.decode_attention(q, k_cache, v_cache, slots, positions, gate=gate[:, :8])


@cuda
def test_norm_rope_to_cache_writes_what_norm_rope_and_index_put_write():
    from services.tower.model import rotary_tables

    g = torch.Generator(device="cuda").manual_seed(12)
    qkv = (torch.randn(6, 16 * 512 + 2 * 2 * 256, device="cuda", generator=g) * 2).bfloat16()
    k = qkv[:, 8192:8704].view(6, 2, 256)                               # column views of the fused GEMM
    v = qkv[:, 8704:].view(6, 2, 256)
    w = torch.randn(256, device="cuda", generator=g) * 0.3
    slots, positions = torch.tensor([3, 0, 3, 1, 2, 0], device="cuda"), torch.tensor([5, 9, 6, 0, 77, 10], device="cuda")
    cos, sin = rotary_tables(positions, 64, 1e7)
    caches = [torch.randn(4, 2, 100, 256, device="cuda", generator=g).bfloat16() for _ in range(2)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    want_k[slots, :, positions] = kernels.norm_rope(k, w, 1e-6, cos, sin)
    want_v[slots, :, positions] = v
    kernels.norm_rope_to_cache(k, v, w, 1e-6, cos, sin, caches[0], caches[1], slots, positions)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


@cuda
def test_fusion_input_is_the_fusions_gather_norms_and_concat():
    """kernels.fusion_input (the GPU path of model.fuse_codes) gives the bits of the unfused ops:
    the codebook row (zeros where there is no target), each half's RMSNorm+, the concat."""
    g = torch.Generator(device="cuda").manual_seed(13)
    rows, dim, vocab = 9, 2048, 64
    table = torch.randn(4 * vocab, dim, device="cuda", generator=g).bfloat16()
    codes = torch.randint(-1, vocab, (rows, 5), device="cuda", generator=g)[:, 2]    # a strided column
    codes[3] = -1
    hidden = (torch.randn(rows, dim + 64, device="cuda", generator=g) * 3).bfloat16()[:, :dim]
    w_e, w_h = (torch.randn(dim, device="cuda", generator=g) * 0.3 for _ in range(2))
    got = kernels.fusion_input(codes, table, 2 * vocab, hidden, w_e, w_h, 1e-6)
    e = table[2 * vocab + codes.clamp(min=0)]
    e = torch.where((codes >= 0)[:, None], e, torch.zeros_like(e))
    want = torch.cat([kernels.rms_norm_plus(e, w_e, 1e-6), kernels.rms_norm_plus(hidden.contiguous(), w_h, 1e-6)], -1)
    assert torch.equal(got, want)
    assert not got[3, :dim].any()


# ------------------------------------------------------------------------------------------
# RMSNorm+ and q/k norm + RoPE
# ------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_norms_match_the_torch_references(dtype):
    from services.tower.model import apply_rotary, rms_norm_plus, rotary_tables

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(37, 2048, device="cuda", generator=g) * 3).to(dtype)
    w = torch.randn(2048, device="cuda", generator=g) * 0.3
    fused, reference = kernels.rms_norm_plus(x, w, 1e-6), rms_norm_plus(x, w, 1e-6)
    exact = rms_norm_plus(x.double(), w.double(), 1e-6)
    assert fused.dtype == dtype
    assert torch.allclose(fused.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.allclose(fused.float(), reference.float(), rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5)
    for heads, head_dim, rotary in [(16, 256, 64), (2, 256, 64), (4, 16, 4)]:
        q_and_gate = (torch.randn(37, heads, 2 * head_dim, device="cuda", generator=g) * 2).to(dtype)
        q = q_and_gate[..., :head_dim]                                  # the strided view the model has
        w = torch.randn(head_dim, device="cuda", generator=g) * 0.3
        positions = torch.randint(0, 8192, (37,), device="cuda", generator=g)
        cos, sin = rotary_tables(positions, rotary, 1e7)
        fused = kernels.norm_rope(q, w, 1e-6, cos, sin)
        reference = apply_rotary(rms_norm_plus(q, w, 1e-6), cos, sin)
        exact = apply_rotary(rms_norm_plus(q.double(), w.double(), 1e-6), cos.double(), sin.double())
        assert fused.shape == q.shape and fused.is_contiguous()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(fused.double(), exact, rtol=tolerance, atol=tolerance)
        assert torch.allclose(fused.float(), reference.float(), rtol=tolerance, atol=tolerance)


# ------------------------------------------------------------------------------------------
# CUDA graphs of the decode step
# ------------------------------------------------------------------------------------------

def _pair(cfg, sessions: int, context: int):
    graphed = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16, seed=7), cfg,
                          max_sessions=sessions, max_context=context, graphs=True)
    eager = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16, seed=7), cfg,
                        max_sessions=sessions, max_context=context, graphs=False)
    graphed.warm_up()
    eager.warm_up()
    assert graphed.graphs_captured and not eager.graphs_captured
    return graphed, eager


@cuda
@pytest.mark.parametrize("preset", ["tiny", "full"])
@pytest.mark.parametrize("decode_gemm", [False, True])
@pytest.mark.parametrize("spin_gpu_wait", [False, True])
def test_graphed_decode_equals_eager(preset, decode_gemm, spin_gpu_wait, monkeypatch):
    """decode_gemm: the projections through decode_linear (DRAMA_TOWER_DECODE_GEMM=1), whose rows
    must not depend on the rows beside them either (the padded bucket below). spin_gpu_wait: the
    replay's codes through pinned memory and a polled wait (DRAMA_GPU_WAIT_SPIN=1)."""
    from services.tower import model

    monkeypatch.setattr(model, "TOWER_DECODE_GEMM", model.decode_gemm_kinds("1" if decode_gemm else "0"))
    monkeypatch.setenv("DRAMA_GPU_WAIT_SPIN", "1" if spin_gpu_wait else "0")
    cfg = _preset(preset)
    sessions, prompt, steps = 8, 37, 12
    graphed, eager = _pair(cfg, sessions, prompt + 2 * steps + 1)
    assert graphed._graphs.spin_gpu_wait == spin_gpu_wait
    d, n = cfg.tower.hidden_size, cfg.num_codebooks
    g = torch.Generator().manual_seed(11)
    none = torch.full((prompt, n), -1, dtype=torch.int64)
    for i in range(sessions):
        hidden = torch.randn(prompt, d, generator=g)
        for engine in (graphed, eager):
            result = engine.step([StepEntry(f"s{i}", 0, prompt, draw=True, seed=100 + i, **_params(i))], hidden, none)
            assert not result.row_errors

    def decode(engine, ids, row, frame, hidden):
        entries = [StepEntry(f"s{i}", row, 1, draw=True, seed=100 + i, frame_index=frame, take_index=i % 2,
                             **_params(i)) for i in ids]
        result = engine.step(entries, hidden, torch.full((len(ids), n), -1, dtype=torch.int64))
        assert not result.row_errors
        return result

    replays = graphed._graphs.replays
    drawn = 0
    for step in range(steps):                                       # all 8 rows: bucket 8
        hidden = torch.randn(sessions, d, generator=g)
        a = decode(graphed, range(sessions), prompt + step, step + 1, hidden)
        b = decode(eager, range(sessions), prompt + step, step + 1, hidden)
        assert torch.equal(a.codes, b.codes) and a.stop == b.stop, (step, a.codes, b.codes)
        drawn += int((a.codes >= 0).sum())
    for step in range(steps, 2 * steps):                            # 5 rows padded to bucket 8
        hidden = torch.randn(sessions, d, generator=g)
        a = decode(graphed, range(5), prompt + step, step + 1, hidden[:5])
        b = decode(eager, range(sessions), prompt + step, step + 1, hidden)
        assert torch.equal(a.codes, b.codes[:5]) and a.stop == b.stop[:5], (step, a.codes, b.codes[:5])
    assert graphed._graphs.replays == replays + 2 * steps
    assert drawn > 0
    # The graphs never touched a real session's RAS window beyond what the eager engine did.
    assert torch.equal(graphed._ras_history[:5], eager._ras_history[:5])


@cuda
def test_graphs_off_by_env(monkeypatch):
    cfg = _preset("tiny")
    monkeypatch.setenv("DRAMA_TOWER_GRAPHS", "0")
    engine = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16), cfg, max_sessions=2,
                         max_context=16)
    engine.warm_up()
    assert not engine.graphs_captured
    monkeypatch.setenv("DRAMA_TOWER_GRAPHS", "1")
    engine = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16), cfg, max_sessions=2,
                         max_context=16)
    engine.warm_up()
    assert engine.graphs_captured and engine.open_sessions == 0


def _served_codes(cfg: DramaConfig, graphs: bool, fused_draws: bool | None = None) -> list:
    """Codes and stops of 8 sessions through a 37-row prompt step each and 16 decode steps
    (row-varied sampling: greedy, RAS-prone, penalised, top-k, plain), one engine."""
    sessions, prompt, steps = 8, 37, 16
    d, n = cfg.tower.hidden_size, cfg.num_codebooks
    engine = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16, seed=7), cfg,
                         max_sessions=sessions, max_context=prompt + steps + 1, graphs=graphs)
    if fused_draws is not None:
        engine._fused_draws = fused_draws
    engine.warm_up()
    g = torch.Generator().manual_seed(12)
    codes = []
    for i in range(sessions):
        result = engine.step([StepEntry(f"s{i}", 0, prompt, draw=True, seed=100 + i, **_params(i))],
                             torch.randn(prompt, d, generator=g), torch.full((prompt, n), -1, dtype=torch.int64))
        codes.append((result.codes.clone(), tuple(result.stop)))
    for step in range(steps):
        entries = [StepEntry(f"s{i}", prompt + step, 1, draw=True, seed=100 + i, frame_index=step + 1,
                             **_params(i)) for i in range(sessions)]
        result = engine.step(entries, torch.randn(sessions, d, generator=g),
                             torch.full((sessions, n), -1, dtype=torch.int64))
        assert not result.row_errors
        codes.append((result.codes.clone(), tuple(result.stop)))
    return codes


@cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_programmatic_dependent_launch_changes_no_code(graphs, monkeypatch):
    """The tower's Triton kernels launched with PDL (DRAMA_TOWER_PDL: they start while the kernel
    before drains and wait in pdl_prologue) draw the same codes and stops as without, prompt and
    decode steps, graphed and eager: a kernel reading before its predecessor finished would show
    as other logits, and at these temperatures as other codes."""
    from services.backbone import kernels as backbone_kernels

    out, used = {}, {}
    for pdl in (True, False):
        monkeypatch.setattr(backbone_kernels, "PDL", pdl)
        monkeypatch.setattr(kernels, "TOWER_PDL", pdl)
        used[pdl] = bool(kernels._pdl_args())
        out[pdl] = _served_codes(_preset("full"), graphs)
    print(f"PDL used: {used[True]} (a GPU of compute capability 9 or more)")
    assert not used[False]
    for (a, sa), (b, sb) in zip(out[True], out[False]):
        assert torch.equal(a, b) and sa == sb


@cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_fused_frame_draws_change_no_code(graphs):
    """kernels.FusedFrameDraws (a draw and its bookkeeping in one launch: the RAS switch, the
    repetition penalty, EOS, the code writes, the RAS windows) draws what the torch bookkeeping
    around kernels.draw draws, over prompts and 16 frames of RAS-prone and penalised rows."""
    cfg = _preset("full")
    fused, unfused = _served_codes(cfg, graphs, fused_draws=True), _served_codes(cfg, graphs, fused_draws=False)
    for (a, sa), (b, sb) in zip(fused, unfused):
        assert torch.equal(a, b) and sa == sb

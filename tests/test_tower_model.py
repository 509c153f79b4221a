"""The tower model and engine (MODEL.md §5, API.md §3.5) on the tiny geometry, CPU float32.

Random weights (services.tower.weights.random_tower) on the tiny config, so these tests need no
checkpoint; the loader is tested against the tiny checkpoint at the end.
"""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest
import torch

from services.common.config import DramaConfig
from services.tower import sampling
from services.tower.engine import StepEntry, TowerEngine
from services.tower.model import RowBatch, forward_rows
from services.tower.naive import naive_timeline
from services.tower.weights import random_tower


def _tiny_dict() -> dict:
    return json.loads(resources.files("services.common").joinpath("presets/tiny.json").read_text())


def _micro_dict() -> dict:
    """MODEL.md §10.2's micro variant: 3 codebooks, so nothing may hard-code 10."""
    raw = _tiny_dict()
    raw["num_codebooks"] = 3
    raw["audio_decoder_config"]["num_residual_layers"] = 2
    raw["codec_config"]["quantizer"]["n_codebooks"] = 2
    return raw


TINY = DramaConfig.from_dict(_tiny_dict())
MICRO = DramaConfig.from_dict(_micro_dict())
N_TINY = TINY.num_codebooks


def _prompt(cfg: DramaConfig, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random hidden rows and targets: rows 3..rows-3 are teacher-forced audio, the rest none."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, cfg.tower.hidden_size, generator=g)
    targets = torch.full((rows, cfg.num_codebooks), -1, dtype=torch.int64)
    for t in range(3, rows - 2):
        targets[t, 0] = torch.randint(0, cfg.semantic_codebook_size, (), generator=g)
        targets[t, 1:] = torch.randint(0, cfg.residual_codebook_size, (cfg.num_codebooks - 1,), generator=g)
    return hidden, targets


def _layer_caches(engine: TowerEngine, slot: int, rows: int) -> list[torch.Tensor]:
    return [torch.stack([layer.self_attn.k_cache[slot, :, :rows], layer.self_attn.v_cache[slot, :, :rows]])
            for layer in engine.model.layers()]


# ------------------------------------------------------------------------------------------
# model against the from-scratch reference
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, MICRO], ids=["tiny", "micro"])
def test_frame_steps_equal_from_scratch_timeline(cfg):
    """Prefill + per-frame steps (with draws, and one EOS mid-way that the timeline continues
    past) give the logits of a cache-free float64 recomputation of the whole timeline."""
    model = random_tower(cfg, seed=1)
    model.setup_caches(2, 64)
    prompt_rows, frames = 9, 6
    hidden, targets = _prompt(cfg, prompt_rows + frames)
    targets = targets[:prompt_rows]
    targets[-1] = -1                                          # the prompt's last row draws
    recorded: list[tuple[int, int, torch.Tensor, int]] = []   # (row, draw index, logits, code)
    eos_row = prompt_rows + 2
    slot = 1

    def sampler_for(row):
        def sample(draw_index, logits):
            keys = sampling.noise_key(11, 0, row, draw_index).expand(logits.shape[0])
            code = sampling.draw(logits, temperature=0.9, top_p=0.95, top_k=0, keys=keys)
            if draw_index == 0 and row == eos_row:
                code = torch.full_like(code, cfg.semantic_codebook_size)
            recorded.append((row, draw_index, logits[0].clone(), int(code[0])))
            return code
        return sample

    timeline = torch.full((prompt_rows + frames, cfg.num_codebooks), -1, dtype=torch.int64)
    timeline[:prompt_rows - 1] = targets[:prompt_rows - 1]
    with torch.inference_mode():
        forward_rows(model, hidden[:prompt_rows - 1], targets[:-1],
                     RowBatch.from_segments([(slot, 0, prompt_rows - 1)]))
        for row in range(prompt_rows - 1, prompt_rows + frames):
            codes, stopped = forward_rows(model, hidden[row:row + 1], torch.full_like(timeline[:1], -1),
                                          RowBatch.from_segments([(slot, row, 1)]),
                                          torch.tensor([0]), sampler_for(row))
            assert bool(stopped[0]) == (row == eos_row)
            timeline[row] = codes[0]
        reference = naive_timeline(model, hidden, timeline)

    assert timeline[eos_row].eq(-1).all()
    for row, draw_index, logits, code in recorded:
        expected = (reference["semantic_logits"][row] if draw_index == 0
                    else reference["codebook_logits"][draw_index - 1][row])
        error = (logits.double() - expected).abs().max().item()
        assert error < 1e-4 * max(1.0, expected.abs().max().item()), (row, draw_index, error)
        if not (draw_index == 0 and row == eos_row):
            keys = sampling.noise_key(11, 0, row, draw_index)[None]
            again = sampling.draw(expected[None].float(), temperature=0.9, top_p=0.95, top_k=0, keys=keys)
            assert int(again) == code, (row, draw_index)
    assert len(recorded) == (frames + 1) * cfg.num_codebooks


def test_fast_path_matches_the_batch_invariant_path():
    """GEMMs + SDPA (the GPU path, here on CPU) give the reference path's logits within float32
    tolerance, for a call mixing a multi-row prefill segment with single-row decode segments."""
    logits = {}
    for batch_invariant in (True, False):
        model = random_tower(TINY, seed=4, batch_invariant=batch_invariant)
        model.setup_caches(3, 32)
        hidden, targets = _prompt(TINY, 20, seed=4)
        recorded = []

        def sample(draw_index, row_logits):
            recorded.append(row_logits)
            keys = sampling.noise_key(1, 0, 0, draw_index).expand(row_logits.shape[0])
            return sampling.draw(row_logits, temperature=1.0, top_p=0.9, top_k=0, keys=keys)

        with torch.inference_mode():
            forward_rows(model, hidden[:6], targets[:6], RowBatch.from_segments([(0, 0, 3), (2, 0, 3)]))
            step_targets = targets[6:12].clone()
            step_targets[[0, 1, 5]] = -1
            forward_rows(model, hidden[6:12], step_targets,
                         RowBatch.from_segments([(0, 3, 1), (1, 0, 4), (2, 3, 1)]),
                         torch.tensor([0, 1, 5]), sample)
        logits[batch_invariant] = recorded
    for reference, fast in zip(logits[True], logits[False]):
        assert torch.allclose(fast, reference, rtol=1e-4, atol=1e-4), (fast - reference).abs().max()


def test_rope_rows_come_from_the_position_tables():
    """setup_caches makes cos/sin of every cache position once per RoPE setting, shared by the
    layers; a step's rows from the tables equal the ones computed at its positions, bit for bit."""
    from services.tower.model import rotary_tables

    model = random_tower(TINY, seed=1)
    model.setup_caches(2, 300)
    attn = [layer.self_attn for layer in model.layers()]
    assert all(a.rope_table is attn[0].rope_table for a in attn)
    assert attn[0].rope_table[0].shape == (300, attn[0].rotary_dim // 2)
    rows = RowBatch.from_segments([(0, 0, 5), (1, 297, 3)])
    assert rows.positions.tolist() == [0, 1, 2, 3, 4, 297, 298, 299]
    got = rows.rotary(attn[0].rotary_dim, attn[0].rope_theta, attn[0].rope_table)
    want = rotary_tables(rows.positions, attn[0].rotary_dim, attn[0].rope_theta)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bench_smoke_on_cpu():
    """bench/tower.py runs at the tiny geometry on CPU (the GPU numbers come from the lead)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "tower.py"
    spec = importlib.util.spec_from_file_location("bench_tower", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from services.tower import model

    switch = model.TOWER_DECODE_GEMM
    results = bench.main(["--preset", "tiny", "--device", "cpu", "--batch", "1", "3", "--context", "5",
                          "--steps", "2", "--warmup", "1", "--decode-gemm", "off", "on"])
    assert [(r["mode"], r["batch"]) for r in results] == [("eager", 1), ("eager", 3), ("eager+dg", 1), ("eager+dg", 3)]
    assert all(r["median_ms"] > 0 for r in results)
    assert model.TOWER_DECODE_GEMM == switch                   # the bench leaves the switch as it was
    results = bench.main(["--preset", "tiny", "--device", "cpu", "--batch", "1", "--context", "5", "--steps", "1",
                          "--warmup", "1", "--decode-gemm", "on", "--fused-draws", "off", "on"])
    assert [r["mode"] for r in results] == ["eager+dg-fd", "eager+dg+fd"]
    from services.backbone.kernels import decode_gemm
    tuned, last_reduces = decode_gemm.TUNED, decode_gemm.LAST_REDUCES
    results = bench.main(["--preset", "tiny", "--device", "cpu", "--batch", "1", "--context", "5", "--steps", "1",
                          "--warmup", "1", "--settings", "session20", "last-reduces", "tuned", "--throwaway"])
    assert [r["mode"] for r in results] == ["eager+dg+session20", "eager+dg+last-reduces", "eager+dg+tuned"]
    assert decode_gemm.TUNED is tuned and decode_gemm.LAST_REDUCES == last_reduces       # restored


# ------------------------------------------------------------------------------------------
# engine: invariances
# ------------------------------------------------------------------------------------------

def _engine(cfg=TINY, sessions: int = 4, context: int = 64, seed: int = 3) -> TowerEngine:
    return TowerEngine(random_tower(cfg, seed=seed), cfg, max_sessions=sessions, max_context=context)


def _entry(session_id, first_row, n_rows, draw=False, frame_index=0, **kw):
    params = dict(seed=42, take_index=0, temperature=0.8, top_p=0.9, top_k=0)
    return StepEntry(session_id, first_row, n_rows, draw=draw, frame_index=frame_index, **{**params, **kw})


def _run_session(engine, hidden, targets, pieces, frames, companions=0, session="a"):
    """Prefill in `pieces`, drawing on the last; then `frames` frame steps. Companion sessions
    share every step when `companions` > 0: each starts with a prefill of its own (3 + c rows,
    drawing), then draws a frame per step, so the session's rows are batched with other
    sessions' prefill and decode rows, in slots other than its own. Returns the frames."""
    prompt_rows = len(targets)
    steps = [(start, size) for start, size in zip([sum(pieces[:i]) for i in range(len(pieces))], pieces)]
    steps += [(prompt_rows + f, 1) for f in range(frames)]
    companion_rows: dict[str, int] = {}
    out = []
    for start, size in steps:
        draws = start + size >= prompt_rows
        tgt = targets[start:start + size].clone() if start < prompt_rows else torch.full((1, N_TINY), -1)
        if draws:
            tgt[-1] = -1
        entries = [_entry(session, start, size, draw=draws, frame_index=max(0, start + size - prompt_rows))]
        hid, tgts = [hidden[start:start + size]], [tgt]
        for c in range(companions):
            name = f"companion{c}"
            held = companion_rows.get(name, 0)
            n = 3 + c if held == 0 else 1
            entries.append(_entry(name, held, n, draw=True, seed=c, frame_index=held))
            g = torch.Generator().manual_seed(100 * c + held)
            hid.append(torch.randn(n, hidden.shape[1], generator=g))
            tgts.append(torch.full((n, N_TINY), -1, dtype=torch.int64))
            companion_rows[name] = held + n
        # The session of interest sits in the middle of the batch (second of the entries).
        order = list(range(len(entries)))
        if companions:
            order = order[1:2] + order[:1] + order[2:]
        result = engine.step([entries[i] for i in order], torch.cat([hid[i] for i in order]),
                             torch.cat([tgts[i] for i in order]))
        assert not result.row_errors, result.row_errors
        if draws:
            position = order.index(0)
            out.append("stop" if result.stop[position] else result.codes[position].tolist())
    return out


def test_prefill_split_invariance():
    """Any split of the prompt into pieces gives bit-identical caches and the same frames."""
    hidden, targets = _prompt(TINY, 30)
    prompt = targets[:24]
    results = []
    for pieces in ([24], [10, 14], [1, 7, 15, 1], [23, 1]):
        engine = _engine()
        frames = _run_session(engine, hidden, prompt, pieces, frames=4)
        results.append((frames, _layer_caches(engine, 0, 24 + 4)))
    for frames, caches in results[1:]:
        assert frames == results[0][0]
        for layer, (got, want) in enumerate(zip(caches, results[0][1])):
            assert torch.equal(got, want), f"layer {layer} cache differs"


def test_batch_invariance():
    """A session's frames and caches are identical alone and batched with other sessions."""
    hidden, targets = _prompt(TINY, 30, seed=5)
    prompt = targets[:20]
    alone = _engine()
    frames_alone = _run_session(alone, hidden, prompt, [20], frames=5)
    together = _engine()
    frames_together = _run_session(together, hidden, prompt, [8, 12], frames=5, companions=3)
    assert frames_alone == frames_together
    slot_together = together._sessions[(None, "a")].slot
    assert slot_together != 0
    for got, want in zip(_layer_caches(together, slot_together, 25), _layer_caches(alone, 0, 25)):
        assert torch.equal(got, want)


def test_same_seed_same_frames_different_seed_differs():
    hidden, targets = _prompt(TINY, 20, seed=2)
    first = _run_session(_engine(), hidden, targets[:12], [12], frames=3)
    assert _run_session(_engine(), hidden, targets[:12], [12], frames=3) == first
    other = _engine()
    other_frames = []
    result = other.step([_entry("a", 0, 12, draw=True, seed=43)], hidden[:12],
                        torch.cat([targets[:11], torch.full((1, 10), -1)]))
    other_frames.append(result.codes[0].tolist())
    assert other_frames[0] != first[0]


# ------------------------------------------------------------------------------------------
# engine: sessions, errors, pool
# ------------------------------------------------------------------------------------------

def _no_targets(rows, cfg=TINY):
    return torch.full((rows, cfg.num_codebooks), -1, dtype=torch.int64)


def test_unknown_session_is_a_row_error_and_others_go_on():
    engine = _engine()
    hidden = torch.randn(5, 64)
    result = engine.step([_entry("ghost", 4, 2), _entry("b", 0, 3, draw=True)], hidden, _no_targets(5))
    assert [(e.row_index, e.code) for e in result.row_errors] == [(0, "NOT_FOUND")]
    assert result.codes[0].eq(-1).all()
    assert result.stop[1] or result.codes[1].ge(0).all()
    assert engine.rows_held("b") == 3 and engine.rows_held("ghost") is None


def test_first_row_mismatch_is_invalid_argument_and_leaves_the_session():
    engine = _engine()
    engine.step([_entry("a", 0, 4)], torch.randn(4, 64), _no_targets(4))
    result = engine.step([_entry("a", 3, 1, draw=True)], torch.randn(1, 64), _no_targets(1))
    assert [(e.row_index, e.code) for e in result.row_errors] == [(0, "INVALID_ARGUMENT")]
    assert engine.rows_held("a") == 4
    result = engine.step([_entry("a", 4, 1, draw=True)], torch.randn(1, 64), _no_targets(1))
    assert not result.row_errors and engine.rows_held("a") == 5


@pytest.mark.parametrize("problem", ["draw_target", "mixed_target", "code_range", "duplicate",
                                     "context", "penalty", "zero_rows"])
def test_malformed_entries_are_invalid(problem):
    engine = _engine(context=16)
    entries = [_entry("a", 0, 3, draw=True)]
    targets = _no_targets(3)
    if problem == "draw_target":
        targets[2] = 0
    elif problem == "mixed_target":
        targets[0, 0] = 1
    elif problem == "code_range":
        targets[0] = 0
        targets[0, 1] = TINY.residual_codebook_size
    elif problem == "duplicate":
        entries = [_entry("a", 0, 1), _entry("a", 1, 2, draw=True)]
    elif problem == "context":
        engine.step([_entry("c", 0, 1)], torch.randn(1, 64), _no_targets(1))
        entries = [_entry("c", 1, 16)]
        targets = _no_targets(16)
    elif problem == "penalty":
        entries = [_entry("a", 0, 3, draw=True, repetition_penalty=-1.0)]
    elif problem == "zero_rows":
        entries = [_entry("a", 0, 0, draw=True), _entry("b", 0, 3)]
    result = engine.step(entries, torch.randn(len(targets), 64), targets)
    codes = {e.code for e in result.row_errors}
    assert codes == ({"OUT_OF_RANGE"} if problem == "context" else {"INVALID_ARGUMENT"}), result.row_errors


@pytest.mark.parametrize("problem", ["draw_target", "mixed_target", "code_range"])
def test_a_bad_target_fails_only_the_entry_holding_it(problem):
    """The step's target checks run once over all rows: each flag lands on its own entry."""
    engine = _engine(context=16)
    entries = [_entry("a", 0, 3), _entry("b", 0, 2, draw=True), _entry("c", 0, 2, draw=True)]
    targets = _no_targets(7)
    row = {"draw_target": 4, "mixed_target": 3, "code_range": 3}[problem]      # b's rows are 3 and 4
    if problem == "code_range":
        targets[row] = 0
        targets[row, 1] = TINY.residual_codebook_size
    elif problem == "draw_target":
        targets[row] = 0                       # a whole valid frame, on b's draw row
    else:
        targets[row, 0] = 1
    result = engine.step(entries, torch.randn(7, 64), targets)
    assert [(e.row_index, e.code) for e in result.row_errors] == [(1, "INVALID_ARGUMENT")]
    assert result.codes[2].min() >= 0 and result.codes[1].tolist() == [-1] * TINY.num_codebooks


def test_mismatched_payload_fails_every_entry():
    engine = _engine()
    result = engine.step([_entry("a", 0, 3), _entry("b", 0, 2)], torch.randn(4, 64), _no_targets(4))
    assert [e.row_index for e in result.row_errors] == [0, 1]
    assert engine.open_sessions == 0


def test_pool_full_then_release_frees_slots():
    engine = _engine(sessions=2)
    hidden = torch.randn(3, 64)
    result = engine.step([_entry(s, 0, 1) for s in "abc"], hidden, _no_targets(3))
    assert [(e.row_index, e.code) for e in result.row_errors] == [(2, "RESOURCE_EXHAUSTED")]
    assert engine.free_slots == 0 and engine.open_sessions == 2
    # Release is applied before rows: "c" gets "a"'s slot in the same message.
    result = engine.step([_entry("c", 0, 1)], hidden[:1], _no_targets(1), release=["a", "zzz"])
    assert not result.row_errors and engine.open_sessions == 2
    engine.release(["b", "c"])
    assert engine.free_slots == 2 and engine.open_sessions == 0


def test_owners_are_separate_and_closing_one_frees_its_sessions():
    engine = _engine()
    engine.step([_entry("a", 0, 2)], torch.randn(2, 64), _no_targets(2), owner="stream1")
    engine.step([_entry("a", 0, 3)], torch.randn(3, 64), _no_targets(3), owner="stream2")
    assert engine.rows_held("a", "stream1") == 2 and engine.rows_held("a", "stream2") == 3
    engine.release_owner("stream1")
    assert engine.rows_held("a", "stream1") is None and engine.open_sessions == 1


def test_first_row_zero_restarts_the_timeline():
    engine = _engine()
    engine.step([_entry("a", 0, 5)], torch.randn(5, 64), _no_targets(5))
    result = engine.step([_entry("a", 0, 2)], torch.randn(2, 64), _no_targets(2))
    assert not result.row_errors and engine.rows_held("a") == 2 and engine.free_slots == 3


def test_warm_up_leaves_the_pool_empty():
    engine = _engine()
    engine.warm_up()
    assert engine.open_sessions == 0 and engine.free_slots == 4


# ------------------------------------------------------------------------------------------
# engine: RAS and the repetition penalty
# ------------------------------------------------------------------------------------------

def _biased_engine(code: int, margin: float) -> TowerEngine:
    """A tower whose semantic logits for hidden rows e_0 are `margin` at `code`, 1 at the other
    semantic codes and 0 at EOS (unless `code` is EOS)."""
    engine = _engine()
    with torch.no_grad():
        head = engine.model.semantic_head.weight
        head.zero_()
        head[:TINY.semantic_codebook_size, 0] = 1.0
        head[code, 0] = margin
    return engine


def _semantic_codes(engine, frames, **params):
    hidden = torch.zeros(1, 64)
    hidden[0, 0] = 1.0
    codes = []
    for f in range(frames):
        result = engine.step([_entry("a", f, 1, draw=True, frame_index=f, **params)], hidden, _no_targets(1))
        codes.append(-1 if result.stop[0] else int(result.codes[0, 0]))
    return codes


def test_ras_switches_a_greedy_loop_to_ras_parameters():
    """Greedy picks code 7 every frame until the last 4 codes repeat; from then on RAS
    (temperature 1.5, top-p 0.95, top-k 30) samples, which leaves code 7 most of the time."""
    codes = _semantic_codes(_biased_engine(7, 3.0), 12, temperature=0.0)
    assert codes[:2] == [7, 7]
    assert sum(c != 7 for c in codes[2:]) >= 5, codes


def test_repetition_penalty_steers_greedy_away_from_recent_codes():
    codes = _semantic_codes(_biased_engine(7, 3.0), 2, temperature=0.0, repetition_penalty=100.0)
    assert codes[0] == 7 and codes[1] != 7


def test_eos_stops_and_does_not_enter_ras_history():
    engine = _biased_engine(TINY.semantic_codebook_size, 50.0)     # EOS dominates
    codes = _semantic_codes(engine, 3, temperature=0.0)
    assert codes == [-1, -1, -1]
    assert engine._ras_history.eq(-1).all()


# ------------------------------------------------------------------------------------------
# loading the tiny checkpoint
# ------------------------------------------------------------------------------------------

def test_loads_tiny_checkpoint_with_semantic_rows_of_the_lm_head(tiny_checkpoint, tiny_config):
    from services.common.checkpoint import open_safetensors
    from services.tower.weights import load_tower

    model = load_tower(tiny_checkpoint)
    cfg = tiny_config
    lm_head = open_safetensors(tiny_checkpoint).get("lm_head.weight").float()
    expected = torch.cat([lm_head[cfg.semantic_start_token_id:cfg.semantic_end_token_id + 1],
                          lm_head[cfg.im_end_token_id:cfg.im_end_token_id + 1]])
    assert torch.equal(model.semantic_head.weight, expected)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    engine = TowerEngine(model, cfg, max_sessions=2, max_context=16)
    result = engine.step([_entry("a", 0, 4, draw=True)], torch.randn(4, cfg.tower.hidden_size), _no_targets(4, cfg))
    assert not result.row_errors


def _rewrite_single_file(src, dst, *, add=None, drop=()):
    """Copy a checkpoint into one model.safetensors with tensors added or dropped."""
    import shutil

    from safetensors.torch import save_file

    from services.common.checkpoint import open_safetensors

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    ckpt = open_safetensors(src)
    tensors = {name: ckpt.get(name).clone() for name in ckpt.names() if name not in drop}
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_semantic_head_tensor_wins(tiny_checkpoint, tiny_config, tmp_path):
    from services.tower.weights import load_tower

    head = torch.randn(tiny_config.semantic_codebook_size + 1, 64).to(torch.bfloat16)
    ckpt = _rewrite_single_file(tiny_checkpoint, tmp_path / "ckpt", add={"audio_decoder.semantic_head.weight": head})
    assert torch.equal(load_tower(ckpt).semantic_head.weight, head.float())


def test_loader_lists_every_problem(tiny_checkpoint, tmp_path):
    from services.common.checkpoint import WeightError
    from services.tower.weights import load_tower

    ckpt = _rewrite_single_file(
        tiny_checkpoint, tmp_path / "ckpt", drop={"audio_decoder.residual_layers.3.fc.weight"},
        add={"audio_decoder.bogus.weight": torch.zeros(2), "audio_decoder.shared_layers.0.mlp.up_proj.weight":
             torch.zeros(3, 64, dtype=torch.bfloat16)})
    with pytest.raises(WeightError) as info:
        load_tower(ckpt)
    message = str(info.value)
    for name in ("residual_layers.3.fc.weight", "audio_decoder.bogus.weight", "shared_layers.0.mlp.up_proj.weight"):
        assert name in message


def test_fp8_head_rows_are_dequantised_with_their_block_scales(tiny_checkpoint, tiny_config, tmp_path):
    """§2.5 rule 4 allows an FP8 LM head; the tower's rows of it equal the dequantised rows."""
    from services.common.checkpoint import open_safetensors
    from services.common.fp8 import dequantize_block_fp8, quantize_block_fp8
    from services.tower.weights import load_tower

    # Small blocks (rewritten into config.json) so the rows span several row and column blocks.
    block = (32, 16)
    lm_head = open_safetensors(tiny_checkpoint).get("lm_head.weight").float()
    weight_fp8, scale_inv = quantize_block_fp8(lm_head, block)
    ckpt = _rewrite_single_file(tiny_checkpoint, tmp_path / "ckpt",
                                add={"lm_head.weight": weight_fp8, "lm_head.weight_scale_inv": scale_inv})
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = list(block)
    (ckpt / "config.json").write_text(json.dumps(raw))
    cfg = tiny_config
    full = dequantize_block_fp8(weight_fp8, scale_inv, block)
    expected = torch.cat([full[cfg.semantic_start_token_id:cfg.semantic_end_token_id + 1],
                          full[cfg.im_end_token_id:cfg.im_end_token_id + 1]])
    assert torch.equal(load_tower(ckpt).semantic_head.weight, expected)


# ------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bfloat16_engine_tracks_the_cpu_reference():
    """The GPU path (bf16 weights and caches, GEMMs, SDPA, device sampler) gives the CPU float32
    reference's teacher-forced logits within bf16 tolerance, and its engine steps run."""
    cpu = random_tower(TINY, seed=6)
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    for module in gpu.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = False
    hidden, targets = _prompt(TINY, 24, seed=6)
    outputs = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        model.setup_caches(2, 32)
        recorded = []

        def sample(draw_index, logits):
            recorded.append(logits.float().cpu())
            return torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)

        with torch.inference_mode():
            forward_rows(model, hidden[:20].to(device, model.codebook_embeddings.weight.dtype),
                         targets[:20].to(device), RowBatch.from_segments([(1, 0, 20)], device),
                         torch.tensor([19], device=device), sample)
        outputs.append(recorded)
    for reference, fast in zip(*outputs):
        scale = reference.abs().max().item()
        assert (fast - reference).abs().max().item() < 0.05 * scale
    engine = TowerEngine(gpu, TINY, max_sessions=4, max_context=32)
    result = engine.step([_entry(s, 0, 5, draw=True) for s in "abc"], torch.randn(15, 64), _no_targets(15))
    assert not result.row_errors and result.codes.shape == (3, N_TINY)


def test_decode_gemm_kinds_parse_and_reject_typos():
    """DRAMA_TOWER_DECODE_GEMM: 0 / 1 / a list of projection kinds; a typo is an error naming the kinds."""
    from services.tower import model

    assert model.decode_gemm_kinds(None) == model.decode_gemm_kinds("0") == frozenset()
    assert model.decode_gemm_kinds("1") == frozenset(model.PROJECTIONS)
    assert model.decode_gemm_kinds(" o_proj, fc ") == {"o_proj", "fc"}
    with pytest.raises(ValueError, match="qkv, o_proj"):
        model.decode_gemm_kinds("o_proj,fcc")


def test_frame_steps_alone_take_the_decode_gemm(monkeypatch):
    """tower_linear hears `decode` for every projection of a frame step (each entry one drawing row)
    and never in a prompt step, whatever TOWER_DECODE_GEMM holds: prompt steps keep cuBLAS's
    128-row pieces. Run on the GPU path's layers (batch_invariant=False), on the CPU."""
    from services.tower import model as tower_model

    calls = []
    real = tower_model.tower_linear

    def recording(x, weight, residual=None, *, kind, decode=False):
        calls.append((kind, decode))
        return real(x, weight, residual, kind=kind, decode=decode)

    monkeypatch.setattr(tower_model, "tower_linear", recording)
    engine = TowerEngine(random_tower(TINY, seed=3, batch_invariant=False), TINY, max_sessions=2, max_context=32)
    d, n = TINY.tower.hidden_size, TINY.num_codebooks
    g = torch.Generator().manual_seed(0)
    prompt = engine.step([_entry("a", 0, 6, draw=True), _entry("b", 0, 4, draw=True)], torch.randn(10, d, generator=g),
                         torch.full((10, n), -1, dtype=torch.int64))
    assert not prompt.row_errors
    kinds = {"qkv", "o_proj", "gate_up", "down", "fc", "head"}
    assert {kind for kind, _ in calls} == kinds and not any(decode for _, decode in calls), calls
    calls.clear()
    frame = engine.step([_entry("a", 6, 1, draw=True, frame_index=1), _entry("b", 4, 1, draw=True, frame_index=1)],
                        torch.randn(2, d, generator=g), torch.full((2, n), -1, dtype=torch.int64))
    assert not frame.row_errors
    assert {kind for kind, _ in calls} == kinds and all(decode for _, decode in calls), calls

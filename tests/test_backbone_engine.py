"""BackboneEngine invariants on the tiny checkpoint (issue #4), CPU float32.

Bit-identity is the point of these tests: a session's hidden rows must not depend on how its
prompt was cut into steps, on which other sessions shared the steps, or on which slot it got.
"""

from __future__ import annotations

import pytest
import torch

from services.backbone.engine import BackboneEngine, CapacityError, ContextFullError
from services.backbone.weights import load_backbone

ROWS = 300


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_backbone(tiny_checkpoint, lm_head=True)


@pytest.fixture()
def engine(model):
    return BackboneEngine(model, max_sessions=4, max_context=512)


def make_prompt(model, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mix of text rows and runs of audio rows: token_ids [rows], frames [rows, N] (−1 for text)."""
    spec = model.audio
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.semantic_start_token_id, (rows,), generator=gen)
    frames = torch.full((rows, spec.num_codebooks), -1, dtype=torch.int64)
    audio = (torch.arange(rows) // 9) % 3 != 0          # runs of 18 audio rows after 9 text rows
    codes = torch.randint(0, spec.residual_codebook_size, (rows, spec.num_codebooks), generator=gen)
    codes[:, 0] = torch.randint(0, spec.semantic_codebook_size, (rows,), generator=gen)
    frames[audio] = codes[audio]
    tokens[audio] = spec.semantic_start_token_id + codes[audio, 0]
    return tokens, frames


def pieces(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


def run_session(engine, tokens, frames, sizes) -> torch.Tensor:
    slot = engine.open()
    out, start = [], 0
    for n in sizes:
        (hidden,) = engine.step([(slot, tokens[start:start + n], frames[start:start + n])])
        assert hidden.shape == (n, engine.hidden_size) and hidden.dtype == engine.hidden_dtype
        out.append(hidden)
        start += n
    engine.release(slot)
    return torch.cat(out)


def test_prompt_split_gives_bit_identical_rows(model, engine):
    """300 text+audio rows appended in pieces of 1, 7, 64, 128, irregular, or all at once."""
    tokens, frames = make_prompt(model, ROWS, seed=0)
    reference = run_session(engine, tokens, frames, [ROWS])
    splits = {size: pieces(ROWS, size) for size in (1, 7, 64, 128)}
    splits["irregular"] = [5, 60, 1, 70, 2, 63, 64, 35]
    for name, sizes in splits.items():
        assert sum(sizes) == ROWS
        got = run_session(engine, tokens, frames, sizes)
        assert torch.equal(got, reference), f"split {name}: max diff {float((got - reference).abs().max()):.3e}"


def test_prompt_split_bit_identical_with_two_threads(model, engine):
    """The same property with two intra-op threads (the CI default), on a shorter prompt."""
    tokens, frames = make_prompt(model, 80, seed=9)
    torch.set_num_threads(2)
    try:
        reference = run_session(engine, tokens, frames, [80])
        for sizes in (pieces(80, 7), [30, 1, 33, 16]):
            assert torch.equal(run_session(engine, tokens, frames, sizes), reference), sizes
    finally:
        torch.set_num_threads(1)


def test_decode_row_equals_prefill_row(model, engine):
    """The row after a 130-row prefill, appended alone, equals row 130 of a 131-row prefill."""
    tokens, frames = make_prompt(model, 131, seed=1)
    full = run_session(engine, tokens, frames, [131])
    decoded = run_session(engine, tokens, frames, [130, 1])
    assert torch.equal(decoded[130], full[130])


def test_step_to_host_equals_step(model, engine):
    """step_to_host (what the scheduler calls) gives the rows `step` gives, in one host tensor,
    for a step of two entries (a prompt beside a decode row), and the sessions advance alike."""
    tokens, frames = make_prompt(model, 12, seed=4)
    other = BackboneEngine(model, max_sessions=4, max_context=512)
    got = []
    for eng in (engine, other):
        a, b = eng.open(), eng.open()
        eng.step([(b, tokens[:3], frames[:3])])
        work = [(a, tokens[3:10], frames[3:10]), (b, tokens[10:11], frames[10:11])]
        got.append(torch.cat(eng.step(work)) if eng is engine else eng.step_to_host(work))
        assert (eng.length(a), eng.length(b)) == (7, 4)
    assert got[1].device.type == "cpu" and torch.equal(got[0], got[1])
    assert other.step_to_host([]).shape == (0, model.config.hidden_size)


def test_a_launched_step_holds_its_slots_until_finish(model, engine):
    """launch_to_host + finish (the scheduler's inline path: host work between the two) give
    step_to_host's rows; between them the step's slots are busy (another step on one of them is
    refused, and `open` does not hand out a slot released meanwhile), and a session's length
    counts the rows only once finished. A launch that fails leaves no slot busy."""
    tokens, frames = make_prompt(model, 12, seed=5)
    other = BackboneEngine(model, max_sessions=2, max_context=512)
    a = engine.open()
    expected = engine.step_to_host([(a, tokens[:9], frames[:9])])
    b, c = other.open(), other.open()
    pending = other.launch_to_host([(b, tokens[:9], frames[:9])])
    assert other.length(b) == 0
    with pytest.raises(ValueError, match="another step"):
        other.launch_to_host([(b, tokens[9:10], frames[9:10])])
    other.release(b)
    other.release(c)
    assert other.free_slots == 1                      # b is busy until its step ends
    assert torch.equal(other.finish(pending), expected)
    assert other.free_slots == 2
    b = other.open()
    with pytest.raises(ValueError):
        other.launch_to_host([(b, torch.tensor([model.config.vocab_size]), None)])   # an id out of range
    assert other.free_slots == 1 and other.length(b) == 0
    assert other.finish(other.launch_to_host([])).shape == (0, model.config.hidden_size)


def test_a_published_step_hands_its_rows_to_publish(model, engine):
    """launch_to_host(publish=) calls publish once with the step's rows (the device hand-off's
    Mailbox.publish), before the wait, and PendingStep.published is what it returned."""
    tokens, frames = make_prompt(model, 6, seed=8)
    other = BackboneEngine(model, max_sessions=1, max_context=64)
    a = engine.open()
    expected = engine.step_to_host([(a, tokens, frames)])
    b = other.open()
    seen = []
    pending = other.launch_to_host([(b, tokens, frames)], publish=lambda rows: seen.append(rows.clone()) or 7)
    assert pending.published == 7 and len(seen) == 1 and torch.equal(seen[0], expected)
    other.finish(pending)
    assert other.length(b) == 6


def test_a_filled_step_takes_its_rows_from_fill(model, engine):
    """launch_to_host(fill=): a decode step whose rows' ids and codes fill writes on the device
    (the device hand-off's chained step, Mailbox.fill) gives the rows of the step given those
    ids and codes, whatever stood in for them, and leaves the stand-ins as they were; a step
    with an entry of more than one row refuses it."""
    tokens, frames = make_prompt(model, 12, seed=9)
    other = BackboneEngine(model, max_sessions=2, max_context=64)
    a, b = engine.open(), engine.open()
    c, d = other.open(), other.open()
    engine.step([(a, tokens[:8], frames[:8]), (b, tokens[:6], frames[:6])])
    other.step([(c, tokens[:8], frames[:8]), (d, tokens[:6], frames[:6])])
    want = engine.step_to_host([(a, tokens[9:10], frames[9:10]), (b, tokens[10:11], frames[10:11])])
    stand_in = [(c, tokens[3:4].clone(), frames[3:4].clone()), (d, tokens[4:5].clone(), frames[4:5].clone())]
    kept = [(t.clone(), f.clone()) for _, t, f in stand_in]

    def fill(ids, codes):
        ids.copy_(tokens[9:11])
        codes.copy_(frames[9:11])
    got = other.finish(other.launch_to_host(stand_in, fill=fill))
    assert torch.equal(got, want)
    assert all(torch.equal(t, kt) and torch.equal(f, kf) for (_, t, f), (kt, kf) in zip(stand_in, kept))
    with pytest.raises(ValueError, match="one row an entry"):
        other.launch_to_host([(c, tokens[:2], frames[:2])], fill=fill)


def test_rows_do_not_depend_on_batch_neighbours_or_slot(model, engine):
    """A session's rows are bit-identical alone (slot 0) and beside two others (slot 2), whose
    pieces have other sizes in the same steps."""
    tokens, frames = make_prompt(model, 200, seed=2)
    alone = run_session(engine, tokens, frames, [64, 70, 1, 1, 64])
    others = [make_prompt(model, 200, seed=s) for s in (3, 4)]
    slot_b, slot_c, slot_a = engine.open(), engine.open(), engine.open()
    assert slot_a == 2
    got, start_a, start_o = [], 0, 0
    for n_a, n_o in [(64, 5), (70, 128), (1, 1), (1, 60), (64, 1)]:
        outs = engine.step([(slot_b, others[0][0][start_o:start_o + n_o], others[0][1][start_o:start_o + n_o]),
                            (slot_a, tokens[start_a:start_a + n_a], frames[start_a:start_a + n_a]),
                            (slot_c, others[1][0][start_o:start_o + n_o], others[1][1][start_o:start_o + n_o])])
        got.append(outs[1])
        start_a, start_o = start_a + n_a, start_o + n_o
    assert torch.equal(torch.cat(got), alone)


def test_engine_rows_equal_forward_tokens_hidden(model, engine):
    """forward_tokens (the parity entry point) and the engine share one path: same final-norm rows."""
    tokens = torch.randint(0, 280, (70,), generator=torch.Generator().manual_seed(5))
    hidden, logits = model.forward_tokens(tokens)
    assert logits.shape == (70, model.config.vocab_size)
    assert torch.equal(run_session(engine, tokens, torch.full((70, 10), -1), [33, 37]), hidden)
    slot = engine.open()                                # frames=None means all rows are text
    assert torch.equal(torch.cat(engine.step([(slot, tokens, None)])), hidden)


def test_pool_never_leaks(engine):
    start = engine.free_slots
    assert start == engine.max_sessions and engine.open_sessions == 0
    for round_ in range(25):
        slots = [engine.open() for _ in range(1 + round_ % engine.max_sessions)]
        for slot in slots:
            engine.step([(slot, torch.tensor([1, 2, 3]), None)])
        for slot in slots:
            engine.release(slot)
            engine.release(slot)                        # idempotent
    assert engine.free_slots == start and engine.open_sessions == 0


def test_capacity_error_when_full_and_slot_reusable_at_once(engine):
    slots = [engine.open() for _ in range(engine.max_sessions)]
    with pytest.raises(CapacityError):
        engine.open()
    engine.release(slots[1])
    assert engine.open() == slots[1] and engine.length(slots[1]) == 0


def test_reopened_slot_starts_from_zero_state(model, engine):
    """A slot that held another session gives the same rows as a never-used one."""
    tokens, frames = make_prompt(model, 90, seed=6)
    fresh = run_session(engine, tokens, frames, [90])
    slot = engine.open()
    engine.step([(slot, *make_prompt(model, 77, seed=7))])
    engine.release(slot)
    assert torch.equal(run_session(engine, tokens, frames, [90]), fresh)


def test_bad_work_is_refused_before_any_cache_changes(model, engine):
    """Every check runs before the forward: after refused steps, the session continues as if
    they never happened."""
    tokens, frames = make_prompt(model, 40, seed=8)
    expected = run_session(engine, tokens, frames, [20, 20])
    small = BackboneEngine(model, max_sessions=2, max_context=30)
    slot, other = small.open(), small.open()
    (first,) = small.step([(slot, tokens[:20], frames[:20])])
    spec = model.audio
    audio_row = int((frames[20:30, 0] >= 0).nonzero()[0]) + 20
    bad_frames = frames[20:30].clone()
    bad_frames[audio_row - 20, 3] = spec.residual_codebook_size          # residual code out of range
    bad_tokens = tokens[20:30].clone()
    bad_tokens[audio_row - 20] += 1                                        # not semantic_start + c_0
    half_text = frames[20:30].clone()
    half_text[audio_row - 20, 1:] = -1                                     # neither text nor audio
    refused = [
        ([(slot, tokens[20:40], frames[20:40])], ContextFullError),         # 20 + 20 > 30
        ([(other, tokens[:5], frames[:5]), (slot, tokens[20:40], frames[20:40])], ContextFullError),
        ([(slot, tokens[20:30], bad_frames)], ValueError),
        ([(slot, bad_tokens, frames[20:30])], ValueError),
        ([(slot, tokens[20:30], half_text)], ValueError),
        ([(slot, torch.tensor([model.config.vocab_size]), None)], ValueError),       # id outside V
        ([(slot, tokens[20:30].int(), frames[20:30])], ValueError),
        ([(slot, tokens[20:22], frames[20:22]), (slot, tokens[22:24], frames[22:24])], ValueError),
        ([(3, tokens[20:22], frames[20:22])], ValueError),
        ([(slot, tokens[20:20], frames[20:20])], ValueError),
    ]
    for work, error in refused:
        with pytest.raises(error):
            small.step(work)
        assert small.length(slot) == 20 and small.length(other) == 0
    (second,) = small.step([(slot, tokens[20:30], frames[20:30])])
    assert torch.equal(torch.cat([first, second]), expected[:30])


def test_rows_are_checked_all_at_once_as_entry_by_entry(model, engine):
    """_bad_rows (one pass over a step's rows) flags exactly the rows _check_rows refuses, and a
    step with a bad row names the first bad entry."""
    tokens, frames = make_prompt(model, 40, seed=9)
    spec = model.audio
    gen = torch.Generator().manual_seed(3)
    rows_t, rows_f = tokens.clone(), frames.clone()
    for r in torch.randperm(40, generator=gen)[:16].tolist():       # corrupt 16 rows, 4 ways
        kind = r % 4
        if kind == 0:
            rows_t[r] = model.config.vocab_size + r
        elif kind == 1 and rows_f[r, 0] >= 0:
            rows_f[r, 1 + r % (spec.num_codebooks - 1)] = -2
        elif kind == 2 and rows_f[r, 0] >= 0:
            rows_t[r] += 1
        else:
            rows_f[r, 0] = spec.semantic_codebook_size
            rows_t[r] = spec.semantic_start_token_id + spec.semantic_codebook_size
    flagged = engine._bad_rows(rows_t, rows_f)                       # numpy's path (40 rows)
    assert len(rows_t) > engine._FEW_ROWS
    for r in range(40):
        try:
            engine._check_rows(0, rows_t[r:r + 1], rows_f[r:r + 1])
            refused = False
        except ValueError:
            refused = True
        assert bool(flagged[r]) == refused, r
        assert engine._bad_rows(rows_t[r:r + 1], rows_f[r:r + 1]).tolist() == [refused], r   # Python's path
    text = torch.full((2, spec.num_codebooks), -1, dtype=torch.int64)
    assert engine._bad_rows(torch.tensor([0, model.config.vocab_size]), text).tolist() == [False, True]
    assert engine._bad_rows(torch.tensor([-1, 5]), text).tolist() == [True, False]
    assert 0 < int(flagged.sum()) < 40
    bad = int(flagged.nonzero()[0][0])              # the first flagged row (numpy)
    slots = [engine.open() for _ in range(3)]
    work = [(slots[0], tokens[:bad], frames[:bad]) if bad else (slots[0], tokens[:1], frames[:1]),
            (slots[1], rows_t[bad:bad + 1], rows_f[bad:bad + 1]), (slots[2], tokens[:2], frames[:2])]
    with pytest.raises(ValueError, match=r"work\[1\]"):
        engine.step(work)
    for slot in slots:
        assert engine.length(slot) == 0
        engine.release(slot)


def test_memory_bytes_reports_weights_and_cache_pool(engine):
    mem = engine.memory_bytes()
    assert mem["weights"] > 0 and mem["cache"] > 0 and mem["total"] == mem["weights"] + mem["cache"]
    bigger = BackboneEngine(engine.model, max_sessions=8, max_context=512)
    assert bigger.memory_bytes()["cache"] == 2 * mem["cache"]


def test_bench_smoke_on_cpu(capsys):
    """bench/backbone.py runs at the tiny geometry on CPU (GPU numbers come from the lead)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "backbone.py"
    spec = importlib.util.spec_from_file_location("bench_backbone", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        results = bench.main(["--preset", "tiny", "--device", "cpu", "--prefill", "16", "70",
                              "--batch", "1", "3", "--context", "8", "--steps", "2", "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    assert [r["rows"] for r in results["prefill"]] == [16, 70]
    assert [r["batch"] for r in results["decode"]] == [1, 3]
    assert all(r["median_ms"] > 0 for r in results["decode"])
    assert "prefill rows" in capsys.readouterr().out


def test_batched_path_agrees_with_exact_path(tiny_checkpoint):
    """The batched (GPU) path, run on CPU, computes the same function: close, not bit-identical."""
    exact = load_backbone(tiny_checkpoint, lm_head=False)
    batched = load_backbone(tiny_checkpoint, lm_head=False, exact=False)
    tokens, frames = make_prompt(exact, 150, seed=10)
    ref = run_session(BackboneEngine(exact, max_sessions=1, max_context=150), tokens, frames, [150])
    got = run_session(BackboneEngine(batched, max_sessions=1, max_context=150), tokens, frames, [64, 70, 1, 15])
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-5, f"rel err {err:.2e}"


def test_split_invariance_at_odd_sizes():
    """The same property at sizes where rows, heads and expert slices are not 64-byte multiples
    (hidden 40, key dim 10, value dim 6, intermediate 20), with block-FP8 experts."""
    from services.backbone.weights import random_backbone
    from services.common.config import TextConfig

    cfg = TextConfig(vocab_size=101, hidden_size=40, num_hidden_layers=3, num_attention_heads=3,
                     num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=6,
                     linear_key_head_dim=10, linear_value_head_dim=6, linear_conv_kernel_dim=3,
                     num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20,
                     shared_expert_intermediate_size=14,
                     layer_types=["linear_attention", "full_attention", "linear_attention"])
    model = random_backbone(cfg, device="cpu", seed=3)
    engine = BackboneEngine(model, max_sessions=3, max_context=160)
    tokens = torch.randint(0, 101, (150,), generator=torch.Generator().manual_seed(0))
    frames = torch.empty(150, 0, dtype=torch.int64)
    reference = run_session(engine, tokens, frames, [150])   # in slot 0
    engine.open()                                            # the splits below run in slot 1
    for sizes in (pieces(150, 1), pieces(150, 7), [63, 2, 64, 21]):
        assert torch.equal(run_session(engine, tokens, frames, sizes), reference), sizes[:3]


def test_warm_up_leaves_the_pool_as_it_found_it(tiny_checkpoint):
    """The start-up warm-up runs prefill and decode steps, then every slot is free and a session
    opened afterwards computes exactly what it computes on a fresh engine."""
    from services.backbone.engine import BackboneEngine
    from services.backbone.weights import load_backbone

    model = load_backbone(tiny_checkpoint, lm_head=False)
    ids = torch.arange(5, 25, dtype=torch.int64)
    fresh = BackboneEngine(model, max_sessions=2, max_context=64)
    slot = fresh.open()
    expected = fresh.step([(slot, ids, None)])[0]

    warmed = BackboneEngine(model, max_sessions=2, max_context=64)
    warmed.warm_up()
    assert warmed.free_slots == 2 and warmed.open_sessions == 0
    slot = warmed.open()
    assert torch.equal(warmed.step([(slot, ids, None)])[0], expected)
    BackboneEngine(model, max_sessions=1, max_context=3).warm_up()    # tiny pools still warm up


def test_overlapped_load_reads_with_two_threads(tiny_checkpoint, monkeypatch):
    """The configuration measured on the H200 (docs/perf.md, session 5): with the experts read
    beside the warm-up, every read takes EXPERT_READ_THREADS readers; the plain load keeps
    read_parallel's default; $DRAMA_LOAD_THREADS overrides both."""
    from services.backbone import weights
    from services.common.checkpoint import SafetensorsCheckpoint

    seen = []
    read_parallel = SafetensorsCheckpoint.read_parallel
    read_into_parallel = SafetensorsCheckpoint.read_into_parallel

    def recording(self, names, fn, *, threads=None, **kwargs):
        seen.append(("per tensor", threads))
        return read_parallel(self, names, fn, threads=threads, **kwargs)

    def recording_runs(self, targets, *, threads=None, **kwargs):
        seen.append(("runs", threads))
        return read_into_parallel(self, targets, threads=threads, **kwargs)

    monkeypatch.setattr(SafetensorsCheckpoint, "read_parallel", recording)
    monkeypatch.setattr(SafetensorsCheckpoint, "read_into_parallel", recording_runs)
    monkeypatch.delenv("DRAMA_LOAD_THREADS", raising=False)
    _, reads = weights.start_backbone_load(tiny_checkpoint, lm_head=False)
    reads.wait()
    two = weights.EXPERT_READ_THREADS
    assert seen == [("per tensor", two), ("per tensor", two), ("runs", two)]
    seen.clear()
    weights.load_backbone(tiny_checkpoint, lm_head=False)
    assert seen == [("per tensor", None), ("runs", None)]
    seen.clear()
    monkeypatch.setenv("DRAMA_LOAD_THREADS", "5")
    _, reads = weights.start_backbone_load(tiny_checkpoint, lm_head=False)
    reads.wait()
    assert seen == [("per tensor", None), ("per tensor", None), ("runs", None)]


def test_overlapped_load_equals_the_plain_load_and_reports_read_errors(tiny_checkpoint, monkeypatch):
    """start_backbone_load (the server's start on CUDA): with the expert reads held back until a
    warm-up has run on the unfilled experts, the model ends up with exactly load_backbone's
    tensors and computes exactly its rows; on the kernel path gate and up are read into the halves
    of the packed w_gate_up (no copy at prepare). A read that fails surfaces from wait()."""
    import threading

    from services.backbone import weights
    from services.backbone.engine import BackboneEngine
    from services.common.checkpoint import DeviceCopier

    gate = threading.Event()
    run = weights.ExpertReads._run

    def held(self, read):
        assert gate.wait(30)
        run(self, read)

    monkeypatch.setattr(weights.ExpertReads, "_run", held)
    plain = weights.load_backbone(tiny_checkpoint, lm_head=False)
    model, reads = weights.start_backbone_load(tiny_checkpoint, lm_head=False)
    engine = BackboneEngine(model, max_sessions=2, max_context=64)
    engine.warm_up()                                  # on experts not read yet
    assert not reads.done()
    gate.set()
    reads.wait()
    assert reads.done() and reads.seconds > 0
    expected = dict(plain.state_dict())
    got = dict(model.state_dict())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    ids = torch.arange(5, 25, dtype=torch.int64)
    fresh = BackboneEngine(plain, max_sessions=1, max_context=64)
    slot = engine.open()
    assert torch.equal(engine.step([(slot, ids, None)])[0], fresh.step([(fresh.open(), ids, None)])[0])

    # the kernel path's layout, built on the CPU (nothing runs): gate | up packed by the reads
    kernel_path = dict(lm_head=False, dtype=torch.bfloat16, exact=False, kernels=True)
    packed, reads = weights.start_backbone_load(tiny_checkpoint, **kernel_path)
    reads.wait()
    mlp = packed.layers[0].mlp
    assert mlp.w_gate_up.data_ptr() == mlp.experts.gate_proj.data_ptr()
    stored = plain.layers[0].mlp.experts                       # as read, unpacked
    for proj in ("gate_proj", "up_proj"):
        assert torch.equal(getattr(mlp.experts, proj).view(torch.uint8), getattr(stored, proj).view(torch.uint8))
        assert torch.equal(getattr(mlp.experts, f"{proj}_scale_inv"), getattr(stored, f"{proj}_scale_inv"))
    reference = weights.load_backbone(tiny_checkpoint, **kernel_path).layers[0].mlp
    assert torch.equal(mlp.w_gate_up.view(torch.uint8), reference.w_gate_up.view(torch.uint8))
    assert torch.equal(mlp.s_gate_up, reference.s_gate_up)

    def broken(self, src, parts):
        raise OSError("disk gone")

    monkeypatch.setattr(DeviceCopier, "copy_parts", broken)
    _, reads = weights.start_backbone_load(tiny_checkpoint, lm_head=False)
    with pytest.raises(OSError, match="disk gone"):
        reads.wait()

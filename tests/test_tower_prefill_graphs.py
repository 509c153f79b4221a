"""The general-step graphs (services/tower/graphs.py StepGraphs): prompt pieces, non-drawing rows
and mixes as T single-row segments plus D draws, staged into one (T, D) bucket.

On the CPU the staged step runs without capture: the same `_general_step` code the CUDA graphs
capture. With the batch-invariant CPU path (attend_rowwise, one matrix-vector product per row)
a row's arithmetic does not depend on the other rows or on how they are grouped into segments,
so the staged step must equal the eager step (graphs off: multi-row segments) bit for bit:
codes, stop flags, every session's KV cache and RAS window. Around each step the whole pool is
compared bit by bit as well: the only entries that may change are the step's own (slot,
position) pairs and the scratch slot, so padding rows and padding draws touched nothing real.
Buckets are shrunk here (T in 4, 8, 16; D in 1, 2, 4) so that one test walks through several
shapes, padded draws and a step cut into two replays.

The fast path (batch_invariant=False, the GPU's arithmetic) is compared within float32
tolerance: on the CPU its eager step attends with SDPA per segment and the GEMMs see other row
counts. The CUDA test captures real graphs and checks that they replay, equal the eager step
(which on CUDA runs single-row segments too) bit for bit, track SDPA prefill within bf16
tolerance, and that a prompt cut into pieces gives the same bits as in one piece.
"""

from __future__ import annotations

import time

import pytest
import torch

from services.tower import graphs as tower_graphs
from services.tower.engine import StepEntry, TowerEngine
from services.tower.weights import random_tower

from tests.test_tower_graphs import _params
from tests.test_tower_model import TINY

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

D_MODEL, N = TINY.tower.hidden_size, TINY.num_codebooks
SESSIONS, CONTEXT = 4, 48


def _rows(n: int, seed: int, draw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """n hidden rows and their targets: teacher-forced audio codes except the first row (none)
    and, when the piece draws, the last (-1, as the engine requires)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D_MODEL, generator=g)
    targets = torch.full((n, N), -1, dtype=torch.int64)
    for t in range(1, n - (1 if draw else 0)):
        targets[t, 0] = torch.randint(0, TINY.semantic_codebook_size, (), generator=g)
        targets[t, 1:] = torch.randint(0, TINY.residual_codebook_size, (N - 1,), generator=g)
    return hidden, targets


def _entry(i: int, first_row: int, n_rows: int, draw: bool, frame: int = 0) -> StepEntry:
    return StepEntry(f"s{i}", first_row, n_rows, draw=draw, seed=10 + i, take_index=i % 2, frame_index=frame,
                     **_params(i))


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(tower_graphs, "ROW_BUCKETS", (4, 8, 16))
    monkeypatch.setattr(tower_graphs, "DRAW_BUCKETS", (1, 2, 4))


def _pair(batch_invariant: bool = True) -> tuple[TowerEngine, TowerEngine, list]:
    """(staged: graphs on, eager: graphs off, the (T, D) shapes the staged engine runs)."""
    staged = TowerEngine(random_tower(TINY, seed=5, batch_invariant=batch_invariant), TINY,
                         max_sessions=SESSIONS, max_context=CONTEXT, graphs=True)
    eager = TowerEngine(random_tower(TINY, seed=5, batch_invariant=batch_invariant), TINY,
                        max_sessions=SESSIONS, max_context=CONTEXT, graphs=False)
    if not batch_invariant:
        # attend_segments' CPU fallback (no Triton) runs one SDPA over decode rows padded to the
        # longest and masked, which reads unwritten pool entries: torch.empty garbage, and a
        # masked NaN still gives 0 * NaN. Zeros keep it finite (the GPU kernel reads 0..p only).
        for engine in (staged, eager):
            for layer in engine.model.layers():
                layer.self_attn.k_cache.zero_()
                layer.self_attn.v_cache.zero_()
    staged.warm_up()
    eager.warm_up()
    assert staged._step_graphs is not None and not staged.graphs_captured and eager._step_graphs is None
    shapes = []
    run = staged._step_graphs.step
    staged._step_graphs.step = lambda bucket: shapes.append((bucket.rows, bucket.draws)) or run(bucket)
    return staged, eager, shapes


def _pool_bits(engine: TowerEngine) -> list[torch.Tensor]:
    """Every layer's keys and values as raw bits [2, S, K, L, d * element]: unwritten pool
    entries are torch.empty garbage (NaN included), so compare bits, not values."""
    return [torch.stack([layer.self_attn.k_cache, layer.self_attn.v_cache]).contiguous().view(torch.uint8).clone()
            for layer in engine.model.layers()]


def _step_both(staged: TowerEngine, eager: TowerEngine, entries, hidden, targets):
    """One step in both engines; asserts every property of the module docstring."""
    before = _pool_bits(staged)
    a = staged.step(entries, hidden, targets)
    b = eager.step(entries, hidden, targets)
    assert not a.row_errors and not b.row_errors
    assert torch.equal(a.codes, b.codes) and a.stop == b.stop, (a.codes, b.codes)
    assert torch.equal(staged._ras_history[:SESSIONS], eager._ras_history)

    written = torch.zeros(SESSIONS + 1, CONTEXT, dtype=torch.bool)
    written[staged.scratch_slot] = True
    for entry in entries:
        slot = staged._sessions[(None, entry.session_id)].slot
        assert slot == eager._sessions[(None, entry.session_id)].slot
        written[slot, entry.first_row:entry.first_row + entry.n_rows] = True
    for layer, (old, new) in enumerate(zip(before, _pool_bits(staged))):
        changed = (old != new).any(dim=4).any(dim=2).any(dim=0)                     # [S, L]
        assert not (changed & ~written).any(), f"layer {layer}: {(changed & ~written).nonzero().tolist()}"
    for key, session in eager._sessions.items():                                      # every session, all rows
        for mine, theirs in zip(staged.model.layers(), eager.model.layers()):
            for cache in ("k_cache", "v_cache"):
                got = getattr(mine.self_attn, cache)[staged._sessions[key].slot, :, :session.rows]
                want = getattr(theirs.self_attn, cache)[session.slot, :, :session.rows]
                assert torch.equal(got, want), (key, cache)
    return a


def _prefill(staged, eager, ids, rows=5):
    """Sessions `ids` get a drawing prompt of `rows` rows (each alone: a (8, 1) step)."""
    for i in ids:
        hidden, targets = _rows(rows, seed=100 + i, draw=True)
        _step_both(staged, eager, [_entry(i, 0, rows, draw=True)], hidden, targets)


def test_step_shapes_and_their_count():
    shapes = tower_graphs.step_shapes(128)
    assert len(shapes) == 18 and (32, 32) in shapes and (2048, 128) in shapes and (128, 16) in shapes
    assert all(d <= t for t, d in shapes)
    assert tower_graphs.step_shapes(8) == [(t, d) for t in tower_graphs.ROW_BUCKETS for d in (1, 8)]


def test_plan_keeps_a_padding_row_cuts_long_steps_and_refuses_too_many_draws(small_buckets):
    graphs = tower_graphs.StepGraphs(lambda bucket: None, max_sessions=SESSIONS, hidden_size=D_MODEL,
                                     hidden_dtype=torch.float32, num_codebooks=N, device=torch.device("cpu"),
                                     scratch_slot=SESSIONS)

    def shapes(rows, draws):
        plan = graphs.plan(rows, draws)
        return None if plan is None else [(c.start, c.stop, c.first_draw, c.last_draw, c.bucket.rows, c.bucket.draws)
                                          for c in plan]

    assert shapes(3, [2]) == [(0, 3, 0, 1, 4, 1)]
    assert shapes(4, [3]) == [(0, 4, 0, 1, 8, 1)]                   # 4 rows: bucket 8, a padding row
    assert shapes(7, []) == [(0, 7, 0, 0, 8, 1)]                    # no draw: one padding draw
    assert shapes(7, [0, 3, 6]) == [(0, 7, 0, 3, 8, 4)]
    assert shapes(20, [12, 18, 19]) == [(0, 15, 0, 1, 16, 1), (15, 20, 1, 3, 8, 2)]
    assert shapes(31, []) == [(0, 15, 0, 0, 16, 1), (15, 30, 0, 0, 16, 1), (30, 31, 0, 0, 4, 1)]
    assert shapes(10, [0, 1, 2, 3, 4]) is None                       # 5 draws: more than D = 4


def test_prompt_piece_drawing_at_its_last_row(small_buckets):
    staged, eager, shapes = _pair()
    hidden, targets = _rows(9, seed=1, draw=True)
    result = _step_both(staged, eager, [_entry(0, 0, 9, draw=True)], hidden, targets)
    assert shapes == [(16, 1)] and (result.codes[0] >= 0).any()


def test_pieces_of_two_sessions_beside_decode_rows(small_buckets):
    staged, eager, shapes = _pair()
    _prefill(staged, eager, [0, 1])
    pieces = [_rows(1, 20, True), _rows(5, 21, False), _rows(1, 22, True), _rows(4, 23, True)]
    entries = [_entry(0, 5, 1, draw=True, frame=1), _entry(2, 0, 5, draw=False),
               _entry(1, 5, 1, draw=True, frame=1), _entry(3, 0, 4, draw=True)]
    shapes.clear()
    result = _step_both(staged, eager, entries, torch.cat([h for h, _ in pieces]), torch.cat([t for _, t in pieces]))
    assert shapes == [(16, 4)]                       # 11 rows, 3 draws: one padding draw
    assert (result.codes[[0, 2, 3]] >= 0).any() and (result.codes[1] == -1).all()


def test_piece_without_a_draw(small_buckets):
    staged, eager, shapes = _pair()
    _prefill(staged, eager, [0])
    hidden, targets = _rows(6, seed=3, draw=False)
    shapes.clear()
    result = _step_both(staged, eager, [StepEntry("s0", 5, 6)], hidden, targets)
    assert shapes == [(8, 1)] and (result.codes == -1).all() and result.stop == [False]
    # and the session goes on to draw the same frames in both engines
    hidden, targets = _rows(3, seed=4, draw=False)
    targets[0] = -1                                                 # s0's row draws
    _step_both(staged, eager, [_entry(0, 11, 1, draw=True, frame=1), StepEntry("s1", 0, 2)], hidden, targets)


def test_step_longer_than_the_largest_bucket_is_cut_without_changing_a_bit(small_buckets):
    staged, eager, shapes = _pair()
    _prefill(staged, eager, [0, 1])
    pieces = [_rows(12, 30, False), _rows(1, 31, True), _rows(6, 32, True), _rows(1, 33, True)]
    entries = [_entry(2, 0, 12, draw=False), _entry(0, 5, 1, draw=True, frame=1),
               _entry(3, 0, 6, draw=True), _entry(1, 5, 1, draw=True, frame=1)]
    shapes.clear()
    replays = staged._step_graphs.replays
    _step_both(staged, eager, entries, torch.cat([h for h, _ in pieces]), torch.cat([t for _, t in pieces]))
    # rows 0-14 (session 2's piece, session 0, two rows of session 3's), then 15-19
    assert shapes == [(16, 1), (8, 2)] and staged._step_graphs.replays == replays   # CPU: nothing replayed


def test_failed_entries_between_accepted_ones_are_left_out_of_the_staging(small_buckets):
    staged, eager, shapes = _pair()
    _prefill(staged, eager, [0])
    pieces = [_rows(3, 40, True), _rows(2, 41, True), _rows(1, 42, True)]
    entries = [_entry(1, 0, 3, draw=True), _entry(3, 7, 2, draw=True),   # s3 unknown: NOT_FOUND
               _entry(0, 5, 1, draw=True, frame=1)]
    hidden, targets = torch.cat([h for h, _ in pieces]), torch.cat([t for _, t in pieces])
    shapes.clear()
    a, b = staged.step(entries, hidden, targets), eager.step(entries, hidden, targets)
    assert [e.code for e in a.row_errors] == ["NOT_FOUND"] and shapes == [(8, 2)]
    assert torch.equal(a.codes, b.codes) and a.stop == b.stop
    assert torch.equal(staged._ras_history[:SESSIONS], eager._ras_history)


def test_restores_use_the_general_graphs_and_decode_steps_do_not(small_buckets):
    staged, eager, shapes = _pair()
    hidden, targets = _rows(4, seed=5, draw=False)
    for engine in (staged, eager):
        engine.step([StepEntry("a", 0, 4, snapshot_key="voice")], hidden, targets)
    assert shapes == [(8, 1)]
    shapes.clear()
    restore = StepEntry("b", 4, 3, draw=True, prefix_key="voice", prefix_rows=4)
    hidden, targets = _rows(3, seed=6, draw=True)
    a, b = staged.step([restore], hidden, targets), eager.step([restore], hidden, targets)
    assert not a.row_errors and shapes == [(4, 1)]            # the restore's rows replayed, after its copies
    assert torch.equal(a.codes, b.codes) and a.stop == b.stop
    for x, y in zip(staged.model.layers(), eager.model.layers()):
        slot_a, slot_b = staged._sessions[(None, "b")].slot, eager._sessions[(None, "b")].slot
        assert torch.equal(x.self_attn.k_cache[slot_a, :, :7], y.self_attn.k_cache[slot_b, :, :7])
    shapes.clear()
    decode = []
    run = staged._graphs.step
    staged._graphs.step = lambda bucket: decode.append(bucket.size) or run(bucket)
    staged.step([StepEntry("b", 7, 1, draw=True), StepEntry("a", 4, 1, draw=True)], torch.randn(2, D_MODEL),
                torch.full((2, N), -1))
    assert shapes == [] and decode == [2]


def test_fast_path_graphs_on_tracks_graphs_off(small_buckets):
    """batch_invariant=False (the GPU's arithmetic, on the CPU): the staged step runs every row as
    its own segment, the eager one (on the CPU) SDPA per segment, with GEMMs of other row counts,
    so bits differ and a sampled code can flip. So both engines draw fixed codes here
    (a function of the draw index only), and the draw rows' logits and every written cache entry
    must agree within float32 tolerance 1e-4 (relative and absolute)."""
    staged, eager, shapes = _pair(batch_invariant=False)
    assert not staged.single_row_segments and not eager.single_row_segments      # CUDA only
    logits = {id(staged): [], id(eager): []}
    for engine in (staged, eager):
        def sampler(history, ints, floats, seen=logits[id(engine)]):
            def sample(draw_index, row_logits):
                seen.append(row_logits.clone())
                return torch.full((row_logits.shape[0],), 3 + draw_index, dtype=torch.int64)
            return sample
        engine._sampler = sampler
        engine._fused_draws = False       # the torch bookkeeping calls _sampler (TRITON_INTERPRET=1)
    steps = [([_entry(0, 0, 9, draw=True)], [_rows(9, 50, True)]),
             ([_entry(1, 0, 6, draw=False), _entry(0, 9, 1, draw=True, frame=1)],
              [_rows(6, 51, False), _rows(1, 52, True)]),
             ([_entry(1, 6, 5, draw=True), _entry(0, 10, 1, draw=True, frame=2), _entry(2, 0, 3, draw=False)],
              [_rows(5, 53, True), _rows(1, 54, True), _rows(3, 55, False)])]
    for entries, pieces in steps:
        hidden, targets = torch.cat([h for h, _ in pieces]), torch.cat([t for _, t in pieces])
        a, b = staged.step(entries, hidden, targets), eager.step(entries, hidden, targets)
        assert torch.equal(a.codes, b.codes) and a.stop == b.stop
    assert shapes == [(16, 1), (8, 1), (16, 2)]
    assert len(logits[id(staged)]) == len(logits[id(eager)]) == 3 * N
    for got, want in zip(logits[id(staged)], logits[id(eager)]):      # staged: padding draws last
        assert torch.allclose(got[:len(want)], want, rtol=1e-4, atol=1e-4), (got[:len(want)] - want).abs().max()
    for key, session in eager._sessions.items():
        for mine, theirs in zip(staged.model.layers(), eager.model.layers()):
            for cache in ("k_cache", "v_cache"):
                got = getattr(mine.self_attn, cache)[staged._sessions[key].slot, :, :session.rows]
                want = getattr(theirs.self_attn, cache)[session.slot, :, :session.rows]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (key, cache, (got - want).abs().max())


# ------------------------------------------------------------------------------------------
# CUDA: captured graphs
# ------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_cuda_general_graphs_replay_and_equal_eager(preset):
    """Captured general graphs against (1) a graphs-off engine, whose eager steps on CUDA run
    single-row segments too: equal bit for bit (codes, stop flags, caches, RAS windows); (2) a
    graphs-off engine made to attend with SDPA per prompt piece (the eager path before the
    general graphs): caches within bf16 tolerance; (3) a prompt cut into two pieces: the same
    bits as in one. Prints prompt-step times of all three engines."""
    from tests.test_tower_gpu import _preset

    cfg = _preset(preset)
    d, n, sessions, context = cfg.tower.hidden_size, cfg.num_codebooks, 8, 1100

    def engine(graphs):
        e = TowerEngine(random_tower(cfg, device="cuda", dtype=torch.bfloat16, seed=7), cfg,
                        max_sessions=sessions, max_context=context, graphs=graphs)
        e.warm_up()
        return e

    graphed, eager, sdpa = engine(True), engine(False), engine(False)
    assert graphed.graphs_captured and not eager.graphs_captured and eager.single_row_segments
    sdpa.single_row_segments = False
    g = torch.Generator().manual_seed(3)

    def rows(count, draw):
        hidden = torch.randn(count, d, generator=g)
        targets = torch.full((count, n), -1, dtype=torch.int64)
        last = count - 1 if draw else count
        targets[1:last, 0] = torch.randint(0, cfg.semantic_codebook_size, (max(0, last - 1),), generator=g)
        targets[1:last, 1:] = torch.randint(0, cfg.residual_codebook_size, (max(0, last - 1), n - 1), generator=g)
        return hidden, targets

    steps = [  # (entries, pieces): a lone prompt; two prompts beside a decode row; a long non-drawing
        # piece; a piece's last rows beside a decode row
        ([StepEntry("a", 0, 300, draw=True, seed=1, **_params(0))], [rows(300, True)]),
        ([StepEntry("b", 0, 150, draw=False), StepEntry("a", 300, 1, draw=True, seed=1, frame_index=1, **_params(0)),
          StepEntry("c", 0, 77, draw=True, seed=3, **_params(2))], [rows(150, False), rows(1, True), rows(77, True)]),
        ([StepEntry("b", 150, 900, draw=False)], [rows(900, False)]),
        ([StepEntry("b", 1050, 3, draw=False), StepEntry("c", 77, 1, draw=True, seed=3, frame_index=1, **_params(2))],
         [rows(3, False), rows(1, True)]),
    ]
    replays = graphed._step_graphs.replays
    for entries, pieces in steps:
        hidden, targets = torch.cat([h for h, _ in pieces]), torch.cat([t for _, t in pieces])
        results = [e.step(entries, hidden, targets) for e in (graphed, eager, sdpa)]
        assert not any(r.row_errors for r in results)
        assert torch.equal(results[0].codes, results[1].codes) and results[0].stop == results[1].stop
    assert graphed._step_graphs.replays == replays + len(steps)
    assert torch.equal(graphed._ras_history[:sessions], eager._ras_history)
    for key, session in graphed._sessions.items():
        for layers in zip(graphed.model.layers(), eager.model.layers(), sdpa.model.layers()):
            for cache in ("k_cache", "v_cache"):
                got, same, other = (getattr(layer.self_attn, cache)[e._sessions[key].slot, :, :session.rows]
                                    for layer, e in zip(layers, (graphed, eager, sdpa)))
                assert torch.equal(got, same), (key, cache)
                if key[1] == "b":   # never drew (a and c did, and SDPA's bits may draw otherwise)
                    error = (got.double() - other.double()).norm() / other.double().norm()
                    assert error < 5e-2, (key, cache, float(error))   # bf16 rows: row-wise vs SDPA

    # prefill split invariance: one piece of 300 rows or pieces of 120 + 180 give the same bits
    hidden, targets = rows(300, False)
    graphed.step([StepEntry("whole", 0, 300)], hidden, targets)
    graphed.step([StepEntry("cut", 0, 120)], hidden[:120], targets[:120])
    graphed.step([StepEntry("cut", 120, 180)], hidden[120:], targets[120:])
    whole, cut = graphed._sessions[(None, "whole")].slot, graphed._sessions[(None, "cut")].slot
    for layer in graphed.model.layers():
        assert torch.equal(layer.self_attn.k_cache[whole, :, :300], layer.self_attn.k_cache[cut, :, :300])
        assert torch.equal(layer.self_attn.v_cache[whole, :, :300], layer.self_attn.v_cache[cut, :, :300])

    # a lone prompt to its first frame, as served (host rows in, codes out)
    for prompt in (100, 300, 1000):
        hidden, targets = rows(prompt, True)
        timings = {}
        for name, e in (("graphed", graphed), ("eager", eager), ("eager SDPA", sdpa)):
            e.step([StepEntry("t", 0, prompt, draw=True)], hidden, targets)           # warm
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(5):
                e.step([StepEntry("t", 0, prompt, draw=True)], hidden, targets)     # first_row 0: restarts
            timings[name] = (time.perf_counter() - started) / 5 * 1e3
        print(f"{preset}: prompt of {prompt} rows + draw: " + ", ".join(f"{k} {v:.2f} ms" for k, v in timings.items()))

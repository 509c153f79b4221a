"""The decode-graph machinery (services/tower/graphs.py) on the CPU: the staged step without
capture, i.e. the same `_decode_step` code the CUDA graphs capture, against the eager step.

Checked: one staging buffer per bucket carries every row's slot, position and sampling
parameters; rows past the real ones go to the scratch slot and change nothing real; RAS windows
advance as in the eager step; steps that are not pure single-row draws do not use them (they
go to the general-step graphs, tests/test_tower_prefill_graphs.py). (The CUDA capture itself
is tests/test_tower_gpu.py.)
"""

from __future__ import annotations

import pytest
import torch

from services.tower import graphs as decode_graphs
from services.tower.engine import StepEntry, TowerEngine
from services.tower.weights import random_tower

from tests.test_tower_model import TINY


def _params(i: int) -> dict:
    """Row-varied sampling parameters: greedy, RAS-prone, penalised, top-k, plain."""
    return [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=30),
            dict(temperature=0.7, repetition_penalty=1.3), dict(temperature=1.2, top_p=1.0, top_k=0)][i % 5]


def test_bucket_sizes_are_capped_at_max_sessions():
    assert decode_graphs.bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_graphs.bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_graphs.bucket_sizes(300) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]


def test_graphs_default_on_cuda_only_and_env_turns_them_off(monkeypatch):
    monkeypatch.delenv("DRAMA_TOWER_GRAPHS", raising=False)
    assert decode_graphs.enabled_by_default(torch.device("cuda"))
    assert not decode_graphs.enabled_by_default(torch.device("cpu"))
    monkeypatch.setenv("DRAMA_TOWER_GRAPHS", "0")
    assert not decode_graphs.enabled_by_default(torch.device("cuda"))


def test_staged_decode_step_equals_eager(one_intra_op_thread):
    sessions, prompt, steps, d, n = 4, 9, 6, TINY.tower.hidden_size, TINY.num_codebooks
    staged = TowerEngine(random_tower(TINY, seed=5), TINY, max_sessions=sessions, max_context=40, graphs=True)
    eager = TowerEngine(random_tower(TINY, seed=5), TINY, max_sessions=sessions, max_context=40, graphs=False)
    staged.warm_up()
    eager.warm_up()
    assert staged._graphs is not None and not staged.graphs_captured and eager._graphs is None
    assert staged.model.shared_layers[0].self_attn.k_cache.shape[0] == sessions + 1     # + scratch slot

    g = torch.Generator().manual_seed(2)
    none = torch.full((prompt, n), -1, dtype=torch.int64)
    for i in range(sessions):
        hidden = torch.randn(prompt, d, generator=g)
        for engine in (staged, eager):
            assert not engine.step([StepEntry(f"s{i}", 0, prompt, draw=True, seed=i, **_params(i))],
                                   hidden, none).row_errors

    calls = []
    original = staged._decode_step
    staged._decode_step = lambda bucket: calls.append(bucket.size) or original(bucket)
    staged._graphs.step = staged._decode_step

    def decode(engine, ids, step, hidden):
        entries = [StepEntry(f"s{i}", prompt + step, 1, draw=True, seed=i, frame_index=step + 1,
                             take_index=1, **_params(i)) for i in ids]
        result = engine.step(entries, hidden, torch.full((len(ids), n), -1, dtype=torch.int64))
        assert not result.row_errors
        return result

    for step in range(steps):
        hidden = torch.randn(sessions, d, generator=g)
        ids = range(sessions) if step % 2 == 0 else range(3)        # 3 rows: bucket 4, one padded
        a = decode(staged, ids, step, hidden[:len(ids)])
        b = decode(eager, range(sessions), step, hidden)
        assert torch.equal(a.codes, b.codes[:len(ids)]) and a.stop == b.stop[:len(ids)]
        if step % 2:   # keep session 3 in step in the eager engine only: re-sync it in the staged one
            decode(staged, [3], step, hidden[3:4])
    assert calls == [4, 4, 1] * (steps // 2)                    # bucket 4 for 4 and 3 rows, 1 for one
    assert torch.equal(staged._ras_history[:sessions], eager._ras_history)
    assert (staged._ras_history[:sessions] >= 0).any()


def test_steps_that_are_not_single_row_draws_do_not_use_the_decode_graphs():
    engine = TowerEngine(random_tower(TINY, seed=1), TINY, max_sessions=2, max_context=16, graphs=True)
    engine.warm_up()
    calls = []
    engine._graphs.step = lambda bucket: calls.append(bucket.size)
    d, n = TINY.tower.hidden_size, TINY.num_codebooks
    none = torch.full((3, n), -1, dtype=torch.int64)
    engine.step([StepEntry("a", 0, 3, draw=True)], torch.randn(3, d), none)                # prefill + draw
    engine.step([StepEntry("a", 3, 1, draw=False)], torch.randn(1, d), none[:1])           # no draw
    engine.step([StepEntry("a", 4, 1, draw=True), StepEntry("b", 0, 2, draw=True)],       # mixed
                torch.randn(3, d), none)
    assert calls == [] and engine.rows_held("a") == 5 and engine.rows_held("b") == 2


@pytest.mark.parametrize("rows", [1, 3])
def test_padded_rows_write_only_the_scratch_slot(rows):
    sessions = 4
    engine = TowerEngine(random_tower(TINY, seed=1), TINY, max_sessions=sessions, max_context=16, graphs=True)
    engine.warm_up()
    d, n = TINY.tower.hidden_size, TINY.num_codebooks
    for i in range(sessions):
        engine.step([StepEntry(f"s{i}", 0, 2, draw=True)], torch.randn(2, d), torch.full((2, n), -1))
    def bits(layer):   # unwritten pool entries are torch.empty garbage, NaNs included: compare bits
        return layer.self_attn.k_cache[:sessions, :, :4].contiguous().view(torch.uint8).clone()

    caches = [bits(layer) for layer in engine.model.layers()]
    engine.step([StepEntry(f"s{i}", 2, 1, draw=True) for i in range(rows)], torch.randn(rows, d),
                torch.full((rows, n), -1))
    for before, layer in zip(caches, engine.model.layers()):
        after = bits(layer)
        assert torch.equal(after[:, :, :2], before[:, :, :2])                   # prompts untouched
        assert torch.equal(after[rows:, :, 2:], before[rows:, :, 2:])          # idle sessions untouched
        assert not torch.equal(after[:rows, :, 2], before[:rows, :, 2])         # the real rows wrote


def test_a_decode_step_with_a_rejected_entry_gathers_the_other_rows(one_intra_op_thread):
    """The decode graph takes the accepted entries' rows: all of them in order without a gather
    (engine._run_graph), the others gathered when an entry in the middle is refused."""
    d, n, prompt = TINY.tower.hidden_size, TINY.num_codebooks, 5
    staged = TowerEngine(random_tower(TINY, seed=5), TINY, max_sessions=3, max_context=40, graphs=True)
    eager = TowerEngine(random_tower(TINY, seed=5), TINY, max_sessions=3, max_context=40, graphs=False)
    staged.warm_up()
    eager.warm_up()
    g = torch.Generator().manual_seed(3)
    none = torch.full((prompt, n), -1, dtype=torch.int64)
    for i in range(3):
        hidden = torch.randn(prompt, d, generator=g)
        for engine in (staged, eager):
            assert not engine.step([StepEntry(f"s{i}", 0, prompt, draw=True, seed=i, **_params(i))],
                                   hidden, none).row_errors
    hidden = torch.randn(3, d, generator=g)
    entries = [StepEntry(f"s{i}", prompt + (7 if i == 1 else 0), 1, draw=True, seed=i, frame_index=1,
                         **_params(i)) for i in range(3)]                  # s1's first_row is wrong
    replays, run = [], staged._graphs.run

    def recording_run(ints, floats, rows, *rest):
        replays.append(rows.clone())
        return run(ints, floats, rows, *rest)
    staged._graphs.run = recording_run
    published = []
    got = staged.step(entries, hidden, none[:3], publish=published.append)
    assert len(replays) == 1 and torch.equal(replays[0], hidden[[0, 2]])
    assert published == []                  # an entry refused: no frames on the device's way back
    assert [e.row_index for e in got.row_errors] == [1]
    want = eager.step([entries[0], entries[2]], hidden[[0, 2]], none[:2])
    assert torch.equal(got.codes[[0, 2]], want.codes) and [got.stop[0], got.stop[2]] == want.stop


@pytest.mark.parametrize("graphs", [True, False])
def test_a_decode_step_publishes_its_frames_before_it_returns(graphs, one_intra_op_thread):
    """engine.step(publish=): the device hand-off's way back gets the step's frames, int64
    [entries, N + 1] (codes, then the stop flag), once, from the decode graph's output or the
    eager step's, the same as the result; a step that is not all draws publishes nothing."""
    d, n, prompt = TINY.tower.hidden_size, TINY.num_codebooks, 4
    engine = TowerEngine(random_tower(TINY, seed=6), TINY, max_sessions=2, max_context=40, graphs=graphs)
    engine.warm_up()
    g = torch.Generator().manual_seed(4)
    none = torch.full((prompt, n), -1, dtype=torch.int64)
    published = []
    for i in range(2):
        engine.step([StepEntry(f"s{i}", 0, prompt, draw=False, seed=i)], torch.randn(prompt, d, generator=g),
                    none, publish=published.append)
    assert published == []                                       # no draw
    for step in range(4):
        entries = [StepEntry(f"s{i}", prompt + step, 1, draw=True, seed=i, frame_index=step, **_params(i))
                   for i in range(2)]
        result = engine.step(entries, torch.randn(2, d, generator=g), none[:2], publish=published.append)
        assert len(published) == 1
        frames = published.pop()
        assert frames.dtype == torch.int64 and frames.shape == (2, n + 1)
        assert torch.equal(frames[:, :n], result.codes) and frames[:, n].tolist() == [int(s) for s in result.stop]

"""Prefill segments as padded pieces (Backbone.prefill_graphs, services/backbone/model.py).

On CPU the pieces run eagerly through the kernels' torch references (the same function a CUDA
graph captures); the CUDA tests replay the graphs. What is proven:
- the cut of a segment into bucket pieces is a function of its length alone;
- padding rows change nothing: the same piece padded to different buckets gives the same bits,
  and the next decode row too (the GDN state passes them, their keys go to the spare slot);
- another session's caches are untouched by a piece;
- the pieces agree with the eager varlen path within BF16 rounding (as a different prompt cut does);
- on CUDA, a replayed piece gives the same bits alone and beside another session's piece or
  decode row, and the graphs are really replayed.
"""

from __future__ import annotations

import os

import pytest
import torch

import services.backbone.model as backbone_model
from services.backbone.engine import BackboneEngine
from services.backbone.kernels import HAS_TRITON, moe_decode
from services.backbone.model import (PREFILL_BUCKETS, PREFILL_GRAPH_ROWS, graph_pieces, piece_gemm_rows,
                                     prefill_cuts, prefill_groups)
from services.backbone.weights import random_backbone
from test_backbone_gpu import MID, copy_to

CUDA = torch.cuda.is_available()
INTERPRET_TRITON = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON


def test_prefill_cuts():
    for rows in list(range(1, 40)) + [63, 64, 65, 200, 511, 512, 513, 1024, 1100, 2048, 2049]:
        cuts = prefill_cuts(rows)
        assert sum(n for n, _ in cuts) == rows
        assert all(n <= b and b in PREFILL_BUCKETS for n, b in cuts)
        assert all(n == b == PREFILL_BUCKETS[-1] for n, b in cuts[:-1])        # full pieces first
        n, b = cuts[-1]
        assert b == min(x for x in PREFILL_BUCKETS if x >= n)                   # the rest padded
    assert prefill_cuts(70) == [(70, 96)]
    assert prefill_cuts(134) == [(134, 160)]           # a 20-word prompt: 26 padding rows, not 122
    assert prefill_cuts(600) == [(600, 768)]
    assert prefill_cuts(1100) == [(1024, 1024), (76, 96)]
    assert prefill_cuts(5, (8, 32)) == [(5, 8)]


def test_prefill_groups():
    lengths = [70, 600, 20, 1100, 5]
    groups = prefill_groups(lengths)
    seen = {i: [] for i in range(len(lengths))}
    for group in groups:
        assert group.slots in graph_pieces(group.bucket) and len(group.pieces) <= group.slots
        assert group.slots * group.bucket <= PREFILL_GRAPH_ROWS
        assert len({i for i, _, _ in group.pieces}) == len(group.pieces)       # a segment once per group
        for i, first, rows in group.pieces:
            assert rows <= group.bucket
            own = prefill_cuts(lengths[i])[len(seen[i])][1]
            # the dense GEMMs see a piece's rows as its own graph would (batch invariance)
            assert piece_gemm_rows(own) == piece_gemm_rows(group.bucket)
            # and the routed experts' MMA: pieces of BM 16 and BM 32 tiles (the per-warp MMA, the
            # same bits) share graphs; the warpgroup MMA's (BM 64) only its own bucket's
            mine, graph = moe_decode.piece_config(own), moe_decode.piece_config(group.bucket)
            assert mine == graph or (mine["BM"] <= 32 and graph["BM"] <= 32)
            seen[i].append((first, rows))
    for i, n in enumerate(lengths):       # every segment's pieces in order, as its own cut says
        assert [rows for _, rows in seen[i]] == [rows for rows, _ in prefill_cuts(n)]
        assert [first for first, _ in seen[i]] == [sum(r for _, r in seen[i][:j]) for j in range(len(seen[i]))]
    # 21 sessions' 70-row prompts: 8 pieces of 96 rows per graph, the rest in the next count up
    assert [(g.bucket, g.slots, len(g.pieces)) for g in prefill_groups([70] * 21)] == \
        [(96, 8, 8), (96, 8, 8), (96, 6, 5)]
    assert [(g.bucket, g.slots, len(g.pieces)) for g in prefill_groups([100] * 10)] == \
        [(128, 8, 8), (128, 2, 2)]
    assert graph_pieces(512) == (1, 2) and graph_pieces(16)[-1] == 16
    # GEMMs of 256 rows for buckets 256 and 512, of the piece for 768 and 1024 (one piece per
    # graph), of 128 for the others: a 200-row piece (bucket 256) joins a 512-row one, a 100-row
    # piece (128) does not
    assert [piece_gemm_rows(b) for b in PREFILL_BUCKETS] == [128] * 7 + [256, 128, 256, 768, 1024]
    assert [(g.bucket, g.slots, [i for i, _, _ in g.pieces]) for g in prefill_groups([200, 500, 100])] == \
        [(512, 2, [1, 0]), (128, 1, [2])]
    assert prefill_groups([]) == []


@pytest.fixture(scope="module")
def weights():
    return random_backbone(MID, device="cpu", seed=3)


def _engine(weights, device="cpu", **kwargs) -> BackboneEngine:
    model = copy_to(weights, device, kernels=True, **kwargs)
    return BackboneEngine(model, max_sessions=4, max_context=1024)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, MID.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _cache_tensors(engine: BackboneEngine, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for cache in engine.caches.layers for t in cache.tensors() if t.shape[0]]


def test_padding_rows_change_nothing(weights, monkeypatch):
    prompt, other = _ids(40, 1), _ids(30, 2)
    results = []
    for buckets in [(40,), (64,), (100,), (16, 32)]:       # no padding, padded twice, 40 = 32 + 8 padded to 16
        monkeypatch.setattr(backbone_model, "PREFILL_BUCKETS", buckets)
        engine = _engine(weights, prefill_graphs=True)
        b, a = engine.open(), engine.open()
        engine.step([(b, other, None)])
        before = _cache_tensors(engine, b)
        hidden = engine.step([(a, prompt, None)])[0]
        c = engine.open()       # beside another session's longer prompt: padded to its bucket, in one replay
        assert torch.equal(engine.step([(c, prompt, None), (engine.open(), _ids(90, 9), None)])[0], hidden)
        assert all(torch.equal(x, y) for x, y in zip(before, _cache_tensors(engine, b))), \
            "a piece touched another session's caches"
        decode = engine.step([(a, prompt[:1], None), (b, other[:1], None)])
        results.append((buckets, hidden, decode))
    (_, hidden, decode), *rest = results
    for buckets, h, d in rest[:2]:
        assert torch.equal(h, hidden), f"padding to {buckets} changed the piece's rows"
        assert torch.equal(d[0], decode[0]) and torch.equal(d[1], decode[1]), \
            f"padding to {buckets} changed the state the piece left"
    # another cut (32 + 8) is other arithmetic: close, not equal (GDN chunks restart per piece)
    _, h, _ = rest[2]
    assert torch.nn.functional.cosine_similarity(h.float(), hidden.float(), dim=-1).min() > 0.999


@pytest.mark.parametrize("rows", [20, 75])
def test_pieces_match_the_eager_path(weights, rows, monkeypatch):
    """Graph pieces vs the eager varlen step, beside a decode row of another session: the same
    values within BF16 rounding, for the prompt and the decode rows after it; the other session's
    decode row is bit-identical (it never goes through a piece). 75 rows = 32 + 32 + 11 padded.
    The other session's own history is fed row by row, so it never goes through a piece either:
    its 20 rows as one prompt would be a padded piece here and a varlen segment there, other
    arithmetic whose F32 states can differ in their last bits (they do on this AVX-512 CI CPU),
    and then so would its decode row."""
    monkeypatch.setattr(backbone_model, "PREFILL_BUCKETS", (16, 32))
    prompt, other = _ids(rows, 3), _ids(20, 4)
    out = {}
    for graphs in (False, True):
        engine = _engine(weights, prefill_graphs=graphs)
        b, a = engine.open(), engine.open()
        for i in range(len(other)):
            engine.step([(b, other[i:i + 1], None)])
        mixed = engine.step([(b, other[:1], None), (a, prompt, None)])
        after = [engine.step([(a, prompt[i:i + 1], None), (b, other[i:i + 1], None)]) for i in range(3)]
        out[graphs] = mixed, after
    (mixed_e, after_e), (mixed_g, after_g) = out[False], out[True]
    assert torch.equal(mixed_e[0], mixed_g[0])
    cos = lambda x, y: torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).min().item()  # noqa: E731
    assert cos(mixed_e[1], mixed_g[1]) > 0.9995
    for e, g in zip(after_e, after_g):
        assert cos(e[0], g[0]) > 0.9995


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_graph_replay_is_batch_invariant(weights):
    """On CUDA the pieces are replayed graphs; a prompt's rows are the same bits alone (its own
    bucket, one piece slot) and packed with another prompt's piece in one replay (padded to the
    larger bucket, fla's batch of two), beside a decode row; and they agree with the eager varlen
    path within BF16 rounding."""
    prompt, other, third = _ids(300, 5), _ids(90, 6), _ids(40, 7)
    engine = _engine(weights, "cuda", decode_graphs=True, prefill_graphs=True)
    shapes = engine.model.capture_prefill_graphs(engine.caches)
    assert len(shapes) == sum(len(graph_pieces(b)) for b in PREFILL_BUCKETS)
    alone = []
    for ids in (prompt, other):
        slot = engine.open()
        alone.append(engine.step([(slot, ids, None)])[0].clone())
        engine.release(slot)
    b, a, c = engine.open(), engine.open(), engine.open()
    engine.step([(b, third, None)])
    replays = engine.model.prefill_replays
    beside = engine.step([(b, third[:1], None), (a, prompt, None), (c, other, None)])
    assert engine.model.prefill_replays == replays + 1           # both prompts in one replay
    assert torch.equal(beside[1], alone[0]) and torch.equal(beside[2], alone[1])
    # pieces of 256-row GEMMs (model.piece_gemm_rows): 200 rows alone in a 256-row graph, and
    # packed behind a 500-row piece in a 512-row graph of two
    big, small = _ids(500, 8), _ids(200, 9)
    for slot in (a, b, c):
        engine.release(slot)
    slot = engine.open()
    small_alone = engine.step([(slot, small, None)])[0].clone()
    engine.release(slot)
    replays = engine.model.prefill_replays
    packed = engine.step([(engine.open(), big, None), (engine.open(), small, None)])
    assert engine.model.prefill_replays == replays + 1
    assert torch.equal(packed[1], small_alone)

    eager = _engine(weights, "cuda", decode_graphs=True, prefill_graphs=False)
    ref = eager.step([(eager.open(), prompt, None)])[0]
    assert torch.nn.functional.cosine_similarity(ref.float(), alone[0].float(), dim=-1).min() > 0.999


@pytest.mark.skipif(not (CUDA or INTERPRET_TRITON), reason="needs CUDA (or TRITON_INTERPRET=1 with Triton)")
def test_tiled_piece_attention_matches_the_row_kernel(weights, monkeypatch):
    """The tiled attention of pieces (kernels/attention.piece_attention, the default) against the
    row-wise decode kernel (DRAMA_PIECE_ATTENTION=rows): the prompt's rows and the decode rows after it agree within BF16 rounding
    (the bound of test_pieces_match_the_eager_path: each path rounds its attention output to bf16
    on its own, and the layers after it carry the difference)."""
    from services.backbone.kernels import attention as kattn

    device = "cuda" if CUDA else "cpu"
    prompt = _ids(75, 11)
    out = {}
    for mode in ("rows", "tiled"):
        monkeypatch.setattr(kattn, "PIECE_ATTENTION", mode)
        engine = _engine(weights, device, decode_graphs=CUDA, prefill_graphs=True)
        slot = engine.open()
        rows = [engine.step([(slot, prompt, None)])[0]]
        rows += [engine.step([(slot, prompt[i:i + 1], None)])[0] for i in range(3)]
        out[mode] = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).float()
    cos = torch.nn.functional.cosine_similarity(out["rows"], out["tiled"], dim=-1).min().item()
    assert cos > 0.9995, cos

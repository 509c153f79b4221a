"""The voice-prefix cache (issue #8): the LRU itself, the engines' snapshots, and the property
that matters: the frames are bit-identical with or without the cache (CPU float32), through real
Generate calls, alone and concurrently, on first use and on a hit, and when the tower has lost
its snapshot and the backbone falls back to a full prefill.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from drama.backbone.v1 import backbone_pb2_grpc
from services.backbone.engine import BackboneEngine
from services.backbone.prefix_cache import PrefixCache, default_capacity_mb, prefix_key
from services.common import grpcutil
from test_generate_e2e import MAX_CONTEXT, MAX_ROWS, _free_port, _start_backbone, collect, make_request
from test_tower_model import TINY, _engine, _entry, _layer_caches


# --------------------------------------------------------------------------------------------
# The LRU and the key
# --------------------------------------------------------------------------------------------

@dataclass
class _Blob:
    nbytes: int


def test_lru_evicts_least_recently_used_until_the_new_entry_fits():
    cache = PrefixCache(100)
    for key in "abc":
        assert cache.put(key, _Blob(30))
    assert cache.get("a") is not None            # a is now the most recent; b the least
    cache.put("d", _Blob(30))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert (cache.used_bytes, cache.evictions) == (90, 1)
    cache.put("e", _Blob(70))                    # evicts c, then a: d + e fill the budget
    assert [k for k in "abcde" if k in cache] == ["d", "e"]
    assert (cache.used_bytes, cache.evictions) == (100, 3)


def test_an_entry_over_the_budget_is_not_stored_and_zero_disables():
    cache = PrefixCache(50)
    assert not cache.put("big", _Blob(51)) and len(cache) == 0
    off = PrefixCache.from_mb(0)
    assert not off.enabled and not off.put("x", _Blob(1)) and off.get("x") is None
    assert default_capacity_mb("cpu") == 64 and default_capacity_mb("cuda:0") == 1024


def test_the_key_covers_every_row_and_the_model_identity():
    tokens = torch.tensor([1, 2, 300])
    frames = torch.full((3, 4), -1)
    frames[2] = torch.tensor([16, 3, 4, 5])
    key = prefix_key("model-a", tokens, frames)
    assert prefix_key("model-a", tokens.clone(), frames.clone()) == key
    changed = frames.clone()
    changed[2, 3] = 6                            # one residual code of one frame
    assert prefix_key("model-a", tokens, changed) != key
    assert prefix_key("model-b", tokens, frames) != key
    assert prefix_key("model-a", tokens[:2], frames[:2]) != key


# --------------------------------------------------------------------------------------------
# Backbone engine: snapshot and restore
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backbone_model(tiny_checkpoint):
    from services.backbone.weights import load_backbone
    return load_backbone(tiny_checkpoint, device="cpu", dtype=torch.float32, lm_head=False)


def _rows(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text rows then audio rows: token ids [n], frames [n, N]."""
    spec = model.audio
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.semantic_start_token_id, (n,), generator=gen)
    frames = torch.full((n, spec.num_codebooks), -1, dtype=torch.int64)
    audio = torch.arange(n) >= n // 4
    codes = torch.randint(0, spec.residual_codebook_size, (n, spec.num_codebooks), generator=gen)
    codes[:, 0] = torch.randint(0, spec.semantic_codebook_size, (n,), generator=gen)
    frames[audio] = codes[audio]
    tokens[audio] = spec.semantic_start_token_id + codes[audio, 0]
    return tokens, frames


@pytest.mark.parametrize("prefix", [5, 64, 100], ids=["short", "one-gdn-chunk", "chunk-and-a-part"])
def test_a_restored_slot_continues_bit_identically(backbone_model, prefix):
    """Prefix rows, snapshot, then the rest: a slot restored from the snapshot (in another slot,
    after other sessions used the pool) gives the same hidden rows as the original."""
    engine = BackboneEngine(backbone_model, max_sessions=3, max_context=256)
    tokens, frames = _rows(backbone_model, prefix + 40, seed=prefix)
    first = engine.open()
    engine.step([(first, tokens[:prefix], frames[:prefix])])
    snapshot = engine.snapshot(first)
    assert snapshot.length == prefix and snapshot.nbytes > 0
    (want,) = engine.step([(first, tokens[prefix:], frames[prefix:])])
    # dirty another slot with a different session, then restore into it
    other = engine.open()
    noise_tokens, noise_frames = _rows(backbone_model, 90, seed=99)
    engine.step([(other, noise_tokens, noise_frames)])
    engine.release(other)
    restored = engine.restore(snapshot)
    assert restored == other and engine.length(restored) == prefix
    for saved in snapshot.tensors:               # the snapshot is a copy, not a view of the pool
        saved.fill_(float("nan")) if saved.is_floating_point() else saved.fill_(0)
    (got,) = engine.step([(restored, tokens[prefix:], frames[prefix:])])
    assert torch.equal(got, want)


def test_restore_refuses_a_snapshot_of_another_layout(backbone_model):
    engine = BackboneEngine(backbone_model, max_sessions=2, max_context=128)
    slot = engine.open()
    tokens, frames = _rows(backbone_model, 10, seed=1)
    engine.step([(slot, tokens, frames)])
    snapshot = engine.snapshot(slot)
    small = BackboneEngine(backbone_model, max_sessions=2, max_context=8)
    with pytest.raises(ValueError):
        small.restore(snapshot)
    assert small.free_slots == 2


# --------------------------------------------------------------------------------------------
# Tower engine: snapshot_key and prefix_key
# --------------------------------------------------------------------------------------------

def _tower_prompt(rows: int, prefix: int, seed: int = 0):
    """Hidden rows and targets whose prefix ends with a row without a target (like `system`)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, TINY.tower.hidden_size, generator=g)
    targets = torch.full((rows, TINY.num_codebooks), -1, dtype=torch.int64)
    for t in list(range(2, prefix - 2)) + list(range(prefix + 2, rows - 1)):
        targets[t, 0] = torch.randint(0, TINY.semantic_codebook_size, (), generator=g)
        targets[t, 1:] = torch.randint(0, TINY.residual_codebook_size, (TINY.num_codebooks - 1,), generator=g)
    return hidden, targets


def _frames_after(engine, session, hidden, targets, first_row, frames=3, **prefix):
    """Rows first_row.. of the prompt (the last one draws), then `frames` frame steps."""
    rows = len(targets)
    result = engine.step([_entry(session, first_row, rows - first_row, draw=True, **prefix)],
                         hidden[first_row:], targets[first_row:])
    assert not result.row_errors, result.row_errors
    out = [result.codes[0].tolist()]
    for f in range(1, frames):
        result = engine.step([_entry(session, rows + f - 1, 1, draw=True, frame_index=f)],
                             torch.randn(1, TINY.tower.hidden_size, generator=torch.Generator().manual_seed(f)),
                             torch.full((1, TINY.num_codebooks), -1))
        out.append(result.codes[0].tolist())
    return out


def test_tower_restore_gives_the_frames_and_caches_of_a_full_prefill():
    prefix, rows, frames = 12, 20, 3
    hidden, targets = _tower_prompt(rows, prefix)
    full_engine = _engine(context=64)
    full = _frames_after(full_engine, "a", hidden, targets, 0, frames)

    engine = _engine(context=64)
    stored = engine.step([_entry("first", 0, prefix, snapshot_key="voice")], hidden[:prefix], targets[:prefix])
    assert not stored.row_errors and "voice" in engine.prefixes
    engine.step([_entry("other", 0, 30)], torch.randn(30, TINY.tower.hidden_size),
                 torch.full((30, TINY.num_codebooks), -1))     # other rows in the slot "a" will get
    engine.release(["other"])
    restored = _frames_after(engine, "a", hidden, targets, prefix, frames, prefix_key="voice", prefix_rows=prefix)
    assert restored == full
    slot = engine._sessions[(None, "a")].slot
    assert slot == 1
    for layer, (got, want) in enumerate(zip(_layer_caches(engine, slot, rows + frames - 1),
                                            _layer_caches(full_engine, 0, rows + frames - 1))):
        assert torch.equal(got, want), f"layer {layer} cache differs"


def test_tower_restore_of_an_evicted_snapshot_is_failed_precondition():
    prefix = 6
    hidden, targets = _tower_prompt(10, prefix)
    engine = _engine(context=64)
    engine.step([_entry("first", 0, prefix, snapshot_key="voice")], hidden[:prefix], targets[:prefix])
    engine.prefixes.clear()                      # evicted
    result = engine.step([_entry("a", prefix, 4, draw=True, prefix_key="voice", prefix_rows=prefix)],
                         hidden[prefix:], targets[prefix:])
    assert [(e.row_index, e.code) for e in result.row_errors] == [(0, "FAILED_PRECONDITION")]
    assert engine.rows_held("a") is None


@pytest.mark.parametrize("entry", [
    _entry("a", 5, 2, prefix_key="voice", prefix_rows=4),     # restore must start at prefix_rows
    _entry("a", 0, 2, draw=True, snapshot_key="voice"),        # a draw row is not a prefix
], ids=["first-row", "draw"])
def test_tower_refuses_inconsistent_prefix_fields(entry):
    engine = _engine(context=64)
    result = engine.step([entry], torch.zeros(2, TINY.tower.hidden_size), torch.full((2, TINY.num_codebooks), -1))
    assert [e.code for e in result.row_errors] == ["INVALID_ARGUMENT"]


# --------------------------------------------------------------------------------------------
# Through Generate: identical frames with and without the cache
# --------------------------------------------------------------------------------------------

REFERENCE_FRAMES = 80          # system = 16 text rows + 80 audio rows + <|im_end|>: over one GDN chunk


async def _tower(checkpoint, **env):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tower", "--checkpoint", str(checkpoint), "--port", str(port),
         "--device", "cpu"],
        env=dict(os.environ, DRAMA_MAX_ROWS=str(MAX_ROWS), DRAMA_MAX_CONTEXT_TOKENS=str(MAX_CONTEXT),
                 OMP_NUM_THREADS="1", **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    addr = f"127.0.0.1:{port}"
    end = time.monotonic() + 60
    while await grpcutil.check_health(addr, timeout=0.5) != "SERVING":
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < end, "tower did not start"
        await asyncio.sleep(0.1)
    return proc, addr


@pytest.fixture(scope="module")
async def tower_addr(tiny_checkpoint):
    proc, addr = await _tower(tiny_checkpoint)
    yield addr
    proc.kill()
    proc.wait(10)


class _Backbone:
    def __init__(self, running):
        self.running = running
        self.channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
        self.stub = backbone_pb2_grpc.BackboneStub(self.channel)

    @property
    def scheduler(self):
        return self.running.scheduler

    async def codes(self, name: str, seed: int, **kw) -> list[torch.Tensor]:
        """Each chunk's frames [N, T] of `_request(name, seed, **kw)`."""
        result = await collect(self.stub, _request(name, seed, **kw))
        return [result.codes(c) for c in range(len(result.chunk_ends))]

    async def close(self):
        await self.channel.close()
        await self.running.stop()


async def _backbone(checkpoint, tower_addr, cache_mb: float, **options) -> _Backbone:
    return _Backbone(await _start_backbone(checkpoint, tower_addr, prefix_cache_mb=cache_mb, **options))


def _request(name: str, seed: int, texts=("hello there", "and more words"), references=REFERENCE_FRAMES):
    return make_request(name, seed=seed, texts=texts, max_new=5, references=references, history=1,
                        temperature=1.0)


SEEDS = (3, 11, 29)


@pytest.fixture(scope="module")
async def uncached(tiny_checkpoint, tower_addr):
    """The reference: every seed's frames with the cache off, one request at a time."""
    backbone = await _backbone(tiny_checkpoint, tower_addr, 0)
    try:
        assert backbone.scheduler.prefix_cache is None
        yield {seed: await backbone.codes(f"ref-{seed}", seed) for seed in SEEDS}
    finally:
        await backbone.close()


async def test_frames_are_identical_with_the_cache_on_first_use_and_on_hits(tiny_checkpoint, tower_addr, uncached):
    backbone = await _backbone(tiny_checkpoint, tower_addr, 64)
    try:
        scheduler = backbone.scheduler
        first = await backbone.codes("first", SEEDS[0])        # chunk 0 stores, chunk 1 hits
        assert (scheduler.prefix_cache.misses, scheduler.prefix_cache.hits) == (1, 1)
        system_rows = scheduler.prefix_rows_skipped
        assert system_rows > REFERENCE_FRAMES
        assert all(torch.equal(a, b) for a, b in zip(first, uncached[SEEDS[0]]))
        for seed in SEEDS:                                     # hits, one at a time
            got = await backbone.codes(f"alone-{seed}", seed)
            assert all(torch.equal(a, b) for a, b in zip(got, uncached[seed])), seed
        together = await asyncio.gather(*[backbone.codes(f"together-{seed}", seed) for seed in SEEDS])
        for seed, got in zip(SEEDS, together):                 # hits, batched together
            assert all(torch.equal(a, b) for a, b in zip(got, uncached[seed])), seed
        assert scheduler.prefix_rows_skipped == system_rows * (1 + 2 * len(SEEDS) * 2)
        assert scheduler.prefix_fallbacks == 0
    finally:
        await backbone.close()


async def test_concurrent_first_uses_give_the_same_frames(tiny_checkpoint, tower_addr, uncached):
    """Several sessions with one new prefix at once: they store it side by side; later chunks
    and sessions hit it."""
    backbone = await _backbone(tiny_checkpoint, tower_addr, 64)
    try:
        got = await asyncio.gather(*[backbone.codes(f"rush-{seed}", seed) for seed in SEEDS])
        for seed, codes in zip(SEEDS, got):
            assert all(torch.equal(a, b) for a, b in zip(codes, uncached[seed])), seed
        assert backbone.scheduler.prefix_cache.hits >= len(SEEDS)
    finally:
        await backbone.close()


async def test_a_lost_tower_snapshot_falls_back_to_a_full_prefill(tiny_checkpoint, uncached):
    """A tower that keeps no snapshots (its budget 0: every snapshot is evicted at once) answers
    each restore FAILED_PRECONDITION; the backbone prefills the whole prompt instead, also with
    later prefill pieces of the abandoned restore still in flight, and the frames do not change."""
    proc, addr = await _tower(tiny_checkpoint, DRAMA_PREFIX_CACHE_MB="0")
    backbone = await _backbone(tiny_checkpoint, addr, 64, prefill_chunk_tokens=16)
    try:
        got = await asyncio.gather(*[backbone.codes(f"lost-{seed}", seed) for seed in SEEDS])
        for seed, codes in zip(SEEDS, got):
            assert all(torch.equal(a, b) for a, b in zip(codes, uncached[seed])), seed
        assert backbone.scheduler.prefix_fallbacks >= len(SEEDS)
        assert backbone.scheduler.prefix_rows_skipped == 0
        assert backbone.scheduler.engine.free_slots == MAX_ROWS
    finally:
        await backbone.close()
        proc.kill()
        proc.wait(10)


async def test_a_voice_evicted_from_the_tower_only_is_prefilled_again(tiny_checkpoint, uncached):
    """The tower's budget holds one voice, the backbone's several: a second voice evicts the
    first from the tower alone, so the first voice's next restore falls back, with the same
    frames, and stores the voice in the tower again."""
    proc, addr = await _tower(tiny_checkpoint, DRAMA_PREFIX_CACHE_MB="0.3")   # a 97-row voice: 0.24 MiB
    backbone = await _backbone(tiny_checkpoint, addr, 64)
    seed = SEEDS[0]
    try:
        scheduler = backbone.scheduler
        await backbone.codes("voice-a", seed, texts=("hello there",))
        await backbone.codes("voice-b", seed, texts=("hello there",), references=REFERENCE_FRAMES - 20)
        assert len(scheduler.prefix_cache) == 2 and scheduler.prefix_fallbacks == 0
        again = await backbone.codes("voice-a-again", seed)
        assert scheduler.prefix_fallbacks == 1
        assert all(torch.equal(a, b) for a, b in zip(again, uncached[seed]))
        skipped = scheduler.prefix_rows_skipped
        assert skipped > 0                        # its second chunk restored the stored voice again
        assert all(torch.equal(a, b) for a, b in zip(await backbone.codes("voice-a-3", seed), uncached[seed]))
        assert scheduler.prefix_fallbacks == 1 and scheduler.prefix_rows_skipped == 3 * skipped
    finally:
        await backbone.close()
        proc.kill()
        proc.wait(10)

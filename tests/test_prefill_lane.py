"""The backbone's prefill lane (issue #8, DRAMA_PREFILL_LANE): prefill pieces computed on their own
thread beside the decode groups.

The engine side: two steps on disjoint slots run at once from two threads (the lock guards only
bookkeeping) and give the rows of sequential steps; a slot inside a running step is refused to a
second step and, released meanwhile, is handed out again only after the step.
The scheduler side, on the real tiny stack (CPU float32, the exact path): the frames of every
session are bit-identical with the lane on and off, also with the voice-prefix cache (stores, hits
and the tower's fallbacks) and multi-chunk requests; lane steps hold only pieces of two rows or
more, the main loop's steps one-row segments; decoding goes on while the lane computes; a session
cancelled during its lane prefill ends cleanly, its slot freed only once the lane step has ended.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.backbone.engine import BackboneEngine
from services.backbone.scheduler import ChunkEnd, FramesOut, GenerateError, Scheduler, TowerResult, Usage
from test_backbone_server import Recorder, _job, scheduler_factory
from test_generate_e2e import MAX_CONTEXT, MAX_ROWS, TowerProcess, _start_backbone
from test_prefix_cache import SEEDS, _Backbone, _rows, _tower, backbone_model, tower_addr  # noqa: F401 (fixtures)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LANE = "backbone-lane"       # the lane's thread name prefix (scheduler.py)


# --------------------------------------------------------------------------------------------
# The engine: concurrent steps on disjoint slots
# --------------------------------------------------------------------------------------------

class _HeldModel:
    """The real model, except that a forward touching slot `hold` waits inside until released."""

    def __init__(self, model, hold: int):
        self.model, self.hold = model, hold
        self.inside, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_rows(self, x, segments, caches):
        if any(s.slot == self.hold for s in segments):
            self.inside.set()
            assert self.go.wait(30)
        return self.model.forward_rows(x, segments, caches)


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()))
    thread.start()
    return thread, box


def test_two_steps_on_disjoint_slots_overlap_and_give_the_sequential_rows(backbone_model):
    """A prefill held inside its forward does not hold up a decode step of another slot (no lock
    across the step), and both give the rows the same steps give one after another."""
    prompt, other = _rows(backbone_model, 40, seed=1), _rows(backbone_model, 9, seed=2)
    reference = BackboneEngine(backbone_model, max_sessions=2, max_context=64)
    a, b = reference.open(), reference.open()
    reference.step([(b, other[0][:8], other[1][:8])])
    want_prefill = reference.step([(a, *prompt)])[0]
    want_decode = reference.step([(b, other[0][8:], other[1][8:])])[0]

    held = _HeldModel(backbone_model, hold=0)
    engine = BackboneEngine(held, max_sessions=2, max_context=64)
    a, b = engine.open(), engine.open()
    assert a == 0
    engine.step([(b, other[0][:8], other[1][:8])])
    thread, box = _in_thread(lambda: engine.step([(a, *prompt)]))
    try:
        assert held.inside.wait(30)
        got_decode = engine.step([(b, other[0][8:], other[1][8:])])[0]   # while the prefill is held
        assert thread.is_alive()
    finally:
        held.go.set()
        thread.join(30)
    assert torch.equal(box["out"][0], want_prefill)
    assert torch.equal(got_decode, want_decode)
    assert engine.length(a) == 40 and engine.length(b) == 9


def test_a_slot_in_a_running_step_is_refused_and_freed_only_when_the_step_ends(backbone_model):
    held = _HeldModel(backbone_model, hold=0)
    engine = BackboneEngine(held, max_sessions=2, max_context=64)
    slot = engine.open()
    tokens, frames = _rows(backbone_model, 5, seed=3)
    thread, _ = _in_thread(lambda: engine.step([(slot, tokens, frames)]))
    try:
        assert held.inside.wait(30)
        with pytest.raises(ValueError, match="another step"):
            engine.step([(slot, tokens[:1], frames[:1])])
        with pytest.raises(ValueError, match="has not ended"):
            engine.snapshot(slot)
        engine.release(slot)                     # the session left mid-step
        assert engine.free_slots == 1            # not this one: the step still writes into it
        assert engine.open() == 1
        engine.release(1)
    finally:
        held.go.set()
        thread.join(30)
    assert engine.free_slots == 2
    with pytest.raises(ValueError):
        engine.length(slot)                      # released: the step's rows were not counted
    assert engine.open() == slot and engine.length(slot) == 0


@cuda
def test_on_cuda_a_lane_stream_prefill_beside_graphed_decode_steps_gives_the_sequential_rows():
    """The GPU shape of the lane: a prefill in pieces on a lane thread and stream while the main
    thread replays decode graphs on a high-priority stream, the new slot opened (reset) on the
    default stream. Every row equals the rows of the same steps run one after another (batch
    invariance: same kernels per row, disjoint slots), and so do the decode steps after it."""
    from services.backbone.weights import random_backbone
    from test_backbone_gpu import MID, copy_to

    model = copy_to(random_backbone(MID, device="cpu", seed=3), "cuda", kernels=True, decode_graphs=True)
    gen = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, MID.vocab_size, (n,), generator=gen)   # noqa: E731
    prompts = [ids(40), ids(70)]
    pieces = [ids(120), ids(90)]
    decodes = [[ids(1), ids(1)] for _ in range(8)]
    after = [[ids(1), ids(1), ids(1)] for _ in range(4)]

    def run(engine: BackboneEngine, concurrent: bool):
        a, b = engine.open(), engine.open()
        engine.step([(a, prompts[0], None), (b, prompts[1], None)])
        c = engine.open()                                    # reset on the default stream
        lane_stream, main_stream = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

        def lane():
            with torch.cuda.stream(lane_stream):
                return [engine.step([(c, piece, None)])[0] for piece in pieces]

        def decode():
            with torch.cuda.stream(main_stream):
                return [torch.cat(engine.step([(a, x, None), (b, y, None)])) for x, y in decodes]
        if concurrent:
            thread, box = _in_thread(lane)
            decoded = decode()
            thread.join(120)
            prefilled = box["out"]
        else:
            prefilled, decoded = lane(), decode()
        tail = [torch.cat(engine.step([(a, x, None), (b, y, None), (c, z, None)])) for x, y, z in after]
        return torch.cat(prefilled + decoded + tail)

    engines = [BackboneEngine(model, max_sessions=4, max_context=300) for _ in range(2)]
    for engine in engines:
        engine.warm_up()
    replays = model.graph_replays
    want = run(engines[0], concurrent=False)
    got = run(engines[1], concurrent=True)
    assert model.graph_replays - replays == 2 * (len(decodes) + len(after))
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


# --------------------------------------------------------------------------------------------
# The scheduler over the real engine and tower
# --------------------------------------------------------------------------------------------

class _LaneRecorder(Recorder):
    """Records which thread computed each step; holds the lane steps `hold_if(work)` picks until
    `go` is set."""

    def __init__(self, engine, tower):
        super().__init__(engine, tower)
        self.calls: list[tuple[bool, list, float, float]] = []   # (on the lane, work, start, end)
        self.hold_if = lambda work: False
        self.holding, self.go = threading.Event(), threading.Event()

    def launch_to_host(self, work, **kwargs):
        lane = threading.current_thread().name.startswith(LANE)
        started = time.monotonic()
        if lane and self.hold_if(work):
            self.holding.set()
            assert self.go.wait(60)
        out = super().launch_to_host(work, **kwargs)
        self.calls.append((lane, work, started, time.monotonic()))
        return out


@pytest.fixture
async def stage(backbone_model, tower_addr, tiny_config):
    async with scheduler_factory(backbone_model, tower_addr, tiny_config, recorder_cls=_LaneRecorder,
                                 max_sessions=4, max_context=MAX_CONTEXT) as make:
        yield make


async def _codes(scheduler, session) -> list[torch.Tensor]:
    """Each chunk's frames [T, N] (empty for a chunk that stopped at once)."""
    events = [e async for e in scheduler.events(session)]
    assert isinstance(events[-1], Usage), events[-1]
    chunks = [e.chunk_index for e in events if isinstance(e, ChunkEnd)]
    return [torch.cat([e.codes for e in events if isinstance(e, FramesOut) and e.chunk_index == c]
                      or [torch.empty(0, 10, dtype=torch.int64)]) for c in chunks]


async def test_a_step_the_tower_client_fails_to_send_ends_its_sessions(stage):
    """A send that raises (not TowerUnavailable: a client bug, or a stream dropped mid-send) for a
    lane step: its sessions had their rows counted as sent, so they must end with an error, not
    wait forever for a draw; later sessions are served."""
    scheduler, rec = await stage(prefill_lane=True, max_sessions=3)
    send, failed = rec.tower_send, []

    async def flaky_send(step):
        if not failed and any(e.n_rows > 1 for e in step.entries):     # the first lane step
            failed.append(step)
            raise RuntimeError("no stream")
        return await send(step)
    rec.tower_send = flaky_send
    first = scheduler.submit(_job("lost", turns=("one",), max_new=3))
    with pytest.raises(GenerateError) as ended:
        await asyncio.wait_for(_codes(scheduler, first), 60)
    assert failed and ended.value.status == "UNAVAILABLE", ended.value
    again = await asyncio.wait_for(_codes(scheduler, scheduler.submit(_job("next", turns=("one",), max_new=3))), 60)
    assert len(again) == 1


@pytest.mark.parametrize("piece", [7, 2])
async def test_frames_are_bit_identical_with_the_lane_on_and_off(stage, piece):
    """Four sessions at once, two chunks each, prompts cut into pieces of at most `piece` rows
    (2: the first chunk's 29 rows end in a one-row piece, which goes with the decode rows), two
    groups in flight at a slow tower: same frames either way. With the lane, lane steps hold only prefill
    pieces of two rows or more, and the main loop's steps only one-row segments."""
    runs = {}
    for lane in (False, True):
        scheduler, rec = await stage(prefill_lane=lane, prefill_chunk_tokens=piece,
                                     step_prefill_rows=2 * piece, max_inflight_steps=2)
        rec.delay_s = 0.02
        sessions = [scheduler.submit(_job(f"s{i}", seed=60 + i, turns=("ones", "two words"), max_new=6))
                    for i in range(4)]
        runs[lane] = await asyncio.gather(*[_codes(scheduler, s) for s in sessions])
        on_lane = [work for is_lane, work, _, _ in rec.calls if is_lane]
        main = [work for is_lane, work, _, _ in rec.calls if not is_lane]
        if lane:
            assert len(on_lane) >= 8                     # 4 sessions x 2 chunks, several pieces each
            assert all(len(ids) >= 2 for work in on_lane for _, ids, _ in work)
            assert all(len(ids) == 1 for work in main for _, ids, _ in work)
            assert sum(len(work) > 1 for work in on_lane) >= 1   # sessions share lane steps
            assert scheduler.lane_steps == len(on_lane)
            # A prompt's last rows are text (assistant_open): a text row computed on the main
            # thread is a one-row prefill piece. Pieces of 7 never leave one row behind; with
            # pieces of 2 an odd prompt does.
            one_row_pieces = sum(bool((frames == -1).all()) for work in main for _, _, frames in work)
            assert (one_row_pieces > 0) == (piece == 2)
        else:
            assert not on_lane
        assert rec.engine.free_slots == 4
    for off, on in zip(runs[False], runs[True]):
        assert len(off) == len(on) == 2
        assert all(torch.equal(a, b) for a, b in zip(off, on))


async def test_decoding_goes_on_during_a_lane_step_and_a_cancel_there_ends_cleanly(stage):
    """A session is cancelled while the lane computes its prefill: the running stream keeps its
    frames coming meanwhile (and finishes), the cancelled one ends without an error, none of its
    rows reach the tower, and its slot stays taken until the lane step has ended."""
    scheduler, rec = await stage(prefill_lane=True, max_sessions=3)
    keep = scheduler.submit(_job("keep", seed=2, turns=("a long one",), max_new=40, first=1, every=1))
    # (seed 2 draws no EOS within 40 frames: keep decodes all along the held lane step)
    frames_at: list[float] = []

    async def consume():
        async for event in scheduler.events(keep):
            if isinstance(event, FramesOut):
                frames_at.append(time.monotonic())
    consumer = asyncio.create_task(consume())
    while len(frames_at) < 2:                            # keep is decoding
        await asyncio.sleep(0.01)
    gone = scheduler.submit(_job("gone", turns=("bye",), max_new=5))
    rec.hold_if = lambda work: any(slot == gone.slot for slot, _, _ in work)
    assert await asyncio.to_thread(rec.holding.wait, 30)   # the lane holds gone's prefill
    held_at = time.monotonic()
    scheduler.cancel(gone)
    events = [e async for e in scheduler.events(gone)]   # ended without an error
    assert [type(e).__name__ for e in events] == ["Started"]
    await asyncio.wait_for(consumer, 60)                 # keep decoded to its end meanwhile
    assert len([t for t in frames_at if t > held_at]) >= 10
    assert rec.engine.free_slots == 2                    # gone's slot: held by the lane step
    rec.go.set()
    end = time.monotonic() + 10
    while rec.engine.free_slots != 3 and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert rec.engine.free_slots == 3
    assert all(e.session_id != "gone" for s in rec.steps for e in s.entries)
    assert [e.session_id for s in rec.steps for e in s.entries if e.draw] == ["keep"] * len(frames_at)


async def test_a_tower_loss_fails_the_streams_it_held_and_a_lane_prefill_goes_on_after(stage, tiny_checkpoint):
    """The tower dies while the lane computes a new session's first piece: the decoding stream
    (tower state) fails UNAVAILABLE; the new session (none yet) waits, computed, for the tower
    to come back, then runs to its end with the frames it gives on an untouched stack."""
    job = lambda name: _job(name, seed=4, turns=("hi",), max_new=6)   # noqa: E731
    scheduler, _ = await stage()
    want = await _codes(scheduler, scheduler.submit(job("reference")))

    tower = TowerProcess(tiny_checkpoint)
    await tower.start()
    try:
        scheduler, rec = await stage(tower=tower.addr, prefill_lane=True)
        doomed = scheduler.submit(_job("doomed", seed=2, turns=("a long one",), max_new=40))
        async for event in scheduler.events(doomed):
            if isinstance(event, FramesOut):
                break
        late = scheduler.submit(job("late"))
        rec.hold_if = lambda work: any(slot == late.slot for slot, _, _ in work)
        assert await asyncio.to_thread(rec.holding.wait, 30)
        tower.kill()
        with pytest.raises(GenerateError) as info:
            async for _ in scheduler.events(doomed):
                pass
        assert info.value.status == "UNAVAILABLE"
        rec.go.set()                                     # computed while the tower is away
        await asyncio.sleep(0.3)
        assert late.state == "active" and late.sent == 0 and scheduler.lane_steps == 1
        await tower.start()                              # same port: the client reconnects
        got = await asyncio.wait_for(_codes(scheduler, late), 60)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        assert rec.engine.free_slots == 4
    finally:
        tower.kill()


class _IdleEngine:
    """Just enough engine for a scheduler without sessions (release-only steps)."""

    max_sessions, max_context, hidden_size, num_codebooks = 2, 16, 8, 2
    hidden_dtype = torch.float32
    free_slots = 2


class _HeldTower:
    """A tower whose answers the test gives, when it likes."""

    ready, max_inflight_steps = True, 1

    def __init__(self):
        self.answers: list[asyncio.Future] = []

    async def send(self, step):
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]


async def test_close_ends_the_lane_when_the_last_answer_wakes_it_just_before():
    """The answer to the last step (release-only) is routed just before close() cancels the main
    loop: `_finish_step` wakes the lane, and close() cancels the lane right after. The lane must
    end all the same (with asyncio.wait_for in its sleep, Python 3.11 dropped that cancel and
    close() waited forever: a CI run hung in the voice-prefix test's teardown). The closer wakes
    0-3 loop callbacks after the answer."""
    loop = asyncio.get_running_loop()
    for hops in range(4):
        tower = _HeldTower()
        scheduler = Scheduler(_IdleEngine(), tower, semantic_start_token_id=0, prefill_lane=True,
                              prefill_chunk_tokens=4)
        scheduler.start()
        scheduler._release.append("gone")          # a session ended: a release-only step goes out
        while not tower.answers:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)                  # both coroutines asleep, the step at the tower
        gate = loop.create_future()

        async def close():
            await gate
            await scheduler.close()
        closing = loop.create_task(close())
        await asyncio.sleep(0)                     # the closer waits at the gate

        def open_gate(n):
            if n:
                loop.call_soon(open_gate, n - 1)
            else:
                gate.set_result(None)
        tower.answers[0].set_result(TowerResult(torch.empty(0, 2, dtype=torch.int64), [], {}))
        loop.call_soon(open_gate, hops)
        done, _ = await asyncio.wait([closing], timeout=2)
        if not done:                               # leave no lane behind in the session's loop
            scheduler._lane_task.cancel()
            await asyncio.wait([closing], timeout=2)
        assert done, f"close() did not end (closer woken {hops} callbacks after the answer)"


# --------------------------------------------------------------------------------------------
# Through Generate: the voice-prefix cache with the lane
# --------------------------------------------------------------------------------------------

async def _lane_backbone(checkpoint, tower_addr, lane: bool, **options) -> _Backbone:
    running = await _start_backbone(checkpoint, tower_addr, prefix_cache_mb=64, prefill_lane=lane, **options)
    assert running.scheduler.prefill_lane == lane
    return _Backbone(running)


async def test_the_voice_prefix_cache_gives_the_same_frames_with_the_lane(tiny_checkpoint, tower_addr):
    """Concurrent first uses (stores), then hits, two chunks each: the same frames with the lane
    on and off, and the same rows skipped."""
    results, skipped = {}, {}
    for lane in (False, True):
        backbone = await _lane_backbone(tiny_checkpoint, tower_addr, lane, prefill_chunk_tokens=48)
        try:
            first = await asyncio.gather(*[backbone.codes(f"first-{seed}", seed) for seed in SEEDS])
            again = await asyncio.gather(*[backbone.codes(f"again-{seed}", seed) for seed in SEEDS])
            results[lane] = first + again
            assert (backbone.scheduler.lane_steps > 0) == lane
            skipped[lane] = backbone.scheduler.prefix_rows_skipped
            assert backbone.scheduler.engine.free_slots == MAX_ROWS
        finally:
            await backbone.close()
    assert skipped[True] == skipped[False] > 0
    for off, on in zip(results[False], results[True]):
        assert all(torch.equal(a, b) for a, b in zip(off, on))


async def test_a_lost_tower_snapshot_falls_back_with_the_lane_too(tiny_checkpoint, tower_addr):
    """A tower that keeps no snapshots answers every restore FAILED_PRECONDITION: with the lane
    the backbone prefills the whole prompt again, and the frames equal those of a full tower."""
    backbone = await _lane_backbone(tiny_checkpoint, tower_addr, False)
    try:
        want = await asyncio.gather(*[backbone.codes(f"want-{seed}", seed) for seed in SEEDS])
    finally:
        await backbone.close()
    proc, forgetful = await _tower(tiny_checkpoint, DRAMA_PREFIX_CACHE_MB="0")
    backbone = await _lane_backbone(tiny_checkpoint, forgetful, True, prefill_chunk_tokens=16)
    try:
        got = await asyncio.gather(*[backbone.codes(f"lost-{seed}", seed) for seed in SEEDS])
        for a, b in zip(want, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert backbone.scheduler.prefix_fallbacks >= len(SEEDS)
        assert backbone.scheduler.lane_steps > 0
        assert backbone.scheduler.engine.free_slots == MAX_ROWS
    finally:
        await backbone.close()
        proc.kill()
        proc.wait(10)


def test_the_lane_setting_defaults_to_cuda_devices_and_reads_the_environment(monkeypatch):
    from services.backbone import __main__ as entry
    from services.backbone.server import Settings, prefill_lane_for

    assert prefill_lane_for(Settings(checkpoint="x", tower_addr="y", device="cuda:0"))
    assert not prefill_lane_for(Settings(checkpoint="x", tower_addr="y", device="cpu"))
    assert prefill_lane_for(Settings(checkpoint="x", tower_addr="y", device="cpu", prefill_lane=True))
    assert not prefill_lane_for(Settings(checkpoint="x", tower_addr="y", device="cuda", prefill_lane=False))
    for value, want in (("1", True), ("0", False), ("off", False), ("", None)):
        monkeypatch.setenv("DRAMA_PREFILL_LANE", value)
        assert entry.parse_args(["--checkpoint", "x"]).prefill_lane is want
    with pytest.raises(ValueError, match="two rows"):
        Scheduler(None, None, semantic_start_token_id=0, prefill_chunk_tokens=1, prefill_lane=True)

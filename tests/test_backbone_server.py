"""Backbone service layer: the chunk plan and targets (pure functions), request validation, and
the scheduler driving the real engine against a real tower server.

The end-to-end Generate tests over gRPC are in test_generate_e2e.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import types
from unittest import mock

import pytest
import torch

from services.backbone.scheduler import (ChunkEnd, FramesOut, GenerateError, Job, Prompt, Rows,
                                         Sampling, Scheduler, Started, TowerStep, Usage,
                                         audio_rows, check_context, plan_chunk, row_targets,
                                         text_rows)

N = 10            # tiny checkpoint codebooks
SEMANTIC_START = 284


def _text(*ids: int) -> Rows:
    return text_rows(torch.tensor(ids), N)


def _audio(n_frames: int, first: int = 0) -> Rows:
    codes = (torch.arange(n_frames * N).reshape(N, n_frames) + first) % 32   # [N, T]
    return audio_rows(codes, SEMANTIC_START)


def _prompt(system=None, history=(), turns=((10, 11),), open_=(20, 21), close=(22,)) -> Prompt:
    return Prompt(system=system if system is not None else _text(),
                  history=list(history), user_turns=[_text(*t) for t in turns],
                  assistant_open=_text(*open_), assistant_close=_text(*close))


# --------------------------------------------------------------------------------------------
# Rows, targets and the chunk plan
# --------------------------------------------------------------------------------------------

def test_audio_rows_token_id_is_semantic_start_plus_c0():
    codes = torch.tensor([[3, 7]] + [[1, 2]] * (N - 1))      # [N, 2]
    rows = audio_rows(codes, SEMANTIC_START)
    assert rows.token_ids.tolist() == [SEMANTIC_START + 3, SEMANTIC_START + 7]
    assert rows.frames[:, 0].tolist() == [3, 7] and rows.frames.shape == (2, N)
    assert (rows.n_text, rows.n_audio) == (0, 2)


def test_targets_are_the_next_rows_frame_where_it_is_audio():
    rows = Rows.cat([_text(1), _audio(2), _text(2, 3), _audio(1, first=5)])
    targets = row_targets(rows.frames)
    assert targets[0].tolist() == rows.frames[1].tolist()     # text -> audio
    assert targets[1].tolist() == rows.frames[2].tolist()     # audio -> audio
    assert (targets[2] == -1).all()                            # audio -> text
    assert (targets[3] == -1).all()                            # text -> text
    assert targets[4].tolist() == rows.frames[5].tolist()     # text -> audio
    assert (targets[5] == -1).all()                            # last row: the draw row


def test_first_chunk_is_system_history_turn_open():
    system, take = Rows.cat([_text(1, 2), _audio(3)]), _text(7, 7, 7)
    prompt = _prompt(system=system, history=[take], turns=[(10, 11), (12,)])
    rows = plan_chunk(prompt, 0, None, row_budget=100, semantic_start_token_id=SEMANTIC_START)
    expect = Rows.cat([system, take, _text(10, 11, 20, 21)])
    assert torch.equal(rows.token_ids, expect.token_ids) and torch.equal(rows.frames, expect.frames)


def test_later_chunk_splices_the_previous_chunk_and_its_frames():
    prompt = _prompt(system=_text(1), history=[_text(7)], turns=[(10, 11), (12,)])
    previous = _audio(4).frames.T                                  # [N, 4]
    rows = plan_chunk(prompt, 1, previous, row_budget=100, semantic_start_token_id=SEMANTIC_START)
    expect = Rows.cat([_text(1), _text(7), _text(10, 11, 20, 21),
                       audio_rows(previous, SEMANTIC_START), _text(22), _text(12, 20, 21)])
    assert torch.equal(rows.token_ids, expect.token_ids) and torch.equal(rows.frames, expect.frames)


def test_trimming_drops_history_oldest_first_then_the_previous_chunk():
    old, new = _text(7, 7, 7), _text(8, 8)
    prompt = _prompt(system=_text(1), history=[old, new], turns=[(10,), (12,)])
    previous = _audio(2).frames.T
    plan = lambda budget: plan_chunk(prompt, 1, previous, row_budget=budget,
                                     semantic_start_token_id=SEMANTIC_START)
    # whole: 1 + 3 + 2 + (1 + 2 + 2 + 1) + (1 + 2) = 15 rows
    assert len(plan(15)) == 15
    assert 7 not in plan(14).token_ids.tolist() and 8 in plan(14).token_ids.tolist()
    assert len(plan(10)) == 10 and 8 not in plan(10).token_ids.tolist()        # history gone
    assert plan(9).token_ids.tolist() == [1, 12, 20, 21]                       # previous gone too
    with pytest.raises(GenerateError) as info:
        plan(3)
    assert info.value.status == "OUT_OF_RANGE"


@pytest.mark.parametrize("sizes, budget, param", [
    ((8, 1, 1), 9, "references"), ((1, 8, 1), 9, "history"), ((1, 1, 8), 9, "text")],
    ids=["references", "history", "text"])
def test_first_chunk_is_never_trimmed_and_names_the_largest_part(sizes, budget, param):
    n_system, n_history, n_text = sizes
    prompt = _prompt(system=_text(*[1] * n_system), history=[_text(*[7] * n_history)],
                     turns=[[10] * (n_text - 1)], open_=(20,))
    check_context(prompt, budget + 1)                     # fits exactly with one row to spare
    with pytest.raises(GenerateError) as info:
        check_context(prompt, budget)
    assert (info.value.status, info.value.drama_code, info.value.param) == (
        "OUT_OF_RANGE", "context_length_exceeded", param)


def test_a_later_chunk_that_cannot_fit_even_alone_is_refused_at_admission():
    prompt = _prompt(system=_text(1), turns=[(10,), [12] * 20])
    with pytest.raises(GenerateError) as info:
        check_context(prompt, 10)
    assert info.value.param == "text"


# --------------------------------------------------------------------------------------------
# The scheduler over the real engine and a real tower
# --------------------------------------------------------------------------------------------
# The tower runs as `python -m services.tower` (its own process, as deployed); the scheduler and
# engine run in this process. Only the failure-injection test alters what the tower answers.

IM_START, IM_END, VOICE = 258, 259, 263
POOL_ROWS, POOL_CONTEXT = 4, 256
# A job that runs for seconds whatever its draws: an EOS only ends one of its many chunks.
LONG = dict(turns=("a long one",) * 20, max_new=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
async def tower_addr(tiny_checkpoint):
    from services.common.grpcutil import check_health
    port = _free_port()
    env = dict(os.environ, DRAMA_MAX_ROWS=str(POOL_ROWS), DRAMA_MAX_CONTEXT_TOKENS=str(POOL_CONTEXT),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "services.tower", "--checkpoint", str(tiny_checkpoint),
                             "--port", str(port), "--device", "cpu"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    addr = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while await check_health(addr, timeout=0.5) != "SERVING":
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < end, "tower did not start"
            await asyncio.sleep(0.1)
        yield addr
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def backbone_model(tiny_checkpoint):
    from services.backbone.weights import load_backbone
    return load_backbone(tiny_checkpoint, device="cpu", dtype=torch.float32, lm_head=False)


class Recorder:
    """Wraps the real engine and tower client, keeping what the scheduler sent them."""

    def __init__(self, engine, tower):
        self.engine, self.tower = engine, tower
        self.work: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = []
        self.steps: list[TowerStep] = []
        self.inject = None         # optional failure injection: (step, result) -> result
        self.delay_s = 0.0         # optional slow tower: answers reach the scheduler this late
        self.sent: list[asyncio.Future] = []   # the tower's answers, one per step
        self.overlap = 0           # the most steps at the tower while the engine computed

    def __getattr__(self, name):   # everything else is the real engine's
        return getattr(self.engine, name)

    def launch_to_host(self, work, **kwargs):  # the engine side (on the engine thread)
        self.work.append(work)
        self.overlap = max(self.overlap, sum(not f.done() for f in list(self.sent)))
        return self.engine.launch_to_host(work, **kwargs)

    async def tower_send(self, step: TowerStep) -> asyncio.Future:
        self.steps.append(step)
        future = await self.tower.send(step)
        if self.inject is None and not self.delay_s:
            self.sent.append(future)
            return future
        loop = asyncio.get_running_loop()
        altered = loop.create_future()

        def alter(done: asyncio.Future) -> None:
            if done.exception() is not None:
                altered.set_exception(done.exception())
            else:
                altered.set_result(self.inject(step, done.result()) if self.inject else done.result())
        future.add_done_callback(lambda done: loop.call_later(self.delay_s, alter, done))
        self.sent.append(altered)
        return altered


class _TowerSide:
    """The tower as the scheduler sees it, through the recorder."""

    def __init__(self, recorder):
        self.recorder = recorder

    @property
    def ready(self) -> bool:
        return self.recorder.tower.ready

    @property
    def max_inflight_steps(self) -> int:
        return self.recorder.tower.max_inflight_steps

    async def send(self, step):
        return await self.recorder.tower_send(step)


@contextlib.asynccontextmanager
async def scheduler_factory(backbone_model, tower_addr, tiny_config, *, recorder_cls=None,
                            max_sessions: int = POOL_ROWS, max_context: int = POOL_CONTEXT):
    """`make(tower=None, max_sessions=..., **scheduler_kwargs) -> (scheduler, recorder)`: a scheduler
    over a fresh engine and a real TowerClient, both sides recorded; leaving closes them all."""
    from services.backbone.engine import BackboneEngine
    from services.backbone.tower_client import TowerClient

    made = []

    async def make(tower=None, **kwargs):
        engine = BackboneEngine(backbone_model, max_sessions=kwargs.pop("max_sessions", max_sessions),
                                max_context=max_context)
        client = TowerClient(tower or tower_addr, hidden_dim=engine.hidden_size, hidden_dtype=engine.hidden_dtype,
                             codebooks=tiny_config.num_codebooks, max_rows=engine.max_sessions,
                             max_context_tokens=max_context)
        recorder = (recorder_cls or Recorder)(engine, client)
        scheduler = Scheduler(recorder, kwargs.pop("tower_side", _TowerSide)(recorder),
                              semantic_start_token_id=tiny_config.semantic_start_token_id,
                              max_rows=engine.max_sessions, **kwargs)
        client.on_lost = scheduler.tower_lost
        client.start()
        assert await client.wait_ready(30), client.last_error
        scheduler.start()
        made.append((scheduler, client))
        return scheduler, recorder

    try:
        yield make
    finally:
        for scheduler, client in made:
            await scheduler.close()
            await client.close()


@pytest.fixture
async def stage(backbone_model, tower_addr, tiny_config):
    """A scheduler over a fresh engine, both sides recorded; tear down frees everything."""
    async with scheduler_factory(backbone_model, tower_addr, tiny_config) as make:
        yield make


def _job(session_id, *, seed=5, turns=("hello", "world"), history=1, max_new=5, first=2, every=3,
         queue_timeout_s=None) -> Job:
    gen = torch.Generator().manual_seed(7)
    ref = torch.randint(0, 32, (N, 3), generator=gen)
    take = torch.randint(0, 32, (N, 2), generator=gen)
    prompt = Prompt(
        system=Rows.cat([_text(IM_START, 115, 10), _audio_of(ref), _text(IM_END)]),
        history=[Rows.cat([_text(IM_START, 117, 10, IM_END, IM_START, 97, VOICE), _audio_of(take),
                           _text(IM_END)]) for _ in range(history)],
        user_turns=[_text(IM_START, 117, 10, *t.encode(), IM_END) for t in turns],
        assistant_open=_text(IM_START, 97, 10, VOICE), assistant_close=_text(IM_END))
    return Job(session_id, prompt, Sampling(0.9, 0.95, 0, 1.0, seed, max_new),
               first_message_frames=first, message_frames=every, queue_timeout_s=queue_timeout_s)


def _audio_of(codes: torch.Tensor) -> Rows:
    return audio_rows(codes, SEMANTIC_START)


async def _run(scheduler, session) -> list:
    return [event async for event in scheduler.events(session)]


async def test_scheduler_sends_every_row_once_in_order_with_its_target(stage):
    scheduler, rec = await stage(prefill_chunk_tokens=7)
    job = _job("rows", max_new=4)
    events = await _run(scheduler, scheduler.submit(job))
    assert isinstance(events[0], Started) and isinstance(events[-1], Usage)
    ends = [e for e in events if isinstance(e, ChunkEnd)]
    frames = {c: torch.cat([e.codes for e in events if isinstance(e, FramesOut) and e.chunk_index == c])
              for c in range(2) if ends[c].n_frames}
    # Replay the chunk plan from what was generated and compare with what the tower saw.
    engine_calls = iter(rec.work)
    timelines, current, released_before = [], None, []
    for step in rec.steps:
        released_before.extend(step.release)
        work = next(engine_calls) if step.entries else []
        assert len(work) == len(step.entries)
        offset = 0
        for entry, (_, token_ids, row_frames) in zip(step.entries, work):
            if entry.first_row == 0:
                current = []
                timelines.append((current, list(released_before)))
            current.append((entry, step.targets[offset:offset + entry.n_rows], token_ids, row_frames))
            offset += entry.n_rows
    assert len(timelines) == 2
    previous = None
    for chunk, (entries, released) in enumerate(timelines):
        assert released.count("rows") == chunk          # the previous timeline was released first
        rows = plan_chunk(job.prompt, chunk, previous, row_budget=POOL_CONTEXT - 4,
                          semantic_start_token_id=SEMANTIC_START)
        prompt_len, position, prefill, decoded, draws = len(rows), 0, [], [], []
        for entry, targets, token_ids, row_frames in entries:
            assert entry.first_row == position and entry.take_index == chunk
            assert entry.n_rows == len(token_ids)
            if position < prompt_len:
                assert entry.n_rows <= 7
                prefill.append((targets, token_ids, row_frames))
                assert entry.draw == (position + entry.n_rows == prompt_len)
            else:
                assert entry.n_rows == 1 and entry.draw and (targets == -1).all()
                assert token_ids[0] == SEMANTIC_START + row_frames[0, 0]
                decoded.append(row_frames[0])
            if entry.draw:
                draws.append(entry.frame_index)
            position += entry.n_rows
        assert torch.equal(torch.cat([p[0] for p in prefill]), row_targets(rows.frames))
        assert torch.equal(torch.cat([p[1] for p in prefill]), rows.token_ids)
        assert torch.equal(torch.cat([p[2] for p in prefill]), rows.frames)
        n = ends[chunk].n_frames
        assert draws == list(range(len(draws)))
        generated = frames[chunk] if n else torch.empty(0, N, dtype=torch.int64)
        # every drawn frame becomes the next row, except a LENGTH chunk's last one
        appended = n - (1 if ends[chunk].finish_reason == "LENGTH" else 0)
        assert position == prompt_len + appended
        assert decoded == [] if appended == 0 else torch.equal(torch.stack(decoded), generated[:appended])
        previous = generated.T
    assert rec.engine.free_slots == POOL_ROWS


@pytest.mark.parametrize("lane", [False, True], ids=["main", "lane"])
async def test_a_prompt_is_cut_on_its_own_grid_whatever_else_prefills(stage, lane):
    """A session's prompt is cut into the same pieces alone and beside other prompts: on the GPU
    another cut changes bits (GDN chunks restart at each piece), so batch invariance needs it. The
    step budget (7 rows) holds one piece of 5; a second session's piece waits for the next step
    whole instead of taking the 2 rows left."""
    cuts = {}
    for others in (0, 2):
        scheduler, rec = await stage(prefill_lane=lane, prefill_chunk_tokens=5, step_prefill_rows=7)
        sessions = [scheduler.submit(_job(f"o{i}", seed=20 + i, max_new=3)) for i in range(others)]
        sessions.append(scheduler.submit(_job("probe", seed=9, max_new=3)))
        await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        cuts[others] = [(e.first_row, e.n_rows) for step in rec.steps for e in step.entries
                        if e.session_id == "probe" and not (e.n_rows == 1 and e.first_row > 0 and e.draw)]
        pieces = [e.n_rows for step in rec.steps for e in step.entries if e.n_rows > 1]
        assert pieces and all(n <= 5 for n in pieces)
        assert all(sum(e.n_rows for e in step.entries if e.n_rows > 1) <= 7 for step in rec.steps)
    assert cuts[0] == cuts[2], (cuts[0], cuts[2])


async def test_pipelined_steps_give_each_session_the_frames_of_sequential_steps(stage):
    """Two groups at the tower at once (while one is at the tower the engine computes the
    other) change nothing for any session: same frames as one step at a time."""
    runs = {}
    for inflight in (1, 2):
        scheduler, rec = await stage(max_inflight_steps=inflight)
        rec.delay_s = 0.05         # a slow tower: the engine has time to compute the other group
        sessions = [scheduler.submit(_job(f"p{i}", seed=40 + i, turns=("one", "two"), max_new=6))
                    for i in range(POOL_ROWS)]
        results = await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        runs[inflight] = [torch.cat([e.codes for e in r if isinstance(e, FramesOut)]) for r in results]
        assert (rec.overlap > 0) == (inflight > 1)
    for sequential, pipelined in zip(runs[1], runs[2]):
        assert torch.equal(sequential, pipelined)


async def test_inline_steps_run_on_the_loop_thread_and_give_the_engine_threads_frames(stage):
    """inline_steps: the main loop's engine steps run on the event loop's thread, two thread
    hand-offs fewer per frame, and every session gets exactly the frames the engine thread
    computes. The default: inline on CUDA with one step in flight and no prompt prefilling on
    the lane; on the CPU (a step is the compute itself) always the engine thread."""
    runs = {}
    for inline in (True, False):
        scheduler, rec = await stage(max_inflight_steps=1, inline_steps=inline)
        threads, engine_step = set(), rec.launch_to_host
        rec.launch_to_host = lambda work, **kw: (threads.add(threading.current_thread()), engine_step(work, **kw))[1]
        sessions = [scheduler.submit(_job(f"i{i}", seed=60 + i, turns=("one", "two"), max_new=5))
                    for i in range(POOL_ROWS)]
        results = await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        runs[inline] = [torch.cat([e.codes for e in r if isinstance(e, FramesOut)]) for r in results]
        assert (threads == {threading.current_thread()}) == inline, threads
    for inline, thread in zip(runs[True], runs[False]):
        assert torch.equal(inline, thread)
    scheduler, _ = await stage(max_inflight_steps=1)
    assert not scheduler._steps_inline()                 # the CPU
    scheduler._on_cuda = True                             # as on a GPU
    assert scheduler._steps_inline()
    scheduler, _ = await stage(max_inflight_steps=2)
    scheduler._on_cuda = True
    assert not scheduler._steps_inline()
    # with the prefill lane, not while a prompt is prefilling: the lane plans its pieces on the loop
    scheduler, _ = await stage(max_inflight_steps=1, prefill_lane=True)
    scheduler._on_cuda = True
    assert scheduler._steps_inline()
    scheduler._active.append(types.SimpleNamespace(prefilling=True))
    assert not scheduler._steps_inline()
    scheduler._active.pop()


class _HostHandOff:
    """What the scheduler uses of the device hand-off's Mailbox (can_publish, publish), keeping
    the published rows on the host: the tower of these tests runs on the CPU, with no GPU memory
    to share (tests/test_device_handoff.py checks the real one on a GPU)."""

    def __init__(self, rows: int):
        self.rows, self.seq, self.published = rows, 0, {}

    def can_publish(self, n_rows: int) -> bool:
        return 0 < n_rows <= self.rows

    def publish(self, hidden: torch.Tensor) -> int:
        self.seq += 1
        self.published[self.seq] = hidden.clone()
        return self.seq


class _HandOffTowerSide(_TowerSide):
    """A tower side with a hand-off: a step sent with `handoff_seq` reaches the real tower with the
    rows published under that number, as the tower's Inbox would give them to its engine."""

    def __init__(self, recorder):
        super().__init__(recorder)
        self.handoff = _HostHandOff(POOL_ROWS)
        self.handed: list[TowerStep] = []

    async def send(self, step):
        if step.handoff_seq:
            self.handed.append(step)
            assert self.recorder.engine._busy, "sent while its step is still the engine's (before finish)"
            step = dataclasses.replace(step, hidden=self.handoff.published.pop(step.handoff_seq), handoff_seq=0)
        return await self.recorder.tower_send(step)


async def test_decode_steps_through_a_device_handoff_give_the_same_frames(stage):
    """With a device hand-off (services/common/device_handoff.py) the main loop's inline decode
    steps publish their rows and are sent before the step's wait; prompt pieces and steps that
    do not fit go the usual way; every session gets the frames it gets without one."""
    runs = {}
    for handoff in (True, False):
        kwargs = dict(tower_side=_HandOffTowerSide) if handoff else {}
        scheduler, rec = await stage(max_inflight_steps=1, inline_steps=True, **kwargs)
        sessions = [scheduler.submit(_job(f"h{i}", seed=70 + i, turns=("one", "two"), max_new=6))
                    for i in range(POOL_ROWS)]
        results = await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        runs[handoff] = [torch.cat([e.codes for e in r if isinstance(e, FramesOut)]) for r in results]
        if handoff:
            side = scheduler.tower
            assert side.handed and not side.handoff.published          # every published step was sent
            assert all(e.draw and e.n_rows == 1 for step in side.handed for e in step.entries)
            # the prompts went with their rows
            assert any(not step.handoff_seq and any(e.n_rows > 1 for e in step.entries) for step in rec.steps)
            scheduler.inline_steps = False                             # not inline: never
            assert scheduler._handoff_for([types.SimpleNamespace(draw=True, rows=[0], store=False,
                                                                 restore=False)]) is None
    for handed, plain in zip(runs[True], runs[False]):
        assert torch.equal(handed, plain)


class _HostChain(_HostHandOff):
    """_HostHandOff with the way back (frames_ready, fill), on the host: the frames of a step sent
    through it are kept under its seq, and `fill` turns them into the next step's ids and codes
    as device_handoff._fill_kernel does (a stopped or out-of-range frame: a padding row)."""

    frames_ready = True

    def __init__(self, rows: int):
        super().__init__(rows)
        self.frames: dict[int, torch.Tensor] = {}
        self.filled: list[int] = []

    def fill(self, seq, ids, codes, token_offset, semantic_codes, residual_codes) -> None:
        self.filled.append(seq)
        for r, frame in enumerate(self.frames[seq][:len(ids)].tolist()):
            c, stop = frame[:-1], frame[-1]
            bad = stop or not 0 <= c[0] < semantic_codes or any(not 0 <= x < residual_codes for x in c[1:])
            ids[r] = 0 if bad else token_offset + c[0]
            codes[r] = torch.tensor([-1] * len(c) if bad else c)

    late = 0                           # fills that give up, from the next one on

    def fill_timed_out(self) -> bool:
        if self.late:
            self.late -= 1
            return True
        return False


class _ChainTowerSide(_HandOffTowerSide):
    """A hand-off tower side that passes frames back: a hand-off step's answer is awaited here
    (on the CPU a chained step computes at its launch, so its frames must be known by then) and
    handed to the scheduler one loop turn later, as if still at the tower when the loop plans."""

    def __init__(self, recorder):
        super().__init__(recorder)
        self.handoff = _HostChain(POOL_ROWS)

    async def send(self, step):
        seq = step.handoff_seq
        future = await super().send(step)
        if not seq:
            return future
        result = await future
        self.handoff.frames[seq] = torch.cat([result.codes, torch.tensor(result.stop, dtype=torch.int64)[:, None]], 1)
        later = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(later.set_result, result)
        return later


async def test_chained_steps_give_the_same_frames(stage):
    """chain_steps: with a hand-off that passes frames back, the main loop queues a group's next
    decode step on the frames of the step still at the tower (Mailbox.fill); every session gets
    the frames it gets without chaining and without any hand-off; a chained request's frame index
    runs on from its predecessor's; prompt steps and sessions joining break the chain."""
    runs, chained = {}, {}
    for name, kwargs in (("chain", dict(tower_side=_ChainTowerSide)),
                         ("no-chain", dict(tower_side=_ChainTowerSide, chain_steps=False)),
                         ("plain", {})):
        scheduler, rec = await stage(max_inflight_steps=1, inline_steps=True, **kwargs)
        sessions = [scheduler.submit(_job(f"c{i}", seed=80 + i, turns=("one", "two"), max_new=7))
                    for i in range(2)]
        results = await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        runs[name] = [torch.cat([e.codes for e in r if isinstance(e, FramesOut)]) for r in results]
        chained[name] = scheduler.chained_steps
        if name == "chain":
            side = scheduler.tower
            assert side.handoff.filled and set(side.handoff.filled) <= set(side.handoff.frames)
            # frame indices never repeat within a take
            indices = collections.Counter((e.session_id, e.take_index, e.frame_index)
                                          for step in rec.steps for e in step.entries if e.draw)
            assert max(indices.values()) == 1, indices
        assert not scheduler._active and scheduler.engine.free_slots == POOL_ROWS
    assert chained["chain"] > 4 and chained["no-chain"] == chained["plain"] == 0
    for a, b, c in zip(runs["chain"], runs["no-chain"], runs["plain"]):
        assert torch.equal(a, b) and torch.equal(a, c)


async def test_a_chained_step_after_a_frame_that_stops_is_dropped(stage):
    """EOS on a frame whose successor is already chained: the chunk ends there (STOP) with the
    frames it has, the chained step's answer is dropped with the old timeline, the next chunk
    and the session go on as without chaining; nothing stays held."""
    runs = {}
    for chain in (True, False):
        scheduler, rec = await stage(max_inflight_steps=1, inline_steps=True, tower_side=_ChainTowerSide,
                                     chain_steps=chain)
        draws = collections.Counter()

        def stop_fourth(step, result):
            stop = list(result.stop)
            for i, e in enumerate(step.entries):
                if e.draw and e.take_index == 0:
                    draws[e.session_id] += 1
                    if e.frame_index == 3:
                        stop[i] = True
            return dataclasses.replace(result, stop=stop)
        rec.inject = stop_fourth
        events = await _run(scheduler, scheduler.submit(_job("eos", seed=90, turns=("one", "two"), max_new=7)))
        ends = [(e.chunk_index, e.n_frames, e.finish_reason) for e in events if isinstance(e, ChunkEnd)]
        assert ends[0] == (0, 3, "STOP") and isinstance(events[-1], Usage), ends
        runs[chain] = [e.codes for e in events if isinstance(e, FramesOut)]
        if chain:
            assert scheduler.chained_steps > 0 and draws["eos"] == 5      # frame 4 was chained on frame 3
        assert scheduler.engine.free_slots == POOL_ROWS
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False])) and len(runs[True]) == len(runs[False])


async def test_a_chained_step_whose_frames_never_came_fails_its_sessions_unavailable(stage):
    """Mailbox.fill gave up (the tower's frames never reached the GPU): the chained step's
    sessions end UNAVAILABLE, nothing stays held, and the scheduler goes on with new sessions."""
    scheduler, _ = await stage(max_inflight_steps=1, inline_steps=True, tower_side=_ChainTowerSide)
    scheduler.tower.handoff.late = 1
    with pytest.raises(GenerateError) as failed:
        await _run(scheduler, scheduler.submit(_job("late", seed=92, turns=("one",), max_new=9)))
    assert failed.value.status == "UNAVAILABLE" and "frames did not arrive" in failed.value.message
    assert scheduler.chained_steps > 0 and scheduler.engine.free_slots == POOL_ROWS
    events = await _run(scheduler, scheduler.submit(_job("after", seed=93, turns=("one",), max_new=4)))
    assert isinstance(events[-1], Usage)


async def test_no_step_is_chained_on_the_frame_that_completes_the_first_message(stage):
    """With a first-audio hold, the frame that completes a request's first frames message starts
    the hold (the codec's first chunk has the GPU): the step after it is not chained on it, it
    waits for the hold like any step; later frames chain again. Frames as without chaining."""
    runs = {}
    for chain in (True, False):
        scheduler, rec = await stage(max_inflight_steps=1, inline_steps=True, tower_side=_ChainTowerSide,
                                     chain_steps=chain, first_audio_hold_s=0.02)
        events = await _run(scheduler, scheduler.submit(_job("held", seed=91, turns=("one",), max_new=9, first=3)))
        runs[chain] = torch.cat([e.codes for e in events if isinstance(e, FramesOut)])
        if chain:
            side = scheduler.tower
            chained = {seq + 1 for seq in side.handoff.filled}
            frames = [e.frame_index for step in side.handed if step.handoff_seq in chained for e in step.entries]
            assert frames and 3 not in frames and max(frames) > 3, frames
    assert torch.equal(runs[True], runs[False])


async def test_spinning_while_a_step_is_at_the_tower_changes_no_frame(stage):
    """spin_wait_s (DRAMA_SPIN_WAIT_MS): the main loop polls instead of sleeping while a step is at
    the tower; every session gets the frames of the sleeping loop, and the loop does spin."""
    runs, spins = {}, {}
    for spin_s in (0.0, 0.02):
        scheduler, _ = await stage(spin_wait_s=spin_s)
        turns, sleeps = [0], asyncio.sleep

        async def counting_sleep(delay, *args, **kwargs):
            turns[0] += delay == 0
            return await sleeps(delay, *args, **kwargs)

        sessions = [scheduler.submit(_job(f"s{i}", seed=70 + i, turns=("one",), max_new=5)) for i in range(2)]
        with mock.patch.object(asyncio, "sleep", counting_sleep):
            results = await asyncio.gather(*[_run(scheduler, s) for s in sessions])
        runs[spin_s] = [torch.cat([e.codes for e in r if isinstance(e, FramesOut)]) for r in results]
        spins[spin_s] = turns[0]
    for slept, spun in zip(runs[0.0], runs[0.02]):
        assert torch.equal(slept, spun)
    assert spins[0.02] > spins[0.0] + 10, spins


async def test_frames_are_grouped_first_then_every_and_flushed_at_chunk_end(stage):
    scheduler, _ = await stage()
    events = await _run(scheduler, scheduler.submit(_job("emit", turns=("one",), max_new=7,
                                                         first=2, every=3)))
    sizes = [e.codes.shape[0] for e in events if isinstance(e, FramesOut)]
    n = [e for e in events if isinstance(e, ChunkEnd)][0].n_frames
    expect, left, want = [], n, 2
    while left > 0:
        expect.append(min(want, left))
        left -= want
        want = 3
    assert sizes == expect


async def test_queue_full_and_queue_timeout(stage):
    scheduler, _ = await stage(max_sessions=1, max_queue=1)
    running = scheduler.submit(_job("occupant", **LONG))
    assert isinstance(await anext(aiter(scheduler.events(running))), Started)   # admitted
    waiting = scheduler.submit(_job("waiter", queue_timeout_s=0.2))
    with pytest.raises(GenerateError) as info:
        scheduler.submit(_job("third"))
    assert (info.value.status, info.value.drama_code) == ("RESOURCE_EXHAUSTED", "queue_full")
    with pytest.raises(GenerateError) as info:
        await _run(scheduler, waiting)
    assert (info.value.status, info.value.drama_code) == ("RESOURCE_EXHAUSTED", "queue_timeout")
    scheduler.cancel(running)


async def test_a_full_buffer_pauses_the_session_until_half_is_drained(stage):
    scheduler, rec = await stage(session_buffer_frames=4)
    session = scheduler.submit(_job("slow-reader", turns=("x",), max_new=30, first=1, every=1))
    end = time.monotonic() + 20                    # nobody reads: it fills 4 frames and pauses
    while not session.paused and time.monotonic() < end:
        await asyncio.sleep(0.02)
    assert session.paused and session.output_tokens == 4
    await asyncio.sleep(0.5)
    assert session.output_tokens == 4              # out of the batch, KV kept
    events = await _run(scheduler, session)        # now drain: it resumes and completes
    n = [e for e in events if isinstance(e, ChunkEnd)][0].n_frames
    assert sum(e.codes.shape[0] for e in events if isinstance(e, FramesOut)) == n


async def test_cancel_leaves_the_batch_and_is_released_in_the_next_step(stage):
    scheduler, rec = await stage()
    keep = scheduler.submit(_job("keep", turns=("x",), max_new=40))
    gone = scheduler.submit(_job("gone", **LONG))
    async for event in scheduler.events(gone):
        if isinstance(event, FramesOut):
            break
    at_cancel = len(rec.steps)
    scheduler.cancel(gone)
    events = await _run(scheduler, keep)
    assert isinstance(events[-1], Usage)
    end = time.monotonic() + 10
    while not any("gone" in s.release for s in rec.steps[at_cancel:]) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    # released by the step after the one in flight at the cancel, and never scheduled again
    released = [i for i, s in enumerate(rec.steps) if "gone" in s.release and i >= at_cancel]
    assert released and released[0] <= at_cancel + 1
    assert all(e.session_id != "gone" for s in rec.steps[released[0]:] for e in s.entries)
    assert rec.engine.free_slots == POOL_ROWS


async def test_a_tower_row_error_ends_only_that_session(stage):
    scheduler, rec = await stage()
    from services.backbone.scheduler import TowerResult

    def lose(step, result):   # the tower "forgets" session "lost" once it is decoding
        errors = dict(result.row_errors)
        for i, entry in enumerate(step.entries):
            if entry.session_id == "lost" and entry.first_row > 0 and entry.n_rows == 1:
                errors[i] = GenerateError("NOT_FOUND", "tower: unknown session")
        return TowerResult(result.codes, result.stop, errors)

    rec.inject = lose
    lost = scheduler.submit(_job("lost", turns=("x",) * 5, max_new=10))   # some chunk decodes
    fine = scheduler.submit(_job("fine", turns=("y",), max_new=10))
    with pytest.raises(GenerateError) as info:
        await _run(scheduler, lost)
    assert info.value.status == "NOT_FOUND"
    assert isinstance((await _run(scheduler, fine))[-1], Usage)


# --------------------------------------------------------------------------------------------
# Start-up checks
# --------------------------------------------------------------------------------------------

def test_the_tower_must_match_hidden_size_dtype_codebooks_and_pool():
    from drama.tower.v1 import tower_pb2
    from services.backbone.tower_client import TowerClient

    client = TowerClient("127.0.0.1:1", hidden_dim=64, hidden_dtype=torch.float32, codebooks=10,
                         max_rows=8, max_context_tokens=512)
    good = dict(hidden_dim=64, hidden_dtype="float32", codebooks=10, max_rows=8, max_context_tokens=512)
    assert client.mismatch(tower_pb2.TowerInfo(**good)) is None
    assert client.mismatch(tower_pb2.TowerInfo(**{**good, "max_rows": 16})) is None
    for field, value in [("hidden_dim", 32), ("hidden_dtype", "bfloat16"), ("codebooks", 3),
                         ("max_rows", 4), ("max_context_tokens", 256)]:
        problem = client.mismatch(tower_pb2.TowerInfo(**{**good, field: value}))
        assert problem is not None and field in problem


def test_the_stage_refuses_to_start_over_its_memory_budget(tiny_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-m", "services.backbone", "--checkpoint", str(tiny_checkpoint), "--port", "0",
         "--tower", "127.0.0.1:1", "--memory-budget-gb", "0.0001"],
        env=dict(os.environ, DRAMA_MAX_ROWS="4", DRAMA_MAX_CONTEXT_TOKENS="256"),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refusing to start" in proc.stderr and "cache pool" in proc.stderr


def test_a_step_message_over_the_grpc_limit_is_refused():
    from services.backbone.server import check_step_message

    check_step_message(rows=2048 + 64, hidden_size=2048, hidden_dtype=torch.bfloat16, codebooks=10,
                       sessions=64)             # API.md §3.2: 2048 BF16 rows at H = 2048 fit
    with pytest.raises(ValueError, match="DRAMA_PREFILL_CHUNK_TOKENS"):
        check_step_message(rows=8192, hidden_size=2048, hidden_dtype=torch.bfloat16, codebooks=10,
                           sessions=64)


async def test_a_sampled_step_sends_its_trace_context_to_the_tower(stage):
    from services.common.telemetry import setup_telemetry
    setup_telemetry("test-backbone")
    scheduler, rec = await stage(step_span_sample=1.0)
    await _run(scheduler, scheduler.submit(_job("traced", turns=("x",), max_new=2)))
    with_rows = [s for s in rec.steps if s.entries]
    assert with_rows and all("traceparent" in s.trace_context for s in with_rows)


async def test_step_metrics_and_gauges_are_recorded(stage):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    scheduler, rec = await stage(meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    await _run(scheduler, scheduler.submit(_job("measured", turns=("x",), max_new=3)))
    points = {m.name: m.data.data_points
              for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    rows = points["drama_backbone_batch_rows"][0]
    assert rows.count == len(rec.work) and rows.sum == sum(len(ids) for w in rec.work for _, ids, _ in w)
    assert points["drama_backbone_step_seconds"][0].count == len(rec.work)
    assert points["drama_backbone_queue_depth"][0].value == 0
    assert points["drama_backbone_kv_usage_ratio"][0].value == 0.0     # all released


async def test_first_audio_milestones_are_recorded_once_each_in_order(stage):
    """drama_backbone_first_audio_seconds{phase}: one observation per milestone of the first
    chunk (a second chunk adds none), each no earlier than the one before."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.backbone.scheduler import FIRST_AUDIO_PHASES

    reader = InMemoryMetricReader()
    scheduler, _ = await stage(meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    await _run(scheduler, scheduler.submit(_job("milestones", turns=("x", "y"), max_new=3, first=2)))
    points = {p.attributes["phase"]: p
              for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == "drama_backbone_first_audio_seconds" for p in m.data.data_points}
    assert set(points) == set(FIRST_AUDIO_PHASES)
    assert all(points[phase].count == 1 for phase in FIRST_AUDIO_PHASES)
    times = [points[phase].sum for phase in FIRST_AUDIO_PHASES]
    assert times == sorted(times) and times[0] >= 0, dict(zip(FIRST_AUDIO_PHASES, times))


async def test_first_audio_hold_sits_the_session_out_once_and_changes_no_frame(stage):
    """first_audio_hold_s: after its first frames message a session sits out the decode steps
    that long (the codec's first chunk has the GPU), once per request; the frames are the same."""
    codes, hold = {}, 0.25
    for hold_s in (0.0, hold):
        scheduler, rec = await stage(first_audio_hold_s=hold_s)
        session = scheduler.submit(_job("held", turns=("x", "y"), max_new=5, first=2))
        arrivals = []
        async for event in scheduler.events(session):
            if isinstance(event, FramesOut):
                arrivals.append((time.monotonic(), event))
        codes[hold_s] = torch.cat([e.codes for _, e in arrivals])
        if hold_s:
            # the next message of the first chunk waits out the hold; the second chunk's first
            # message sets no new one (the hold still ends where the first message set it)
            assert arrivals[1][0] - arrivals[0][0] >= hold
            assert session.held_until <= arrivals[0][0] + hold
    assert torch.equal(codes[0.0], codes[hold])


async def test_a_long_prompt_is_prefilled_in_pieces_back_to_back(stage):
    """The next prefill piece is computed while the tower works on the previous one; the frames
    equal those of a one-piece prefill."""
    codes = {}
    for piece, inflight in ((1000, 1), (6, 2)):
        scheduler, rec = await stage(prefill_chunk_tokens=piece, max_inflight_steps=inflight)
        rec.delay_s = 0.05
        events = await _run(scheduler, scheduler.submit(_job("long-prompt", turns=("x",), max_new=4)))
        codes[piece] = torch.cat([e.codes for e in events if isinstance(e, FramesOut)])
        assert (rec.overlap > 0) == (inflight > 1)
    assert torch.equal(codes[1000], codes[6])


async def test_a_mismatched_tower_is_never_served(tower_addr, tiny_config):
    from services.backbone.tower_client import TowerClient

    client = TowerClient(tower_addr, hidden_dim=32, hidden_dtype=torch.float32,
                         codebooks=tiny_config.num_codebooks, max_rows=POOL_ROWS,
                         max_context_tokens=POOL_CONTEXT)
    client.start()
    try:
        assert not await client.wait_ready(1.0)
        assert "refused" in client.last_error and "hidden_dim" in client.last_error
    finally:
        await client.close()


@pytest.mark.parametrize("interval_s", [0.0, 1.5])
async def test_prefill_interval_spaces_prefill_steps_while_streams_decode(stage, interval_s):
    """DRAMA_PREFILL_INTERVAL_MS: a session arriving while another decodes waits for the next
    prefill step (at most `interval_s` after the last one); the first session, with nobody
    decoding, is prefilled at once; and the decoding stream keeps its frames coming meanwhile."""
    from services.backbone.scheduler import PrefillDone

    scheduler, _ = await stage(prefill_interval_s=interval_s)
    events: dict[str, list] = {"a": [], "b": []}

    async def consume(name, session):
        async for event in scheduler.events(session):
            events[name].append((time.time_ns(), event))

    a_sent = time.time_ns()
    a = asyncio.create_task(consume("a", scheduler.submit(_job("a", turns=("hello",), max_new=150,
                                                               first=1, every=1))))
    while not any(isinstance(e, FramesOut) for _, e in events["a"]):     # a is decoding
        await asyncio.sleep(0.005)
    b_sent = time.time_ns()
    b = asyncio.create_task(consume("b", scheduler.submit(_job("b", turns=("hi",), max_new=2))))
    await asyncio.wait_for(b, 60)
    a.cancel()
    (a_prefill,) = [e for _, e in events["a"] if isinstance(e, PrefillDone)]
    b_prefill = next(e for _, e in events["b"] if isinstance(e, PrefillDone))
    assert a_prefill.start_ns - a_sent < 1.0e9                  # nobody decoding: at once
    if interval_s:
        assert b_prefill.start_ns - a_prefill.start_ns >= interval_s * 1e9 - 0.05e9
        # a's frames kept coming while b waited for its prefill step
        between = [t for t, e in events["a"] if isinstance(e, FramesOut) and b_sent < t < b_prefill.start_ns]
        assert len(between) >= 3
    else:
        assert b_prefill.start_ns - b_sent < 1.0e9

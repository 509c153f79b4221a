"""Backbone.Generate end to end over real gRPC: the backbone server in-process, the tower server as
a subprocess (`python -m services.tower`), both on localhost with the tiny checkpoint.

Each test states one property: same seed -> same frames alone or batched, chunk ends (STOP and
LENGTH), multi-chunk requests, cancellation frees both stages, bad requests are refused with the
API's metadata, and a lost tower fails the sessions on it and comes back.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from services.backbone import server as backbone_server
from services.common import grpcutil
from services.common.tensors import codes_from_wire, codes_to_wire, ids_to_bytes

MAX_ROWS = 8
MAX_CONTEXT = 512
IM_START, IM_END, VOICE, SPEAKER0 = 258, 259, 263, 268
# A request that runs for seconds whatever its draws: an EOS only ends one of its many chunks.
LONG = dict(texts=("a long story",) * 30, max_new=50, first=1, every=1)


# --------------------------------------------------------------------------------------------
# Fixtures: a tower subprocess and an in-process backbone
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TowerProcess:
    """`python -m services.tower` on a fixed localhost port, restartable on the same port."""

    def __init__(self, checkpoint, port: int | None = None):
        self.checkpoint, self.port = checkpoint, port or _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        env = dict(os.environ, DRAMA_MAX_ROWS=str(MAX_ROWS), DRAMA_MAX_CONTEXT_TOKENS=str(MAX_CONTEXT),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.tower", "--checkpoint", str(self.checkpoint),
             "--port", str(self.port), "--host", "127.0.0.1", "--device", "cpu"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tower exited: {self.proc.stderr.read().decode()[-3000:]}")
            if await grpcutil.check_health(self.addr, timeout=0.5) == "SERVING":
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("tower did not become SERVING")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
async def tower(tiny_checkpoint):
    proc = TowerProcess(tiny_checkpoint)
    await proc.start()
    yield proc
    proc.kill()


async def _start_backbone(checkpoint, tower_addr, **overrides):
    options = dict(max_rows=MAX_ROWS, max_context_tokens=MAX_CONTEXT, max_queue=16,
                   prefill_chunk_tokens=64) | overrides
    settings = backbone_server.Settings(checkpoint=str(checkpoint), tower_addr=tower_addr, port=0,
                                        **options)
    running = await backbone_server.start(settings)
    assert await running.tower.wait_ready(30), running.tower.last_error
    return running


@pytest.fixture(scope="module")
async def backbone(tiny_checkpoint, tower):
    running = await _start_backbone(tiny_checkpoint, tower.addr)
    yield running
    await running.stop()


@pytest.fixture(scope="module")
async def stub(backbone):
    channel = grpcutil.create_channel(f"127.0.0.1:{backbone.port}")
    yield backbone_pb2_grpc.BackboneStub(channel)
    await channel.close()


# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------

def _ids(text: str) -> list[int]:
    return list(text.encode())           # the tiny tokenizer: byte b has id b


def make_request(session_id: str, *, seed: int = 1, texts=("hello there",), max_new: int = 6,
                 temperature: float = 0.9, references: int = 3, history: int = 0,
                 first: int = 2, every: int = 3, queue_timeout_ms: int = 0
                 ) -> backbone_pb2.GenerateRequest:
    """A §8.2 prompt as token ids: a system turn with `references` frames of reference codes,
    `history` previous takes of 2 frames each, and one user turn per text chunk."""
    gen = torch.Generator().manual_seed(1234)

    def codes(n):   # [N, n] in range per codebook
        c = torch.randint(0, 32, (10, n), generator=gen)
        c[0] = torch.randint(0, 64, (n,), generator=gen)
        return c

    def tokens(ids):
        return backbone_pb2.Segment(tokens=ids_to_bytes(ids))

    system = []
    if references:
        system = [tokens([IM_START] + _ids("system\nref: ") + [SPEAKER0] + _ids("hi")),
                  backbone_pb2.Segment(codes=codes_to_wire(codes(references))), tokens([IM_END])]
    takes = [backbone_pb2.HistoryTake(segments=[
        tokens([IM_START] + _ids("user\n") + [SPEAKER0] + _ids(f"take {i}") + [IM_END]),
        tokens([IM_START] + _ids("assistant\n") + [VOICE]),
        backbone_pb2.Segment(codes=codes_to_wire(codes(2))), tokens([IM_END])])
        for i in range(history)]
    chunks = [backbone_pb2.Chunk(user_turn=ids_to_bytes(
        [IM_START] + _ids("user\n") + [SPEAKER0] + _ids(t) + [IM_END])) for t in texts]
    return backbone_pb2.GenerateRequest(
        session_id=session_id, model="drama-3", system=system, history=takes, chunks=chunks,
        assistant_open=ids_to_bytes([IM_START] + _ids("assistant\n") + [VOICE]),
        assistant_close=ids_to_bytes([IM_END]),
        sampling=backbone_pb2.Sampling(temperature=temperature, top_p=0.95, top_k=0,
                                       repetition_penalty=1.0, seed=seed, max_new_tokens=max_new),
        emit=backbone_pb2.Emit(first_message_frames=first, message_frames=every),
        queue_timeout_ms=queue_timeout_ms)


@dataclass
class Result:
    kinds: list[str] = field(default_factory=list)
    started: backbone_pb2.Started | None = None
    frames: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # chunk -> [N, n] pieces
    message_sizes: list[int] = field(default_factory=list)
    chunk_ends: list[backbone_pb2.ChunkEnd] = field(default_factory=list)
    usage: backbone_pb2.Usage | None = None

    def codes(self, chunk: int = 0) -> torch.Tensor:
        return torch.cat(self.frames.get(chunk, [torch.empty(10, 0, dtype=torch.int64)]), dim=1)


async def collect(stub, request, **kwargs) -> Result:
    result = Result()
    async for message in stub.Generate(request, **kwargs):
        kind = message.WhichOneof("msg")
        result.kinds.append(kind)
        if kind == "started":
            result.started = message.started
        elif kind == "frames":
            f = message.frames
            pieces = result.frames.setdefault(f.chunk_index, [])
            assert f.first_frame_index == sum(p.shape[1] for p in pieces)
            codes = codes_from_wire(f.codes, 10)
            assert codes.shape == (10, f.n_frames)
            pieces.append(codes)
            result.message_sizes.append(f.n_frames)
        elif kind == "chunk_end":
            result.chunk_ends.append(message.chunk_end)
        else:
            result.usage = message.usage
    return result


async def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

async def test_same_seed_gives_the_same_frames_alone_and_among_eight(stub):
    alone = await collect(stub, make_request("alone", seed=7, max_new=10))
    batch = await asyncio.gather(*[
        collect(stub, make_request(f"batch-{i}", seed=7 if i == 0 else 100 + i, max_new=10,
                                   texts=("hello there",) if i % 2 == 0 else ("other words",)))
        for i in range(8)])
    assert alone.codes().shape[1] > 0
    assert torch.equal(batch[0].codes(), alone.codes())
    again = await collect(stub, make_request("again", seed=7, max_new=10))
    assert torch.equal(again.codes(), alone.codes())


async def test_different_seeds_give_different_frames(stub):
    a, b = await asyncio.gather(collect(stub, make_request("seed-a", seed=1, max_new=8)),
                                collect(stub, make_request("seed-b", seed=2, max_new=8)))
    assert not torch.equal(a.codes(), b.codes())


async def test_stream_shape_and_length_finish(stub):
    result = await collect(stub, make_request("shape", max_new=6, first=2, every=3))
    assert result.kinds[0] == "started" and result.kinds[-1] == "usage"
    assert result.kinds[-2] == "chunk_end"
    end = result.chunk_ends[0]
    n = result.codes().shape[1]
    assert end.n_frames == n <= 6
    assert end.finish_reason == (backbone_pb2.LENGTH if n == 6 else backbone_pb2.STOP)
    # first message 2 frames, then 3, the rest flushed at the chunk end
    expect = [2, 3, 1][: len(result.message_sizes)] if n == 6 else None
    if expect:
        assert result.message_sizes == expect
    assert result.started.prompt_audio_frames == 3
    assert result.usage.output_tokens == n
    assert result.usage.audio_tokens == 3
    codes = result.codes()
    assert (codes[0] < 64).all() and (codes[1:] < 32).all() and (codes >= 0).all()


async def test_eos_ends_a_chunk_with_stop_before_max_new_tokens(stub):
    """Over many seeds at a high temperature some take draws EOS; those end STOP short of the
    cap, the others end LENGTH exactly at it."""
    reasons = []
    for group in range(4):
        results = await asyncio.gather(*[
            collect(stub, make_request(f"eos-{group}-{i}", seed=1000 + 8 * group + i, max_new=24,
                                       temperature=2.0, references=0))
            for i in range(8)])
        for r in results:
            end = r.chunk_ends[0]
            assert end.n_frames == r.codes().shape[1]
            if end.finish_reason == backbone_pb2.STOP:
                assert end.n_frames < 24
            else:
                assert end.finish_reason == backbone_pb2.LENGTH and end.n_frames == 24
            reasons.append(end.finish_reason)
        if backbone_pb2.STOP in reasons:
            break
    assert backbone_pb2.STOP in reasons


async def test_multi_chunk_request_runs_chunks_in_order(stub):
    texts = ("first chunk.", "second one,", "and third")
    result = await collect(stub, make_request("chunks", texts=texts, max_new=4, history=1))
    assert [e.chunk_index for e in result.chunk_ends] == [0, 1, 2]
    ns = [e.n_frames for e in result.chunk_ends]
    assert [result.codes(i).shape[1] for i in range(3)] == ns
    assert result.usage.output_tokens == sum(ns)
    # Chunk i > 0 carries the previous chunk's frames; references and history every time.
    assert result.usage.audio_tokens == 3 * (3 + 2) + ns[0] + ns[1]
    # frames messages of a chunk come before its chunk_end
    kinds = [k for k in result.kinds if k in ("frames", "chunk_end")]
    assert kinds.count("chunk_end") == 3 and kinds[-1] == "chunk_end"


async def test_a_cancelled_generate_frees_both_stages(stub, backbone, tower):
    call = stub.Generate(make_request("cancel-me", **LONG))
    async for message in call:
        if message.WhichOneof("msg") == "frames":
            break
    call.cancel()
    tower_channel = grpcutil.create_channel(tower.addr)
    tower_stub = tower_pb2_grpc.TowerStub(tower_channel)

    async def freed():
        info = await stub.GetInfo(backbone_pb2.GetInfoRequest())
        tinfo = await tower_stub.GetInfo(tower_pb2.GetInfoRequest())
        return (info.open_sessions == 0 and info.free_slots == MAX_ROWS
                and tinfo.open_sessions == 0)

    try:
        assert await _wait_for(freed)
    finally:
        await tower_channel.close()


async def test_deadline_ends_the_session(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, make_request("deadline", **LONG), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def freed():
        return (await stub.GetInfo(backbone_pb2.GetInfoRequest())).open_sessions == 0
    assert await _wait_for(freed)


def _mutations():
    def set_chunk(r, data):
        r.chunks[0].user_turn = data

    def set_system_codes(r, codes):
        r.system[1].codes = codes_to_wire(codes)

    bad_c0 = torch.zeros(10, 2, dtype=torch.int64)
    bad_c0[0, 1] = 64
    bad_residual = torch.zeros(10, 2, dtype=torch.int64)
    bad_residual[5, 0] = 32
    return [
        ("token id", lambda r: set_chunk(r, ids_to_bytes([IM_START, 352])), "chunks[0].user_turn", "invalid_value"),
        ("negative id", lambda r: set_chunk(r, ids_to_bytes([-1])), "chunks[0].user_turn", "invalid_value"),
        ("ragged ids", lambda r: set_chunk(r, b"\x01\x02\x03"), "chunks[0].user_turn", "invalid_value"),
        ("empty chunk", lambda r: set_chunk(r, b""), "chunks[0].user_turn", "empty_string"),
        ("no chunks", lambda r: r.ClearField("chunks"), "chunks", "missing_required_parameter"),
        ("semantic code", lambda r: set_system_codes(r, bad_c0), "system[1].codes", "invalid_value"),
        ("residual code", lambda r: set_system_codes(r, bad_residual), "system[1].codes", "invalid_value"),
        ("ragged codes", lambda r: setattr(r.system[1], "codes", b"\x00" * 30), "system[1].codes", "invalid_value"),
        ("temperature", lambda r: setattr(r.sampling, "temperature", 2.5), "sampling.temperature", "out_of_range"),
        ("top_p", lambda r: setattr(r.sampling, "top_p", 1.5), "sampling.top_p", "out_of_range"),
        ("top_k", lambda r: setattr(r.sampling, "top_k", -1), "sampling.top_k", "out_of_range"),
        ("penalty", lambda r: setattr(r.sampling, "repetition_penalty", 0.5), "sampling.repetition_penalty", "out_of_range"),
        ("max_new", lambda r: setattr(r.sampling, "max_new_tokens", -3), "sampling.max_new_tokens", "out_of_range"),
        ("no session", lambda r: setattr(r, "session_id", ""), "session_id", "missing_required_parameter"),
        ("no open", lambda r: setattr(r, "assistant_open", b""), "assistant_open", "empty_string"),
    ]


@pytest.mark.parametrize("name, mutate, param, code", _mutations(), ids=[m[0] for m in _mutations()])
async def test_bad_requests_are_invalid_argument_with_metadata(stub, name, mutate, param, code):
    request = make_request(f"bad-{name}")
    mutate(request)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert grpcutil.error_details(info.value) == (code, param)


async def test_context_overflow_is_out_of_range_naming_the_part(stub):
    request = make_request("too-long", references=MAX_CONTEXT, max_new=4)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert grpcutil.error_details(info.value) == ("context_length_exceeded", "references")


async def test_duplicate_session_id_is_already_exists(stub):
    call = stub.Generate(make_request("twice", **LONG))
    async for message in call:
        if message.WhichOneof("msg") == "frames":
            break
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, make_request("twice"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()


async def _first_frame(call) -> None:
    async for message in call:
        if message.WhichOneof("msg") == "frames":
            return
    raise AssertionError("the stream ended before its first frame")


async def test_admission_queue_full_and_queue_timeout(tiny_checkpoint, tower):
    running = await _start_backbone(tiny_checkpoint, tower.addr, max_rows=1, max_queue=1)
    channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
    small = backbone_pb2_grpc.BackboneStub(channel)
    try:
        occupant = small.Generate(make_request("occupant", **LONG))
        await _first_frame(occupant)                               # holds the only slot
        waiter = asyncio.ensure_future(collect(small, make_request("waiter", queue_timeout_ms=500)))

        async def queued():
            return (await small.GetInfo(backbone_pb2.GetInfoRequest())).queued_sessions == 1
        assert await _wait_for(queued)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(small, make_request("third"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert grpcutil.error_details(info.value)[0] == "queue_full"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await waiter
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert grpcutil.error_details(info.value)[0] == "queue_timeout"
        occupant.cancel()
    finally:
        await channel.close()
        await running.stop()


async def test_drain_finishes_running_sessions_and_refuses_new_ones(tiny_checkpoint, tower):
    running = await _start_backbone(tiny_checkpoint, tower.addr)
    channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
    stub = backbone_pb2_grpc.BackboneStub(channel)
    try:
        call = stub.Generate(make_request("draining", texts=("one", "two", "three"), max_new=8,
                                          first=1, every=1))
        await _first_frame(call)
        stopping = asyncio.ensure_future(running.stop(grace_s=30))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, make_request("too-late"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert grpcutil.error_details(info.value)[0] == "not_ready"
        kinds = [m.WhichOneof("msg") async for m in call]
        assert kinds.count("chunk_end") >= 2 and kinds[-1] == "usage"    # it ran to the end
        await stopping
    finally:
        await channel.close()


async def test_a_backbone_started_with_overlapped_expert_reads_serves_the_same_frames(
        stub, tiny_checkpoint, tower, monkeypatch, capsys):
    """load_overlap (DRAMA_LOAD_OVERLAP=1): the start reads the routed experts while the warm-up
    runs. Held back here until the warm-up is over (so it ran on unfilled experts), they land
    before SERVING, and the frames equal those of the backbone that loaded first."""
    import threading

    from services.backbone import weights
    from services.backbone.engine import BackboneEngine

    warmed = threading.Event()
    read, warm_up = weights.ExpertReads._run, BackboneEngine.warm_up

    def held(self, work):
        assert warmed.wait(60)
        read(self, work)

    def warm_up_first(self, *args, **kwargs):
        try:
            return warm_up(self, *args, **kwargs)
        finally:
            warmed.set()

    monkeypatch.setattr(weights.ExpertReads, "_run", held)
    monkeypatch.setattr(BackboneEngine, "warm_up", warm_up_first)
    running = await _start_backbone(tiny_checkpoint, tower.addr, load_overlap=True)
    channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
    try:
        assert "backbone experts read in" in capsys.readouterr().out
        overlapped = await collect(backbone_pb2_grpc.BackboneStub(channel), make_request("overlap", seed=11))
        expected = await collect(stub, make_request("overlap-ref", seed=11))
        assert overlapped.codes().shape[1] > 0 and torch.equal(overlapped.codes(), expected.codes())
    finally:
        await channel.close()
        await running.stop()


async def test_generate_is_traced_with_session_events_prefill_and_step_spans(stub, backbone):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from services.common.telemetry import setup_telemetry

    exporter = InMemorySpanExporter()
    setup_telemetry("test-backbone", span_processor=SimpleSpanProcessor(exporter))
    backbone.scheduler.step_span_sample = 1.0
    try:
        await collect(stub, make_request("traced", texts=("one", "two"), max_new=3))
    finally:
        backbone.scheduler.step_span_sample = 0.0
    spans = exporter.get_finished_spans()
    generate = [s for s in spans if s.name.endswith("Backbone/Generate")
                and s.attributes.get("drama.session_id") == "traced"]
    assert len(generate) == 1
    generate = generate[0]
    assert {"admitted", "first_frame", "chunk_done"} <= {e.name for e in generate.events}
    prefills = [s for s in spans if s.name == "prefill" and s.parent is not None
                and s.parent.span_id == generate.context.span_id]
    assert sorted(s.attributes["drama.chunk_index"] for s in prefills) == [0, 1]
    assert all(s.end_time > s.start_time for s in prefills)
    steps = [s for s in spans if s.name == "backbone.step"
             and any(link.context.span_id == generate.context.span_id for link in s.links)]
    assert steps and all(s.attributes["drama.batch.rows"] >= 1 for s in steps)


async def test_tower_loss_fails_sessions_unavailable_and_the_backbone_reconnects(tiny_checkpoint):
    tower = TowerProcess(tiny_checkpoint)
    await tower.start()
    running = await _start_backbone(tiny_checkpoint, tower.addr)
    channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
    stub = backbone_pb2_grpc.BackboneStub(channel)
    health = health_pb2_grpc.HealthStub(channel)

    async def status():
        return (await health.Check(health_pb2.HealthCheckRequest(service=backbone_server.SERVICE_NAME))).status
    try:
        assert await _wait_for(lambda: _is(status, health_pb2.HealthCheckResponse.SERVING))
        # `python -m services.tower` on this host: the Step stream runs over its same-host lane
        assert (await stub.GetInfo(backbone_pb2.GetInfoRequest())).tower_transport == "lane"
        call = stub.Generate(make_request("doomed", **LONG))
        async for message in call:
            if message.WhichOneof("msg") == "frames":
                break
        tower.kill()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        async def tower_gone():
            info = await stub.GetInfo(backbone_pb2.GetInfoRequest())
            return (not info.tower_ready and info.tower_transport == "" and info.open_sessions == 0
                    and info.free_slots == MAX_ROWS)
        assert await _wait_for(tower_gone)
        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, make_request("while-away"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert grpcutil.error_details(info.value)[0] == "not_ready"

        await tower.start()            # same port
        async def tower_back():
            return (await stub.GetInfo(backbone_pb2.GetInfoRequest())).tower_ready
        assert await _wait_for(tower_back, timeout_s=15)
        assert (await stub.GetInfo(backbone_pb2.GetInfoRequest())).tower_transport == "lane"
        assert await _wait_for(lambda: _is(status, health_pb2.HealthCheckResponse.SERVING))
        result = await collect(stub, make_request("after", max_new=3))
        assert result.usage is not None and result.codes().shape[1] > 0
    finally:
        await channel.close()
        await running.stop()
        tower.kill()


async def _is(getter, value) -> bool:
    return await getter() == value

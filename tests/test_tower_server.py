"""The Tower gRPC service over a real localhost port (API.md §3.5), tiny random weights, CPU."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
import torch

from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from services.common import grpcutil
from services.common.tensors import tensor_from_bytes, tensor_to_bytes
from services.tower.engine import StepEntry, TowerEngine
from services.tower.server import TowerServicer, serve
from services.tower.weights import random_tower
from test_tower_model import TINY, _prompt

N = TINY.num_codebooks
SESSIONS, CONTEXT = 4, 64


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tower():
    server, port, health, servicer = await serve(None, port=0, max_sessions=SESSIONS, max_context=CONTEXT,
                                                 model=random_tower(TINY, seed=7), cfg=TINY)
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", traced=False)
    yield tower_pb2_grpc.TowerStub(channel), port
    await channel.close()
    await server.stop(None)
    servicer.worker.shutdown(wait=True)


def _row(session_id, first_row, n_rows, draw=False, frame_index=0, seed=42):
    return tower_pb2.RowEntry(session_id=session_id, first_row=first_row, n_rows=n_rows, draw=draw,
                              take_index=0, frame_index=frame_index, seed=seed, temperature=0.8,
                              top_p=0.9, top_k=0, repetition_penalty=1.0)


def _request(step_id, rows, hidden, targets, release=()):
    return tower_pb2.StepRequest(step_id=step_id, rows=rows, hidden=tensor_to_bytes(hidden.float()),
                                 targets=tensor_to_bytes(targets.to(torch.int16)), release=list(release))


def _codes(response, entries):
    return tensor_from_bytes(response.codes, "int16", (entries, N)).to(torch.int64)


def _session_plan(session_id, hidden, targets, pieces, frames):
    """The requests of one timeline: prefill pieces (the last draws), then frame steps."""
    plan, start = [], 0
    for size in pieces:
        draw = start + size == len(targets)
        tgt = targets[start:start + size].clone()
        if draw:
            tgt[-1] = -1
        plan.append(([_row(session_id, start, size, draw=draw)], hidden[start:start + size], tgt))
        start += size
    for f in range(1, frames + 1):
        row = start + f - 1
        plan.append(([_row(session_id, row, 1, draw=True, frame_index=f)], hidden[row:row + 1],
                     torch.full((1, N), -1, dtype=torch.int64)))
    return plan


def _expected_frames(plan):
    """The same steps straight on an engine with the same weights."""
    engine = TowerEngine(random_tower(TINY, seed=7), TINY, max_sessions=SESSIONS, max_context=CONTEXT)
    out = []
    for rows, hidden, targets in plan:
        entries = [StepEntry(r.session_id, r.first_row, r.n_rows, r.draw, r.take_index, r.frame_index,
                             r.seed, r.temperature, r.top_p, r.top_k, r.repetition_penalty) for r in rows]
        result = engine.step(entries, hidden, targets)
        if rows[-1].draw:
            out.append(result.codes[-1].tolist())
    return out


async def test_health_and_info(tower):
    stub, port = tower
    assert await grpcutil.check_health(f"127.0.0.1:{port}", service="drama.tower.v1.Tower") == "SERVING"
    info = await stub.GetInfo(tower_pb2.GetInfoRequest())
    assert (info.hidden_dim, info.hidden_dtype, info.codebooks) == (64, "float32", N)
    assert (info.max_rows, info.max_context_tokens, info.max_inflight_steps) == (SESSIONS, CONTEXT, 2)
    assert info.free_slots == SESSIONS and info.open_sessions == 0


async def test_prefill_and_draws_match_the_engine(tower):
    stub, _ = tower
    hidden, targets = _prompt(TINY, 24, seed=9)
    plan = _session_plan("s", hidden, targets[:18], [10, 8], frames=5)
    call = stub.Step()
    frames = []
    for step_id, (rows, h, t) in enumerate(plan, start=1):
        await call.write(_request(step_id, rows, h, t))
        response = await call.read()
        assert response.step_id == step_id and not response.row_errors
        assert len(response.stop) == 1 and response.tower_us > 0
        if rows[-1].draw:
            frames.append(_codes(response, 1)[0].tolist())
        else:
            assert _codes(response, 1).eq(-1).all()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert frames == _expected_frames(plan)


async def test_a_spinning_server_answers_as_a_sleeping_one():
    """spin_wait_s (DRAMA_SPIN_WAIT_MS): after each response the servicer's loop spins while the
    next request is due; the frames are the engine's, and the spinner ends with the stream."""
    server, port, _, servicer = await serve(None, port=0, max_sessions=SESSIONS, max_context=CONTEXT,
                                            spin_wait_s=0.02, model=random_tower(TINY, seed=7), cfg=TINY)
    assert servicer.spin_wait_s == 0.02
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", traced=False)
    try:
        hidden, targets = _prompt(TINY, 16, seed=4)
        plan = _session_plan("spin", hidden, targets[:12], [12], frames=4)
        call = tower_pb2_grpc.TowerStub(channel).Step()
        frames, spun = [], 0

        def spinners():
            return [t for t in asyncio.all_tasks() if t.get_name() == "spinner" and not t.done()]

        for step_id, (rows, h, t) in enumerate(plan, start=1):
            await asyncio.sleep(0.005)             # the backbone's step between messages
            spun += bool(spinners())               # the servicer spins while this request is due
            await call.write(_request(step_id, rows, h, t))
            frames.append(_codes(await call.read(), 1)[0].tolist())
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert frames == _expected_frames(plan)
        assert spun >= len(plan) - 2, spun
        await asyncio.sleep(0.05)                  # longer than spin_wait_s: every spinner has ended
        assert not spinners()
    finally:
        await channel.close()
        await server.stop(None)
        servicer.worker.shutdown(wait=True)


async def test_pipelined_requests_answer_in_order(tower):
    """Two sessions' plans interleaved with two requests in flight at all times (and a burst of
    three, which the server takes as its limit allows)."""
    stub, _ = tower
    hidden, targets = _prompt(TINY, 20, seed=3)
    plan_a = _session_plan("a", hidden, targets[:12], [12], frames=4)
    plan_b = _session_plan("b", hidden.flip(0), targets[:8], [5, 3], frames=5)
    requests = [p for pair in zip(plan_a, plan_b) for p in pair] + plan_b[len(plan_a):]
    call = stub.Step()
    for step_id, (rows, h, t) in enumerate(requests[:3], start=1):
        await call.write(_request(step_id, rows, h, t))
    got = {"a": [], "b": []}
    next_id = 4
    for step_id in range(1, len(requests) + 1):
        response = await call.read()
        assert response.step_id == step_id and not response.row_errors
        rows = requests[step_id - 1][0]
        if rows[-1].draw:
            got[rows[-1].session_id].append(_codes(response, 1)[0].tolist())
        if next_id <= len(requests):
            rows, h, t = requests[next_id - 1]
            await call.write(_request(next_id, rows, h, t))
            next_id += 1
    await call.done_writing()
    assert got["a"] == _expected_frames(plan_a)
    assert got["b"] == _expected_frames(plan_b)


async def test_row_errors_and_payload_errors(tower):
    stub, _ = tower
    call = stub.Step()
    hidden = torch.randn(4, 64)
    rows = [_row("ghost", 7, 1), _row("new", 0, 3, draw=True)]
    await call.write(_request(1, rows, hidden, torch.full((4, N), -1)))
    response = await call.read()
    assert [(e.row_index, e.code) for e in response.row_errors] == [(0, grpc.StatusCode.NOT_FOUND.value[0])]
    codes = _codes(response, 2)
    assert codes[0].eq(-1).all() and (response.stop[1] or codes[1].ge(0).all())

    bad = _request(2, [_row("new", 3, 1, draw=True)], hidden[:1], torch.full((1, N), -1))
    bad.hidden = bad.hidden[:-4]
    await call.write(bad)
    response = await call.read()
    assert [(e.row_index, e.code) for e in response.row_errors] == [(0, grpc.StatusCode.INVALID_ARGUMENT.value[0])]

    mismatch = _request(3, [_row("new", 2, 1, draw=True)], hidden[:1], torch.full((1, N), -1))
    await call.write(mismatch)
    response = await call.read()
    assert [(e.row_index, e.code) for e in response.row_errors] == [(0, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    await call.done_writing()


async def _open_sessions(stub) -> int:
    return (await stub.GetInfo(tower_pb2.GetInfoRequest())).open_sessions


async def test_closed_stream_frees_its_sessions(tower):
    stub, _ = tower
    other = stub.Step()
    await other.write(_request(1, [_row("keep", 0, 2)], torch.randn(2, 64), torch.full((2, N), -1)))
    await other.read()
    call = stub.Step()
    await call.write(_request(1, [_row("x", 0, 2), _row("y", 0, 1)], torch.randn(3, 64), torch.full((3, N), -1)))
    await call.read()
    assert await _open_sessions(stub) == 3
    call.cancel()
    for _ in range(250):
        if await _open_sessions(stub) == 1:
            break
        await asyncio.sleep(0.02)
    assert await _open_sessions(stub) == 1          # only the other stream's session is left
    await other.done_writing()
    assert await other.read() == grpc.aio.EOF
    for _ in range(250):
        if await _open_sessions(stub) == 0:
            break
        await asyncio.sleep(0.02)
    assert await _open_sessions(stub) == 0


async def test_not_serving_until_an_engine_is_attached():
    servicer = TowerServicer()
    server, port, health = await grpcutil.start_server(
        add_servicers=[lambda s: tower_pb2_grpc.add_TowerServicer_to_server(servicer, s)],
        service_names=["drama.tower.v1.Tower"], port=0)
    try:
        assert await grpcutil.check_health(f"127.0.0.1:{port}") == "NOT_SERVING"
        channel = grpcutil.create_channel(f"127.0.0.1:{port}", traced=False)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tower_pb2_grpc.TowerStub(channel).GetInfo(tower_pb2.GetInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert grpcutil.error_details(info.value)[0] == "not_ready"
        await channel.close()
    finally:
        await server.stop(None)
        servicer.worker.shutdown()


async def test_entry_point_serves_the_tiny_checkpoint_and_stops_on_sigterm(tiny_checkpoint):
    """`python -m services.tower` loads a checkpoint, reports SERVING, answers, exits 0 on SIGTERM."""
    import os
    import re
    import signal
    import sys

    env = {**os.environ, "DRAMA_MAX_ROWS": "3", "DRAMA_MAX_CONTEXT_TOKENS": "128", "DRAMA_GRACE_S": "5"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.tower", "--checkpoint", str(tiny_checkpoint), "--port", "0",
        env=env, stderr=asyncio.subprocess.PIPE)
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
            assert line, "the tower exited before serving"
            match = re.search(r"serving on [\d.]+:(\d+)", line)
            port = int(match.group(1)) if match else None
        assert await grpcutil.check_health(f"127.0.0.1:{port}") == "SERVING"
        channel = grpcutil.create_channel(f"127.0.0.1:{port}", traced=False)
        info = await tower_pb2_grpc.TowerStub(channel).GetInfo(tower_pb2.GetInfoRequest())
        assert (info.max_rows, info.max_context_tokens, info.hidden_dtype) == (3, 128, "float32")
        await channel.close()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sampled_step_joins_the_backbone_trace(tower):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.common.telemetry import setup_telemetry

    exporter = InMemorySpanExporter()
    setup_telemetry("test-tower", span_processor=SimpleSpanProcessor(exporter))
    stub, _ = tower
    trace_id, parent_id = "ab" * 16, "cd" * 8
    call = stub.Step()
    request = _request(1, [_row("traced", 0, 2)], torch.randn(2, 64), torch.full((2, N), -1))
    request.trace_context["traceparent"] = f"00-{trace_id}-{parent_id}-01"
    await call.write(request)
    await call.read()
    await call.done_writing()
    spans = [s for s in exporter.get_finished_spans() if s.name == "tower.step"]
    assert len(spans) == 1
    assert spans[0].context.trace_id == int(trace_id, 16) and spans[0].parent.span_id == int(parent_id, 16)
    assert spans[0].attributes["drama.batch.rows"] == 2


async def test_a_failing_step_ends_the_stream_with_internal(tower, monkeypatch):
    """A device error or bug in a step is INTERNAL for the stream, never a silent wrong answer."""
    stub, _ = tower

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device error")

    monkeypatch.setattr(TowerEngine, "step", broken)
    call = stub.Step()
    await call.write(_request(1, [_row("z", 0, 1)], torch.randn(1, 64), torch.full((1, N), -1)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INTERNAL


class _HostInbox:
    """The device hand-off's Inbox as run_step uses it (receive, timed_out, publish_frames), with
    the rows and frames on the host: there is no GPU memory to share on the CPU
    (tests/test_device_handoff.py has the real one)."""

    def __init__(self, frames_ready: bool = True):
        self.published: dict[int, torch.Tensor] = {}
        self.frames: dict[int, torch.Tensor] = {}        # what publish_frames got, by seq
        self.late = False
        self.frames_ready, self.rows, self.device = frames_ready, 8, torch.device("cpu")

    def receive(self, seq: int, n_rows: int) -> torch.Tensor:
        return self.published[seq][:n_rows]

    def timed_out(self) -> bool:
        return self.late

    def publish_frames(self, seq: int, frames: torch.Tensor) -> None:
        assert seq not in self.frames and frames.dtype == torch.int64 and frames.shape[1] == N + 1
        self.frames[seq] = frames.clone()


def test_run_step_takes_a_hand_off_requests_rows_from_its_inbox():
    """A request with handoff_seq: its rows come from the connection's inbox (the frames are
    those of the same rows in `hidden`); without an inbox, with hidden bytes too, or with an entry
    that does not draw, its entries fail INVALID_ARGUMENT; a wait that gave up fails them
    UNAVAILABLE."""
    from services.tower.server import run_step

    engine = TowerEngine(random_tower(TINY, seed=7), TINY, max_sessions=SESSIONS, max_context=CONTEXT)
    hidden, targets = _prompt(TINY, 12, seed=4)
    plan = _session_plan("h", hidden, targets[:8], [8], frames=4)
    inbox, owner, frames = _HostInbox(), object(), []
    for step_id, (rows, h, t) in enumerate(plan, start=1):
        request = _request(step_id, rows, h, t)
        if step_id > 1:                                  # the frame steps through the inbox
            inbox.published[step_id] = h.float()
            request.ClearField("hidden")
            request.handoff_seq = step_id
        response = run_step(engine, request, "float32", owner, inbox)
        assert not response.row_errors, response.row_errors
        frames.append(_codes(response, 1)[0].tolist())
        if step_id > 1:      # the way back: the frame and its stop flag, before the response
            assert inbox.frames.pop(step_id).tolist() == [frames[-1] + [int(response.stop[0])]]
    assert frames == _expected_frames(plan) and not inbox.frames

    def failed(request, inbox) -> tuple[list[int], str]:
        response = run_step(engine, request, "float32", owner, inbox)
        if inbox is not None:   # a hand-off step that never ran still publishes frames: rows of -1, stopped
            published = inbox.frames.pop(request.handoff_seq).tolist()
            assert inbox.late or published == [[-1] * N + [1]]     # late: what it drew from whatever came
        return [e.code for e in response.row_errors], response.row_errors[0].message if response.row_errors else ""

    row = _row("h", 12, 1, draw=True, frame_index=5)
    handed = tower_pb2.StepRequest(step_id=9, rows=[row], handoff_seq=9,
                                   targets=tensor_to_bytes(torch.full((1, N), -1, dtype=torch.int16)))
    inbox.published[9] = hidden[11:12].float()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    codes, message = failed(handed, None)
    assert codes == [invalid] and "without a device hand-off" in message
    with_bytes = tower_pb2.StepRequest()
    with_bytes.CopyFrom(handed)
    with_bytes.hidden = tensor_to_bytes(hidden[11:12].float())
    assert failed(with_bytes, inbox)[0] == [invalid]
    no_draw = tower_pb2.StepRequest()
    no_draw.CopyFrom(handed)
    no_draw.rows[0].draw = False
    assert failed(no_draw, inbox)[0] == [invalid]
    inbox.late = True
    codes, message = failed(handed, inbox)
    assert codes == [grpc.StatusCode.UNAVAILABLE.value[0]] and "did not arrive" in message
    rows_only = _HostInbox(frames_ready=False)           # a hand-off without the way back: no frames
    rows_only.published[9] = hidden[11:12].float()
    run_step(engine, handed, "float32", owner, rows_only)
    assert not rows_only.frames

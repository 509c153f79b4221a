"""Streams end in their own task: no "Failed to detach context" from the OpenTelemetry gRPC server
interceptor when a client cancels a response stream, or when the gateway ends a session.

grpc.aio drives an async-generator handler and does not close it when its loop is left by a
cancelled or failed write; the traced generator was then closed by asyncio's finalizer in a new
task, where detaching the trace context fails (the codec logged 20 such tracebacks in one
bench/h200_serving.sh run). grpcutil wraps every response stream so the call's task closes it; the
gateway waits for a finished Decode stream's status instead of cancelling it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from gateway.session import SpeechSession
from services.codec.server import serve
from services.common.telemetry import setup_telemetry
from services.common.tensors import codes_to_wire
from test_gateway_e2e import MAX_NEW, Stack

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

DETACH_FAILED = "Failed to detach context"


def detach_failures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "opentelemetry.context" and DETACH_FAILED in r.getMessage()]


def collect_abandoned_generators() -> None:
    """An abandoned async generator is closed by the loop's finalizer once collected: make that
    happen now, so a failure would be logged before the test looks."""
    for _ in range(3):
        gc.collect()
        time.sleep(0.1)


async def test_decode_cancelled_while_the_codec_waits_to_write(tiny_checkpoint, caplog):
    """The client stops reading, so the codec's handler is suspended at its `yield` inside a
    write that flow control holds; then the client cancels. The handler must be closed in the
    call's task: the session freed at once, no failed context detach."""
    caplog.set_level(logging.INFO)
    setup_telemetry("drama-test")
    server, port, _, servicer = await serve(str(tiny_checkpoint), port=0)
    # No BDP probing: the client's receive window stays at 64 KiB, so unread PCM (4 KiB a frame)
    # stalls the codec's writes after a few dozen frames instead of megabytes.
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
    try:
        stub = codec_pb2_grpc.CodecStub(channel)
        per_message, messages = 4, 400
        codes = codes_to_wire(torch.zeros(servicer.codec.num_codebooks, per_message, dtype=torch.int64))

        async def requests():
            yield codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(session_id="s", first_chunk_frames=4))
            for i in range(messages):
                yield codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(
                    first_frame_index=i * per_message, n_frames=per_message, codes=codes))

        call = stub.Decode(requests())
        # Wait until the codec stops making progress with frames still to come: it is blocked
        # writing PCM nobody reads.
        last, unchanged, deadline = -1, 0, time.monotonic() + 60
        while unchanged < 5:
            assert time.monotonic() < deadline, "the codec never stalled on flow control"
            await asyncio.sleep(0.1)
            session = next(iter(servicer.sessions.values()), None)
            decoded = session.next_frame if session is not None else -1
            unchanged = unchanged + 1 if decoded == last and decoded > 0 else 0
            last = decoded
        assert 0 < last < per_message * messages
        assert len(servicer.sessions) == 1

        call.cancel()
        deadline = time.monotonic() + 5
        while servicer.sessions:
            assert time.monotonic() < deadline, "the cancelled stream kept its session"
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, collect_abandoned_generators)
        await asyncio.sleep(0.2)
        assert detach_failures(caplog) == []
    finally:
        await channel.close()
        await server.stop(None)
        await servicer.close()


# --------------------------------------------------------------------------------------------
# The real stack, as bench/h200_serving.sh drives it: concurrent requests to their end.
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    setup_telemetry("drama-test")
    s = Stack(tiny_checkpoint)
    yield s
    s.close()


def test_finished_sessions_end_their_streams_without_cancelling(stack, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    decode_finished_at_close: list[bool] = []
    original_aclose = SpeechSession.aclose

    async def recording_aclose(self, error=None):
        if not self._closed and self.result is not None and self._dec_call is not None:
            decode_finished_at_close.append(self._dec_call.done())
        await original_aclose(self, error)

    monkeypatch.setattr(SpeechSession, "aclose", recording_aclose)

    def one(i: int) -> int:
        response = stack.http.post("/v1/audio/speech", json={
            "model": "tts-1", "voice": "alloy", "input": f"Request number {i}.", "response_format": "pcm",
            "seed": i, "max_new_tokens": MAX_NEW})
        return response.status_code

    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            assert list(pool.map(one, range(4))) == [200] * 4
    collect_abandoned_generators()
    assert detach_failures(caplog) == []
    # The gateway waited for each Decode stream's own end: nothing was cancelled after `done`.
    assert decode_finished_at_close == [True] * 8
    assert stack.open_sessions() == (0, 0)


"""The gateway end to end against the real stages (API.md §1.3-§1.4, §2): codec, tower and backbone
servers with the tiny checkpoint, the gateway on a real port, driven by the official `openai`
client and plain HTTP.

The stages run in-process on their own event loop in a background thread (so the tests can be
plain functions with blocking clients), the gateway under uvicorn in another thread. Takes are kept
short (`max_new_tokens` small) so the module stays within a couple of minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time

import av
import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from gateway.app import create_app
from gateway.settings import Settings

openai = pytest.importorskip("openai")

MAX_NEW = 6                      # frames per chunk: ~0.28 s of audio
MAX_CONTEXT = 1024


# --------------------------------------------------------------------------------------------
# Fixtures: stages on a background loop, the gateway under uvicorn
# --------------------------------------------------------------------------------------------

class BackgroundLoop:
    """An asyncio loop in a daemon thread; `run(coro)` blocks until the coroutine is done."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _stage_modules():
    try:
        from services.backbone import server as backbone_server
        from services.codec import server as codec_server
        from services.tower import server as tower_server
    except ImportError as exc:          # the stage servers land in parallel with this file
        pytest.skip(f"stage servers not available yet: {exc}")
    return backbone_server, tower_server, codec_server


class ServerHandle:
    """The (server, port, health, servicer) that the codec and tower `serve()` return."""

    def __init__(self, server, port, health, servicer):
        self.server, self.port, self.servicer = server, port, servicer

    async def stop(self):
        await self.server.stop(None)
        close = getattr(self.servicer, "close", None)      # the codec's batcher and worker
        if close is not None:
            await close()


async def _start_stages(checkpoint):
    """Codec, tower, backbone in-process on port 0; returns (handles, backbone addr, codec addr)."""
    backbone_server, tower_server, codec_server = _stage_modules()
    codec = ServerHandle(*await codec_server.serve(str(checkpoint), port=0))
    tower = ServerHandle(*await tower_server.serve(str(checkpoint), port=0, max_sessions=8, max_context=MAX_CONTEXT))
    backbone = await backbone_server.start(backbone_server.Settings(
        checkpoint=str(checkpoint), tower_addr=f"127.0.0.1:{tower.port}", port=0, max_rows=8,
        max_context_tokens=MAX_CONTEXT, max_queue=16, prefill_chunk_tokens=256))
    assert await backbone.tower.wait_ready(60), backbone.tower.last_error
    return [backbone, tower, codec], f"127.0.0.1:{backbone.port}", f"127.0.0.1:{codec.port}"


class Stack:
    def __init__(self, checkpoint):
        import uvicorn

        self.background = BackgroundLoop()
        self.handles, self.backbone_addr, self.codec_addr = self.background.run(_start_stages(checkpoint))
        settings = Settings(checkpoint=checkpoint, backbone_addr=self.backbone_addr, codec_addr=self.codec_addr)
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="EMPTY", max_retries=0)

    def open_sessions(self) -> tuple[int, int]:
        """(backbone, codec) open sessions from their GetInfo."""
        async def query():
            async with grpc.aio.insecure_channel(self.backbone_addr) as b, \
                    grpc.aio.insecure_channel(self.codec_addr) as c:
                bi = await backbone_pb2_grpc.BackboneStub(b).GetInfo(backbone_pb2.GetInfoRequest(), timeout=5)
                ci = await codec_pb2_grpc.CodecStub(c).GetInfo(codec_pb2.GetInfoRequest(), timeout=5)
                return bi.open_sessions + bi.queued_sessions, ci.open_sessions
        return self.background.run(query())

    def close(self):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(15)
        for handle in self.handles:
            self.background.run(handle.stop())
        self.background.close()


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    s = Stack(tiny_checkpoint)
    yield s
    s.close()


def sine_wav(seconds=1.5, rate=22050, freq=220.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def read_audio(data: bytes, fmt: str, rate: int) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, rate
    if fmt in ("opus", "aac"):
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)]), stream.rate
    return sf.read(io.BytesIO(data), dtype="float32")


def sse_events(body: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in body.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events


def speech(stack, **body):
    return stack.http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hello there.",
                                                      "max_new_tokens": MAX_NEW, **body})


def tts(stack, **body):
    return stack.http.post("/v1/tts", json={"text": "Hello there.", "max_new_tokens": MAX_NEW, **body})


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

def test_ready_reports_every_stage_serving(stack):
    r = stack.http.get("/ready")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "stages": {"backbone": "SERVING", "tower": "SERVING", "codec": "SERVING"}}


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_openai_client_gets_valid_audio(stack, fmt):
    response = stack.openai.audio.speech.with_raw_response.create(
        model="tts-1", voice="alloy", input="Hello there.", response_format=fmt,
        extra_body={"max_new_tokens": MAX_NEW, "seed": 3})
    headers = response.headers
    assert headers["x-sample-rate"] == "24000" and headers["x-seed"] == "3" and headers["x-voice-id"] == "alloy"
    assert headers["x-take-id"].startswith("take_") and headers["x-channels"] == "1"
    assert headers["content-disposition"] == f'attachment; filename="speech.{fmt}"'
    assert headers["cache-control"] == "no-store"
    assert headers["content-type"] == {"pcm": "audio/pcm;rate=24000", "wav": "audio/wav", "mp3": "audio/mpeg",
                                       "opus": "audio/ogg;codecs=opus", "aac": "audio/aac",
                                       "flac": "audio/flac"}[fmt]
    samples, rate = read_audio(response.content, fmt, 24000)
    assert rate == (48000 if fmt == "opus" else 24000)
    assert len(samples) > 0 and np.isfinite(samples).all()


def test_progressive_and_sse_bytes_agree(stack):
    """SSE deltas concatenate to the progressive body; buffered equals progressive (wav: but the sizes)."""
    body = {"response_format": "wav", "seed": 11}
    with stack.openai.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format="wav",
            extra_body={"max_new_tokens": MAX_NEW, "seed": 11}) as response:
        assert response.headers["x-accel-buffering"] == "no"
        progressive = b"".join(response.iter_bytes())
    # The OpenAI SDK asks for SSE with `Accept: application/octet-stream`; the body follows stream_format.
    sse = stack.openai.audio.speech.with_raw_response.create(
        model="tts-1", voice="alloy", input="Hello there.", response_format="wav", stream_format="sse",
        extra_body={"max_new_tokens": MAX_NEW, "seed": 11})
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = sse_events(sse.content)
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(e["audio"]) for _, e in events[:-1]) == progressive
    done = events[-1][1]
    assert done["take_id"] == sse.headers["x-take-id"]
    assert done["seed"] == 11 and done["finish_reason"] in ("stop", "length") and done["take_id"].startswith("take_")
    usage = done["usage"]
    assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_token_details"]["audio_tokens"] == 0 and usage["input_token_details"]["text_tokens"] > 0
    buffered = speech(stack, stream=False, **body)
    assert buffered.headers["content-length"] == str(len(buffered.content))
    assert "server-timing" in buffered.headers and "queue;dur=" in buffered.headers["server-timing"]
    assert buffered.content[44:] == progressive[44:] and len(buffered.content) == len(progressive)


def test_same_seed_gives_the_same_bytes(stack):
    first = speech(stack, response_format="pcm", seed=42).content
    assert speech(stack, response_format="pcm", seed=42).content == first
    # OpenAI voice names are seeded voices: stable without a request seed.
    a, b = speech(stack, response_format="pcm"), speech(stack, response_format="pcm")
    assert a.headers["x-seed"] == b.headers["x-seed"] and a.content == b.content


def test_speed_and_instructions(stack):
    """speed is a pitch-preserving stretch of the same take; instructions reach the prompt."""
    normal = speech(stack, response_format="pcm", seed=9)
    fast = speech(stack, response_format="pcm", seed=9, speed=2.0)
    assert fast.status_code == 200 and abs(len(fast.content) / len(normal.content) - 0.5) < 0.01

    def text_tokens(**extra):
        done = sse_events(speech(stack, response_format="pcm", stream_format="sse", **extra).content)[-1][1]
        return done["usage"]["input_token_details"]["text_tokens"]

    assert text_tokens(instructions="Whisper it.") > text_tokens()


def test_concurrent_requests_get_their_own_audio(stack):
    """Sessions running side by side (batched in the stages) each get exactly their solo bytes."""
    from concurrent.futures import ThreadPoolExecutor

    seeds = [31, 32, 33]
    solo = {seed: speech(stack, response_format="pcm", seed=seed).content for seed in seeds}
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = dict(zip(seeds, pool.map(lambda seed: speech(stack, response_format="pcm", seed=seed).content,
                                            seeds)))
    assert together == solo and len(set(solo.values())) == len(seeds)


def test_slow_reader_gets_the_same_bytes_under_backpressure(stack, monkeypatch):
    """With tiny bounds the session keeps stopping its streams for a slow client; nothing is lost."""
    import gateway.session

    body = {"response_format": "pcm", "seed": 21, "max_new_tokens": 40, "latency": "low"}
    fast = speech(stack, **body).content
    monkeypatch.setattr(gateway.session, "MAX_PENDING_PCM", 1)
    monkeypatch.setattr(gateway.session, "MAX_FRAMES_AHEAD", 2)
    slow = bytearray()
    with stack.http.stream("POST", "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy",
                                                             "input": "Hello there.", **body}) as response:
        for piece in response.iter_bytes(4096):
            slow += piece
            time.sleep(0.01)
    assert bytes(slow) == fast and len(fast) > 0


def test_tts_with_reference_two_speakers_and_previous_take(stack):
    ref = base64.b64encode(sine_wav()).decode()
    references = [{"audio": ref, "text": "A low tone.", "speaker": 0},
                  {"vq_codes": [[1, 2, 3]] + [[0, 1, 2]] * 9, "text": "Another voice.", "speaker": 1}]
    first = tts(stack, text="<|speaker:0|>Hi there. <|speaker:1|>Hello back.", references=references,
                format="wav", seed=5)
    assert first.status_code == 200, first.text
    assert first.headers["x-sample-rate"] == "44100"          # /v1/tts: native rate by default
    samples, rate = sf.read(io.BytesIO(first.content))
    assert rate == 44100 and len(samples) > 0
    take_id = first.headers["x-take-id"]
    take = stack.http.get(f"/v1/takes/{take_id}").json()
    assert take["id"] == take_id and len(take["vq_codes"]) == 10 and take["seed"] == 5
    follow = tts(stack, text="And again.", references=references, history=[{"take_id": take_id}],
                 format="pcm", stream_format="sse", streaming=True)
    events = sse_events(follow.content)
    done = events[-1][1]
    assert events[-1][0] == "speech.audio.done", events[-1]
    # audio tokens: the reference frames (encoded clip + 3 given) and the previous take's frames
    assert done["usage"]["input_token_details"]["audio_tokens"] > 3 + len(take["vq_codes"][0])
    # The take's codes are a valid reference too (the take artifact round trip).
    again = tts(stack, text="Once more.", references=[{"vq_codes": take["vq_codes"], "text": take["text"]}],
                format="pcm")
    assert again.status_code == 200, again.text


def test_long_text_is_chunked_into_several_takes(stack):
    text = " ".join(f"Sentence number {i} is here." for i in range(6))
    r = tts(stack, text=text, chunk_length=40, format="pcm", streaming=True, stream_format="sse", max_new_tokens=3)
    events = sse_events(r.content)
    chunk_indices = [e["chunk_index"] for kind, e in events if kind == "speech.audio.delta"]
    assert chunk_indices == sorted(chunk_indices) and chunk_indices[-1] >= 2
    assert events[-1][0] == "speech.audio.done"


def test_uploaded_voice_is_used_as_reference(stack, monkeypatch):
    from gateway.voices import Voice

    reads = []
    read_file = Voice.audio_bytes
    monkeypatch.setattr(Voice, "audio_bytes", lambda voice: reads.append(voice.id) or read_file(voice))
    r = stack.http.post("/v1/audio/voices", data={"name": "tone", "consent": "ok", "ref_text": "A tone."},
                        files={"audio_sample": ("tone.wav", sine_wav(), "audio/wav")})
    assert r.status_code == 200, r.text
    r = speech(stack, voice="tone", stream_format="sse", response_format="pcm")
    done = sse_events(r.content)[-1][1]
    assert done["usage"]["input_token_details"]["audio_tokens"] > 0
    first_use = len(reads)
    r = tts(stack, text="<|speaker:1|>Me again.", reference_id=[None, "tone"], streaming=True, stream_format="sse")
    assert sse_events(r.content)[-1][1]["usage"]["input_token_details"]["audio_tokens"] > 0
    # the second use finds the codes by the voice's stored SHA-256: its file is not read again
    assert first_use <= 1 and len(reads) == first_use
    assert stack.http.delete("/v1/audio/voices/tone").status_code == 200


def test_reference_in_a_container_the_codec_cannot_read(stack):
    """AAC (ADTS) is decoded in the gateway and sent to Codec.Encode as PCM."""
    from gateway.audio import encode_all

    t = np.arange(int(1.5 * 44100)) / 44100
    aac = encode_all((8000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16), "aac", 24000)
    r = tts(stack, references=[{"audio": base64.b64encode(aac).decode(), "text": "A tone."}],
            streaming=True, stream_format="sse", format="pcm")
    done = sse_events(r.content)[-1][1]
    assert done["usage"]["input_token_details"]["audio_tokens"] > 0


def test_errors_from_the_stages_keep_the_envelope(stack):
    r = tts(stack, max_new_tokens=4096)                       # 4096 frames > the whole context
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_new_tokens"
    r = speech(stack, input="A rather long sentence. " * 8, max_new_tokens=MAX_CONTEXT - 20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"            # the backbone's "text", in the caller's name
    r = tts(stack, references=[{"audio": base64.b64encode(sine_wav(0.3)).decode(), "text": "x"}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_short"
    assert r.json()["error"]["param"] == "references[0].audio"


@pytest.mark.parametrize("mode", [{"stream": True}, {"stream": False}, {"stream_format": "sse"}],
                         ids=["progressive", "buffered", "sse"])
def test_disconnect_frees_every_stage(stack, mode):
    """A client that goes away mid-generation cancels Generate and Decode, in every mode."""
    body = json.dumps({"model": "tts-1", "voice": "alloy", "input": "A long one.", "response_format": "pcm",
                       "max_new_tokens": 900, "latency": "low", **mode}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while stack.open_sessions()[1] == 0:                      # the codec is decoding: mid-generation
        assert time.monotonic() < deadline, "the session never started"
        time.sleep(0.01)
    sock.close()
    closed = time.monotonic()
    while stack.open_sessions() != (0, 0):
        assert time.monotonic() - closed < 1.0, f"sessions still open: {stack.open_sessions()}"
        time.sleep(0.01)


def test_metrics_count_speech(stack):
    speech(stack, response_format="pcm")
    text = stack.http.get("/metrics").text
    assert "drama_speech_ttfa_seconds_count" in text and "drama_speech_output_frames_total" in text
    assert 'drama_http_requests_total{route="/v1/audio/speech",status="200"}' in text


def test_metrics_phases_of_one_request_are_ordered(stack):
    """One streamed request adds one observation per phase, and its milestones come in order:
    admitted <= first frames <= first PCM <= first byte (all from the request's arrival)."""
    from bench.e2e import PHASES as phases, gateway_phases

    before = gateway_phases(stack.http, "")
    speech(stack, response_format="pcm", stream=True)
    after = gateway_phases(stack.http, "")
    delta = {}
    for phase in phases:
        total, count = after[phase]
        total0, count0 = before.get(phase, (0.0, 0))
        assert count - count0 == 1, (phase, before, after)
        delta[phase] = total - total0
    assert all(delta[a] <= delta[b] for a, b in zip(phases, phases[1:])), delta
    assert delta["admitted"] > 0


# --------------------------------------------------------------------------------------------
# Failure after the first byte (failure injection: a backbone that breaks mid-take, real codec)
# --------------------------------------------------------------------------------------------

class BreakingBackbone(backbone_pb2_grpc.BackboneServicer):
    """Admits, sends frames, then fails with INTERNAL, as a backbone hitting a CUDA error would."""

    def Generate(self, request, context):
        yield backbone_pb2.GenerateResponse(started=backbone_pb2.Started())
        time.sleep(0.3)                                        # a slow first frame (SSE keep-alives)
        for i in range(3):
            codes = np.full((4, 10), i, dtype="<i2").tobytes()
            yield backbone_pb2.GenerateResponse(frames=backbone_pb2.Frames(
                chunk_index=0, first_frame_index=4 * i, n_frames=4, codes=codes))
            time.sleep(0.05)
        context.abort(grpc.StatusCode.INTERNAL, "injected failure")


@pytest.fixture(scope="module")
def broken(stack):
    from concurrent import futures

    import uvicorn

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    backbone_pb2_grpc.add_BackboneServicer_to_server(BreakingBackbone(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    settings = Settings(checkpoint=stack.app.state.settings.checkpoint, backbone_addr=f"127.0.0.1:{port}",
                        codec_addr=stack.codec_addr)
    gateway = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=gateway.run, daemon=True)
    thread.start()
    while not gateway.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{gateway.servers[0].sockets[0].getsockname()[1]}"
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client
    gateway.should_exit = True
    thread.join(10)
    server.stop(0)


def test_failure_after_first_byte_truncates_the_body(broken):
    body = {"input": "Hello.", "response_format": "pcm"}
    received = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):           # no terminating chunk
        with broken.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            for piece in response.iter_raw():
                received += piece
    assert len(received) > 0                                  # audio had been sent


def test_failure_after_start_is_an_sse_error_event_or_a_real_status(broken, monkeypatch):
    import gateway.responses

    monkeypatch.setattr(gateway.responses, "KEEPALIVE_S", 0.05)
    content = broken.post("/v1/audio/speech", json={"input": "Hello.", "response_format": "pcm",
                                                    "stream_format": "sse"}).content
    assert content.startswith(b": keep-alive\n\n")             # comments until the first delta
    events = sse_events(content)
    assert events[-1][0] == "speech.audio.error" and events[-1][1]["error"]["code"] == "internal_error"
    assert {kind for kind, _ in events[:-1]} == {"speech.audio.delta"}
    r = broken.post("/v1/audio/speech", json={"input": "Hello.", "response_format": "pcm", "stream": False})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


# --------------------------------------------------------------------------------------------
# Fish Audio's own SDK, unchanged, pointed at the gateway (API.md §2.1: MessagePack bodies)
# --------------------------------------------------------------------------------------------

def test_fish_audio_sdk_synthesizes_with_a_reference_clip(stack):
    """fish-audio-sdk sends MessagePack with raw reference bytes, its default fields and a Fish
    backend name in the `model` header; the gateway must honour all of it, unchanged."""
    fishaudio = pytest.importorskip("fishaudio")
    from fishaudio.types import ReferenceAudio, TTSConfig

    client = fishaudio.FishAudio(api_key="EMPTY", base_url=stack.url)
    config = TTSConfig(format="wav", max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.7)
    reference = ReferenceAudio(audio=sine_wav(1.5), text="A calm reference sentence.")
    audio = client.tts.convert(text="Hello from the fish client.", references=[reference], config=config)
    data, rate = sf.read(io.BytesIO(audio), dtype="float32")
    assert rate == 44100                      # /v1/tts answers at the native rate by default
    assert 0 < len(data) <= MAX_NEW * 2048 and np.isfinite(data).all()
    streamed = b"".join(client.tts.stream(text="Hello again.", references=[reference], config=config))
    assert streamed[:4] == b"RIFF"

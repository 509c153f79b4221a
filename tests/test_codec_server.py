"""The Codec gRPC service (API.md §3.3) on a real localhost port with the tiny checkpoint."""

from __future__ import annotations

import asyncio
import io
import math
import time

import grpc
import numpy as np
import pytest
import pytest_asyncio
import soundfile
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from services.codec.batcher import pcm16_bytes
from services.codec.server import serve
from services.common import grpcutil
from services.common.tensors import codes_from_wire, codes_to_wire


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tone(seconds: float, rate: int, freq: float = 220.0, channels: int = 1) -> np.ndarray:
    """Input audio: a sine (test input only; every codec output comes from the real model)."""
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.5 * np.sin(2 * math.pi * freq * t)).astype(np.float32)
    return np.stack([mono] * channels, axis=1) if channels > 1 else mono


def audio_file(samples: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def random_codes(codec, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, codec.semantic_codebook_size, (1, frames), generator=gen),
                      torch.randint(0, codec.codebook_size, (codec.num_codebooks - 1, frames), generator=gen)])


class Running:
    def __init__(self, server, port, servicer, channel):
        self.server, self.port, self.servicer, self.channel = server, port, servicer, channel
        self.stub = codec_pb2_grpc.CodecStub(channel)
        self.codec = servicer.codec


async def start(checkpoint) -> Running:
    server, port, _, servicer = await serve(str(checkpoint), port=0)
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=32)
    return Running(server, port, servicer, channel)


async def stop(running: Running) -> None:
    await running.channel.close()
    await running.server.stop(None)
    await running.servicer.close()


@pytest_asyncio.fixture(scope="module")
async def codec_server(tiny_checkpoint):
    running = await start(tiny_checkpoint)
    yield running
    await stop(running)


def decode_requests(codes: torch.Tensor, groups: list[int], session_id: str = "s"):
    """start, frames in the given chunk sizes (codes [N, T]), end."""
    yield codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(session_id=session_id, first_chunk_frames=groups[0]))
    start = 0
    for size in groups:
        chunk = codes[:, start:start + size]
        yield codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(
            first_frame_index=start, n_frames=chunk.shape[-1], codes=codes_to_wire(chunk)))
        start += size
    yield codec_pb2.DecodeRequest(end=codec_pb2.DecodeEnd())


async def run_decode(stub, requests) -> tuple[bytes, list[codec_pb2.DecodeResponse]]:
    responses = [r async for r in stub.Decode(requests)]
    pcm = b"".join(r.pcm.samples for r in responses if r.WhichOneof("msg") == "pcm")
    return pcm, responses


async def expect_error(call, code: grpc.StatusCode, drama_code: str | None):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    assert info.value.code() == code, info.value.details()
    assert grpcutil.error_details(info.value)[0] == drama_code
    return info.value


async def aiter_of(items):
    for item in items:
        yield item


# --------------------------------------------------------------------------------------------

async def test_health_and_info(codec_server):
    health = health_pb2_grpc.HealthStub(codec_server.channel)
    for service in ("", "drama.codec.v1.Codec"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = await codec_server.stub.GetInfo(codec_pb2.GetInfoRequest())
    assert (info.sample_rate, info.codebooks, info.hop_length) == (44100, 10, 2048)
    assert (info.codebook_size, info.semantic_codebook_size) == (32, 64)
    assert info.frame_rate_hz == pytest.approx(44100 / 2048)
    assert info.open_sessions == 0 and info.max_encode_seconds >= 30


async def test_encode_file_then_decode_its_codes(codec_server):
    """A 48 kHz stereo WAV tone: encode over gRPC equals the model's encode of the mono mix, and
    decoding those codes over gRPC equals the model's offline decode, sample for sample."""
    stereo = tone(1.5, 48000, channels=2)
    data = audio_file(stereo, 48000)
    reply = await codec_server.stub.Encode(codec_pb2.EncodeRequest(audio_file=data))
    codes = codes_from_wire(reply.codes, reply.codebooks)
    expected = codec_server.codec.encode(torch.from_numpy(stereo.mean(axis=1))[None], 48000)[0]
    assert torch.equal(codes, expected)
    assert reply.n_frames == codes.shape[-1] == math.ceil(math.ceil(1.5 * 44100) / 2048)
    assert reply.duration_s == pytest.approx(1.5)
    assert len(reply.sha256) == 64

    pcm, responses = await run_decode(codec_server.stub, decode_requests(codes, [3, 4, 1, codes.shape[-1] - 8]))
    offline = codec_server.codec.decode(codes[None])[0]
    assert pcm == pcm16_bytes(offline)
    starts = [r.pcm.first_sample_index for r in responses[:-1]]
    assert starts == [0, 3 * 2048, 7 * 2048, 8 * 2048]
    assert responses[-1].done.total_samples == codes.shape[-1] * 2048


async def test_encode_raw_pcm(codec_server):
    samples = tone(1.2, 44100, freq=440.0)
    reply = await codec_server.stub.Encode(codec_pb2.EncodeRequest(
        pcm=codec_pb2.Pcm(samples=samples.astype("<f4").tobytes(), sample_rate=44100)))
    codes = codes_from_wire(reply.codes, reply.codebooks)
    assert torch.equal(codes, codec_server.codec.encode(torch.from_numpy(samples)[None], 44100)[0])


@pytest.mark.parametrize("group", [1, 3, 4, 37])
async def test_streamed_equals_offline(codec_server, group):
    codes = random_codes(codec_server.codec, 40, seed=group)
    groups = [group] * (40 // group) + ([40 % group] if 40 % group else [])
    pcm, _ = await run_decode(codec_server.stub, decode_requests(codes, groups))
    assert pcm == pcm16_bytes(codec_server.codec.decode(codes[None])[0])


async def test_concurrent_sessions_do_not_mix(codec_server):
    """Two sessions sent at once (so their chunks share decode calls) each equal a lone run."""
    codec = codec_server.codec
    a, b = random_codes(codec, 12, seed=1), random_codes(codec, 9, seed=2)
    (pcm_a, _), (pcm_b, _) = await asyncio.gather(
        run_decode(codec_server.stub, decode_requests(a, [2] * 6, "a")),
        run_decode(codec_server.stub, decode_requests(b, [3, 3, 3], "b")))
    assert pcm_a == pcm16_bytes(codec.decode(a[None])[0])
    assert pcm_b == pcm16_bytes(codec.decode(b[None])[0])


async def test_batcher_puts_sessions_in_one_call(codec_server):
    """Chunks queued in the same tick go through one decode call."""
    codec, batcher = codec_server.codec, codec_server.servicer.batcher
    states = [codec.new_state() for _ in range(3)]
    chunks = [random_codes(codec, n, seed=n) for n in (2, 2, 5)]
    before = batcher.batches
    outputs = await asyncio.gather(*[batcher.decode(s, c) for s, c in zip(states, chunks)])
    assert batcher.batches == before + 1
    for chunk, out in zip(chunks, outputs):
        assert out == pcm16_bytes(codec.decode(chunk[None])[0])


async def test_batcher_closes_a_tick_when_every_open_stream_is_in_it(codec_server):
    """A tick waits out its window only while an open stream could still join it: with one open
    stream its chunk goes at once; with two open and one chunk pending, it waits."""
    from concurrent.futures import ThreadPoolExecutor

    from services.codec.batcher import DecodeBatcher

    codec = codec_server.codec
    chunk = random_codes(codec, 2, seed=3)
    with ThreadPoolExecutor(max_workers=1) as worker:
        for open_streams, window, waits in ((1, 5.0, False), (2, 0.4, True)):
            batcher = DecodeBatcher(codec, worker, max_wait_s=window, open_streams=lambda n=open_streams: n)
            try:
                started = time.monotonic()
                out = await batcher.decode(codec.new_state(), chunk)
                elapsed = time.monotonic() - started
            finally:
                await batcher.close()
            assert out == pcm16_bytes(codec.decode(chunk[None])[0])
            assert (elapsed >= window) if waits else (elapsed < 2.0), (open_streams, elapsed)


@pytest.mark.parametrize("case", ["too_short", "too_long", "declared_too_long", "undecodable", "empty",
                                  "bad_pcm_bytes", "nan"])
async def test_encode_refuses_bad_audio(codec_server, case):
    if case == "too_short":
        request = codec_pb2.EncodeRequest(audio_file=audio_file(tone(0.5, 16000), 16000))
        expected = "audio_too_short"
    elif case == "too_long":
        request = codec_pb2.EncodeRequest(audio_file=audio_file(tone(31, 8000), 8000))
        expected = "audio_too_long"
    elif case == "declared_too_long":
        # A FLAC whose header claims 10 hours: refused from the header, never decoded in full.
        data = bytearray(audio_file(tone(1.0, 8000), 8000, fmt="FLAC"))
        word = int.from_bytes(data[18:26], "big")
        word = (word & ~((1 << 36) - 1)) | (8000 * 36000)
        data[18:26] = word.to_bytes(8, "big")
        request = codec_pb2.EncodeRequest(audio_file=bytes(data))
        expected = "audio_too_long"
    elif case == "undecodable":
        request = codec_pb2.EncodeRequest(audio_file=b"this is not audio at all" * 10)
        expected = "audio_undecodable"
    elif case == "empty":
        request = codec_pb2.EncodeRequest()
        expected = "audio_undecodable"
    elif case == "bad_pcm_bytes":
        request = codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=b"\x00" * 4001, sample_rate=44100))
        expected = "audio_undecodable"
    else:
        samples = tone(1.5, 44100)
        samples[100] = np.nan
        request = codec_pb2.EncodeRequest(pcm=codec_pb2.Pcm(samples=samples.tobytes(), sample_rate=44100))
        expected = "audio_undecodable"
    await expect_error(lambda: codec_server.stub.Encode(request), grpc.StatusCode.INVALID_ARGUMENT, expected)


async def test_encode_respects_request_limits(codec_server):
    samples = tone(2.0, 44100).astype("<f4").tobytes()
    pcm = codec_pb2.Pcm(samples=samples, sample_rate=44100)
    await expect_error(lambda: codec_server.stub.Encode(codec_pb2.EncodeRequest(pcm=pcm, max_seconds=1.5)),
                       grpc.StatusCode.INVALID_ARGUMENT, "audio_too_long")
    await expect_error(lambda: codec_server.stub.Encode(codec_pb2.EncodeRequest(pcm=pcm, min_seconds=2.5)),
                       grpc.StatusCode.INVALID_ARGUMENT, "audio_too_short")


def _frames(first: int, codes: torch.Tensor, n_frames: int | None = None, raw: bytes | None = None):
    return codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(
        first_frame_index=first, n_frames=codes.shape[-1] if n_frames is None else n_frames,
        codes=codes_to_wire(codes) if raw is None else raw))


START = codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(session_id="bad"))


@pytest.mark.parametrize("case", ["before_start", "out_of_range_semantic", "out_of_range_residual",
                                  "negative", "wrong_codebook_count", "n_frames_mismatch", "gap",
                                  "repeat", "second_start", "empty_chunk"])
async def test_decode_refuses_bad_frames(codec_server, case):
    codec = codec_server.codec
    codes = random_codes(codec, 4, seed=9)
    good = _frames(0, codes[:, :2])
    bad = codes[:, 2:].clone()
    requests = {
        "before_start": [_frames(0, codes)],
        "out_of_range_semantic": [START, good, _frames(2, bad.index_fill(0, torch.tensor([0]), codec.semantic_codebook_size))],
        "out_of_range_residual": [START, good, _frames(2, bad.index_fill(0, torch.tensor([3]), codec.codebook_size))],
        "negative": [START, _frames(0, bad.index_fill(0, torch.tensor([1]), -1))],
        "wrong_codebook_count": [START, _frames(0, codes[:-1], n_frames=4)],
        "n_frames_mismatch": [START, _frames(0, codes, n_frames=3)],
        "gap": [START, good, _frames(3, bad)],
        "repeat": [START, good, _frames(0, bad)],
        "second_start": [START, good, START],
        "empty_chunk": [START, _frames(0, codes[:, :0])],
    }[case]
    await expect_error(lambda: codec_server.stub.Decode(aiter_of(requests)),
                       grpc.StatusCode.INVALID_ARGUMENT, "invalid_value")
    await _wait_for_no_sessions(codec_server)


async def _wait_for_no_sessions(codec_server, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await codec_server.stub.GetInfo(codec_pb2.GetInfoRequest())
        if info.open_sessions == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{info.open_sessions} sessions still open"
        await asyncio.sleep(0.05)


async def test_cancelled_stream_frees_its_state(codec_server):
    codes = random_codes(codec_server.codec, 4, seed=4)
    call = codec_server.stub.Decode()
    await call.write(START)
    await call.write(_frames(0, codes))
    first = await call.read()
    assert first.pcm.first_sample_index == 0 and len(first.pcm.samples) == 4 * 2048 * 2
    info = await codec_server.stub.GetInfo(codec_pb2.GetInfoRequest())
    assert info.open_sessions == 1
    call.cancel()
    await _wait_for_no_sessions(codec_server)


async def test_micro_server(tiny_checkpoint, tmp_path):
    """num_codebooks = 3 end to end: nothing in the service assumes 10."""
    import json
    import shutil

    from services.common.config import DramaConfig
    from services.common.make_checkpoint import write_codec

    micro = tmp_path / "micro"
    shutil.copytree(tiny_checkpoint, micro)
    raw = json.loads((micro / "config.json").read_text())
    raw["num_codebooks"] = 3
    raw["audio_decoder_config"]["num_residual_layers"] = 2
    raw["codec_config"]["quantizer"]["n_codebooks"] = 2
    (micro / "config.json").write_text(json.dumps(raw))
    write_codec(micro / "codec.pth", DramaConfig.from_dict(raw), seed=3)
    running = await start(micro)
    try:
        info = await running.stub.GetInfo(codec_pb2.GetInfoRequest())
        assert info.codebooks == 3
        reply = await running.stub.Encode(codec_pb2.EncodeRequest(audio_file=audio_file(tone(1.0, 22050), 22050)))
        codes = codes_from_wire(reply.codes, 3)
        pcm, _ = await run_decode(running.stub, decode_requests(codes, [2, codes.shape[-1] - 2]))
        assert pcm == pcm16_bytes(running.codec.decode(codes[None])[0])
    finally:
        await stop(running)


def test_decode_dtype_setting(monkeypatch):
    from services.codec.__main__ import parse_args

    monkeypatch.setenv("DRAMA_CHECKPOINT", "/ckpt")
    assert parse_args([]).dtype is None                      # load_codec's default for the device
    monkeypatch.setenv("DRAMA_CODEC_DTYPE", "BFloat16")
    assert parse_args([]).dtype is torch.bfloat16
    monkeypatch.setenv("DRAMA_CODEC_DTYPE", "half")
    with pytest.raises(SystemExit):                          # named, not guessed
        parse_args([])


def test_graph_lengths_setting(monkeypatch):
    from services.codec.__main__ import parse_args

    monkeypatch.setenv("DRAMA_CHECKPOINT", "/ckpt")
    assert parse_args([]).graph_lengths is None
    monkeypatch.setenv("DRAMA_CODEC_GRAPH_LENGTHS", "8, 4,2,1")
    assert parse_args([]).graph_lengths == (1, 2, 4, 8)
    for bad in ("2,4", "1,x", "0,1"):                        # 1 is needed to split any chunk
        monkeypatch.setenv("DRAMA_CODEC_GRAPH_LENGTHS", bad)
        with pytest.raises(SystemExit):
            parse_args([])


def test_graph_buckets_setting(monkeypatch):
    from services.codec.__main__ import parse_args

    monkeypatch.setenv("DRAMA_CHECKPOINT", "/ckpt")
    assert parse_args([]).graph_buckets is None               # graphs.BATCH_BUCKETS
    monkeypatch.setenv("DRAMA_CODEC_GRAPH_BUCKETS", "1,2,4,8,12,16,24,32,48,64")
    assert parse_args([]).graph_buckets == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    for bad in ("2,4", "1,x", "0,1", ","):                    # 1 is needed for a lone session
        monkeypatch.setenv("DRAMA_CODEC_GRAPH_BUCKETS", bad)
        with pytest.raises(SystemExit):
            parse_args([])


def test_long_lengths_setting(monkeypatch):
    from services.codec.__main__ import parse_args

    monkeypatch.setenv("DRAMA_CHECKPOINT", "/ckpt")
    assert parse_args([]).long_lengths is None                # graphs.LONG_LENGTHS
    monkeypatch.setenv("DRAMA_CODEC_LONG_LENGTHS", "64, 16")
    assert parse_args([]).long_lengths == (16, 64)
    for off in ("none", "0"):
        monkeypatch.setenv("DRAMA_CODEC_LONG_LENGTHS", off)
        assert parse_args([]).long_lengths == ()
    for bad in ("16,x", "-16"):
        monkeypatch.setenv("DRAMA_CODEC_LONG_LENGTHS", bad)
        with pytest.raises(SystemExit):
            parse_args([])


async def test_pool_with_fewer_graph_lengths_splits_chunks(tiny_checkpoint):
    """Lengths (1, 2, 4): a 7-frame chunk runs as 4 + 2 + 1 and still equals the offline decode."""
    server, port, _, servicer = await serve(str(tiny_checkpoint), port=0, graphs=True, graph_lengths=(1, 2, 4),
                                            long_lengths=())
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=32)
    running = Running(server, port, servicer, channel)
    try:
        assert servicer.streams.lengths == (1, 2, 4) and servicer.streams.long_lengths == ()
        codes = random_codes(running.codec, 10, seed=6)
        pcm, _ = await run_decode(running.stub, decode_requests(codes, [7, 3]))
        # The pool runs whole pieces, not the frame-serial CPU path: equal up to rounding.
        got = np.frombuffer(pcm, dtype="<i2").astype(np.int32)
        want = np.frombuffer(pcm16_bytes(running.codec.decode(codes[None])[0]), dtype="<i2").astype(np.int32)
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3   # test_codec_graphs' bound + PCM16
        assert servicer.streams.ticks >= 3 + 2          # 7 = 4 + 2 + 1 and 3 = 2 + 1: one tick each
    finally:
        await stop(running)


async def test_pool_with_other_batch_buckets(tiny_checkpoint):
    """Buckets (1, 3): three sessions' ticks run in the 3-session graph shape (eager ticks on CPU),
    each stream still its own offline decode."""
    server, port, _, servicer = await serve(str(tiny_checkpoint), port=0, graphs=True, graph_buckets=(1, 3),
                                            long_lengths=())
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=32)
    running = Running(server, port, servicer, channel)
    try:
        assert servicer.streams.buckets == (1, 3)
        streams = [random_codes(running.codec, 6, seed=10 + i) for i in range(3)]
        results = await asyncio.gather(*(run_decode(running.stub, decode_requests(codes, [2, 4]))
                                         for codes in streams))
        for codes, (pcm, _) in zip(streams, results):
            got = np.frombuffer(pcm, dtype="<i2").astype(np.int32)
            want = np.frombuffer(pcm16_bytes(running.codec.decode(codes[None])[0]), dtype="<i2").astype(np.int32)
            assert got.shape == want.shape
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    finally:
        await stop(running)


async def test_server_decodes_in_the_chosen_dtype(tiny_checkpoint):
    server, port, _, servicer = await serve(str(tiny_checkpoint), port=0, dtype=torch.bfloat16)
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=32)
    running = Running(server, port, servicer, channel)
    try:
        assert running.codec.decode_dtype is torch.bfloat16
        assert "bfloat16" in (await running.stub.GetInfo(codec_pb2.GetInfoRequest())).build
        codes = random_codes(running.codec, 3, seed=4)
        pcm, _ = await run_decode(running.stub, decode_requests(codes, [1, 2]))
        assert pcm == pcm16_bytes(running.codec.decode(codes[None])[0])
    finally:
        await stop(running)


def test_pcm16_rounding():
    samples = torch.tensor([-2.0, -1.0, -0.5, 0.0, 1e-6, 0.5, 1.0, 3.0])
    values = np.frombuffer(pcm16_bytes(samples), dtype="<i2")
    assert values.tolist() == [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767]


def test_entry_point_defaults(monkeypatch):
    from services.codec.__main__ import parse_args

    monkeypatch.setenv("DRAMA_CHECKPOINT", "/ckpt")
    monkeypatch.setenv("DRAMA_DEVICE", "cuda")
    monkeypatch.setenv("DRAMA_HOST", "0.0.0.0")
    args = parse_args([])
    assert (args.checkpoint, args.device, args.host, args.port) == ("/ckpt", "cuda", "0.0.0.0", 50053)
    assert parse_args(["--port", "1234", "--device", "cpu"]).port == 1234


async def test_model_failure_is_internal_and_frees_the_session(codec_server, monkeypatch):
    """Failure injection: a decode call that raises ends the stream with INTERNAL."""
    def broken(states, chunks):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(codec_server.servicer.batcher.codec, "decode_streams", broken)
    codes = random_codes(codec_server.codec, 2, seed=5)
    await expect_error(lambda: codec_server.stub.Decode(aiter_of([START, _frames(0, codes)])),
                       grpc.StatusCode.INTERNAL, "internal_error")
    monkeypatch.undo()
    await _wait_for_no_sessions(codec_server)
    pcm, _ = await run_decode(codec_server.stub, decode_requests(codes, [2]))     # still serving
    assert pcm == pcm16_bytes(codec_server.codec.decode(codes[None])[0])


async def test_entry_point_serves_and_stops_on_sigterm(tiny_checkpoint):
    """`python -m services.codec` comes up SERVING and exits 0 on SIGTERM (graceful drain)."""
    import os
    import signal
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "DRAMA_CHECKPOINT": str(tiny_checkpoint), "DRAMA_GRACE_S": "2"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.codec", "--port", str(port),
                                                env=env, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while await grpcutil.check_health(f"127.0.0.1:{port}") != "SERVING":
            assert proc.returncode is None, (await proc.stderr.read()).decode()[-2000:]
            assert asyncio.get_running_loop().time() < deadline, "codec never became SERVING"
            await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_not_ready_before_weights_load():
    """Listening but not loaded: health NOT_SERVING, calls UNAVAILABLE with `not_ready`."""
    from services.codec.server import SERVICE_NAME, CodecServicer

    servicer = CodecServicer()
    server, port, _ = await grpcutil.start_server(
        add_servicers=[lambda s: codec_pb2_grpc.add_CodecServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME], port=0, max_message_mb=32)
    channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=32)
    try:
        assert await grpcutil.check_health(f"127.0.0.1:{port}", service=SERVICE_NAME) == "NOT_SERVING"
        stub = codec_pb2_grpc.CodecStub(channel)
        await expect_error(lambda: stub.GetInfo(codec_pb2.GetInfoRequest()), grpc.StatusCode.UNAVAILABLE, "not_ready")
        await expect_error(lambda: stub.Decode(aiter_of([START])), grpc.StatusCode.UNAVAILABLE, "not_ready")
    finally:
        await channel.close()
        await server.stop(None)
        await servicer.close()


async def test_model_worker_threads_are_its_own():
    """The model thread runs with its own intra-op count; the process default is left alone."""
    import threading

    from services.codec.server import start_model_worker

    torch.set_num_threads(2)
    try:
        worker = await start_model_worker(1)
        after_ops = lambda: (torch.nn.functional.conv1d(torch.ones(1, 2, 64), torch.ones(2, 2, 3)),  # noqa: E731
                             torch.get_num_threads())[1]
        assert await asyncio.get_running_loop().run_in_executor(worker, after_ops) == 1
        assert torch.get_num_threads() == 2
        seen = []
        thread = threading.Thread(target=lambda: seen.append((torch.ones(1) + 1, torch.get_num_threads())))
        thread.start()
        thread.join()
        assert seen[0][1] == 2          # a thread started later still gets the process default
        worker.shutdown()
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("fmt", ["FLAC", "OGG", "MP3"])
async def test_encode_other_containers(codec_server, fmt):
    """Any container soundfile reads: the codes equal the model's encode of the decoded samples."""
    data = audio_file(tone(1.2, 24000, freq=300.0), 24000, fmt=fmt)
    reply = await codec_server.stub.Encode(codec_pb2.EncodeRequest(audio_file=data))
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    expected = codec_server.codec.encode(torch.from_numpy(samples.mean(axis=1))[None], rate)[0]
    assert torch.equal(codes_from_wire(reply.codes, reply.codebooks), expected)


async def test_reflection_lists_the_codec(codec_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(codec_server.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(aiter_of([request]))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"drama.codec.v1.Codec", "grpc.health.v1.Health"} <= names

"""The gRPC Codec service (API.md §3.3): GetInfo, Encode, and Decode as one bidi stream per session.

On CUDA (unless `graphs=False`, env DRAMA_CODEC_GRAPHS=0) each session's stream state is a slot
of a device pool and every tick replays captured CUDA graphs (graphs.py), captured before the
server reports SERVING; a full pool refuses a new session with RESOURCE_EXHAUSTED `queue_full`.
Every model call runs on one dedicated worker thread; the event loop only does I/O. Decode chunks
of all open sessions are gathered by `DecodeBatcher` (batcher.py) into one `Codec.decode_streams`
call per tick; each session keeps its own stream state, so concurrent sessions never mix.

    server, port, health, servicer = await serve(checkpoint_dir, port=0)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import soundfile
import torch
from opentelemetry import trace

from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from services.codec.batcher import DecodeBatcher
from services.codec.graphs import GraphedDecoder, PoolFull
from services.codec.state import StreamState
from services.common import grpcutil
from services.common.tensors import codes_from_wire, codes_to_wire

log = logging.getLogger(__name__)

SERVICE_NAME = "drama.codec.v1.Codec"
MAX_MESSAGE_MB = 32
DEFAULT_MIN_SECONDS = 1.0
DEFAULT_MAX_SECONDS = 30.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT


# --------------------------------------------------------------------------------------------
# pure helpers: protobuf/bytes <-> tensors
# --------------------------------------------------------------------------------------------

class AudioError(ValueError):
    """A reference clip we refuse; `code` is the API error code (audio_undecodable, …)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def read_audio_file(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """Any container soundfile reads -> (mono float32 [S], rate).

    The declared length is checked before decoding, so a header claiming hours is refused at once.
    """
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as exc:  # soundfile raises several types for garbage
        raise AudioError("audio_undecodable", f"cannot read the audio file: {exc}", "audio_file") from None
    if info.samplerate <= 0:
        raise AudioError("audio_undecodable", "the audio file declares no sample rate", "audio_file")
    if info.frames > 0 and info.frames / info.samplerate > max_seconds:
        raise AudioError("audio_too_long", f"audio is {info.frames / info.samplerate:.2f} s, "
                         f"longer than {max_seconds:g} s", "audio_file")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:
        raise AudioError("audio_undecodable", f"cannot decode the audio file: {exc}", "audio_file") from None
    return samples.mean(axis=1, dtype=np.float32), int(rate)


def read_pcm(pcm: codec_pb2.Pcm) -> tuple[np.ndarray, int]:
    """Raw float32 little-endian mono samples -> (samples [S], rate)."""
    if len(pcm.samples) % 4:
        raise AudioError("audio_undecodable", f"{len(pcm.samples)} bytes are not whole float32 samples",
                         "pcm.samples")
    if pcm.sample_rate <= 0:
        raise AudioError("audio_undecodable", f"sample_rate must be positive, got {pcm.sample_rate}",
                         "pcm.sample_rate")
    return np.frombuffer(pcm.samples, dtype="<f4").astype(np.float32), int(pcm.sample_rate)


def check_duration(samples: np.ndarray, rate: int, min_seconds: float, max_seconds: float,
                   param: str) -> float:
    duration = len(samples) / rate
    if duration > max_seconds:
        raise AudioError("audio_too_long", f"audio is {duration:.2f} s, longer than {max_seconds:g} s", param)
    if duration < min_seconds or len(samples) == 0:
        raise AudioError("audio_too_short", f"audio is {duration:.2f} s, shorter than {min_seconds:g} s", param)
    if not np.isfinite(samples).all():
        raise AudioError("audio_undecodable", "audio holds NaN or infinite samples", param)
    return duration


# --------------------------------------------------------------------------------------------
# the servicer
# --------------------------------------------------------------------------------------------

@dataclass
class DecodeSession:
    session_id: str
    state: StreamState               # or a GraphedDecoder slot
    next_frame: int = 0
    samples_sent: int = 0


def _set_thread_count(count: int) -> None:
    # torch initialises a thread's count lazily, from the process default, on its first parallel
    # op; run that first, or it would later overwrite the count set here.
    torch.get_num_threads()
    torch.set_num_threads(count)


async def start_model_worker(intra_op_threads: int | None) -> ThreadPoolExecutor:
    """The one thread that runs every model call, with its own intra-op thread count.

    The codec's per-frame ops are tiny: an OpenMP fork/join per op costs more than it computes
    (a 2-core CPU box decoded 40x slower with 2 threads than with 1 while other work ran). torch
    keeps the count per thread, but `set_num_threads` also stores a process-wide default for
    threads started later; we put that default back at once so other stages in the same process
    (tests, `dramaturg up`) keep theirs.
    """
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="codec-model")
    if intra_op_threads:
        previous = torch.get_num_threads()
        await asyncio.get_running_loop().run_in_executor(worker, _set_thread_count, intra_op_threads)
        torch.set_num_threads(previous)        # this (event-loop) thread's count was `previous` already
    return worker


class CodecServicer(codec_pb2_grpc.CodecServicer):
    """The codec is attached once loaded and warmed; until then calls answer UNAVAILABLE."""

    def __init__(self, worker: ThreadPoolExecutor | None = None, *, max_encode_seconds: float = 60.0,
                 build: str = "dramaturg"):
        self.worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="codec-model")
        self.codec = None
        self.streams: GraphedDecoder | None = None
        self.batcher: DecodeBatcher | None = None
        self.sessions: dict[int, DecodeSession] = {}
        self.max_encode_seconds = max_encode_seconds
        self.build = build
        self.admitting = True

    def attach(self, codec, streams: GraphedDecoder | None = None) -> None:
        """streams: the graphed slot pool the sessions decode through (None: eager states)."""
        self.codec, self.streams = codec, streams
        self.batcher = DecodeBatcher(streams or codec, self.worker, open_streams=lambda: len(self.sessions))

    async def _open_state(self, context):
        if self.streams is None:
            return self.codec.new_state(1)
        try:
            return self.streams.acquire()
        except PoolFull as exc:
            await grpcutil.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                                 drama_code="queue_full")

    def stop_admitting(self) -> None:
        self.admitting = False

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def _require_ready(self, context) -> None:
        if self.codec is None or not self.admitting:
            await grpcutil.abort(context, grpc.StatusCode.UNAVAILABLE,
                                 "codec is loading" if self.codec is None else "codec is shutting down",
                                 drama_code="not_ready")

    async def _check_deadline(self, context) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await grpcutil.abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the work started")

    async def GetInfo(self, request: codec_pb2.GetInfoRequest, context) -> codec_pb2.CodecInfo:
        await self._require_ready(context)
        codec = self.codec
        return codec_pb2.CodecInfo(
            sample_rate=codec.sample_rate, codebooks=codec.num_codebooks,
            codebook_size=codec.codebook_size, semantic_codebook_size=codec.semantic_codebook_size,
            frame_rate_hz=codec.sample_rate / codec.frame_samples, hop_length=codec.frame_samples,
            max_encode_seconds=self.max_encode_seconds, open_sessions=len(self.sessions), build=self.build)

    async def Encode(self, request: codec_pb2.EncodeRequest, context) -> codec_pb2.EncodeResponse:
        await self._require_ready(context)
        min_seconds = request.min_seconds or DEFAULT_MIN_SECONDS
        max_seconds = min(request.max_seconds or DEFAULT_MAX_SECONDS, self.max_encode_seconds)
        source = request.WhichOneof("source")
        try:
            if source == "audio_file":
                raw = request.audio_file
                samples, rate = read_audio_file(raw, max_seconds)
            elif source == "pcm":
                raw = request.pcm.samples
                samples, rate = read_pcm(request.pcm)
            else:
                raise AudioError("audio_undecodable", "request has no audio (audio_file or pcm)", "source")
            duration = check_duration(samples, rate, min_seconds, max_seconds, source or "source")
        except AudioError as exc:
            await grpcutil.abort(context, INVALID, str(exc), drama_code=exc.code, param=exc.param)
        await self._check_deadline(context)
        loop = asyncio.get_running_loop()
        try:
            codes = await loop.run_in_executor(self.worker, self.codec.encode,
                                               torch.from_numpy(samples)[None], rate)
        except ValueError as exc:   # e.g. a sample rate the resampler cannot handle
            await grpcutil.abort(context, INVALID, str(exc), drama_code="audio_undecodable", param=source)
        return codec_pb2.EncodeResponse(
            codes=codes_to_wire(codes[0]), n_frames=codes.shape[-1], duration_s=duration,
            sha256=hashlib.sha256(raw).hexdigest(), codebooks=codes.shape[1])

    async def Decode(self, request_iterator, context):
        await self._require_ready(context)
        session: DecodeSession | None = None
        key = id(context)
        span = trace.get_current_span()      # the interceptor's SERVER span, if tracing is on
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("msg")
                if kind == "start":
                    if session is not None:
                        await grpcutil.abort(context, INVALID, "a second start on one stream",
                                             drama_code="invalid_value", param="start")
                    session = DecodeSession(request.start.session_id, await self._open_state(context))
                    self.sessions[key] = session
                elif session is None:
                    await grpcutil.abort(context, INVALID, f"'{kind}' before 'start'",
                                         drama_code="invalid_value", param=kind or "msg")
                elif kind == "frames":
                    if session.next_frame == 0:      # where the first frames meet the codec (bench/timeline.py)
                        span.add_event("first_frames")
                    codes = await self._frames_codes(request.frames, session, context)
                    await self._check_deadline(context)
                    try:
                        pcm = await self.batcher.decode(session.state, codes)
                    except Exception as exc:   # a model failure (CUDA error, bug): logged by the batcher
                        await grpcutil.abort(context, grpc.StatusCode.INTERNAL, f"decode failed: {exc}",
                                             drama_code="internal_error")
                    session.next_frame += codes.shape[-1]
                    chunk = codec_pb2.PcmChunk(first_sample_index=session.samples_sent, samples=pcm)
                    if session.samples_sent == 0:
                        span.add_event("first_pcm")
                    session.samples_sent += len(pcm) // 2
                    yield codec_pb2.DecodeResponse(pcm=chunk)
                elif kind == "end":
                    yield codec_pb2.DecodeResponse(done=codec_pb2.DecodeDone(total_samples=session.samples_sent))
                    return
                else:
                    await grpcutil.abort(context, INVALID, "empty DecodeRequest", drama_code="invalid_value",
                                         param="msg")
        finally:
            # Ended, failed or cancelled: the stream's state goes with it.
            self.sessions.pop(key, None)
            if session is not None and self.streams is not None:
                self.streams.release(session.state)

    async def _frames_codes(self, frames: codec_pb2.DecodeFrames, session: DecodeSession, context) -> torch.Tensor:
        """Validate one frames message against the session; returns codes [N, t]."""
        n = self.codec.num_codebooks
        if frames.first_frame_index != session.next_frame:
            await grpcutil.abort(context, INVALID, f"first_frame_index {frames.first_frame_index} does not "
                                 f"continue the stream (expected {session.next_frame})",
                                 drama_code="invalid_value", param="frames.first_frame_index")
        try:
            codes = codes_from_wire(frames.codes, n)
            if frames.n_frames <= 0:
                raise ValueError("a frames message must carry at least one frame")
            if codes.shape[-1] != frames.n_frames:
                raise ValueError(f"n_frames {frames.n_frames} but codes hold {codes.shape[-1]} frames "
                                 f"of {n} codebooks")
            self.codec.check_codes(codes[None])
        except ValueError as exc:
            await grpcutil.abort(context, INVALID, str(exc), drama_code="invalid_value", param="frames.codes")
        return codes


async def serve(checkpoint: str | None, *, host: str = "127.0.0.1", port: int = 50053, device: str = "cpu",
                max_encode_seconds: float = 60.0, cpu_threads: int | None = 1, codec=None,
                ready: asyncio.Event | None = None, graphs: bool | None = None, slots: int = 256,
                dtype: torch.dtype | None = None, graph_lengths: tuple[int, ...] | None = None,
                long_lengths: tuple[int, ...] | None = None, graph_buckets: tuple[int, ...] | None = None):
    """Start listening (NOT_SERVING), load and warm the codec on the worker thread, then SERVING.

    Returns (server, port, health, servicer). `codec` skips loading from `checkpoint`;
    `cpu_threads` is the worker's intra-op thread count on CPU (None: torch's default).
    `graphs` (None: on for CUDA): decode through a pool of `slots` stream slots and CUDA graphs
    captured here, before SERVING (graphs.py); on CPU it means the same pool with eager ticks.
    `dtype`: the decode dtype of a codec loaded from `checkpoint` (None: load_codec's default).
    `graph_lengths`: the chunk lengths that get a graph (None: graphs.STREAM_LENGTHS, 1, 2, 4, 8);
    other lengths are split into these, so fewer lengths mean fewer graphs to capture and hold
    at the price of more replays for the odd chunk. `long_lengths`: the batch-1 graph lengths a
    longer chunk is split into (None: graphs.LONG_LENGTHS, 16-128; () for none). `graph_buckets`:
    the batch sizes with a graph per stream length (None: graphs.BATCH_BUCKETS); a tick of n
    sessions runs in the smallest that holds n, padded.
    """
    on_cpu = torch.device(device).type == "cpu" if codec is None else codec.device.type == "cpu"
    worker = await start_model_worker(cpu_threads if on_cpu else None)
    servicer = CodecServicer(worker, max_encode_seconds=max_encode_seconds,
                             build=f"dramaturg codec ({device})")
    server, bound, health = await grpcutil.start_server(
        add_servicers=[lambda s: codec_pb2_grpc.add_CodecServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME], host=host, port=port, max_message_mb=MAX_MESSAGE_MB)

    def load():
        from services.codec.model import load_codec

        model = codec if codec is not None else load_codec(checkpoint, device=device, dtype=dtype)
        warm_up(model)
        use_graphs = model.device.type == "cuda" if graphs is None else graphs
        streams = None
        if use_graphs:
            shapes = {key: value for key, value in (("lengths", graph_lengths), ("long_lengths", long_lengths),
                                                    ("buckets", graph_buckets)) if value is not None}
            streams = GraphedDecoder(model, slots, **shapes)
            streams.capture()
        return model, streams

    loaded, streams = await asyncio.get_running_loop().run_in_executor(servicer.worker, load)
    servicer.build = (f"dramaturg codec ({loaded.device.type} {str(loaded.decode_dtype).removeprefix('torch.')}"
                      f"{', graphs' if streams is not None and streams.use_graphs else ''})")
    servicer.attach(loaded, streams)
    await grpcutil.set_serving(health, True)
    log.info("codec serving on %s:%d (%s)", host, bound, servicer.build)
    if ready is not None:
        ready.set()
    return server, bound, health, servicer


def warm_up(codec) -> None:
    """One decode and one encode, so the first request pays no first-call costs."""
    codes = torch.zeros(1, codec.num_codebooks, 2, dtype=torch.int64)
    codec.decode(codes)
    codec.encode(torch.zeros(1, codec.frame_samples), codec.sample_rate)

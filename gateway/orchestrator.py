"""One speech request end to end (API.md §2.2, §3.3-§3.4):

    job = await orchestrator.prepare(request)     # voices, takes, Codec.Encode, prompt -> Generate request
    session = orchestrator.session(job)
    await session.start()                         # Backbone.Generate until `started` (admission)
    async for pcm in session.pcm_chunks(): ...    # frames -> Codec.Decode -> PCM16 at 44.1 kHz
    session.result                                 # usage, finish reason, take id, seed

Everything before `start()` returns raises `ApiError`, so validation, overload and not-ready
errors are real HTTP statuses; later failures surface from `pcm_chunks()`. `aclose()` cancels
both calls (client disconnect, failure) and is safe to call twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import grpc
import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from drama.backbone.v1 import backbone_pb2
from drama.codec.v1 import codec_pb2
from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.model_info import ModelInfo
from gateway.prompt import BuiltPrompt, PromptBuilder, PromptError, RefPart, TakePart
from gateway.settings import Settings
from gateway.stages import Stages
from gateway.takes import Take, TakeStore, new_take_id
from gateway.validation import LATENCY_FIRST_FRAMES, MAX_CLIP_BYTES, MESSAGE_FRAMES, ClipSpec, SpeechRequest
from gateway.voices import VoiceRegistry
from services.common.grpcutil import error_details

log = logging.getLogger("gateway.orchestrator")
tracer = trace.get_tracer("gateway")


# --------------------------------------------------------------------------------------------
# gRPC status -> HTTP (API.md §3.2 table)
# --------------------------------------------------------------------------------------------

def caller_param(wire_param: str | None, text_param: str = "text") -> str | None:
    """A stage's field path (GenerateRequest) as the caller's field of the HTTP request."""
    if not wire_param:
        return wire_param
    if wire_param.startswith("sampling."):
        return wire_param[len("sampling."):]
    if wire_param == "text" or wire_param.startswith("chunks"):
        return text_param
    if wire_param.startswith("system"):
        return "references"
    if wire_param.startswith("history"):
        return "history"
    return wire_param


def grpc_error(exc: grpc.aio.AioRpcError, stage: str, text_param: str = "text") -> ApiError:
    code = exc.code()
    drama_code, wire_param = error_details(exc)
    param = caller_param(wire_param, text_param)
    details = exc.details() or f"{stage} call failed"
    status = grpc.StatusCode
    if code == status.INVALID_ARGUMENT and wire_param == "sampling.max_new_tokens" and drama_code == "out_of_range":
        # Valid for the API (1..4096) but more than this backbone's context holds: a context error.
        return ApiError(400, "context_length_exceeded", details, param)
    if code == status.INVALID_ARGUMENT:
        return ApiError(400, drama_code or "invalid_value", details, param)
    if code == status.OUT_OF_RANGE:
        return ApiError(400, "context_length_exceeded", details, param)
    if code == status.NOT_FOUND:
        return ApiError(503, "upstream_unavailable", f"{stage}: {details}")
    if code == status.RESOURCE_EXHAUSTED and drama_code in ("queue_full", "queue_timeout"):
        return ApiError(503, "server_overloaded", "The server is overloaded; retry shortly.",
                        headers={"Retry-After": "1", "retry-after-ms": "1000"})
    if code == status.UNAVAILABLE:
        if drama_code == "not_ready":
            return ApiError(503, "not_ready", f"The {stage} stage is not ready: {details}")
        return ApiError(503, "upstream_unavailable", f"The {stage} stage is unavailable: {details}")
    if code == status.DEADLINE_EXCEEDED:
        return ApiError(504, "timeout", "The request deadline passed.")
    if code == status.CANCELLED:
        return ApiError(499, "cancelled", "The request was cancelled.")
    # ALREADY_EXISTS (a gateway bug), RESOURCE_EXHAUSTED (message size), INTERNAL, UNKNOWN, ...
    log.error("%s call failed: %s %s", stage, code.name, details)
    return ApiError(500, "internal_error", "The server had an error while processing your request.")


def codes_to_wire(codes: torch.Tensor) -> bytes:
    """[N, T] -> int16 frame-major [T, N] bytes."""
    return np.ascontiguousarray(codes.to(torch.int16).numpy().T).astype("<i2").tobytes()


def codes_from_wire(data: bytes, num_codebooks: int) -> torch.Tensor:
    """int16 frame-major [T, N] bytes -> int64 [N, T]."""
    frames = np.frombuffer(data, dtype="<i2").reshape(-1, num_codebooks)
    return torch.from_numpy(frames.T.astype(np.int64))


def ids_to_wire(ids) -> bytes:
    return np.asarray(list(ids), dtype="<i4").tobytes()


def segment_to_proto(segment) -> backbone_pb2.Segment:
    if segment.tokens is not None:
        return backbone_pb2.Segment(tokens=ids_to_wire(segment.tokens))
    return backbone_pb2.Segment(codes=codes_to_wire(segment.codes))


class CodesCache:
    """Encoded reference codes by SHA-256 of the clip bytes (LRU)."""

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._codes: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        codes = self._codes.get(key)
        if codes is not None:
            self._codes.move_to_end(key)
        return codes

    def put(self, key: str, codes: torch.Tensor) -> None:
        self._codes[key] = codes
        self._codes.move_to_end(key)
        while len(self._codes) > self.max_entries:
            self._codes.popitem(last=False)

    def drop(self, key: str | None) -> None:
        self._codes.pop(key, None)


# --------------------------------------------------------------------------------------------
# A prepared request
# --------------------------------------------------------------------------------------------

@dataclass
class Job:
    request: SpeechRequest
    session_id: str
    request_id: str
    seed: int
    voice_id: str
    prompt: BuiltPrompt
    generate: backbone_pb2.GenerateRequest
    arrival: float
    deadline: float
    span: trace.Span
    take_id: str = field(default_factory=new_take_id)   # announced in headers before the take exists
    timings: dict[str, float] = field(default_factory=dict)    # ms, for Server-Timing


@dataclass
class Result:
    take_id: str
    seed: int
    finish_reason: str
    text_tokens: int
    audio_tokens: int
    output_tokens: int
    audio_duration_s: float = 0.0

    def usage(self) -> dict:
        return {"input_tokens": self.text_tokens + self.audio_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.text_tokens + self.audio_tokens + self.output_tokens,
                "input_token_details": {"text_tokens": self.text_tokens, "audio_tokens": self.audio_tokens}}


class Orchestrator:
    def __init__(self, settings: Settings, info: ModelInfo, stages: Stages, builder: PromptBuilder,
                 voices: VoiceRegistry, takes: TakeStore, metrics: GatewayMetrics):
        self.settings, self.info, self.stages, self.builder = settings, info, stages, builder
        self.voices, self.takes, self.metrics = voices, takes, metrics
        self.codes_cache = CodesCache()
        voices.on_delete.append(lambda voice: self.codes_cache.drop(voice.sha256))

    # ---- references ---------------------------------------------------------------------

    async def encode_clip(self, audio: bytes, param: str, max_seconds: float, deadline: float,
                          keep: bool = True) -> torch.Tensor:
        """Codec.Encode of one clip, cached by SHA-256 of its bytes; one retry on UNAVAILABLE."""
        key = hashlib.sha256(audio).hexdigest()
        cached = self.codes_cache.get(key)
        if cached is not None:
            self.metrics.reference_cache_hits.inc()
            return cached
        started = time.monotonic()
        request = codec_pb2.EncodeRequest(audio_file=audio, min_seconds=1.0, max_seconds=max_seconds)
        for attempt in (0, 1):
            try:
                reply = await self.stages.codec.Encode(request, timeout=max(0.1, deadline - time.monotonic()))
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0:
                    continue
                err = grpc_error(exc, "codec")
                if err.status == 400:
                    err.param = param        # the codec names its own field; the caller's path is ours
                raise err from None
        codes = codes_from_wire(reply.codes, reply.codebooks or self.info.num_codebooks)
        self.metrics.reference_encode.observe(time.monotonic() - started)
        if keep:
            self.codes_cache.put(key, codes)
        return codes

    async def _clip_audio(self, clip: ClipSpec) -> bytes:
        if clip.audio is not None:
            return clip.audio
        return await fetch_audio_path(clip.audio_path, f"{clip.param}.audio_path", self.settings)

    async def _clip_codes(self, clip: ClipSpec, deadline: float, keep: bool) -> torch.Tensor:
        if clip.vq_codes is not None:
            return torch.tensor(clip.vq_codes, dtype=torch.int64)
        audio = await self._clip_audio(clip)
        return await self.encode_clip(audio, f"{clip.param}.audio", clip.max_seconds, deadline, keep)

    async def _references(self, req: SpeechRequest, deadline: float) -> tuple[list[RefPart], list[str]]:
        """Reference parts (by speaker, then as given) and their caller paths. A speaker's clips come
        from `references` or from a registered voice in `reference_id`, never both (validation)."""
        keep = req.sampling.use_memory_cache
        inline = await asyncio.gather(*(self._clip_codes(c, deadline, keep) for c in req.references))
        parts = [(RefPart(clip.text, codes, clip.speaker), clip.param) for clip, codes in zip(req.references, inline)]
        for speaker, voice_id, param in req.reference_ids:
            resolved = self.voices.resolve(voice_id, param)
            if resolved.voice is None:       # builtin or seeded voice: no reference clip
                continue
            codes = await self.encode_clip(resolved.voice.audio_bytes(), param, 30.0, deadline)
            parts.append((RefPart(resolved.voice.transcript or "", codes, speaker), param))
        parts.sort(key=lambda part: part[0].speaker)       # stable: given order within a speaker
        return [part for part, _ in parts], [param for _, param in parts]

    async def _history(self, req: SpeechRequest, deadline: float) -> tuple[list[TakePart], list[str]]:
        parts, params = [], []
        for clip in req.history:
            if clip.take_id is not None:
                take = self.takes.get(clip.take_id)
                if take is None:
                    raise errors.take_not_found(clip.take_id, f"{clip.param}.take_id")
                parts.append(TakePart(take.text, torch.from_numpy(take.codes.astype(np.int64)), 0))
            else:
                codes = await self._clip_codes(clip, deadline, req.sampling.use_memory_cache)
                parts.append(TakePart(clip.text, codes, clip.speaker))
            params.append(clip.param)
        return parts, params

    # ---- the request ----------------------------------------------------------------------

    async def prepare(self, req: SpeechRequest, request_id: str) -> Job:
        arrival = time.monotonic()
        deadline = arrival + self.settings.request_timeout_s
        span = tracer.start_span("text_to_speech drama-3", kind=trace.SpanKind.INTERNAL)
        try:
            return await self._prepare(req, request_id, arrival, deadline, span)
        except BaseException as exc:
            _end_span(span, exc)
            raise

    async def _prepare(self, req, request_id, arrival, deadline, span) -> Job:
        with trace.use_span(span, end_on_exit=False):
            seed_from_voice, voice_id, references, ref_params = None, "default", [], []
            if req.route == "openai":
                resolved = self.voices.resolve(req.voice or "default")
                voice_id, seed_from_voice = resolved.id, resolved.seed
                if resolved.voice is not None:
                    codes = await self.encode_clip(resolved.voice.audio_bytes(), "voice", 30.0, deadline)
                    references, ref_params = [RefPart(resolved.voice.transcript or "", codes, 0)], ["voice"]
            else:
                references, ref_params = await self._references(req, deadline)
                for speaker, vid, param in req.reference_ids:
                    if speaker == 0:
                        voice_id = vid
                        seed_from_voice = self.voices.resolve(vid, param).seed
                if req.references and voice_id == "default":
                    voice_id = "inline"
            history, history_params = await self._history(req, deadline)
            encode_ms = (time.monotonic() - arrival) * 1000.0     # voices, takes and Codec.Encode
            prompt = self._build_prompt(req, references, ref_params, history, history_params)

        seed = req.sampling.seed
        if seed is None:
            seed = seed_from_voice if seed_from_voice is not None else secrets.randbits(32)
        session_id = f"sess_{uuid.uuid4().hex}"
        sampling = req.sampling
        generate = backbone_pb2.GenerateRequest(
            session_id=session_id, model=req.model,
            system=[segment_to_proto(s) for s in prompt.system],
            history=[backbone_pb2.HistoryTake(segments=[segment_to_proto(s) for s in take])
                     for take in prompt.history],
            chunks=[backbone_pb2.Chunk(user_turn=ids_to_wire(ids)) for ids in prompt.chunks],
            assistant_open=ids_to_wire(prompt.assistant_open),
            assistant_close=ids_to_wire(prompt.assistant_close),
            sampling=backbone_pb2.Sampling(
                temperature=self.info.temperature if sampling.temperature is None else sampling.temperature,
                top_p=self.info.top_p if sampling.top_p is None else sampling.top_p,
                top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty, seed=seed,
                max_new_tokens=sampling.max_new_tokens or 0),
            emit=backbone_pb2.Emit(first_message_frames=LATENCY_FIRST_FRAMES[sampling.latency],
                                   message_frames=MESSAGE_FRAMES),
            queue_timeout_ms=int(self.settings.queue_timeout_s * 1000))
        self._describe_span(span, req, seed, voice_id, session_id, request_id)
        return Job(request=req, session_id=session_id, request_id=request_id, seed=seed, voice_id=voice_id,
                   prompt=prompt, generate=generate, arrival=arrival, deadline=deadline, span=span,
                   timings={"encode": encode_ms})

    def _build_prompt(self, req, references, ref_params, history, history_params) -> BuiltPrompt:
        try:
            return self.builder.build(req.text, references=references, history=history,
                                      instructions=req.instructions, chunk_length=req.sampling.chunk_length,
                                      normalize=req.sampling.normalize, text_param=req.text_param)
        except PromptError as exc:
            raise ApiError(400, exc.code, exc.message,
                           _caller_param(exc.param, ref_params, history_params)) from None

    def _describe_span(self, span, req: SpeechRequest, seed, voice_id, session_id, request_id) -> None:
        s = req.sampling
        attributes = {
            "gen_ai.operation.name": "text_to_speech", "gen_ai.output.type": "speech",
            "gen_ai.request.model": req.model, "gen_ai.request.seed": seed,
            "gen_ai.request.top_k": s.top_k, "drama.voice.id": voice_id,
            "drama.response_format": req.audio.format, "drama.sample_rate": req.audio.sample_rate,
            "drama.stream_format": "sse" if req.audio.mode == "sse" else "audio",
            "drama.response_mode": req.audio.mode, "drama.text.chars": len(req.text),
            "drama.references.count": len(req.references) + len(req.reference_ids),
            "drama.history.count": len(req.history), "drama.session_id": session_id,
            "drama.request_id": request_id,
        }
        if s.temperature is not None:
            attributes["gen_ai.request.temperature"] = s.temperature
        if s.top_p is not None:
            attributes["gen_ai.request.top_p"] = s.top_p
        if self.settings.trace_content:
            attributes["drama.text"] = req.text
        span.set_attributes(attributes)

    def session(self, job: Job) -> "SpeechSession":
        return SpeechSession(self, job)


def _caller_param(param: str | None, ref_params: list[str], history_params: list[str]) -> str | None:
    """The builder names parts by their index in the lists we gave it; map back to the caller's."""
    if not param:
        return param
    for prefix, params in (("references", ref_params), ("history", history_params)):
        if param.startswith(prefix + "["):
            index_text, _, rest = param[len(prefix) + 1:].partition("]")
            if index_text.isdigit() and int(index_text) < len(params):
                return params[int(index_text)] + rest
    return param


def _end_span(span, exc: BaseException | None = None) -> None:
    if exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        if isinstance(exc, ApiError):
            span.set_attribute("error.type", exc.code or str(exc.status))
    span.end()


async def fetch_audio_path(path: str, param: str, settings: Settings) -> bytes:
    """`file://` under DRAMA_ALLOWED_LOCAL_MEDIA_PATH or `http(s)://` to DRAMA_ALLOWED_MEDIA_DOMAINS."""
    url = urlparse(path)
    if url.scheme == "file" and settings.allowed_local_media_path is not None:
        root = settings.allowed_local_media_path.resolve()
        target = Path(unquote(url.path)).resolve()
        if target.is_relative_to(root) and target.is_file():
            if target.stat().st_size > MAX_CLIP_BYTES:
                raise ApiError(400, "audio_too_long", f"Invalid '{param}': the file is over 10 MiB.", param)
            return target.read_bytes()
    elif url.scheme in ("http", "https") and (url.hostname or "").lower() in settings.allowed_media_domains:
        import httpx

        async with httpx.AsyncClient(timeout=30.0, follow_redirects=False) as client:
            async with client.stream("GET", path) as response:
                if response.status_code != 200:
                    raise ApiError(400, "audio_undecodable",
                                   f"Invalid '{param}': fetching it answered HTTP {response.status_code}.", param)
                data = bytearray()
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > MAX_CLIP_BYTES:
                        raise ApiError(400, "audio_too_long", f"Invalid '{param}': the file is over 10 MiB.",
                                       param)
                return bytes(data)
    raise ApiError(400, "invalid_value",
                   f"Invalid '{param}': only data: URLs and allowed local paths or media domains are accepted.",
                   param)


# --------------------------------------------------------------------------------------------
# The running session
# --------------------------------------------------------------------------------------------

class SpeechSession:
    """One Backbone.Generate stream and one Codec.Decode stream, frames piped as they come."""

    def __init__(self, orchestrator: Orchestrator, job: Job):
        self.orch, self.job = orchestrator, job
        self.info = orchestrator.info
        self.span = job.span
        self.result: Result | None = None
        self._gen_call = None
        self._dec_call = None
        self._tasks: list[asyncio.Task] = []
        self._out: asyncio.Queue = asyncio.Queue()
        self._decode_queue: asyncio.Queue | None = None
        self._decode_sent: list[codec_pb2.DecodeRequest] | None = []
        self._frames: list[np.ndarray] = []        # [n, N] int16 blocks of every chunk
        self._frames_total = 0
        self._finish_reasons: list[str] = []
        self._chunk_frame_ends: list[int] = []     # cumulative frames at each chunk_end
        self.chunk_index = 0                       # text chunk of the PCM last yielded
        self._usage = None
        self._closed = False
        self._t_started = self._t_first_frame = self._t_last_frame = None
        self._first_byte_at = None
        self._audio_written_s = 0.0
        self._underrun_s = 0.0
        self._last_write_at = None

    def _remaining(self) -> float:
        return max(0.05, self.job.deadline - time.monotonic())

    def _metadata(self) -> tuple:
        return (("x-request-id", self.job.request_id), ("drama-session-id", self.job.session_id))

    # ---- start: admission ------------------------------------------------------------------

    async def start(self) -> backbone_pb2.Started:
        """Open Generate and wait for `started`; one retry on UNAVAILABLE. Raises ApiError."""
        stages = self.orch.stages
        with trace.use_span(self.span, end_on_exit=False):
            for attempt in (0, 1):
                self._gen_call = stages.backbone.Generate(self.job.generate, timeout=self._remaining(),
                                                          metadata=self._metadata())
                try:
                    first = await self._gen_call.read()
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0:
                        continue
                    err = grpc_error(exc, "backbone", self.job.request.text_param)
                    await self.aclose(err)
                    raise err from None
            if first is grpc.aio.EOF or first.WhichOneof("msg") != "started":
                err = ApiError(500, "internal_error", "The backbone did not admit the session.")
                await self.aclose(err)
                raise err
            started = first.started
            self._t_started = time.monotonic()
            self.job.timings["queue"] = float(started.queue_wait_ms)
            self.orch.metrics.queue_wait.observe(started.queue_wait_ms / 1000.0)
            self.span.add_event("admitted", {"drama.queue_wait_ms": started.queue_wait_ms})
            self.span.set_attribute("drama.queue_wait_ms", started.queue_wait_ms)
            self._open_decode()
            self._tasks = [asyncio.create_task(self._pump_frames()), asyncio.create_task(self._read_pcm())]
        return started

    def _open_decode(self) -> None:
        """A new Decode stream replaying every message sent so far (used again on retry)."""
        queue: asyncio.Queue = asyncio.Queue()
        if not self._decode_sent:
            first = LATENCY_FIRST_FRAMES[self.job.request.sampling.latency]
            self._decode_sent.append(codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(
                session_id=self.job.session_id, first_chunk_frames=first)))
        for message in self._decode_sent:
            queue.put_nowait(message)
        self._decode_queue = queue

        async def requests():
            while True:
                message = await queue.get()
                yield message
                if message.WhichOneof("msg") == "end":
                    return

        self._dec_call = self.orch.stages.codec.Decode(requests(), timeout=self._remaining(),
                                                       metadata=self._metadata())

    def _send_decode(self, message: codec_pb2.DecodeRequest) -> None:
        if self._decode_sent is not None:        # kept for a replay until the codec answers
            self._decode_sent.append(message)
        self._decode_queue.put_nowait(message)

    # ---- the two pumps ---------------------------------------------------------------------

    async def _pump_frames(self) -> None:
        """Backbone messages -> frames to the codec; chunk ends and usage recorded."""
        n = self.info.num_codebooks
        try:
            while True:
                message = await self._gen_call.read()
                if message is grpc.aio.EOF:
                    break
                kind = message.WhichOneof("msg")
                if kind == "frames":
                    frames = message.frames
                    if self._t_first_frame is None:
                        self._t_first_frame = time.monotonic()
                        self.span.add_event("first_frame")
                    self._t_last_frame = time.monotonic()
                    block = np.frombuffer(frames.codes, dtype="<i2").reshape(frames.n_frames, n)
                    self._frames.append(block)
                    self._send_decode(codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(
                        first_frame_index=self._frames_total, n_frames=frames.n_frames, codes=frames.codes)))
                    self._frames_total += frames.n_frames
                elif kind == "chunk_end":
                    end = message.chunk_end
                    reason = "length" if end.finish_reason == backbone_pb2.LENGTH else "stop"
                    self._finish_reasons.append(reason)
                    self._chunk_frame_ends.append(self._frames_total)
                    self.span.add_event("chunk_done", {"drama.chunk_index": end.chunk_index,
                                                       "drama.chunk_frames": end.n_frames,
                                                       "drama.finish_reason": reason})
                elif kind == "usage":
                    self._usage = message.usage
            if self._usage is None:
                raise ApiError(500, "internal_error", "The backbone stream ended without usage.")
            self._send_decode(codec_pb2.DecodeRequest(end=codec_pb2.DecodeEnd()))
        except grpc.aio.AioRpcError as exc:
            self._out.put_nowait(("error", grpc_error(exc, "backbone", self.job.request.text_param)))
        except ApiError as exc:
            self._out.put_nowait(("error", exc))

    async def _read_pcm(self) -> None:
        """Codec PCM -> the output queue; one retry (with replay) on UNAVAILABLE before any PCM."""
        received = False
        for attempt in (0, 1):
            try:
                async for reply in self._dec_call:
                    kind = reply.WhichOneof("msg")
                    if kind == "pcm":
                        if not received:
                            received, self._decode_sent = True, None    # no retry from here on
                        self._out.put_nowait(("pcm", np.frombuffer(reply.pcm.samples, dtype="<i2")))
                    elif kind == "done":
                        self._out.put_nowait(("done", reply.done.total_samples))
                        return
                self._out.put_nowait(("error", ApiError(500, "internal_error",
                                                        "The codec stream ended without done.")))
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0 and not received:
                    self._open_decode()
                    continue
                self._out.put_nowait(("error", grpc_error(exc, "codec")))
                return

    async def pcm_chunks(self):
        """PCM16 blocks at the codec rate, in order; raises ApiError on failure. Sets `result`."""
        samples = 0
        while True:
            kind, value = await self._out.get()
            if kind == "pcm":
                frame = samples // self.info.frame_samples
                self.chunk_index = sum(1 for end in self._chunk_frame_ends if end <= frame)
                samples += len(value)
                yield value
            elif kind == "done":
                break
            else:
                raise value
        self._finish()

    # ---- bookkeeping -------------------------------------------------------------------------

    def _finish(self) -> None:
        job, usage = self.job, self._usage
        codes = (np.concatenate(self._frames, axis=0) if self._frames
                 else np.zeros((0, self.info.num_codebooks), np.int16))
        take = Take(id=job.take_id, text=job.request.text, codes=np.ascontiguousarray(codes.T),
                    speakers=job.prompt.speakers or [0], sample_rate=job.request.audio.sample_rate,
                    seed=job.seed)
        self.orch.takes.put(take)
        reason = "length" if "length" in self._finish_reasons else "stop"
        self.result = Result(take_id=take.id, seed=job.seed, finish_reason=reason,
                             text_tokens=usage.text_tokens, audio_tokens=usage.audio_tokens,
                             output_tokens=usage.output_tokens,
                             audio_duration_s=self._frames_total * self.info.frame_samples / self.info.sample_rate)
        if self._t_first_frame is not None:
            job.timings["first_frame"] = (self._t_first_frame - job.arrival) * 1000.0
        if self._t_started is not None and self._t_last_frame is not None:
            job.timings["generate"] = (self._t_last_frame - self._t_started) * 1000.0
        job.timings["total"] = (time.monotonic() - job.arrival) * 1000.0
        self.orch.metrics.output_frames.inc(self._frames_total)

    def server_timing(self) -> str:
        return ", ".join(f"{name};dur={value:.1f}" for name, value in self.job.timings.items())

    def note_written(self, audio_seconds: float) -> None:
        """Called by the response as audio leaves: TTFA, chunk interval and underrun."""
        now = time.monotonic()
        metrics = self.orch.metrics
        if self._first_byte_at is None:
            self._first_byte_at = now
            self.span.add_event("first_audio_byte")
            ttfa = now - self.job.arrival
            self.span.set_attribute("drama.ttfa_ms", round(ttfa * 1000.0, 1))
            metrics.ttfa.observe(ttfa)
        else:
            metrics.chunk_interval.observe(now - self._last_write_at)
            self._underrun_s = max(self._underrun_s, (now - self._first_byte_at) - self._audio_written_s)
        self._last_write_at = now
        self._audio_written_s += audio_seconds

    # ---- closing -----------------------------------------------------------------------------

    async def aclose(self, error: BaseException | None = None) -> None:
        """Cancel both calls and end the span; idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in (self._gen_call, self._dec_call):
            if call is not None and not call.done():
                call.cancel()
        for task in self._tasks:
            task.cancel()
        metrics, job = self.orch.metrics, self.job
        if error is None and self.result is not None:
            elapsed = time.monotonic() - job.arrival
            result = self.result
            metrics.e2e.observe(elapsed)
            metrics.audio_seconds.observe(result.audio_duration_s)
            if result.audio_duration_s > 0:
                rtf = (self._t_last_frame or time.monotonic()) - (self._t_started or job.arrival)
                metrics.rtf.observe(rtf / result.audio_duration_s)
                self.span.set_attribute("drama.rtf", rtf / result.audio_duration_s)
            if self._first_byte_at is not None:
                metrics.underrun.observe(max(0.0, self._underrun_s))
            log.info("session %s (request %s) done: take %s, %.2f s audio, usage %s, finish %s",
                     job.session_id, job.request_id, result.take_id, result.audio_duration_s,
                     result.usage(), result.finish_reason)
            self.span.set_attributes({
                "gen_ai.usage.input_tokens": result.text_tokens + result.audio_tokens,
                "gen_ai.usage.output_tokens": result.output_tokens,
                "gen_ai.response.finish_reasons": [result.finish_reason],
                "drama.audio.duration_s": result.audio_duration_s,
                "drama.take_id": result.take_id})
        if error is None and self.result is None:
            error = asyncio.CancelledError("client went away")
        if isinstance(error, asyncio.CancelledError):
            log.info("session %s (request %s): 499 client went away", job.session_id, job.request_id)
        _end_span(self.span, error)

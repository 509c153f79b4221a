"""Preparing a speech request (API.md §2.2): voices and takes resolved, reference clips encoded
through `Codec.Encode` (cached by SHA-256 of their bytes), the prompt built, seeds chosen, and the
`Backbone.Generate` request made; then a `SpeechSession` (gateway/session.py) runs it.

    job = await orchestrator.prepare(request, request_id)   # ApiError for anything refused
    session = orchestrator.session(job)

Everything here happens before any response header, so its errors are real HTTP statuses.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import secrets
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from urllib.parse import unquote, urlparse

import grpc
import numpy as np
import soundfile as sf
import torch
from opentelemetry import trace

from drama.backbone.v1 import backbone_pb2
from drama.codec.v1 import codec_pb2
from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.model_info import ModelInfo
from gateway.prompt import BuiltPrompt, PromptBuilder, PromptError, RefPart, TakePart
from gateway.schemas import LATENCY_FIRST_FRAMES, MESSAGE_FRAMES, ClipSpec, SpeechRequest
from gateway.session import Job, SpeechSession, end_span
from gateway.settings import Settings
from gateway.stages import Stages, codes_from_wire, grpc_error, ids_to_wire, segment_to_proto
from gateway.takes import TakeStore
from gateway.validation import MAX_CLIP_BYTES
from gateway.voices import VoiceRegistry, decode_clip

tracer = trace.get_tracer("gateway")


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
        request = encode_request(audio, param, max_seconds)
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

    async def voice_codes(self, voice, param: str, deadline: float) -> torch.Tensor:
        """A registered voice's reference codes: on a hit straight from the codes cache by the
        SHA-256 the registry keeps (no file read, no hashing: ~2 ms per request for a 20 s clip),
        else Codec.Encode of its file (encode_clip, which keys the cache by the same digest)."""
        if voice.sha256 is not None:
            cached = self.codes_cache.get(voice.sha256)
            if cached is not None:
                self.metrics.reference_cache_hits.inc()
                return cached
        return await self.encode_clip(voice.audio_bytes(), param, 30.0, deadline)

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
            codes = await self.voice_codes(resolved.voice, param, deadline)
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
            end_span(span, exc)
            raise

    async def _prepare(self, req, request_id, arrival, deadline, span) -> Job:
        with trace.use_span(span, end_on_exit=False):
            seed_from_voice, voice_id, references, ref_params = None, "default", [], []
            if req.route == "openai":
                resolved = self.voices.resolve(req.voice or "default")
                voice_id, seed_from_voice = resolved.id, resolved.seed
                if resolved.voice is not None:
                    codes = await self.voice_codes(resolved.voice, "voice", deadline)
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


def encode_request(audio: bytes, param: str, max_seconds: float) -> codec_pb2.EncodeRequest:
    """The file itself when the codec can read it (soundfile: wav, flac, ogg, mp3), else PCM decoded
    here with FFmpeg (webm, mp4, aac uploads; API.md §1.5)."""
    try:
        sf.info(io.BytesIO(audio))
        return codec_pb2.EncodeRequest(audio_file=audio, min_seconds=1.0, max_seconds=max_seconds)
    except (sf.LibsndfileError, RuntimeError, TypeError):
        pass
    samples, rate = decode_clip(audio, param, max_seconds)
    pcm = codec_pb2.Pcm(samples=samples.astype("<f4").tobytes(), sample_rate=rate)
    return codec_pb2.EncodeRequest(pcm=pcm, min_seconds=1.0, max_seconds=max_seconds)


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

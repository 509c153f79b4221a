"""A running speech session: one Backbone.Generate stream and one Codec.Decode stream, frames piped
to the codec as they come (API.md §3.3-§3.4).

    session = SpeechSession(orchestrator, job)
    await session.start()                         # Generate until `started` (admission); ApiError
    async for pcm in session.pcm_chunks(): ...    # PCM16 at 44.1 kHz; ApiError on a later failure
    session.result                                # usage, finish reason, take id, seed
    await session.aclose()                        # cancels both calls; idempotent

The take is stored under `job.take_id` (announced in headers before it exists) once the codec
has sent its last samples.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from drama.backbone.v1 import backbone_pb2
from drama.codec.v1 import codec_pb2
from gateway.errors import ApiError
from gateway.prompt import BuiltPrompt
from gateway.schemas import LATENCY_FIRST_FRAMES, SpeechRequest
from gateway.stages import grpc_error
from gateway.takes import Take, new_take_id

if TYPE_CHECKING:
    from gateway.orchestrator import Orchestrator

log = logging.getLogger("gateway.session")

# Backpressure: a client that reads slowly must slow generation down rather than pile up audio
# here. PCM waiting for the HTTP side and frames waiting in the codec are bounded; past the bounds
# we stop reading the streams, gRPC flow control holds the codec, and the backbone pauses the
# session once its own buffer is full (API.md §3.4).
MAX_PENDING_PCM = 32          # PCM messages decoded but not yet taken by the response
MAX_FRAMES_AHEAD = 256        # frames sent to the codec whose PCM has not come back


@dataclass
class Job:
    """A prepared request (Orchestrator.prepare): everything a session needs to run."""
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
    """What a finished session reports (SSE `done`, span, logs)."""
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


def end_span(span, exc: BaseException | None = None) -> None:
    """End the request span; status ERROR unless it ended well or the client left."""
    if exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        if isinstance(exc, ApiError):
            span.set_attribute("error.type", exc.code or str(exc.status))
    span.end()


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
        self._out: asyncio.Queue = asyncio.Queue()   # ("pcm", samples) | ("done", n) | ("error", ApiError)
        self._room = asyncio.Event()                  # set while _out holds fewer than MAX_PENDING_PCM
        self._room.set()
        self._decoded = asyncio.Event()               # set when PCM comes back from the codec
        self._frames_decoded = 0
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
        # The status line goes out right after admission, so the codec must be known to answer
        # by then: a cheap GetInfo runs beside the admission wait (issue #9: codec down -> 503).
        codec_check = asyncio.create_task(self._codec_reachable())
        try:
            return await self._admit(stages, codec_check)
        finally:
            codec_check.cancel()

    async def _codec_reachable(self) -> None:
        for attempt in (0, 1):
            try:
                await self.orch.stages.codec.GetInfo(codec_pb2.GetInfoRequest(),
                                                     timeout=min(2.0, self._remaining()))
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0:
                    await asyncio.sleep(0.2)
                    continue
                raise

    async def _admit(self, stages, codec_check: asyncio.Task) -> backbone_pb2.Started:
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
            try:
                await codec_check
            except grpc.aio.AioRpcError as exc:
                err = grpc_error(exc, "codec", self.job.request.text_param)
                await self.aclose(err)
                raise err from None
            started = first.started
            self._t_started = time.monotonic()
            self._milestone("admitted", self._t_started)
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
                while self._frames_total - self._frames_decoded > MAX_FRAMES_AHEAD:
                    self._decoded.clear()
                    await self._decoded.wait()
                message = await self._gen_call.read()
                if message is grpc.aio.EOF:
                    break
                kind = message.WhichOneof("msg")
                if kind == "frames":
                    frames = message.frames
                    if self._t_first_frame is None:
                        self._t_first_frame = time.monotonic()
                        self._milestone("first_frames", self._t_first_frame)
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
                            self._milestone("first_pcm", time.monotonic())
                            self.span.add_event("first_pcm")
                        samples = np.frombuffer(reply.pcm.samples, dtype="<i2")
                        self._out.put_nowait(("pcm", samples))
                        self._frames_decoded += len(samples) // self.info.frame_samples
                        self._decoded.set()
                        while self._out.qsize() >= MAX_PENDING_PCM:
                            self._room.clear()
                            await self._room.wait()
                    elif kind == "done":
                        # The codec ends the stream right after `done`: wait for its status, so
                        # aclose() finds the call finished instead of cancelling a stream that
                        # ended well (a cancel racing the codec's last write interrupts it there).
                        await self._dec_call.code()
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
            if self._out.qsize() < MAX_PENDING_PCM:
                self._room.set()
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

    def _milestone(self, phase: str, at: float) -> None:
        """Arrival -> `at` into drama_speech_phase_seconds{phase}: where the time to first audio goes."""
        self.orch.metrics.phase.observe(at - self.job.arrival, phase=phase)

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
            self._milestone("first_byte", now)
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
        end_span(self.span, error)

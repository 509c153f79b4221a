"""The backbone's gRPC service (API.md §3.4): `drama.backbone.v1.Backbone`.

The servicer only translates: a GenerateRequest becomes a scheduler `Job` (validated here, since
the checks are about the request's bytes and fields), the session's events become
GenerateResponses, and a `GenerateError` becomes the call's status with `drama-error-code` and
`drama-error-param` in trailing metadata. Batching, chunks and the tower live in `scheduler.py`
and `tower_client.py`.

`start(settings)` listens at once (health NOT_SERVING), loads the weights, sizes the cache pool
and the voice-prefix cache (`DRAMA_PREFIX_CACHE_MB`, prefix_cache.py), connects the tower and
reports SERVING while the tower stream is up; `serve(settings)` also waits for SIGTERM and drains.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import trace

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from services.backbone.prefix_cache import PrefixCache, default_capacity_mb
from services.backbone.scheduler import (ChunkEnd, FramesOut, GenerateError, Job, PrefillDone, Prompt,
                                         Rows, Sampling, Scheduler, Started, Usage, audio_rows,
                                         text_rows)
from services.backbone.tower_client import TowerClient
from services.common import aio, device_handoff, grpcutil
from services.common.config import DramaConfig, load_config
from services.common.grpcutil import env_default
from services.common.tensors import codes_to_wire, codes_from_wire, ids_from_bytes

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("services.backbone")

SERVICE_NAME = "drama.backbone.v1.Backbone"
MODEL_ID = "drama-3"
DEFAULT_MESSAGE_FRAMES = 8      # API.md §2.1 `latency`: later messages every 8 frames
STEP_MESSAGE_LIMIT_BYTES = 16 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# GenerateRequest -> Job
# --------------------------------------------------------------------------------------------

def _invalid(message: str, param: str, code: str = "invalid_value") -> GenerateError:
    return GenerateError("INVALID_ARGUMENT", message, drama_code=code, param=param)


def _token_rows(data: bytes, param: str, config: DramaConfig, *, required: bool) -> Rows:
    try:
        ids = ids_from_bytes(data)
    except ValueError as exc:
        raise _invalid(str(exc), param) from None
    if required and ids.numel() == 0:
        raise _invalid(f"'{param}' must not be empty", param, "empty_string")
    vocab = config.text.vocab_size
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise _invalid(f"token id {bad} in '{param}' is outside the vocabulary [0, {vocab})", param)
    return text_rows(ids, config.num_codebooks)


def _code_rows(data: bytes, param: str, config: DramaConfig) -> Rows:
    try:
        codes = codes_from_wire(data, config.num_codebooks)       # [N, T]
    except ValueError as exc:
        raise _invalid(str(exc), param) from None
    if codes.shape[1] == 0:
        raise _invalid(f"'{param}' holds no frames", param)
    limits = [config.semantic_codebook_size] + [config.residual_codebook_size] * (config.num_codebooks - 1)
    for k, limit in enumerate(limits):
        row = codes[k]
        if row.min() < 0 or row.max() >= limit:
            raise _invalid(f"codebook {k} of '{param}' has codes outside [0, {limit})", param)
    return audio_rows(codes, config.semantic_start_token_id)


def _segment_rows(segments, param: str, config: DramaConfig) -> Rows:
    parts = []
    for i, segment in enumerate(segments):
        kind = segment.WhichOneof("content")
        if kind == "tokens":
            parts.append(_token_rows(segment.tokens, f"{param}[{i}].tokens", config, required=False))
        elif kind == "codes":
            parts.append(_code_rows(segment.codes, f"{param}[{i}].codes", config))
        else:
            raise _invalid(f"'{param}[{i}]' has neither tokens nor codes", f"{param}[{i}]")
    return Rows.cat(parts) if parts else text_rows(torch.empty(0, dtype=torch.int64), config.num_codebooks)


def _check_range(value, low, high, param: str) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise _invalid(f"Invalid '{param}': expected a value between {low} and {high}, "
                       f"but got {value} instead.", param, "out_of_range")


def parse_sampling(request: backbone_pb2.GenerateRequest, config: DramaConfig,
                   max_context: int) -> Sampling:
    """Sampling with the checkpoint's defaults for fields a proto3 zero cannot mean: top_p 0,
    repetition_penalty 0 and max_new_tokens 0 (temperature 0 is greedy, top_k 0 keeps all)."""
    defaults = config.sampling
    if not request.HasField("sampling"):
        return Sampling(defaults.temperature, defaults.top_p, defaults.top_k, 1.0, 0,
                        min(defaults.max_new_frames, max_context - 1))
    s = request.sampling
    top_p = s.top_p or defaults.top_p
    penalty = s.repetition_penalty or 1.0
    max_new = s.max_new_tokens or min(defaults.max_new_frames, max_context - 1)
    _check_range(s.temperature, 0.0, 2.0, "sampling.temperature")
    _check_range(top_p, 1e-6, 1.0, "sampling.top_p")
    _check_range(s.top_k, 0, 2 ** 31 - 1, "sampling.top_k")
    _check_range(penalty, 1.0, 2.0, "sampling.repetition_penalty")
    _check_range(max_new, 1, max_context - 1, "sampling.max_new_tokens")
    return Sampling(s.temperature, top_p, s.top_k, penalty, s.seed, max_new)


def parse_job(request: backbone_pb2.GenerateRequest, config: DramaConfig, *, max_context: int,
              deadline: float | None, span: trace.Span | None = None) -> Job:
    """Validate a GenerateRequest and turn it into rows; raises INVALID_ARGUMENT GenerateErrors."""
    if not request.session_id:
        raise _invalid("Missing required parameter: 'session_id'.", "session_id",
                       "missing_required_parameter")
    if not request.chunks:
        raise _invalid("Missing required parameter: 'chunks'.", "chunks", "missing_required_parameter")
    prompt = Prompt(
        system=_segment_rows(request.system, "system", config),
        history=[_segment_rows(take.segments, f"history[{i}].segments", config)
                 for i, take in enumerate(request.history)],
        user_turns=[_token_rows(chunk.user_turn, f"chunks[{i}].user_turn", config, required=True)
                    for i, chunk in enumerate(request.chunks)],
        assistant_open=_token_rows(request.assistant_open, "assistant_open", config, required=True),
        assistant_close=_token_rows(request.assistant_close, "assistant_close", config,
                                    required=len(request.chunks) > 1))
    sampling = parse_sampling(request, config, max_context)
    emit = request.emit
    _check_range(emit.first_message_frames, 0, 2 ** 31 - 1, "emit.first_message_frames")
    _check_range(emit.message_frames, 0, 2 ** 31 - 1, "emit.message_frames")
    _check_range(request.queue_timeout_ms, 0, 2 ** 31 - 1, "queue_timeout_ms")
    message_frames = emit.message_frames or DEFAULT_MESSAGE_FRAMES
    return Job(session_id=request.session_id, prompt=prompt, sampling=sampling,
               first_message_frames=emit.first_message_frames or message_frames,
               message_frames=message_frames,
               queue_timeout_s=request.queue_timeout_ms / 1000 if request.queue_timeout_ms else None,
               deadline=deadline, span=span,
               span_context=None if span is None else span.get_span_context())


def response_message(event) -> backbone_pb2.GenerateResponse:
    if isinstance(event, Started):
        return backbone_pb2.GenerateResponse(started=backbone_pb2.Started(
            queue_wait_ms=event.queue_wait_ms, prompt_text_tokens=event.prompt_text_tokens,
            prompt_audio_frames=event.prompt_audio_frames))
    if isinstance(event, FramesOut):
        return backbone_pb2.GenerateResponse(frames=backbone_pb2.Frames(
            chunk_index=event.chunk_index, first_frame_index=event.first_frame_index,
            n_frames=event.codes.shape[0], codes=codes_to_wire(event.codes.T)))
    if isinstance(event, ChunkEnd):
        return backbone_pb2.GenerateResponse(chunk_end=backbone_pb2.ChunkEnd(
            chunk_index=event.chunk_index, n_frames=event.n_frames,
            finish_reason=backbone_pb2.FinishReason.Value(event.finish_reason)))
    if isinstance(event, Usage):
        return backbone_pb2.GenerateResponse(usage=backbone_pb2.Usage(
            text_tokens=event.text_tokens, audio_tokens=event.audio_tokens,
            output_tokens=event.output_tokens))
    raise TypeError(f"unknown event {event!r}")


def trace_event(span: trace.Span, event) -> None:
    """Per-session span events (API.md §3.6); the prefill becomes a child span."""
    if isinstance(event, Started):
        span.add_event("admitted", {"drama.queue_wait_ms": event.queue_wait_ms,
                                    "drama.prompt.text_tokens": event.prompt_text_tokens,
                                    "drama.prompt.audio_frames": event.prompt_audio_frames})
        span.set_attribute("drama.queue_wait_ms", event.queue_wait_ms)
    elif isinstance(event, PrefillDone):
        prefill = _tracer.start_span("prefill", context=trace.set_span_in_context(span),
                                     start_time=event.start_ns,
                                     attributes={"drama.chunk_index": event.chunk_index,
                                                 "drama.prefill.rows": event.rows})
        prefill.end(end_time=event.end_ns)
    elif isinstance(event, FramesOut) and event.chunk_index == 0 and event.first_frame_index == 0:
        span.add_event("first_frame")
    elif isinstance(event, ChunkEnd):
        span.add_event("chunk_done", {"drama.chunk_index": event.chunk_index,
                                      "drama.chunk.frames": event.n_frames,
                                      "drama.finish_reason": event.finish_reason.lower()})
    elif isinstance(event, Usage):
        span.set_attribute("gen_ai.usage.input_tokens", event.text_tokens + event.audio_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", event.output_tokens)


async def abort_with(context: grpc.aio.ServicerContext, error: GenerateError) -> None:
    await grpcutil.abort(context, grpc.StatusCode[error.status], error.message,
                         drama_code=error.drama_code, param=error.param)


# --------------------------------------------------------------------------------------------
# The servicer
# --------------------------------------------------------------------------------------------

class BackboneServicer(backbone_pb2_grpc.BackboneServicer):
    """GetInfo and Generate over a Scheduler; answers not_ready until `attach` and while the
    tower is away."""

    def __init__(self, *, max_rows: int, max_queue: int, max_context_tokens: int, build: str = ""):
        self.max_rows, self.max_queue, self.max_context_tokens = max_rows, max_queue, max_context_tokens
        self.build = build
        self.config: DramaConfig | None = None
        self.scheduler: Scheduler | None = None
        self.tower: TowerClient | None = None

    def attach(self, config: DramaConfig, scheduler: Scheduler, tower: TowerClient) -> None:
        self.config, self.scheduler, self.tower = config, scheduler, tower

    @property
    def ready(self) -> bool:
        return (self.scheduler is not None and self.scheduler.accepting
                and self.tower is not None and self.tower.ready)

    async def GetInfo(self, request: backbone_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> backbone_pb2.BackboneInfo:
        scheduler = self.scheduler
        return backbone_pb2.BackboneInfo(
            model_id=MODEL_ID, max_rows=self.max_rows, max_queue=self.max_queue,
            max_context_tokens=self.max_context_tokens,
            max_speakers=self.config.num_speakers if self.config else 0,
            tower_ready=bool(self.tower and self.tower.ready),
            tower_transport=self.tower.transport if self.tower is not None else "",
            open_sessions=scheduler.open_sessions if scheduler else 0,
            free_slots=scheduler.engine.free_slots if scheduler else 0,
            queued_sessions=scheduler.queued_sessions if scheduler else 0,
            codebooks=self.config.num_codebooks if self.config else 0, build=self.build)

    async def Generate(self, request: backbone_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        if not self.ready:
            why = "loading" if self.scheduler is None else (
                "draining" if not self.scheduler.accepting else "tower not connected")
            await grpcutil.abort(context, grpc.StatusCode.UNAVAILABLE, f"backbone not ready: {why}",
                                 drama_code="not_ready")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await grpcutil.abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        span = trace.get_current_span()      # the interceptor's SERVER span, if tracing is on
        try:
            job = parse_job(request, self.config, max_context=self.scheduler.engine.max_context,
                            deadline=None if remaining is None else time.monotonic() + remaining,
                            span=span)
            session = self.scheduler.submit(job)
        except GenerateError as error:
            await abort_with(context, error)
        span.set_attribute("drama.session_id", request.session_id)
        try:
            async for event in self.scheduler.events(session):
                trace_event(span, event)
                if not isinstance(event, PrefillDone):
                    yield response_message(event)
        except GenerateError as error:
            await abort_with(context, error)
        finally:
            self.scheduler.cancel(session)   # a no-op once the session ended


# --------------------------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------------------------

@dataclass
class Settings:
    checkpoint: str
    tower_addr: str
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    memory_budget_gb: float | None = None
    max_rows: int = 64
    max_context_tokens: int = 8192
    max_queue: int = 256
    prefill_chunk_tokens: int = 2048
    prefill_interval_ms: float = 0.0  # while sessions decode, prefill steps at most this often (Scheduler)
    # prefill pieces on a lane of their own (thread, CUDA stream, TowerSteps) beside the decode
    # groups (Scheduler). None: on for a CUDA device (DRAMA_PREFILL_LANE=0 turns it off), off on
    # the CPU unless set; see prefill_lane_for.
    prefill_lane: bool | None = None
    session_buffer_frames: int = 1024
    step_span_sample: float = 0.01
    # Step requests at the tower at once (also capped by the tower's). 1: with the stages on one
    # GPU (its contexts time-slice, so the backbone and tower never truly overlap), two groups in
    # flight measured worse at 128 streams on the H200 (59.8 against 65.2 audio s per s, TTFA p99
    # 721 against 595 ms; docs/perf.md, session 5): the groups ran half-size steps. 2 is for a
    # backbone and a tower on GPUs of their own (not measured yet).
    max_inflight_steps: int = 1
    # the main loop's engine steps on the event loop's thread (Scheduler.inline_steps). None:
    # inline on CUDA while max_inflight_steps is 1 (DRAMA_INLINE_STEPS=0 or 1 forces it)
    inline_steps: bool | None = None
    # voice-prefix cache budget in MiB; None: DRAMA_PREFIX_CACHE_MB, else the device's default
    # (prefix_cache.default_capacity_mb); 0: off
    prefix_cache_mb: float | None = None
    # CUDA graphs for the decode rows of a step (bucketed by batch size, captured in the warm-up
    # before SERVING; kernel path only). None: on for a CUDA device (DRAMA_DECODE_GRAPHS=0 turns
    # them off), see decode_graphs_for.
    decode_graphs: bool | None = None
    # a session sits out the decode steps this long after its first frames message, so the
    # codec's first chunk has the GPU (Scheduler). None: 5 ms on a CUDA device, 0 on the CPU;
    # see first_audio_hold_ms_for.
    first_audio_hold_ms: float | None = None
    # read the routed experts (~95% of the checkpoint) while the warm-up compiles and captures
    # (weights.start_backbone_load). None: on for a CUDA device (DRAMA_LOAD_OVERLAP=0 turns it
    # off); see load_overlap_for.
    load_overlap: bool | None = None
    # while a step is at the tower, the scheduler's loop spins this long before it sleeps, so the
    # frame is routed without waiting for the loop thread to wake (Scheduler's spin_wait_s). None:
    # 10 ms on a CUDA device, off on the CPU (services.common.aio.spin_wait_s); 0: off.
    spin_wait_ms: float | None = None
    # the Step stream over the tower's same-host lane (a Unix socket, TowerInfo.step_socket) when
    # the tower names one and we reach it: the same messages without grpc's threads, ~0.5 ms a
    # frame on the H200 host (services/common/local_lane.py); False keeps the gRPC stream.
    tower_local_lane: bool = True
    # with a device hand-off that passes frames back (services/common/device_handoff.py), a
    # group's next decode step queued behind a GPU wait for the frames of the step at the tower,
    # before the response is read (Scheduler's chain_steps); False: each step after the response
    chain_steps: bool = True
    grace_s: float = 30.0


class MemoryBudgetError(RuntimeError):
    """Weights + cache pool do not fit the memory budget (or the device)."""


@dataclass
class Backbone:
    """A running backbone stage."""

    server: grpc.aio.Server
    port: int
    health: object
    servicer: BackboneServicer
    scheduler: Scheduler | None = None
    tower: TowerClient | None = None
    _tasks: list = field(default_factory=list)

    async def stop(self, grace_s: float = 0.0) -> None:
        if self.scheduler is not None:
            self.scheduler.accepting = False
            await grpcutil.set_serving(self.health, False)
            if grace_s:
                await self.scheduler.drain(grace_s)
        await self.server.stop(grace_s)
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.tower is not None:
            await self.tower.close()


def decode_graphs_for(settings: Settings) -> bool:
    """Whether the model replays decode steps from CUDA graphs: settings.decode_graphs, or by
    default on CUDA devices (graphs exist only on the kernel path on CUDA; elsewhere a no-op)."""
    if settings.decode_graphs is not None:
        return settings.decode_graphs
    return settings.device.startswith("cuda")


def load_overlap_for(settings: Settings) -> bool:
    """Whether the start reads the routed experts beside the warm-up: settings.load_overlap, else
    on for a CUDA device. On the H200 from a cold page cache (docs/perf.md, session 5) the
    backbone served after 55.5 s with it (2 background readers, the 1 ms switch interval),
    against 92.7 s loading first; with 8 readers beside the warm-up it took 77.9 s. On the CPU
    there is no warm-up to overlap."""
    if settings.load_overlap is not None:
        return settings.load_overlap
    return settings.device.startswith("cuda")


def first_audio_hold_ms_for(settings: Settings) -> float:
    """settings.first_audio_hold_ms, or by default 5 ms on a CUDA device: about what the codec's
    first 2-frame chunk takes from the backbone's message to its PCM when it has the GPU alone
    (hop to the gateway and the codec, the graph replay, the copy back; bench/timeline.py). On
    the CPU the stages share cores, not a time-sliced device, and the tests keep the plain cadence."""
    if settings.first_audio_hold_ms is not None:
        return max(0.0, settings.first_audio_hold_ms)
    return 5.0 if settings.device.startswith("cuda") else 0.0


def prefill_lane_for(settings: Settings) -> bool:
    """Whether the scheduler runs the prefill lane: settings.prefill_lane, or by default on CUDA
    devices, where a prefill step is host-bound (eager launches) and would stall every decoding
    stream. Off by default on the CPU: there the two engine threads share the same few cores, so
    the lane buys nothing, and the CPU suites keep one engine thread (the frames are the same
    either way, tests/test_prefill_lane.py)."""
    if settings.prefill_lane is not None:
        return settings.prefill_lane
    return settings.device.startswith("cuda")


def _build_version() -> str:
    try:
        from importlib.metadata import version
        return version("dramaturg")
    except Exception:
        return "dev"


def memory_report(engine, budget_gb: float | None, device: str) -> str:
    """Print-ready figures; raises MemoryBudgetError when weights + pool exceed the budget."""
    memory = engine.memory_bytes()
    weights, pool = memory["weights"], memory["cache"]
    total = weights + pool
    limit = budget_gb * 2 ** 30 if budget_gb else None
    if device.startswith("cuda"):
        device_total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        limit = min(limit, device_total) if limit else device_total
    gib = 2 ** 30
    line = (f"backbone memory: weights {weights / gib:.3f} GiB + cache pool {pool / gib:.3f} GiB "
            f"({engine.max_sessions} sessions x {engine.max_context} rows) = {total / gib:.3f} GiB; "
            f"budget {'none' if limit is None else f'{limit / gib:.3f} GiB'}")
    if limit is not None and total > limit:
        raise MemoryBudgetError(line + " -> does not fit; lower DRAMA_MAX_ROWS or "
                                "DRAMA_MAX_CONTEXT_TOKENS, or raise the budget")
    return line


def prefix_cache_for(settings: Settings) -> PrefixCache:
    mb = settings.prefix_cache_mb
    if mb is None:
        mb = env_default("DRAMA_PREFIX_CACHE_MB", default_capacity_mb(settings.device), float)
    return PrefixCache.from_mb(mb)


def model_identity(settings: Settings, model) -> str:
    """What a cached prefix state depends on besides its rows: the weights and the numerics."""
    return "|".join([MODEL_ID, os.path.realpath(settings.checkpoint), str(model.dtype), str(model.device),
                     f"exact={model.exact}", f"kernels={getattr(model, 'kernels', False)}"])


def check_step_message(*, rows: int, hidden_size: int, hidden_dtype: torch.dtype,
                       codebooks: int, sessions: int) -> None:
    """Refuse a configuration whose largest StepRequest could pass the message limit (API.md §3.2)."""
    size = rows * (hidden_size * hidden_dtype.itemsize + codebooks * 2) + sessions * 128
    if size > STEP_MESSAGE_LIMIT_BYTES:
        raise ValueError(f"a Step message of {rows} rows is {size / 2 ** 20:.1f} MiB, over the "
                         f"{STEP_MESSAGE_LIMIT_BYTES // 2 ** 20} MiB limit; lower "
                         "DRAMA_PREFILL_CHUNK_TOKENS")


async def start(settings: Settings, *, loaded_model=None) -> Backbone:
    """Listen (NOT_SERVING), load, size the pool, connect the tower, then serve.

    `loaded_model` lets tests share one loaded model between stages they start.
    """
    from services.backbone.engine import BackboneEngine
    from services.backbone.weights import load_backbone, start_backbone_load

    config = load_config(settings.checkpoint)
    max_context = min(settings.max_context_tokens, config.text.max_position_embeddings)
    servicer = BackboneServicer(max_rows=settings.max_rows, max_queue=settings.max_queue,
                                max_context_tokens=max_context, build=_build_version())
    server, port, health = await grpcutil.start_server(
        add_servicers=[lambda s: backbone_pb2_grpc.add_BackboneServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME], host=settings.host, port=settings.port)
    running = Backbone(server, port, health, servicer)
    lane, overlap = prefill_lane_for(settings), load_overlap_for(settings)
    if lane or overlap:
        # Threads that need the GIL briefly, behind one that runs Python for long stretches: the
        # lane's thread runs ~190 ms of Python per eager prefill step (thousands of launches), and
        # at start the warm-up's captures run beside the expert readers. At the default 5 ms
        # switch interval each brief need (a decode step's replay and copy, the event loop's
        # routing, a reader's next copy) waits up to 5 ms for the long runner to yield; at 1 ms
        # they lose little. Process-wide, set once here, before the load.
        sys.setswitchinterval(0.001)
    try:
        dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
        # lm_head=False: the tower owns the semantic head; the service never computes logits.
        load_args = dict(device=settings.device, dtype=dtype, lm_head=False,
                         **({"decode_graphs": True} if decode_graphs_for(settings) else {}))
        expert_reads = None          # the experts still being read while the warm-up runs
        if loaded_model is not None:
            model = loaded_model
        elif overlap:
            model, expert_reads = await asyncio.to_thread(start_backbone_load, settings.checkpoint, **load_args)
        else:
            model = await asyncio.to_thread(load_backbone, settings.checkpoint, **load_args)
        try:
            engine = BackboneEngine(model, max_sessions=settings.max_rows, max_context=max_context)
        except torch.OutOfMemoryError as exc:
            raise MemoryBudgetError(
                f"the cache pool for {settings.max_rows} sessions x {max_context} rows does not fit "
                f"on {settings.device}: {exc}; lower DRAMA_MAX_ROWS or DRAMA_MAX_CONTEXT_TOKENS") from None
        print(memory_report(engine, settings.memory_budget_gb, settings.device), flush=True)
        # NOT_SERVING until warm (API.md §3.2): the first request must not pay kernel compilation.
        started = time.perf_counter()
        buckets = await asyncio.to_thread(engine.warm_up)
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in engine.warm_up_phases.items())
        print(f"backbone warm-up: {time.perf_counter() - started:.1f} s ({phases}); decode graphs: "
              + (f"on, batch buckets {buckets}" if buckets else "off"), flush=True)
        if device_handoff.enabled(engine.model.device):
            await asyncio.to_thread(device_handoff.warm_up_handoff, engine.model.device, engine.hidden_size,
                                    engine.hidden_dtype, device_handoff.frame_columns(config.num_codebooks))
        if expert_reads is not None:
            waited = time.perf_counter()
            await asyncio.to_thread(expert_reads.wait)
            print(f"backbone experts read in {expert_reads.seconds:.1f} s beside the warm-up "
                  f"(then waited {time.perf_counter() - waited:.1f} s for them)", flush=True)
        check_step_message(rows=settings.prefill_chunk_tokens + settings.max_rows,
                           hidden_size=engine.hidden_size, hidden_dtype=engine.hidden_dtype,
                           codebooks=config.num_codebooks, sessions=settings.max_rows)
    except BaseException:
        await server.stop(0)
        raise

    def on_tower_ready(ready: bool) -> None:
        serving = ready and running.scheduler is not None and running.scheduler.accepting
        # keep a reference until the health update ran (the loop holds tasks only weakly)
        running._tasks = [t for t in running._tasks if not t.done()]
        running._tasks.append(asyncio.get_running_loop().create_task(
            grpcutil.set_serving(health, serving)))
        running.scheduler.wake()

    prefix_cache = prefix_cache_for(settings)
    print(f"backbone voice-prefix cache: {prefix_cache.capacity_bytes / 2 ** 20:.0f} MiB"
          + ("" if prefix_cache.enabled else " (off)"), flush=True)
    print(f"backbone prefill lane: {'on' if lane else 'off'}", flush=True)
    tower = TowerClient(settings.tower_addr, hidden_dim=engine.hidden_size,
                        hidden_dtype=engine.hidden_dtype, codebooks=config.num_codebooks,
                        max_rows=settings.max_rows, max_context_tokens=max_context,
                        on_ready=on_tower_ready, local_lane=settings.tower_local_lane, device=engine.model.device)
    scheduler = Scheduler(engine, tower, semantic_start_token_id=config.semantic_start_token_id,
                          max_rows=settings.max_rows, max_queue=settings.max_queue,
                          prefill_chunk_tokens=settings.prefill_chunk_tokens,
                          prefill_interval_s=settings.prefill_interval_ms / 1000,
                          prefill_lane=lane, first_audio_hold_s=first_audio_hold_ms_for(settings) / 1000,
                          session_buffer_frames=settings.session_buffer_frames,
                          step_span_sample=settings.step_span_sample,
                          max_inflight_steps=settings.max_inflight_steps,
                          inline_steps=settings.inline_steps,
                          spin_wait_s=aio.spin_wait_s(settings.spin_wait_ms, settings.device),
                          chain_steps=settings.chain_steps,
                          prefix_cache=prefix_cache,
                          model_identity=model_identity(settings, model))
    tower.on_lost = scheduler.tower_lost
    running.scheduler, running.tower = scheduler, tower
    servicer.attach(config, scheduler, tower)
    scheduler.start()
    tower.start()
    return running


async def serve(settings: Settings, *, loaded_model=None) -> None:
    """Run until SIGTERM/SIGINT, then drain for `grace_s` (`loaded_model`: see `start`)."""
    running = await start(settings, loaded_model=loaded_model)
    log.info("backbone listening on %s:%d, tower %s", settings.host, running.port, settings.tower_addr)

    async def stop_admitting():
        running.scheduler.accepting = False
        await running.scheduler.drain(settings.grace_s)

    await grpcutil.serve_until_signalled(running.server, running.health, grace_s=settings.grace_s,
                                         on_shutdown=stop_admitting)
    await running.scheduler.close()
    await running.tower.close()

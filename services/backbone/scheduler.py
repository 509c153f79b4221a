"""Continuous batching for the backbone stage (API.md §3.4-§3.5, MODEL.md §5.4, §8.3).

Pure Python over the engine: no protobuf and no gRPC here; the rows and each chunk's plan are
`rows.py`'s (re-exported here). `server.py` turns a GenerateRequest into a `Job`, submits it, and
translates the session's events back into GenerateResponses; the tower is reached through an
object with `ready`, `max_inflight_steps` and `async send(TowerStep) -> Future[TowerResult]`
(`tower_client.TowerClient`).

A step of one group of sessions:
    1. admit queued sessions FIFO while the engine has free slots (each gets its first chunk's rows);
    2. plan: at most one entry per session, decode rows first (one row: the frame the tower just
       drew), then prefill pieces within the step's prefill row budget, at most `max_rows` entries;
    3. the engine step on the engine thread (`engine.launch_to_host`, then `finish`); on CUDA with
       one step in flight on the loop's thread itself, its frames out running between the two;
    4. send one TowerStep with every row (hidden, targets, draws, and the releases so far);
    5. when its StepResponse comes back, route the drawn frames: buffer and emit them, end chunks
       on `stop` (STOP) or at `max_new_tokens` (LENGTH), start the next chunk as a fresh timeline.

Voice-prefix cache (issue #8, prefix_cache.py): every chunk's timeline starts with the rows of
`system`. With a cache, a chunk whose prefix is cached opens its slot from the snapshot
(`engine.restore`), tells the tower to restore too (the first entry's `prefix_key`) and prefills
only the rest; on a miss the first prefill piece ends exactly at the prefix, and after that step
the engine's slot is snapshotted and the tower told to store its own (`snapshot_key`). If the
tower no longer holds its snapshot (FAILED_PRECONDITION), the chunk starts over from row 0 as a
new timeline; the answers to the abandoned timeline's entries still in flight are ignored. The
frames do not depend on the cache: on the CPU exact path a session's state is bit-identical
however its rows were split into steps (tests/test_prefix_cache.py).

Stage pipelining (API.md §3.5): up to `max_inflight_steps` groups are at the tower at once (the
smaller of ours and the tower's). While one group is at the tower, the loop plans and computes the
next from the sessions not waiting for a frame, so backbone and tower work at the same time. A
decoding session is in at most one group (it waits for its own frame; a long prompt's prefill
pieces may follow each other without waiting) and responses come back in request order, so each
session sees the same rows in the same order as without pipelining; with one step in flight the
loop is simply sequential.

Prefill lane (issue #8, `prefill_lane`, DRAMA_PREFILL_LANE): on the GPU a step with a prefill
piece costs ~190 ms of host time (eager launches) against 4-30 ms for a graphed decode step, and
without the lane every running stream of the group waits for it. With the lane, prefill pieces
of two rows or more leave the decode groups: a second coroutine plans them (several sessions per
lane step, within the step's prefill row budget), computes them on its own engine thread (on
CUDA on its own stream) while the main loop keeps running decode-only steps on the main engine
thread, and sends each lane step to the tower as its own TowerStep; after the draw that ends its
prompt a session decodes in the groups. A one-row piece (the remainder of a prompt the lane could
not avoid cutting to one row, or a one-row voice prefix) rides in a decode group's step instead:
it costs what a decode row costs, and a lane step never holds a one-row segment, which the model
would replay from the decode graphs the main thread is using. In-flight budget: a lane step
counts like any group against `max_inflight_steps` (API.md §3.5); once computed it takes the next
free place before any new decode group (decoding waits at most one tower step per lane step,
and the lane waits at most until the oldest step at the tower answers). Groups are then capped
at ⌈sessions past their prompt / max_inflight_steps⌉ rows, so they stay balanced around the
lane's steps. A session planned into a step (`in_step`) is left alone by the other planner until
that step is sent; a slot released while an engine call uses it is freed when the call ends;
a session restored from the voice prefix has its further pieces wait for the restore's answer
(a fallback opens a new slot, and the old one must not be in use). The frames do not depend on
the lane: on the CPU exact path they are bit-identical with it on and off
(tests/test_prefill_lane.py).

Engine calls: `open` and `release` are made by the coroutines on the event loop; a step
(`engine.launch_to_host` and `finish`) runs on the main engine thread (decode groups; on CUDA with
one step in flight, the loop's own thread) or the lane's thread, never two steps on one slot
(engine.py: its lock guards bookkeeping only, so the two steps overlap). `cancel` and the
tower's loss callback only set flags and wake the loop.

Metrics (API.md §1.7, OpenTelemetry): `drama_backbone_batch_rows` and `drama_backbone_step_seconds`
(engine time) per step of the main loop, `drama_backbone_lane_batch_rows` and
`drama_backbone_lane_step_seconds` per lane step (a series of its own: the two threads overlap,
and one series would count more busy time than there was wall time),
`drama_backbone_queue_depth` and `drama_backbone_kv_usage_ratio` (rows held over the pool's rows)
as gauges, `drama_backbone_prefix_rows_skipped` (prompt rows restored from the voice-prefix cache)
and `drama_backbone_prefix_fallbacks` (restores the tower could not serve) as counters;
`drama_backbone_first_audio_seconds{phase}`: for each session's first chunk, the time from its
submission to each milestone on the way to its first frames message (FIRST_AUDIO_PHASES), so the
time to first audio can be taken apart stage by stage (bench/stage_metrics.py prints the means).

Tracing (API.md §3.6): a fraction `step_span_sample` of steps get a `backbone.step` span linked to
the Generate spans of their sessions (at most 32 links), and its context rides in the TowerStep
so the tower's span joins the trace; each chunk's prefill is reported as a `PrefillDone` event
with its start and end times, which the servicer turns into a `prefill` span.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import torch
from opentelemetry import metrics, propagate, trace
from torch import Tensor

from services.common import aio
from services.common.telemetry import BATCH_SIZE_BUCKETS, STEP_SECONDS_BUCKETS

from .engine import PendingStep
from .prefix_cache import PrefixCache, prefix_key
from .rows import (GenerateError, Prompt, Rows, audio_rows, check_context, plan_chunk,  # noqa: F401
                   row_targets, text_rows)

# The milestones of drama_backbone_first_audio_seconds, in the order a session meets them:
# admitted (Started queued), the step holding its last prompt row computed and handed to the
# tower, the first frame back, the row of that frame computed and sent (sent first, through the
# device hand-off: the request goes before the step's wait), the second frame back, the first
# frames message queued for the Generate stream.
FIRST_AUDIO_PHASES = ("admitted", "prompt_computed", "prompt_sent", "first_frame", "first_decode_computed",
                      "first_decode_sent", "second_frame", "first_message")

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("services.backbone")
MAX_STEP_SPAN_LINKS = 32


class TowerUnavailable(Exception):
    """The Step stream broke (or is not open): every session with tower state is lost."""


# --------------------------------------------------------------------------------------------
# Requests, events and the tower interface
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    max_new_tokens: int          # frames per chunk


@dataclass
class Job:
    """One Generate call, validated and converted to rows by the servicer."""

    session_id: str
    prompt: Prompt
    sampling: Sampling
    first_message_frames: int
    message_frames: int
    queue_timeout_s: float | None = None     # None: wait as long as the deadline allows
    deadline: float | None = None            # time.monotonic() value, None: no deadline
    span_context: trace.SpanContext | None = None   # the Generate span, for step-span links
    span: trace.Span | None = None           # the Generate span itself: first-audio milestones as events


@dataclass(frozen=True)
class Started:
    queue_wait_ms: int
    prompt_text_tokens: int
    prompt_audio_frames: int


@dataclass(frozen=True)
class PrefillDone:
    """A chunk's prompt has gone through both stages (for the `prefill` span; not sent)."""

    chunk_index: int
    rows: int
    start_ns: int                 # time.time_ns() of the first piece and after the last one
    end_ns: int


@dataclass(frozen=True)
class FramesOut:
    chunk_index: int
    first_frame_index: int        # within the chunk
    codes: Tensor                 # int64 [n_frames, N], frame-major as on the wire


@dataclass(frozen=True)
class ChunkEnd:
    chunk_index: int
    n_frames: int
    finish_reason: str            # "STOP" or "LENGTH"


@dataclass(frozen=True)
class Usage:
    text_tokens: int
    audio_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TowerEntry:
    """One session's rows in a TowerStep (API.md §3.5 RowEntry)."""

    session_id: str
    first_row: int
    n_rows: int
    draw: bool
    take_index: int = 0
    frame_index: int = 0
    sampling: Sampling | None = None
    prefix_key: str = ""          # restore the tower state stored under this key (first_row = prefix_rows)
    prefix_rows: int = 0
    snapshot_key: str = ""        # store the tower state after this entry under this key


@dataclass(frozen=True)
class TowerStep:
    entries: list[TowerEntry]
    hidden: Tensor                # [sum n_rows, H], engine dtype (not read with handoff_seq)
    targets: Tensor               # int64 [sum n_rows, N], -1 = none
    release: list[str]
    trace_context: dict[str, str] = field(default_factory=dict)
    handoff_seq: int = 0          # > 0: the rows are in the tower client's device hand-off under this number


@dataclass(frozen=True)
class TowerResult:
    codes: Tensor                 # int64 [len(entries), N]; -1 without a draw or when stopped
    stop: list[bool]
    row_errors: dict[int, GenerateError]   # entry index -> the session's error


class Tower(Protocol):
    @property
    def ready(self) -> bool: ...

    @property
    def max_inflight_steps(self) -> int: ...

    async def send(self, step: TowerStep) -> "asyncio.Future[TowerResult]":
        """Write the step; the returned future resolves to its result (or TowerUnavailable)."""


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------

_END = object()   # the last item of a session's outbox after Usage


@dataclass(eq=False)
class Session:
    job: Job
    submitted: float
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "queued"                  # queued -> active -> done
    cancelled: bool = False
    slot: int | None = None
    tower_open: bool = False               # the tower holds state for this timeline
    chunk_index: int = 0
    rows: Rows | None = None               # the current chunk's prompt rows
    targets: Tensor | None = None          # their targets [P, N]
    sent: int = 0                          # rows of this timeline through engine and tower
    chunk_frames: list[Tensor] = field(default_factory=list)   # frames drawn in this chunk
    next_row: Tensor | None = None         # the last drawn frame, its row not yet appended
    pending: list[Tensor] = field(default_factory=list)        # frames not yet in a message
    emitted_in_chunk: int = 0              # frames of this chunk already put in messages
    messages_sent: int = 0
    buffered_frames: int = 0               # emitted frames the caller has not taken yet
    paused: bool = False
    held_until: float = 0.0                # time.monotonic() before which it sits out (first-audio hold)
    prefill_start_ns: int = 0
    timeline: int = 0                      # counts the timelines opened (chunks, prefix fallbacks)
    prefix: tuple[str, int] | None = None  # (key, rows) of the cacheable prefix, once computed
    restore_prefix: bool = False           # the next entry restores the tower from the prefix
    store_prefix: bool = False             # cut a piece at the prefix and store both stages' state
    awaiting_restore: bool = False         # a restore entry is at the tower, not answered yet
    in_step: bool = False                  # planned into a step not yet sent (no planner takes it)
    chained: bool = False                  # its frame at the tower is already a chained step's input
    text_tokens: int = 0
    audio_tokens: int = 0
    output_tokens: int = 0
    milestones: set = field(default_factory=set)   # FIRST_AUDIO_PHASES recorded so far

    @property
    def id(self) -> str:
        return self.job.session_id

    @property
    def decoding(self) -> bool:
        return self.next_row is not None

    @property
    def prefilling(self) -> bool:
        return self.rows is not None and self.sent < len(self.rows)


@dataclass
class _Entry:
    """A planned entry: the rows a session sends this step."""

    session: Session
    rows: Rows
    targets: Tensor
    draw: bool
    timeline: int
    restore: bool = False          # the tower starts this session from the prefix snapshot
    store: bool = False            # both stages store their state after this entry
    chained: bool = False          # its row is the session's frame still at the tower (a chained step)


@dataclass
class _Unfinished:
    """A chained step sent to the tower whose engine step has not been waited for yet."""

    launched: tuple[PendingStep, float]
    entries: list[_Entry]
    slots: set[int]
    mailbox: object
    span: object | None
    inflight: "_InFlight | None" = None      # its request, waited for at the latest before its response is routed


@dataclass
class _InFlight:
    """A step sent to the tower, waiting for its response."""

    entries: list[_Entry]
    result: asyncio.Future
    span: object | None
    lane: bool = False             # a prefill lane step
    handoff: tuple[object, int] | None = None   # (Mailbox, seq) of a step sent through the device hand-off


class _StageMetrics:
    """The backbone's series (API.md §1.7) on one meter, made once per meter: the SDK keeps only
    the first callback of a gauge registered twice under one name, so the gauges observe every
    open scheduler of the meter rather than the first one made (a server has exactly one)."""

    _by_meter: dict[int | None, "_StageMetrics"] = {}

    @classmethod
    def of(cls, meter: metrics.Meter | None) -> "_StageMetrics":
        """The instruments on `meter`; None: on the process's meter, made once (get_meter hands
        out a new proxy per call until a MeterProvider is set)."""
        key = None if meter is None else id(meter)
        if key not in cls._by_meter:
            cls._by_meter[key] = cls(meter or metrics.get_meter("services.backbone"))
        return cls._by_meter[key]

    def __init__(self, meter: metrics.Meter):
        self.meter = meter          # held, so its id stays its own
        # Weak references, copied as a whole (atomic) by the exporter's thread.
        self.schedulers: list[weakref.ref] = []
        self.batch_rows = meter.create_histogram(
            "drama_backbone_batch_rows", unit="{row}", description="rows per backbone step",
            explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS)
        self.step_seconds = meter.create_histogram(
            "drama_backbone_step_seconds", unit="s", description="backbone compute time per step",
            explicit_bucket_boundaries_advisory=STEP_SECONDS_BUCKETS)
        self.lane_batch_rows = meter.create_histogram(
            "drama_backbone_lane_batch_rows", unit="{row}", description="rows per prefill lane step",
            explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS)
        self.lane_step_seconds = meter.create_histogram(
            "drama_backbone_lane_step_seconds", unit="s",
            description="backbone compute time per prefill lane step",
            explicit_bucket_boundaries_advisory=STEP_SECONDS_BUCKETS)
        meter.create_observable_gauge(
            "drama_backbone_queue_depth", [self._queue_depth],
            unit="{session}", description="sessions waiting for admission")
        meter.create_observable_gauge(
            "drama_backbone_kv_usage_ratio", [self._kv_usage],
            unit="1", description="rows held over the cache pool's rows")
        self.rows_skipped = meter.create_counter(
            "drama_backbone_prefix_rows_skipped", unit="{row}",
            description="prompt rows restored from the voice-prefix cache instead of prefilled")
        self.fallbacks = meter.create_counter(
            "drama_backbone_prefix_fallbacks", unit="{restore}",
            description="voice-prefix restores the tower could not serve (full prefill instead)")
        self.first_audio_seconds = meter.create_histogram(
            "drama_backbone_first_audio_seconds", unit="s",
            description="submission to each milestone of a session's first chunk (attribute phase)",
            explicit_bucket_boundaries_advisory=STEP_SECONDS_BUCKETS)

    def add(self, scheduler: "Scheduler") -> None:
        self.schedulers = [r for r in self.schedulers if r() is not None] + [weakref.ref(scheduler)]

    def remove(self, scheduler: "Scheduler") -> None:
        self.schedulers = [r for r in self.schedulers if r() not in (None, scheduler)]

    def _open(self) -> list["Scheduler"]:
        return [s for s in (r() for r in list(self.schedulers)) if s is not None]

    # Gauge callbacks, on the metric reader's thread; no scheduler open: no point.
    def _queue_depth(self, _options):
        open_ = self._open()
        return [metrics.Observation(sum(s.queued_sessions for s in open_))] if open_ else []

    def _kv_usage(self, _options):
        open_ = self._open()
        return [metrics.Observation(max(s.kv_usage_ratio for s in open_))] if open_ else []


class Scheduler:
    """Admission queue, continuous batching loop and per-session output streams."""

    def __init__(self, engine, tower: Tower, *, semantic_start_token_id: int,
                 max_rows: int = 64, max_queue: int = 256, prefill_chunk_tokens: int = 2048,
                 step_prefill_rows: int | None = None, session_buffer_frames: int = 1024,
                 step_span_sample: float = 0.01, max_inflight_steps: int = 2,
                 idle_poll_s: float = 0.05, meter: metrics.Meter | None = None,
                 prefix_cache: PrefixCache | None = None, model_identity: str = "",
                 prefill_interval_s: float = 0.0, prefill_lane: bool = False,
                 first_audio_hold_s: float = 0.0, inline_steps: bool | None = None,
                 spin_wait_s: float = 0.0, chain_steps: bool = True):
        """prefix_cache: the voice-prefix cache of engine snapshots (None: off); model_identity
        goes into its keys, so snapshots of different weights or numerics never mix.

        prefill_interval_s: while sessions are decoding, a step carries prefill pieces only when
        this long has passed since the last step that did; new sessions wait for that step
        and share it. 0 (the default) prefills in every step that has a piece to run. Why: a
        step with a prefill piece costs what the piece costs (on the GPU the prefill path is
        host-bound, ~140 ms whatever its size, against ~5-30 ms for a graphed decode step), and
        every running stream waits for it; spacing the prefill steps trades up to this much
        TTFA for the running streams' cadence. With no session decoding, prefill runs at once.
        With the prefill lane it spaces the lane's steps.

        prefill_lane: compute prefill pieces on a lane of their own, beside the decode groups
        (see the module docstring). Needs pieces of two rows or more.

        spin_wait_s: while a step is at the tower, the main loop spins this long before it sleeps
        (see _sleep); 0, the default, never spins.

        first_audio_hold_s: a session whose first frames message has just gone out sits out the
        decode steps for this long (once per request). Why: the stages are processes sharing one
        GPU, which time-slices between them, so the codec's first chunk, the last thing before
        the first audio byte, ran beside this session's next backbone and tower steps and took
        ~7.5 ms instead of ~3 (bench/timeline.py on the H200). The session's later frames come
        that much later, far ahead of playback; other sessions' steps go on. 0: no hold.

        inline_steps: run the main loop's engine steps on the event loop's own thread instead of
        the engine thread. None: inline on a CUDA device while one step at a time may be at the
        tower (the default, API.md §3.5), engine thread otherwise. Why: a frame's round trip is backbone
        step -> tower step -> backbone step, and each trip through the engine thread is two
        thread hand-offs (~0.65 ms per frame on the CPU, docs/perf.md), the same cost the tower
        saved by stepping inline. With one step in flight nothing else needs the loop while a
        step runs: no response can arrive, a computed lane step waits for the place the step
        holds anyway; frames already routed go out first (the loop yields once before the
        step), and a new request waits at most one step for admission. With two steps in
        flight the loop must read one group's frames while the other's step runs, so that keeps
        the engine thread; so does a step while the prefill lane has prompts to prefill (the
        lane plans each piece on the loop), and every step on the CPU, where a step is the
        compute itself (seconds for a real-size model: health checks, new requests and cancels
        would wait that long). The lane always computes on its own thread.

        chain_steps: with a device hand-off that passes frames back too (Mailbox.frames_ready),
        queue a group's next decode step behind a GPU wait for the frames of the step still at
        the tower, before its response is read (`_plan_chained` says when). Why: otherwise a
        frame's way back goes tower GPU -> tower host -> lane -> backbone host -> the next launch
        (~0.5 ms of a ~4.8 ms single-stream frame on the H200, session 25), with the backbone's
        GPU idle meanwhile; chained, the next step starts as soon as the frames land. Its cost:
        when a frame ends its chunk (EOS), the step chained on it was computed for nothing, and
        its answer is dropped (the chunk's slots are discarded, as at any chunk end)."""
        self.engine = engine
        self.tower = tower
        self.semantic_start_token_id = semantic_start_token_id
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Prefill rows per step over all sessions, so one long prompt cannot stall the decode
        # cadence of the running streams.
        self.step_prefill_rows = step_prefill_rows or prefill_chunk_tokens
        self.prefill_interval_s = prefill_interval_s
        self.first_audio_hold_s = first_audio_hold_s
        self._spinner = aio.Spinner(spin_wait_s) if spin_wait_s > 0 else None
        self._last_prefill_step = float("-inf")    # time.monotonic() of the last step with prefill
        self.session_buffer_frames = session_buffer_frames
        self.step_span_sample = step_span_sample
        self.max_inflight_steps = max_inflight_steps
        self.inline_steps = inline_steps
        self.idle_poll_s = idle_poll_s
        self.chain_steps = chain_steps
        self.chained_steps = 0                     # decode steps queued behind the tower's frames
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.model_identity = model_identity
        self.prefix_rows_skipped = 0               # prompt rows restored instead of prefilled
        self.prefix_fallbacks = 0                  # restores the tower could not serve
        self.lane_steps = 0                        # prefill lane steps sent to the tower
        self.accepting = True
        self._queue: collections.deque[Session] = collections.deque()
        self._active: list[Session] = []           # admission order
        self._sessions: dict[str, Session] = {}    # queued and active, by id
        self._release: list[str] = []              # tower states to free in the next step
        self._inflight: collections.deque[_InFlight] = collections.deque()   # request order
        self._tower_lost = False
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backbone-engine")
        self._task: asyncio.Task | None = None
        self.prefill_lane = prefill_lane
        if prefill_lane and min(self.prefill_chunk_tokens, self.step_prefill_rows) < 2:
            raise ValueError("the prefill lane needs prefill pieces of two rows or more "
                             f"(prefill_chunk_tokens {self.prefill_chunk_tokens}, "
                             f"step_prefill_rows {self.step_prefill_rows})")
        self._lane_executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="backbone-lane")
                               if prefill_lane else None)
        self._lane_task: asyncio.Task | None = None
        self._lane_wake = asyncio.Event()
        self._lane_waiting = False                 # a computed lane step waits for a place at the tower
        self._claimed = 0                          # places at the tower taken by steps not yet sent
        self._computing: set[int] = set()          # engine slots inside a running engine call
        self._held: list[int] = []                 # slots released meanwhile, freed when it ends
        self._unfinished: _Unfinished | None = None   # a chained step not waited for yet
        # CUDA streams, with the lane only (without it everything stays on the default stream, as
        # before). The decode stream gets the higher priority: when both have kernels ready, the
        # GPU schedules the decode step's blocks first, so the lane's prefill costs the running
        # streams as little device time as possible.
        device = torch.device(getattr(getattr(engine, "model", None), "device", "cpu"))
        self._on_cuda = device.type == "cuda"
        on_cuda = prefill_lane and device.type == "cuda"
        self._lane_stream = torch.cuda.Stream(device) if on_cuda else None
        self._main_stream = torch.cuda.Stream(device, priority=-1) if on_cuda else None
        self._metrics = _StageMetrics.of(meter)
        self._metrics.add(self)
        self._batch_rows, self._step_seconds = self._metrics.batch_rows, self._metrics.step_seconds
        self._lane_batch_rows = self._metrics.lane_batch_rows
        self._lane_step_seconds = self._metrics.lane_step_seconds
        self._rows_skipped, self._fallbacks = self._metrics.rows_skipped, self._metrics.fallbacks
        self._first_audio_seconds = self._metrics.first_audio_seconds
        # the targets of every decode row (a draw row has none); shared, never written
        self._no_targets = torch.full((1, engine.num_codebooks), -1, dtype=torch.int64)

    # ---- public API -------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="backbone-scheduler")
        if self.prefill_lane:
            self._lane_task = loop.create_task(self._run_lane(), name="backbone-prefill-lane")

    async def close(self) -> None:
        """Stop the loop; sessions still open end UNAVAILABLE."""
        self.accepting = False
        self._metrics.remove(self)
        for task in (self._task, self._lane_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._spinner is not None:
            self._spinner.close()
        # A step cancelled mid-flight may still run on an engine thread; let it finish before
        # the slots are released.
        loop = asyncio.get_running_loop()
        for executor in (self._executor, self._lane_executor):
            if executor is not None:
                await loop.run_in_executor(executor, lambda: None)
        if self._unfinished is not None:
            self._finish_quietly(self._unfinished.launched)
            self._unfinished = None
        self._computing.clear()
        self._free_held()
        for step in self._inflight:
            step.result.cancel()
            if step.span is not None:
                step.span.end()
        self._inflight.clear()
        for session in list(self._sessions.values()):
            self._end(session, GenerateError("UNAVAILABLE", "backbone shutting down",
                                             drama_code="not_ready"))
        self._executor.shutdown(wait=True)
        if self._lane_executor is not None:
            self._lane_executor.shutdown(wait=True)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting and wait up to `timeout_s` for the open sessions to finish."""
        self.accepting = False
        end = time.monotonic() + timeout_s
        while self._sessions and time.monotonic() < end:
            await asyncio.sleep(0.05)

    @property
    def queued_sessions(self) -> int:
        return len(self._queue)

    @property
    def open_sessions(self) -> int:
        return len(self._active)

    @property
    def kv_usage_ratio(self) -> float:
        held = sum(session.sent for session in self._active if session.slot is not None)
        return held / (self.engine.max_sessions * self.engine.max_context)

    def submit(self, job: Job) -> Session:
        """Queue a job; raises GenerateError (ALREADY_EXISTS, OUT_OF_RANGE for the context,
        RESOURCE_EXHAUSTED queue_full, UNAVAILABLE not_ready)."""
        if not self.accepting:
            raise GenerateError("UNAVAILABLE", "backbone is draining", drama_code="not_ready")
        if job.session_id in self._sessions:
            raise GenerateError("ALREADY_EXISTS", f"session {job.session_id!r} is already running",
                                param="session_id")
        check_context(job.prompt, self.engine.max_context - job.sampling.max_new_tokens)
        if len(self._queue) >= self.max_queue:
            raise GenerateError("RESOURCE_EXHAUSTED", f"admission queue full ({self.max_queue})",
                                drama_code="queue_full")
        session = Session(job, submitted=time.monotonic())
        self._sessions[job.session_id] = session
        self._queue.append(session)
        self._wake.set()
        return session

    def cancel(self, session: Session) -> None:
        """The caller went away: the session leaves the batch at the next step (no-op when done)."""
        if session.state != "done":
            session.cancelled = True
            self._wake.set()

    async def events(self, session: Session
                     ) -> AsyncIterator[Started | PrefillDone | FramesOut | ChunkEnd | Usage]:
        """The session's events in order; raises its GenerateError if it fails."""
        while True:
            item = await session.outbox.get()
            if item is _END:
                return
            if isinstance(item, GenerateError):
                raise item
            if isinstance(item, FramesOut):
                session.buffered_frames -= item.codes.shape[0]
                if session.paused and session.buffered_frames <= self.session_buffer_frames // 2:
                    self._nudge()
            yield item

    def tower_lost(self) -> None:
        """Called by the tower client when the Step stream breaks (from the event loop)."""
        self._tower_lost = True
        self._nudge()

    def wake(self) -> None:
        self._nudge()

    def _nudge(self) -> None:
        """Wake the main loop and the lane (something they wait for may have changed)."""
        self._wake.set()
        self._lane_wake.set()

    # ---- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                if self._tower_lost:
                    self._fail_tower_sessions()
                self._reap()
                self._admit()
                if self._inflight and self._inflight[0].result.done():
                    if self._unfinished is not None and self._unfinished.inflight is self._inflight[0]:
                        self._finish_chained()     # its slots are free before its sessions move on
                    self._finish_step(self._inflight.popleft())
                    continue
                # A computed lane step waiting for a place goes first (see the module docstring).
                if self.tower.ready and self._free_places() > 0 and not self._lane_waiting:
                    entries = self._plan()
                    # A message with only releases goes out when nothing else will carry them.
                    if entries or (self._release and not self._inflight):
                        self._finish_chained()
                        await self._start_step(entries)
                        continue
                chained = self._plan_chained()
                if chained is not None:
                    self._finish_chained()
                    if all(e.session.state == "active" for e in chained[0]):
                        await self._start_step(chained[0], fill_from=chained[1])
                    else:   # the step before failed meanwhile (its frames never came): plan again
                        for e in chained[0]:
                            e.session.in_step = e.session.chained = False
                    continue
                await self._sleep()
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug here must not silently stop every stream
                log.exception("scheduler step failed")
                for session in list(self._active):
                    self._end(session, GenerateError("INTERNAL", "backbone scheduler error"))

    def _steps_inline(self) -> bool:
        """Does the main loop's next step run on the loop's thread (see inline_steps)?"""
        if self.inline_steps is not None:
            return self.inline_steps
        if not self._on_cuda or self._inflight_limit() != 1:
            return False
        # The lane plans its next piece on the loop: while prompts are prefilling, a step on the
        # loop's thread would hold the lane's next piece back for a whole step (at 128 streams
        # on the H200 the prompts took +34 ms to compute, TTFA p99 693 against 606 ms).
        return not (self.prefill_lane and any(s.prefilling for s in self._active))

    def _inflight_limit(self) -> int:
        return max(1, min(self.max_inflight_steps, self.tower.max_inflight_steps))

    def _free_places(self) -> int:
        """Steps that may still go to the tower: the limit less those in flight and those on
        their way (a main-loop step from its plan on, a lane step once computed)."""
        return self._inflight_limit() - len(self._inflight) - self._claimed

    async def _sleep(self) -> None:
        """Wait for a wake-up, a response (each step's result sets `_wake` when done, see `_send`)
        or the poll interval (queue timeouts). The loop's own task waits on the event: an
        asyncio.wait over a new `_wake.wait()` task and the oldest result cost a task per sleep
        and one more trip through the event loop between a frame's arrival and its routing.

        With `spin_wait_s` and a step at the tower, a Spinner keeps the loop busy for up to that
        long instead of letting it sleep in epoll, so the response is routed on the loop's next
        turn (services.common.aio.Spinner says why; bench/hops.py measures it)."""
        self._wake.clear()
        spinning = self._spinner is not None and bool(self._inflight)
        if spinning:
            self._spinner.start()
        timer = asyncio.get_running_loop().call_later(self.idle_poll_s, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
            if spinning:
                self._spinner.stop()

    def _reap(self) -> None:
        """End cancelled sessions and sessions past their deadline (queued ones too)."""
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if session.cancelled:
                self._end(session, None)
            elif session.job.deadline is not None and now > session.job.deadline:
                self._end(session, GenerateError("DEADLINE_EXCEEDED", "deadline exceeded"))

    def _admit(self) -> None:
        now = time.monotonic()
        while self._queue:
            session = self._queue[0]
            if session.state != "queued":          # ended while queued
                self._queue.popleft()
                continue
            timeout = session.job.queue_timeout_s
            if timeout is not None and now - session.submitted > timeout:
                self._queue.popleft()
                self._end(session, GenerateError(
                    "RESOURCE_EXHAUSTED", f"waited more than {timeout:.3f} s for admission",
                    drama_code="queue_timeout"))
                continue
            if self.engine.free_slots <= 0 or len(self._active) >= self.max_rows:
                # The head waits; later ones still need their queue timeouts checked.
                for waiting in list(self._queue)[1:]:
                    t = waiting.job.queue_timeout_s
                    if waiting.state == "queued" and t is not None and now - waiting.submitted > t:
                        self._queue.remove(waiting)
                        self._end(waiting, GenerateError(
                            "RESOURCE_EXHAUSTED", f"waited more than {t:.3f} s for admission",
                            drama_code="queue_timeout"))
                return
            self._queue.popleft()
            session.state = "active"
            self._active.append(session)
            self._start_chunk(session, previous_frames=None)
            session.outbox.put_nowait(Started(
                queue_wait_ms=int((now - session.submitted) * 1000),
                prompt_text_tokens=session.rows.n_text, prompt_audio_frames=session.rows.n_audio))
            self._milestone(session, "admitted")
            self._lane_wake.set()                  # a prompt to prefill

    def _start_chunk(self, session: Session, previous_frames: Tensor | None) -> None:
        """Open a fresh timeline (engine slot, rows from position 0, or from the end of the cached
        voice prefix) for the session's chunk."""
        job = session.job
        session.rows = plan_chunk(job.prompt, session.chunk_index, previous_frames,
                                  row_budget=self.engine.max_context - job.sampling.max_new_tokens,
                                  semantic_start_token_id=self.semantic_start_token_id)
        session.targets = row_targets(session.rows.frames)
        session.prefill_start_ns = 0
        self._open_timeline(session, restore=True)
        session.chunk_frames = []
        session.next_row = None
        session.emitted_in_chunk = 0
        session.text_tokens += session.rows.n_text
        session.audio_tokens += session.rows.n_audio

    def _open_timeline(self, session: Session, *, restore: bool) -> None:
        """A fresh slot for the current chunk's rows: from the prefix snapshot when `restore` and
        the cache holds it, else empty (then the prefix is stored on the way, when cacheable)."""
        session.timeline += 1
        session.sent = 0
        session.restore_prefix = session.store_prefix = session.awaiting_restore = session.chained = False
        prefix = self._cacheable_prefix(session)
        if prefix is not None:
            key, rows = prefix
            snapshot = self.prefix_cache.get(key) if restore else None
            if snapshot is not None and snapshot.length == rows:
                session.slot = self.engine.restore(snapshot)
                session.sent = rows
                session.restore_prefix = True
                return
            session.store_prefix = True
        session.slot = self.engine.open()

    def _cacheable_prefix(self, session: Session) -> tuple[str, int] | None:
        """(key, rows) of the chunk's `system` rows if the cache may hold them: some rows, a
        prompt that goes on after them, and no target on their last row (the tower's state then
        does not depend on the rows after the prefix, MODEL.md §5.4)."""
        system = session.job.prompt.system
        rows = len(system)
        if (self.prefix_cache is None or rows == 0 or rows >= len(session.rows)
                or (session.targets[rows - 1] >= 0).any()):
            return None
        if session.prefix is None:
            session.prefix = (prefix_key(self.model_identity, system.token_ids, system.frames), rows)
        return session.prefix

    def _prefill_without_restore(self, session: Session) -> None:
        """The tower lost the prefix snapshot: start the chunk over as a full prefill."""
        log.info("session %s: tower prefix snapshot gone, prefilling the whole prompt", session.id)
        self.prefix_fallbacks += 1
        self._fallbacks.add(1)
        self._release_slot(session.slot)
        self._open_timeline(session, restore=False)

    def _plan(self) -> list[_Entry]:
        """This step's entries: decode rows first (cadence), then prefill pieces FIFO. With the
        prefill lane: decode rows, at most a group's share of them, and one-row pieces only."""
        entries: list[_Entry] = []
        runnable = []
        now = time.monotonic()
        for session in self._active:
            if session.paused and session.buffered_frames <= self.session_buffer_frames // 2:
                session.paused = False
            if session.held_until > now:   # first-audio hold (a timer wakes the loop at its end)
                continue
            # A decoding session's frame has come back; one waiting for its frame is neither.
            # Prefill pieces need not wait for the previous piece's response: the stream keeps
            # their order, and only the last piece draws.
            if not session.paused and not session.in_step and (session.decoding or session.prefilling):
                runnable.append(session)
        limit = self.max_rows
        if self.prefill_lane:
            limit = min(limit, self._group_rows())
        elif self._inflight_limit() > 1 and not self._inflight:
            # Nothing is at the tower: send half now, so the engine computes the other half while
            # the tower works on this one; from then on the two groups alternate (API.md §3.5).
            limit = min(limit, (len(runnable) + 1) // 2)
        for session in runnable:
            if session.decoding and len(entries) < limit:
                frame = session.next_row.unsqueeze(0)
                row = Rows(frame[:, 0] + self.semantic_start_token_id, frame)
                # One shared targets row (only ever read), not a full_like per decode row. The
                # token id stays a torch add: through numpy (fewer µs warm) the planning of a
                # frame's row took ~80 µs against ~68 on the CPU tiny stack, just after the wake.
                entries.append(_Entry(session, row, self._no_targets, draw=True,
                                      timeline=session.timeline))
                session.in_step = True
        if self.prefill_lane:
            # The lane leaves a piece here only when it can be one row and nothing else; it costs
            # a decode row (a graph replay on the GPU). No spacing: it stalls nobody.
            for session in runnable:
                if (session.prefilling and self._piece_end(session) - session.sent == 1
                        and len(entries) < self.max_rows):
                    entries.append(self._piece(session, 1))
            return entries
        budget = self.step_prefill_rows
        # Not due while streams are past their prompt: decoding now, or waiting at the tower for
        # their frame (with two groups in flight, a prefill step in the other group delays them
        # just the same). Checked only inside the interval, so the default (0) costs nothing.
        if not self._prefill_due(now):
            budget = 0                       # no prefill piece: the prefill step is not due yet
        for session in runnable:
            if session.prefilling and len(entries) < limit and budget > 0:
                n = self._piece_rows(session)
                if n > budget:               # FIFO: it waits for the next step, uncut
                    break
                self._last_prefill_step = now
                budget -= n
                entries.append(self._piece(session, n))
        return entries

    def _piece_rows(self, session: Session) -> int:
        """Rows of the session's next prefill piece: its own grid only (prefill_chunk_tokens,
        capped by the step's budget, and the prefix cut), never what other sessions left of the
        step's budget. Why (issue #8, batch invariance): on the GPU a different cut of the same
        prompt changes bits (GDN chunks restart at each piece), so a session's pieces must be the
        same alone or beside any other prompt; a piece that does not fit what is left of a step
        waits for the next one whole."""
        return min(self._piece_end(session) - session.sent, self.prefill_chunk_tokens, self.step_prefill_rows)

    def _prefill_due(self, now: float) -> bool:
        """May a step with prefill pieces (a lane step) run now (prefill_interval_s)?"""
        return (now - self._last_prefill_step >= self.prefill_interval_s
                or not any(s.rows is not None and not s.prefilling for s in self._active))

    def _piece_end(self, session: Session) -> int:
        """Where the session's next prefill piece must end at the latest: the end of its prompt,
        or of the voice prefix while that is to be stored (a piece ends where the prefix does)."""
        prefix_rows = session.prefix[1] if session.prefix else 0
        if session.store_prefix and session.sent < prefix_rows:
            return prefix_rows
        return len(session.rows)

    def _piece(self, session: Session, n: int) -> _Entry:
        """The session's next n prompt rows as an entry (planned: `in_step` until it is sent)."""
        end = session.sent + n
        prefix_rows = session.prefix[1] if session.prefix else 0
        entry = _Entry(session, session.rows[session.sent:end], session.targets[session.sent:end],
                       draw=end == len(session.rows), timeline=session.timeline,
                       restore=session.restore_prefix,
                       store=session.store_prefix and end == prefix_rows)
        session.restore_prefix = False
        session.in_step = True
        if session.prefill_start_ns == 0:      # the prefill span starts with its first piece's plan
            session.prefill_start_ns = time.time_ns()
        return entry

    def _group_rows(self) -> int:
        """With the lane: the most decode rows in one group, ⌈sessions past their prompt /
        places at the tower⌉, so groups stay balanced while lane steps take places (otherwise the
        groups that wait behind a lane step merge into one, and pipelining is lost)."""
        past_prompt = sum(1 for s in self._active if s.rows is not None and not s.prefilling and not s.paused)
        return max(1, -(-past_prompt // self._inflight_limit()))

    def _plan_lane(self) -> list[_Entry]:
        """The next lane step: prefill pieces of two rows or more, FIFO, within the step's prefill
        row budget. A piece never leaves a one-row remainder when it can help it (a one-row
        piece goes with the decode rows, see `_plan`); a session restored from the voice prefix
        waits for the restore's answer before its next piece."""
        now = time.monotonic()
        if not self._prefill_due(now):
            return []
        budget, entries = self.step_prefill_rows, []
        for session in self._active:
            if budget < 2 or len(entries) >= self.max_rows:
                break
            if not session.prefilling or session.in_step or session.paused or session.awaiting_restore:
                continue
            left = self._piece_end(session) - session.sent
            if left < 2:
                continue
            n = self._piece_rows(session)
            if left - n == 1 and n > 2:
                n -= 1
            if n < 2:
                continue
            if n > budget:                   # FIFO: it waits for the next lane step, uncut
                break
            budget -= n
            entries.append(self._piece(session, n))
        if entries:
            self._last_prefill_step = now
        return entries

    def _plan_chained(self) -> tuple[list[_Entry], tuple[object, int]] | None:
        """The next decode step of the group at the tower, chained on its frames (chain_steps),
        and the (Mailbox, seq) its inputs come from; None when it may not be. It may when:
        - the tower client's hand-off passes frames back, the tower takes a second request, and
          this is the loop's only step in flight: an inline step (one step at a time otherwise)
          sent through that same hand-off, with no other place claimed;
        - its sessions (one entry each) are all the active ones, and none is queued: anyone else (a prompt to
          prefill, a session paused or held) waits for the group's next planned step, which
          comes only once a chain breaks;
        - each of its sessions goes on past that frame whatever it is: still on the entry's
          timeline, not chained already, room for two more frames within max_new_tokens and
          its buffer, no first-audio hold now or due with that frame (the step chained on it
          would run beside the codec's first chunk, which the hold is there to spare). Only an
          EOS can end its chunk there; then this step's answer is dropped with the old timeline
          (`_route`).
        The step before it may still be computing (a chained step is waited for only before the
        next launch, `_finish_chained`): its slots are the same, and it comes first on the stream."""
        if (not self.chain_steps or len(self._inflight) != 1 or self._claimed or self._lane_waiting
                or self._queue or not self.tower.ready or self.tower.max_inflight_steps < 2):
            return None
        last = self._inflight[0]
        mailbox = getattr(self.tower, "handoff", None)
        if (last.handoff is None or last.handoff[0] is not mailbox or not getattr(mailbox, "frames_ready", False)
                or last.result.done() or len(last.entries) != len(self._active) or not self._steps_inline()
                or not mailbox.can_publish(len(last.entries))):
            return None
        now = time.monotonic()
        for e in last.entries:
            s = e.session
            if (s.state != "active" or s.cancelled or e.timeline != s.timeline or s.chained or s.in_step
                    or s.paused or s.held_until > now or self._first_message_due(s)
                    or len(s.chunk_frames) + 2 > s.job.sampling.max_new_tokens
                    or s.buffered_frames + len(s.pending) + 2 >= self.session_buffer_frames):
                return None
        entries = []
        for e in last.entries:
            e.session.in_step = e.session.chained = True
            # the last entry's rows only stand in for the frame (engine.launch_to_host's fill)
            entries.append(_Entry(e.session, e.rows, self._no_targets, draw=True, timeline=e.timeline, chained=True))
        return entries, last.handoff

    def _first_message_due(self, session: Session) -> bool:
        """Does the session's frame at the tower complete its first frames message, which starts
        the first-audio hold (`_flush`)?"""
        return (self.first_audio_hold_s > 0 and session.chunk_index == 0 and session.messages_sent == 0
                and len(session.pending) + 1 >= session.job.first_message_frames)

    # ---- steps ------------------------------------------------------------------------------

    async def _start_step(self, entries: list[_Entry], fill_from: tuple[object, int] | None = None) -> None:
        """A main-loop step: compute the group's hidden rows and send them to the tower;
        `_finish_step` routes the response when it comes. `fill_from`: a chained step's
        (Mailbox, seq), see `_plan_chained`."""
        span = self._step_span(entries, lane=False)
        self._claimed += 1                    # its place at the tower is taken from now on
        try:
            if fill_from is not None:
                await self._compute_and_hand_off(entries, span, fill_from[0], fill_from[1])
                return
            mailbox = self._handoff_for(entries)
            if mailbox is not None:
                await self._compute_and_hand_off(entries, span, mailbox)
                return
            if entries:
                hidden = await self._compute_entries(entries, lane=False)
                if hidden is None:             # the step failed, its sessions have ended
                    if span is not None:
                        span.end()
                    return
                if span is not None:           # bench/timeline.py: where a frame's hops go
                    span.add_event("computed")
            else:   # a release-only message
                hidden = torch.empty(0, self.engine.hidden_size, dtype=self.engine.hidden_dtype)
            await self._send(entries, hidden, span, lane=False)
        finally:
            self._claimed -= 1

    def _handoff_for(self, entries: list[_Entry]):
        """The tower client's device hand-off (services/common/device_handoff.py), when this
        main-loop step may use it: an inline step (CUDA, one step in flight) of decode rows only
        (each entry one row that draws, no voice-prefix work) that fits its buffer; else None."""
        mailbox = getattr(self.tower, "handoff", None)
        if (mailbox is None or not entries or not self._steps_inline()
                or not all(e.draw and len(e.rows) == 1 and not (e.store or e.restore) for e in entries)
                or not mailbox.can_publish(len(entries))):
            return None
        return mailbox

    async def _compute_and_hand_off(self, entries: list[_Entry], span, mailbox, fill_seq: int = 0) -> None:
        """An inline decode step through the device hand-off: queue the step and its rows'
        publish, send the request at once (the tower queues its own step behind a wait for the
        rows, on its GPU stream), then wait for this step here. The bookkeeping of
        `_compute_entries` + `_send`, in that order but for the send. `fill_seq`: a chained
        step, whose rows' ids and codes come from the frames of step fill_seq (Mailbox.fill)."""
        work = [(e.session.slot, e.rows.token_ids, e.rows.frames) for e in entries]
        slots = {slot for slot, _, _ in work}
        self._computing |= slots
        fill = None
        if fill_seq:
            semantic_codes, residual_codes = self.engine.code_sizes
            fill = functools.partial(mailbox.fill, fill_seq, token_offset=self.semantic_start_token_id,
                                     semantic_codes=semantic_codes, residual_codes=residual_codes)
            self.chained_steps += 1
        try:
            pending = self._launch(work, publish=mailbox.publish, fill=fill)
        except Exception as exc:
            self._step_failed(entries, slots, exc)
            return
        try:
            await self._send(entries, pending[0].hidden, span, lane=False, handoff_seq=pending[0].published)
        except BaseException:                  # cancelled (close()), or a bug: no slot stays busy
            self._computing -= slots
            self._finish_quietly(pending)
            raise
        unfinished = _Unfinished(pending, entries, slots, mailbox, span, self._inflight[-1])
        if fill is not None:
            # Waited for before the next launch, not now: this step computes after the frames of
            # the step still at the tower, whose response the loop should route (frames out) the
            # moment it comes, not after this step's ~2.5 ms (TTFA +5 ms on the H200, session 26).
            self._unfinished = unfinished
            return
        self._finish_unfinished(unfinished)

    def _finish_chained(self) -> None:
        """Wait for the chained step not waited for yet, if any (before the next engine launch)."""
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is not None:
            self._finish_unfinished(unfinished)

    def _finish_unfinished(self, step: _Unfinished) -> None:
        """The end of `_compute_and_hand_off`: wait for the step; a chained step whose frames
        never came fails its sessions (UNAVAILABLE)."""
        try:
            self._finish(step.launched, [], lane=False)
            if any(e.chained for e in step.entries) and step.mailbox.fill_timed_out():
                raise TowerUnavailable("the tower's frames did not arrive through GPU memory")
        except Exception as exc:
            # sent already: its response is routed to sessions this ends (and so dropped)
            self._step_failed(step.entries, step.slots, exc)
            return
        self._computing -= step.slots
        self._free_held()
        for e in step.entries:      # a chained row's frame may have been routed meanwhile
            self._draw_row_milestone(e.session, "computed", ahead=int(e.chained and e.session.chained))
        if step.span is not None:
            step.span.add_event("computed")

    def _step_failed(self, entries: list[_Entry], slots: set[int], exc: Exception) -> None:
        """The engine raised on a step: its sessions end INTERNAL (UNAVAILABLE when the tower's
        frames never came)."""
        log.error("engine step failed", exc_info=exc)
        self._computing -= slots
        code = "UNAVAILABLE" if isinstance(exc, TowerUnavailable) else "INTERNAL"
        for e in entries:
            e.session.in_step = False
            self._end(e.session, GenerateError(code, f"backbone step failed: {exc}"))
        self._free_held()

    async def _run_lane(self) -> None:
        """The prefill lane's coroutine: plan a lane step, compute it on the lane's thread, wait
        for a place at the tower (before any new decode group), send it; again."""
        while True:
            entries: list[_Entry] = []
            try:
                self._lane_wake.clear()
                entries = self._plan_lane() if self.tower.ready else []
                if not entries:
                    await self._lane_sleep()
                    continue
                span = self._step_span(entries, lane=True)
                hidden = await self._compute_entries(entries, lane=True)
                if hidden is None:
                    if span is not None:
                        span.end()
                    continue
                if span is not None:           # bench/timeline.py: a chunk boundary's hand-offs
                    span.add_event("computed")
                self._lane_waiting = True
                try:
                    while True:
                        self._lane_wake.clear()
                        if self.tower.ready and self._free_places() > 0:
                            break
                        await self._lane_sleep()
                finally:
                    self._lane_waiting = False
                self._claimed += 1
                try:
                    await self._send(entries, hidden, span, lane=True)
                finally:
                    self._claimed -= 1
                self._wake.set()               # the main loop: a new step to wait for
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug here must not silently stop prefilling
                log.exception("prefill lane failed")
                for e in entries:
                    if e.session.in_step:
                        e.session.in_step = False
                        self._end(e.session, GenerateError("INTERNAL", "backbone scheduler error"))

    async def _lane_sleep(self) -> None:
        """Wait for a wake-up or the poll interval. aio.wait_event, not asyncio.wait_for:
        close() cancels the lane right after the main loop, whose last act may be `_finish_step`
        waking the lane (the answer to the final release-only step); wait_for then lost the
        cancel, the lane polled on and close() waited for it forever (a CI test hung in teardown)."""
        await aio.wait_event(self._lane_wake, self.idle_poll_s)

    def _step_span(self, entries: list[_Entry], *, lane: bool):
        """A sampled `backbone.step` span linked to the sessions' Generate spans, or None."""
        if not entries or random.random() >= self.step_span_sample:
            return None
        links = [trace.Link(e.session.job.span_context) for e in entries
                 if e.session.job.span_context is not None
                 and e.session.job.span_context.is_valid][:MAX_STEP_SPAN_LINKS]
        return _tracer.start_span("backbone.step", links=links, attributes={
            "drama.batch.rows": sum(len(e.rows) for e in entries),
            "drama.batch.sessions": len(entries), "drama.step.lane": lane,
            "drama.step.chained": any(e.chained for e in entries)})

    async def _compute_entries(self, entries: list[_Entry], *, lane: bool) -> Tensor | None:
        """The entries' hidden rows [sum of rows, H] on the host, computed on the main engine
        thread or the lane's; stores the voice-prefix snapshots of entries that end a prefix.
        None when the engine failed (the entries' sessions have ended INTERNAL)."""
        work = [(e.session.slot, e.rows.token_ids, e.rows.frames) for e in entries]
        store = [e for e in entries if e.store]
        slots = {slot for slot, _, _ in work}
        self._computing |= slots
        executor = self._lane_executor if lane else self._executor
        store_slots = [e.session.slot for e in store]
        try:
            if not lane and self._steps_inline():
                pending = self._launch(work)
                try:
                    # what the last routing queued (frames out) runs while the GPU computes
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    self._finish_quietly(pending)
                    raise
                hidden, snapshots = self._finish(pending, store_slots, lane)
            else:
                hidden, snapshots = await asyncio.get_running_loop().run_in_executor(
                    executor, self._compute, work, store_slots, lane)
        except asyncio.CancelledError:
            raise                              # close(): it waits for the thread, then frees
        except Exception as exc:
            self._step_failed(entries, slots, exc)
            return None
        self._computing -= slots
        self._free_held()
        for e in entries:
            if e.draw:
                self._draw_row_milestone(e.session, "computed")
        for e, snapshot in zip(store, snapshots):
            self.prefix_cache.put(e.session.prefix[0], snapshot)
            e.session.store_prefix = False
        return hidden

    async def _send(self, entries: list[_Entry], hidden: Tensor, span, *, lane: bool, handoff_seq: int = 0) -> None:
        """Send a computed step to the tower (with the releases so far). Entries whose session
        ended, or moved to a new timeline, while the step was computed are left out, except from
        a device hand-off (`handoff_seq`): its rows are published whole, and it is sent before
        any await, so none has."""
        keep = [handoff_seq > 0 or (e.session.state != "done" and e.timeline == e.session.timeline)
                for e in entries]
        for e in entries:
            e.session.in_step = False
        if entries and not any(keep):
            if span is not None:
                span.end()
            return                             # nothing left to send; releases go with the next step
        if not all(keep):
            # the kept entries' rows, sliced only now: a slice per entry costs ~2 us of host time
            parts, offset = [], 0
            for e, kept in zip(entries, keep):
                if kept:
                    parts.append(hidden[offset:offset + len(e.rows)])
                offset += len(e.rows)
            entries, hidden = [e for e, kept in zip(entries, keep) if kept], torch.cat(parts)
        tower_entries = []
        for e in entries:
            s = e.session
            key, rows = s.prefix if e.restore or e.store else ("", 0)
            tower_entries.append(TowerEntry(
                s.id, first_row=s.sent, n_rows=len(e.rows), draw=e.draw, take_index=s.chunk_index,
                frame_index=len(s.chunk_frames) + e.chained, sampling=s.job.sampling,
                prefix_key=key if e.restore else "", prefix_rows=rows if e.restore else 0,
                snapshot_key=key if e.store else ""))
            s.sent += len(e.rows)
            s.next_row = None
            s.tower_open = True
            if e.draw:
                self._draw_row_milestone(s, "sent", ahead=e.chained)
            if e.restore:
                s.awaiting_restore = True
        if len(entries) == 1:
            targets = entries[0].targets       # a single-stream step: no copy (~3 µs)
        elif entries:
            targets = torch.cat([e.targets for e in entries])
        else:
            targets = torch.empty(0, self.engine.num_codebooks, dtype=torch.int64)
        release, self._release = self._release, []
        trace_context: dict[str, str] = {}
        if span is not None:
            propagate.inject(trace_context, context=trace.set_span_in_context(span))
        step = TowerStep(tower_entries, hidden, targets, release, trace_context, handoff_seq)
        if self._spinner is not None:
            # the write's completion comes back through grpc's poller thread: with the loop
            # spinning it is seen on the next turn, not after the loop thread wakes up (the
            # spin then goes on in _sleep while the step is at the tower)
            self._spinner.start()
        try:
            result = await self.tower.send(step)
            if span is not None:
                span.add_event("sent")
        except Exception as exc:
            # Any failure to send is the step's: its sessions' rows count as sent and in_step is
            # cleared, so an exception escaping here would strand them (the lane's handler ends
            # only sessions still in_step): they would wait forever for a draw. As a failed
            # step, _finish_step ends every session the tower held (UNAVAILABLE).
            if not isinstance(exc, TowerUnavailable):
                log.exception("tower send failed")
                exc = TowerUnavailable(f"tower send failed: {type(exc).__name__}: {exc}")
            result = asyncio.get_running_loop().create_future()
            result.set_exception(exc)
        result.add_done_callback(self._result_done)
        handoff = (self.tower.handoff, handoff_seq) if handoff_seq else None
        self._inflight.append(_InFlight(entries, result, span, lane, handoff))
        self.lane_steps += lane
        self._lane_wake.set()                  # sessions sent on: the lane may plan their next piece

    def _result_done(self, _result: asyncio.Future) -> None:
        self._wake.set()                       # the main loop routes it (in request order)

    def _compute(self, work, store_slots: list[int], lane: bool):
        """On an engine thread (the main one, or the lane's): the step (timed here), snapshots of
        the slots that just ended a prefix, and the rows copied to the host. On CUDA with the
        lane each thread runs on its own stream; engine.finish waits for its stream's work, so the
        time includes the GPU's."""
        return self._finish(self._launch(work, lane), store_slots, lane)

    def _launch(self, work, lane: bool = False, publish=None, fill=None) -> tuple[PendingStep, float]:
        """Queue the step on this thread's stream (the lane's or the main one); `_finish` waits.
        `publish`, `fill`: the device hand-off's (engine.launch_to_host)."""
        stream = self._lane_stream if lane else self._main_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            started = time.perf_counter()
            # The rows come back on the host (pinned), copied on the step's stream: the event
            # loop never waits for a stream, and no other stream ever reads memory this one allocated.
            return self.engine.launch_to_host(work, publish=publish, fill=fill), started

    def _finish(self, launched: tuple[PendingStep, float], store_slots: list[int], lane: bool):
        pending, started = launched
        hidden = self.engine.finish(pending)
        elapsed = time.perf_counter() - started
        stream = self._lane_stream if lane else self._main_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            snapshots = [self.engine.snapshot(slot) for slot in store_slots]
        rows = sum(seg.count for seg in pending.segments)
        if lane:
            self._lane_step_seconds.record(elapsed)
            self._lane_batch_rows.record(rows)
        else:
            self._step_seconds.record(elapsed)
            self._batch_rows.record(rows)
        return hidden, snapshots

    def _finish_quietly(self, launched: tuple[PendingStep, float]) -> None:
        """Wait for a launched step whose caller was cancelled or failed: its slots must not stay busy."""
        try:
            self.engine.finish(launched[0])
        except Exception:
            log.exception("engine step failed while its caller was cancelled")

    def _finish_step(self, step: _InFlight) -> None:
        if step.span is not None:
            step.span.end()
        self._lane_wake.set()                  # a place at the tower is free again
        if step.result.cancelled() or isinstance(step.result.exception(), TowerUnavailable):
            self._fail_tower_sessions()
            return
        self._route(step.entries, step.result.result())

    def _route(self, entries: list[_Entry], result: TowerResult) -> None:
        codes = result.codes
        if codes.dtype != torch.int64:         # cast once per step, not per frame (~2.5 µs a frame)
            codes = codes.to(torch.int64)
        for index, e in enumerate(entries):
            session = e.session
            if session.state == "done":
                continue
            if session.cancelled:          # left while its rows were in flight
                self._end(session, None)
                continue
            if e.timeline != session.timeline:   # abandoned by a prefix fallback
                continue
            if e.restore:
                session.awaiting_restore = False
            if index in result.row_errors:
                error = result.row_errors[index]
                if error.status == "FAILED_PRECONDITION":
                    if e.restore:
                        self._prefill_without_restore(session)
                        continue
                    error = GenerateError("INTERNAL", error.message)
                self._end(session, error)
                continue
            if e.restore:                      # the tower restored too: these rows were skipped
                self.prefix_rows_skipped += session.prefix[1]
                self._rows_skipped.add(session.prefix[1])
            if not e.draw:
                continue
            if not session.chunk_frames:   # the draw that ends the prefill
                session.outbox.put_nowait(PrefillDone(session.chunk_index, len(session.rows),
                                                      session.prefill_start_ns, time.time_ns()))
            if result.stop[index]:
                self._end_chunk(session, "STOP")
                continue
            frame = codes[index]
            session.chunk_frames.append(frame)
            if len(session.chunk_frames) <= 2:
                self._milestone(session, ("first_frame", "second_frame")[len(session.chunk_frames) - 1])
            session.output_tokens += 1
            self._buffer(session, frame)
            if len(session.chunk_frames) >= session.job.sampling.max_new_tokens:
                self._end_chunk(session, "LENGTH")   # emitted; its row is never appended
            elif session.chained:
                session.chained = False        # its row is on its way already (a chained step)
            else:
                session.next_row = frame

    # ---- output -----------------------------------------------------------------------------

    def _milestone(self, session: Session, phase: str) -> None:
        """Submission -> now into drama_backbone_first_audio_seconds{phase} and a `first_audio.<phase>`
        event on the Generate span, once per phase, for the first chunk only (later chunks start
        from a running session, not a request)."""
        if session.chunk_index == 0 and phase not in session.milestones:
            session.milestones.add(phase)
            self._first_audio_seconds.record(time.monotonic() - session.submitted, {"phase": phase})
            # also on the request's trace, so one request's hops line up across the stages
            # (bench/timeline.py reads them back from exported spans)
            if session.job.span is not None:
                session.job.span.add_event(f"first_audio.{phase}")

    def _draw_row_milestone(self, session: Session, event: str, ahead: int = 0) -> None:
        """`event` ("computed" or "sent") of a row that draws a frame: the prompt's last row
        before any frame, the first frame's row after it; later rows are no milestone. `ahead`:
        frames at the tower before this row's (1 for a chained step's)."""
        frames = len(session.chunk_frames) + ahead
        if frames < 2:
            self._milestone(session, ("prompt_", "first_decode_")[frames] + event)

    def _buffer(self, session: Session, frame: Tensor) -> None:
        session.pending.append(frame)
        want = (session.job.first_message_frames if session.messages_sent == 0
                else session.job.message_frames)
        if len(session.pending) >= want:
            self._flush(session)
        if session.buffered_frames + len(session.pending) >= self.session_buffer_frames:
            session.paused = True

    def _flush(self, session: Session) -> None:
        if not session.pending:
            return
        codes = torch.stack(session.pending)
        session.outbox.put_nowait(FramesOut(session.chunk_index, session.emitted_in_chunk, codes))
        if session.messages_sent == 0:
            self._milestone(session, "first_message")
            if session.chunk_index == 0 and self.first_audio_hold_s > 0:
                session.held_until = time.monotonic() + self.first_audio_hold_s
                asyncio.get_running_loop().call_later(self.first_audio_hold_s, self._nudge)
        session.emitted_in_chunk += len(session.pending)
        session.buffered_frames += len(session.pending)
        session.messages_sent += 1
        session.pending = []

    def _end_chunk(self, session: Session, reason: str) -> None:
        self._flush(session)
        n_frames = len(session.chunk_frames)
        session.outbox.put_nowait(ChunkEnd(session.chunk_index, n_frames, reason))
        self._close_timeline(session)
        if session.chunk_index + 1 < len(session.job.prompt.user_turns):
            previous = (torch.stack(session.chunk_frames).T if n_frames
                        else torch.empty(self.engine.num_codebooks, 0, dtype=torch.int64))
            session.chunk_index += 1
            self._start_chunk(session, previous)
        else:
            self._end(session, None)

    def _close_timeline(self, session: Session) -> None:
        if session.slot is not None:
            self._release_slot(session.slot)
            session.slot = None
        if session.tower_open:
            self._release.append(session.id)
            session.tower_open = False

    def _end(self, session: Session, error: GenerateError | None) -> None:
        """Finish a session: free both stages' state, then Usage + end, or the error."""
        if session.state == "done":
            return
        self._close_timeline(session)
        if session in self._active:
            self._active.remove(session)
        if session.state == "queued":
            try:
                self._queue.remove(session)
            except ValueError:
                pass
        session.state = "done"
        self._sessions.pop(session.id, None)
        if error is not None:
            session.outbox.put_nowait(error)
        elif not session.cancelled:
            session.outbox.put_nowait(Usage(session.text_tokens, session.audio_tokens,
                                            session.output_tokens))
        session.outbox.put_nowait(_END)
        self._nudge()

    def _release_slot(self, slot: int) -> None:
        """Free an engine slot, or, while an engine call uses it, once that call has ended (the
        call may still snapshot it, and the slot must not be opened for someone else before)."""
        if slot in self._computing:
            self._held.append(slot)
        else:
            self.engine.release(slot)

    def _free_held(self) -> None:
        held, self._held = self._held, []
        for slot in held:
            self._release_slot(slot)

    def _fail_tower_sessions(self) -> None:
        """The Step stream broke: its state is gone, so every session that had some fails."""
        self._tower_lost = False
        self._release = []
        for session in list(self._active):
            if session.tower_open:
                session.tower_open = False    # nothing to release on a new stream
                self._end(session, GenerateError("UNAVAILABLE", "lost the tower stream"))

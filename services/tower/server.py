"""The Tower gRPC service (API.md §3.5): GetInfo and the Step bidi stream, thin over the engine.

Each StepRequest becomes one `TowerEngine.step` call, run right on the event loop's thread, and
its StepResponse goes back before the next request is read, so responses come in request order
and the backbone may have up to `max_inflight_steps` requests written ahead (HTTP/2 flow control
holds the rest). Why not a worker thread: the tower process serves nothing else while a step
runs (health checks wait a step at most), and the two hand-offs a worker costs per frame (loop to
worker, worker back to loop) cost ~0.3 ms of a frame's ~2.3 ms of hops on the CPU stack
(docs/perf.md, session 5). The engine is touched by this one thread only. Tower state is keyed
by the stream, and a closed stream frees all of it.

The same Step stream also runs over the same-host lane (services/common/local_lane.py): a Unix
socket, named in `TowerInfo.step_socket`, carrying the same messages without grpc's threads
(~0.5 ms a frame on the H200 host). A connection there is a Step stream in every way, and a
backbone that cannot reach the socket uses the gRPC stream. On one GPU under MPS a lane connection
may also take a decode step's rows through GPU memory (services/common/device_handoff.py): the
request carries a sequence number instead of the rows, and the step waits for them on the GPU.

Rules a client codes against (API.md §3.5, with our reading where it is silent):
- an entry's rows all run every layer with their given targets (-1 = none), except that a draw
  entry's last row is the draw row: its target must be -1 and its frame is drawn here;
- so the last prefill piece of a timeline is the entry that draws the first frame;
- `first_row == 0` starts a new timeline for that session id (replacing any old one);
- `repetition_penalty` 0 (unset) means 1.0, off;
- `prefix_key`/`snapshot_key` restore/store voice-prefix snapshots (engine.py), which any stream
  may use; an evicted one is the row error FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from opentelemetry import metrics, trace

from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from services.common import device_handoff, grpcutil, local_lane
from services.common.aio import Spinner
from services.common.telemetry import STEP_SECONDS_BUCKETS, extract_context
from services.common.tensors import DTYPE_NAMES, tensor_from_bytes, tensor_to_bytes
from services.tower.engine import StepEntry, StepResult, TowerEngine

log = logging.getLogger(__name__)

SERVICE_NAME = "drama.tower.v1.Tower"

# API.md §1.7; a no-op until a MeterProvider is set (telemetry.setup_telemetry when exporting).
_step_seconds = metrics.get_meter("services.tower").create_histogram(
    "drama_tower_step_seconds", unit="s", description="tower time per Step request (all its rows)",
    explicit_bucket_boundaries_advisory=STEP_SECONDS_BUCKETS)


# --------------------------------------------------------------------------------------------
# protobuf <-> engine
# --------------------------------------------------------------------------------------------

def entries_from_request(request: tower_pb2.StepRequest) -> list[StepEntry]:
    return [StepEntry(session_id=r.session_id, first_row=r.first_row, n_rows=r.n_rows, draw=r.draw,
                      take_index=r.take_index, frame_index=r.frame_index, seed=r.seed,
                      temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                      repetition_penalty=r.repetition_penalty, prefix_key=r.prefix_key,
                      prefix_rows=r.prefix_rows, snapshot_key=r.snapshot_key)
            for r in request.rows]


def response_from_result(step_id: int, result: StepResult) -> tower_pb2.StepResponse:
    return tower_pb2.StepResponse(
        step_id=step_id, codes=tensor_to_bytes(result.codes, torch.int16), stop=result.stop,
        row_errors=[tower_pb2.RowError(row_index=e.row_index, code=grpc.StatusCode[e.code].value[0],
                                       message=e.message) for e in result.row_errors],
        tower_us=result.tower_us)


def run_step(engine: TowerEngine, request: tower_pb2.StepRequest, hidden_dtype: str,
             owner, inbox: device_handoff.Inbox | None = None) -> tower_pb2.StepResponse:
    """Decode, step, encode (on the event loop's thread: module docstring). `inbox`: the
    connection's device hand-off, where a request with handoff_seq has its rows and, when it
    takes frames, gets the step's frames back before the response, whatever became of the step
    (a backbone step may be waiting for them on the GPU)."""
    frames_out = _FramesOut(inbox, request.handoff_seq, len(request.rows)) if request.handoff_seq else None
    result = None
    try:
        result = _run_step(engine, request, hidden_dtype, owner, inbox, frames_out)
        return response_from_result(request.step_id, result)
    finally:
        if frames_out is not None and not frames_out.published:
            frames_out.publish_result(result, engine.cfg.num_codebooks)


class _FramesOut:
    """A hand-off step's frames on their way back to the backbone's buffer (Inbox.publish_frames):
    from the step's device output when the engine hands it over (`__call__`), else from the
    result on the host, or rows of -1 that stopped for a step that never ran."""

    def __init__(self, inbox: device_handoff.Inbox | None, seq: int, n_entries: int):
        self.inbox, self.seq, self.n_entries = inbox, seq, n_entries
        self.published = inbox is None or not inbox.frames_ready    # nothing to publish

    def __call__(self, frames: torch.Tensor) -> None:
        self.inbox.publish_frames(self.seq, frames)
        self.published = True

    def publish_result(self, result: StepResult | None, codebooks: int) -> None:
        rows = min(max(self.n_entries, 1), self.inbox.rows)
        frames = torch.full((rows, codebooks + 1), -1, dtype=torch.int64)
        frames[:, codebooks] = 1
        if result is not None:        # a row that failed counts as stopped too
            n = min(rows, result.codes.shape[0])
            frames[:n, :codebooks] = result.codes[:n]
            frames[:n, codebooks] = torch.tensor(result.stop[:n], dtype=torch.int64)
            for error in result.row_errors:
                if error.row_index < n:
                    frames[error.row_index, codebooks] = 1
        try:
            self(frames.to(self.inbox.device))
        except Exception:    # the backbone's wait gives up on its own (device_handoff.RECEIVE_TIMEOUT_S)
            log.exception("could not publish a hand-off step's frames")


def _run_step(engine: TowerEngine, request: tower_pb2.StepRequest, hidden_dtype: str, owner,
              inbox: device_handoff.Inbox | None, frames_out: "_FramesOut | None") -> StepResult:
    entries = entries_from_request(request)
    rows = sum(max(e.n_rows, 0) for e in entries)
    codebooks = engine.cfg.num_codebooks
    try:
        targets = tensor_from_bytes(request.targets, "int16", (rows, codebooks))
        if request.handoff_seq:
            hidden = _handed_off_rows(request, entries, rows, inbox)
        else:
            hidden = tensor_from_bytes(request.hidden, hidden_dtype, (rows, engine.model.hidden_size))
    except ValueError as exc:
        engine.release(request.release, owner)
        return StepResult.all_failed(len(entries), codebooks, "INVALID_ARGUMENT", f"payload: {exc}")
    # A sampled backbone step sends its span context; our span joins that trace (API.md §3.6).
    span = contextlib.nullcontext()
    if request.trace_context:
        span = trace.get_tracer("services.tower").start_as_current_span(
            "tower.step", context=extract_context(request.trace_context),
            attributes={"drama.batch.rows": rows, "drama.batch.entries": len(entries)})
    started = time.perf_counter()
    with span:
        result = engine.step(entries, hidden, targets, release=list(request.release), owner=owner,
                             publish=None if frames_out is None or frames_out.published else frames_out)
    # engine.step copies the drawn codes to the host, which waits for the GPU, so a step with a
    # draw is timed with its device work; a prefill-only step returns once its work is queued,
    # and that work shows in the next step's time.
    _step_seconds.record(time.perf_counter() - started)
    if request.handoff_seq and inbox.timed_out():
        # the rows never came (the backbone died mid-step?): what ran on them is not a frame
        result = StepResult.all_failed(len(entries), codebooks, "UNAVAILABLE",
                                       "the backbone's rows did not arrive through GPU memory")
    return result


def _handed_off_rows(request: tower_pb2.StepRequest, entries: list[StepEntry], rows: int,
                     inbox: device_handoff.Inbox | None) -> torch.Tensor:
    """A hand-off request's rows, waited for on the GPU (ValueError: not a valid one). Every
    entry must draw: its codes come back only after the GPU has run the wait, so the wait's
    outcome is known before the response, and the backbone may reuse the slot after it."""
    if inbox is None:
        raise ValueError("rows in GPU memory on a connection without a device hand-off")
    if request.hidden:
        raise ValueError("a hand-off request carries no hidden bytes")
    if not entries or not all(e.draw for e in entries):
        raise ValueError("a hand-off request's entries must all draw")
    return inbox.receive(request.handoff_seq, rows)


def set_up_handoff(engine: TowerEngine, request: tower_pb2.StepRequest) -> device_handoff.Inbox | None:
    """Map the backbone's buffer named in a set-up request; None (logged) if it cannot be."""
    if request.rows or request.hidden:
        log.warning("Step lane: a device hand-off set-up with rows in it, refused")
        return None
    if not device_handoff.enabled(engine.device):
        log.info("Step lane: a device hand-off asked for, but this tower is not on a GPU under MPS")
        return None
    try:
        inbox = device_handoff.Inbox(request.handoff_handle, request.handoff_rows, request.handoff_slots,
                                     engine.model.hidden_size, engine.hidden_dtype, engine.device,
                                     code_columns=request.handoff_code_columns)
    except device_handoff.HandoffError as exc:
        log.warning("Step lane: no device hand-off (%s); rows come in the requests", exc)
        return None
    columns = device_handoff.frame_columns(engine.cfg.num_codebooks)   # as TowerEngine.step publishes them
    inbox.frames_ready = request.handoff_code_columns == columns
    if request.handoff_code_columns and not inbox.frames_ready:
        log.warning("Step lane: frames of %d columns asked for, this tower's have %d: frames go in the responses only",
                    request.handoff_code_columns, columns)
    return inbox


# --------------------------------------------------------------------------------------------
# the servicer
# --------------------------------------------------------------------------------------------

class StepFailed(Exception):
    """A step raised (a bug or a device error): the stream, and its sessions, end."""


class TowerServicer(tower_pb2_grpc.TowerServicer):
    """The engine is attached once loaded and warmed; until then calls answer UNAVAILABLE."""

    def __init__(self, *, max_inflight_steps: int = 2, build: str = "", spin_wait_s: float = 0.0,
                 step_socket: str = ""):
        self.engine: TowerEngine | None = None
        # after a response, spin the event loop this long while the stream's next request is due
        # (services.common.aio.Spinner: the request runs on the loop's next turn, not after the
        # loop thread wakes up); 0 never spins. `python -m services.tower` gives 10 ms on CUDA
        # (services.common.aio.spin_wait_s).
        self.spin_wait_s = spin_wait_s
        self.hidden_dtype = ""
        self.max_inflight_steps = max_inflight_steps
        self.build = build
        # the same-host lane's socket ("" none; serve() listens there once the engine is warm)
        self.step_socket = step_socket
        self.instance_id = uuid.uuid4().hex
        self.lane_server: asyncio.AbstractServer | None = None
        # loads the engine (and warms it up) off the event loop
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tower-load")

    def attach(self, engine: TowerEngine, hidden_dtype: str) -> None:
        self.engine, self.hidden_dtype = engine, hidden_dtype

    async def _require_engine(self, context) -> TowerEngine:
        if self.engine is None:
            await grpcutil.abort(context, grpc.StatusCode.UNAVAILABLE, "tower is loading",
                                 drama_code="not_ready")
        return self.engine

    def info(self, engine: TowerEngine) -> tower_pb2.TowerInfo:
        return tower_pb2.TowerInfo(
            hidden_dim=engine.model.hidden_size, hidden_dtype=self.hidden_dtype,
            codebooks=engine.cfg.num_codebooks, max_rows=engine.max_sessions,
            max_context_tokens=engine.max_context, max_inflight_steps=self.max_inflight_steps,
            open_sessions=engine.open_sessions, free_slots=engine.free_slots, build=self.build,
            step_socket=self.step_socket if self.lane_server is not None else "",
            instance_id=self.instance_id)

    async def GetInfo(self, request: tower_pb2.GetInfoRequest, context) -> tower_pb2.TowerInfo:
        return self.info(await self._require_engine(context))

    async def steps(self, engine: TowerEngine, requests, *, lane: bool = False):
        """One Step stream, over gRPC or the lane: a response per request, in order; the stream's
        sessions are freed when it ends. Raises StepFailed when a step raises. `lane`: the
        stream may set up a device hand-off (gRPC's never does: another host, maybe)."""
        owner = object()          # this stream's sessions
        spinner = Spinner(self.spin_wait_s) if self.spin_wait_s > 0 else None
        inbox: device_handoff.Inbox | None = None
        try:
            async for request in requests:
                if spinner is not None:
                    spinner.stop()
                if request.handoff_handle:
                    if inbox is None and lane:
                        inbox = set_up_handoff(engine, request)
                    if spinner is not None:
                        spinner.start()
                    yield tower_pb2.StepResponse(step_id=request.step_id, handoff_ready=inbox is not None,
                                                 handoff_frames_ready=inbox is not None and inbox.frames_ready)
                    continue
                try:
                    response = run_step(engine, request, self.hidden_dtype, owner, inbox)
                except Exception as exc:
                    log.exception("tower step failed")
                    raise StepFailed(f"tower step failed: {exc!r}") from exc
                if spinner is not None:
                    # before the yield: grpc.aio resumes this generator only once the response's
                    # write has completed, and that completion, like the next request, comes
                    # through grpc's poller thread; spinning, the loop sees both on its next turn
                    # (over the lane, the next request on the socket the same way)
                    spinner.start()
                yield response
        finally:
            if spinner is not None:
                spinner.close()
            engine.release_owner(owner)
            if inbox is not None:
                inbox.close()

    async def Step(self, request_iterator, context):
        engine = await self._require_engine(context)
        responses = self.steps(engine, request_iterator)
        try:
            async for response in responses:
                yield response
        except StepFailed as exc:
            await grpcutil.abort(context, grpc.StatusCode.INTERNAL, str(exc))
        finally:
            await responses.aclose()

    async def lane_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection of the same-host lane: the hello (this TowerInfo), then a Step stream."""
        engine = self.engine
        hello = self.info(engine)
        if device_handoff.enabled(engine.device):
            hello.device_uuid = device_handoff.device_uuid(engine.device)
        try:
            ring = local_lane.Ring(self.step_socket)     # large requests come through it
            hello.step_ring = ring.name
        except OSError as exc:
            log.warning("Step lane: no shared memory for this connection (%s); its requests come "
                        "through the socket", exc)
            ring = None

        responses = self.steps(engine, local_lane.read_requests(reader, tower_pb2.StepRequest, ring), lane=True)
        try:
            writer.write(local_lane.encode(hello))
            async for response in responses:
                writer.write(local_lane.encode(response))
                await writer.drain()          # at once unless the socket's buffer is full
        except (local_lane.LaneError, StepFailed, ConnectionError) as exc:
            log.warning("Step lane connection ended: %s", exc)
        finally:
            await responses.aclose()
            writer.close()
            if ring is not None:
                ring.close()

    async def start_lane(self) -> None:
        """Listen on the lane's socket; if that fails (another tower there, no permission) the
        tower serves the gRPC stream only, as with no lane (TowerInfo.step_socket stays empty)."""
        if self.step_socket and self.engine is not None:
            try:
                self.lane_server = await local_lane.serve(self.step_socket, self.lane_connection)
            except OSError as exc:
                log.warning("no Step lane at %s (%s): the Step stream is gRPC only", self.step_socket, exc)

    def close_lane(self) -> None:
        local_lane.close_server(self.lane_server, self.step_socket)
        self.lane_server = None


# --------------------------------------------------------------------------------------------
# serve()
# --------------------------------------------------------------------------------------------

def build_string(device: str) -> str:
    try:
        from importlib.metadata import version
        ours = version("dramaturg")
    except Exception:   # not installed as a package (a bare checkout)
        ours = "unknown"
    return f"dramaturg {ours} tower, torch {torch.__version__}, {device}"


async def serve(checkpoint: str, *, host: str = "127.0.0.1", port: int = 50052, device: str = "cpu",
                max_sessions: int = 64, max_context: int = 8192, max_inflight_steps: int = 2,
                prefix_cache_mb: float | None = None, spin_wait_s: float = 0.0, step_socket: str = "",
                ready: asyncio.Event | None = None, model=None, cfg=None):
    """Start listening (NOT_SERVING), load and warm the tower, then SERVING.

    Returns (server, port, health, servicer). `model`/`cfg` skip loading from `checkpoint`
    (tests with random weights). `prefix_cache_mb`: the voice-prefix snapshot budget (None: the
    device's default, 0: off). `step_socket`: the same-host lane's Unix socket ("" none),
    listening once the engine is warm; `servicer.close_lane()` closes it.
    """
    servicer = TowerServicer(max_inflight_steps=max_inflight_steps, build=build_string(device),
                             spin_wait_s=spin_wait_s, step_socket=step_socket)
    server, bound, health = await grpcutil.start_server(
        add_servicers=[lambda s: tower_pb2_grpc.add_TowerServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME], host=host, port=port, max_message_mb=16)
    loop = asyncio.get_running_loop()

    def load() -> TowerEngine:
        from services.common.config import load_config
        from services.tower.weights import load_tower

        nonlocal model, cfg
        if model is None:
            model = load_tower(checkpoint, device=device)
            cfg = load_config(checkpoint)
        engine = TowerEngine(model, cfg, max_sessions=max_sessions, max_context=max_context,
                             prefix_cache_mb=prefix_cache_mb)
        engine.warm_up()
        if device_handoff.enabled(engine.device):
            device_handoff.warm_up_handoff(engine.device, engine.model.hidden_size, engine.hidden_dtype,
                                           device_handoff.frame_columns(cfg.num_codebooks))
        return engine

    engine = await loop.run_in_executor(servicer.worker, load)
    hidden_dtype = DTYPE_NAMES[engine.hidden_dtype]
    servicer.attach(engine, hidden_dtype)
    await servicer.start_lane()
    await grpcutil.set_serving(health, True)
    log.info("tower serving on %s:%d (%s, %d sessions x %d rows)%s", host, bound, device, max_sessions,
             max_context, f", Step lane {step_socket}" if servicer.lane_server is not None else "")
    if ready is not None:
        ready.set()
    return server, bound, health, servicer

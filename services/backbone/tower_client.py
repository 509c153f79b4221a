"""The backbone's side of the long-lived Tower.Step stream (API.md §3.5).

`TowerClient` connects, checks `Tower.GetInfo` against the backbone (hidden size and dtype,
codebooks, a cache pool at least ours), opens the Step stream and keeps it for the process.
`send()` writes one StepRequest and returns a future for its result; responses come in request
order, so a FIFO of futures pairs them up and a single reader task resolves them. Up to the
tower's `max_inflight_steps` requests may be outstanding (the scheduler keeps to that).

When the stream breaks (tower killed, connection lost, a malformed response) every outstanding
step raises `TowerUnavailable`, `on_lost` tells the scheduler that all tower state is gone, the
client reports not ready, and it reconnects with exponential backoff (0.1 s doubling up to 5 s).
It is ready again once GetInfo matches and the new stream is open.

When the tower names a same-host lane (`TowerInfo.step_socket`, services/common/local_lane.py) and
the socket there answers with the same `instance_id`, the stream runs over it instead: the same
messages and rules, without grpc's threads (~0.5 ms a frame on the H200 host). A socket that is
not there (another host, another container) or that belongs to another tower leaves the gRPC
stream; `transport` says which one is in use.

Over the lane, when both stages are on one GPU under MPS (the hello's `device_uuid` is ours), the
client also sets up a device hand-off (services/common/device_handoff.py): `handoff` is then the
Mailbox where the scheduler publishes a decode step's rows, and a TowerStep with `handoff_seq`
goes out without them. The Mailbox has room for the steps' frames too; if the tower agrees
(`handoff_frames_ready`), it publishes them there, and the scheduler may chain the next decode
step on them (Mailbox.frames_ready).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import grpc
import torch

from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from services.backbone.scheduler import GenerateError, TowerResult, TowerStep, TowerUnavailable
from services.common import device_handoff, grpcutil, local_lane
from services.common.tensors import DTYPE_NAMES, tensor_from_bytes, tensor_to_bytes

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# TowerStep <-> protobuf
# --------------------------------------------------------------------------------------------

def step_request(step: TowerStep, step_id: int, hidden_dtype: torch.dtype) -> tower_pb2.StepRequest:
    rows = []
    for entry in step.entries:
        row = tower_pb2.RowEntry(session_id=entry.session_id, first_row=entry.first_row,
                                 n_rows=entry.n_rows, draw=entry.draw, prefix_key=entry.prefix_key,
                                 prefix_rows=entry.prefix_rows, snapshot_key=entry.snapshot_key)
        if entry.draw:
            s = entry.sampling
            row.take_index, row.frame_index, row.seed = entry.take_index, entry.frame_index, s.seed
            row.temperature, row.top_p, row.top_k = s.temperature, s.top_p, s.top_k
            row.repetition_penalty = s.repetition_penalty
        rows.append(row)
    request = tower_pb2.StepRequest(step_id=step_id, rows=rows, targets=tensor_to_bytes(step.targets, torch.int16))
    if step.handoff_seq:
        request.handoff_seq = step.handoff_seq       # the rows are in the device hand-off's buffer
    else:
        request.hidden = tensor_to_bytes(step.hidden, hidden_dtype)
    # set only when there is something to set: an empty map costs ~2 µs a step (most steps have
    # no releases and no trace context)
    if step.release:
        request.release.extend(step.release)
    if step.trace_context:
        request.trace_context.update(step.trace_context)
    return request


def step_result(response: tower_pb2.StepResponse, n_entries: int, codebooks: int) -> TowerResult:
    """Decode a StepResponse; a malformed one means the two stages disagree: TowerUnavailable."""
    if len(response.codes) != n_entries * codebooks * 2 or len(response.stop) != n_entries:
        raise TowerUnavailable(f"malformed StepResponse for {n_entries} entries "
                               f"({len(response.codes)} code bytes, {len(response.stop)} stops)")
    codes = tensor_from_bytes(response.codes, "int16", (n_entries, codebooks), cast=torch.int64)
    errors = {}
    for err in response.row_errors:
        # NOT_FOUND (the tower lost the session) goes to the caller as is; anything else means
        # the backbone built a bad row, which is our bug: INTERNAL.
        if err.code == grpc.StatusCode.NOT_FOUND.value[0]:
            errors[err.row_index] = GenerateError("NOT_FOUND", f"tower: {err.message}")
        elif err.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
            # a voice-prefix snapshot the tower no longer holds: the scheduler prefills instead
            errors[err.row_index] = GenerateError("FAILED_PRECONDITION", f"tower: {err.message}")
        else:
            errors[err.row_index] = GenerateError("INTERNAL", f"tower row error {err.code}: {err.message}")
    return TowerResult(codes=codes, stop=list(response.stop), row_errors=errors)


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------

class TowerClient:
    """One Step stream to the tower at `addr`, kept open (and reopened) for the process."""

    def __init__(self, addr: str, *, hidden_dim: int, hidden_dtype: torch.dtype, codebooks: int,
                 max_rows: int, max_context_tokens: int,
                 on_lost: Callable[[], None] | None = None,
                 on_ready: Callable[[bool], None] | None = None,
                 backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 info_timeout_s: float = 5.0, local_lane: bool = True, device: torch.device | str = "cpu"):
        self.addr = addr
        self.hidden_dim, self.hidden_dtype, self.codebooks = hidden_dim, hidden_dtype, codebooks
        self.max_rows, self.max_context_tokens = max_rows, max_context_tokens
        self.on_lost, self.on_ready = on_lost, on_ready
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.info_timeout_s = info_timeout_s
        self.use_local_lane = local_lane       # False: always the gRPC Step stream
        self.device = torch.device(device)     # the backbone's: a device hand-off needs the tower on it
        self.transport = ""                    # "lane" or "grpc" while connected
        self.handoff: device_handoff.Mailbox | None = None   # set up on a lane connection, if it can be
        self.info: tower_pb2.TowerInfo | None = None
        self.last_error: str | None = None
        self._ready = False
        self._ready_event = asyncio.Event()
        self._call = None
        # (future, step_id, entries, handoff_seq) per outstanding request, in wire order
        self._pending: collections.deque[tuple[asyncio.Future, int, int, int]] = collections.deque()
        self._write_lock = asyncio.Lock()
        self._broken = asyncio.Event()
        self._step_id = 0
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def max_inflight_steps(self) -> int:
        return max(1, self.info.max_inflight_steps) if self.info is not None else 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._maintain(), name="tower-client")

    async def wait_ready(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self._ready

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def mismatch(self, info: tower_pb2.TowerInfo) -> str | None:
        """Why this tower cannot serve this backbone, or None (API.md §3.5)."""
        want_dtype = DTYPE_NAMES.get(self.hidden_dtype, str(self.hidden_dtype))
        problems = []
        if info.hidden_dim != self.hidden_dim:
            problems.append(f"hidden_dim {info.hidden_dim} != {self.hidden_dim}")
        if info.hidden_dtype != want_dtype:
            problems.append(f"hidden_dtype {info.hidden_dtype!r} != {want_dtype!r}")
        if info.codebooks != self.codebooks:
            problems.append(f"codebooks {info.codebooks} != {self.codebooks}")
        if info.max_rows < self.max_rows:
            problems.append(f"tower max_rows {info.max_rows} < backbone {self.max_rows}")
        if info.max_context_tokens < self.max_context_tokens:
            problems.append(f"tower max_context_tokens {info.max_context_tokens} < "
                            f"backbone {self.max_context_tokens}")
        return "; ".join(problems) or None

    async def send(self, step: TowerStep) -> asyncio.Future:
        """Write one step; the returned future resolves to its TowerResult, or raises
        TowerUnavailable when the stream breaks first."""
        if not self._ready or self._broken.is_set():
            raise TowerUnavailable("tower not connected")
        call = self._call
        self._step_id += 1
        request = step_request(step, self._step_id, self.hidden_dtype)
        future = asyncio.get_running_loop().create_future()
        async with self._write_lock:   # the queue order is the wire order
            # the stream may have broken (and _maintain dropped the call) while we waited
            if call is None or call is not self._call or self._broken.is_set():
                raise TowerUnavailable("the Step stream broke")
            self._pending.append((future, request.step_id, len(step.entries), step.handoff_seq))
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, OSError) as exc:
                self._broken.set()
                raise TowerUnavailable(f"Step write failed: {exc}") from None
        return future

    async def step(self, step: TowerStep) -> TowerResult:
        """Send one step and wait for its result."""
        return await (await self.send(step))

    # ---- connection lifecycle ---------------------------------------------------------------

    async def _maintain(self) -> None:
        delay = self.backoff_min_s
        while True:
            channel = grpcutil.create_channel(self.addr)
            # The Step stream gets a channel without client interceptors. The tracing filter
            # leaves Step untraced anyway, but any interceptor on a channel makes grpc.aio proxy a
            # stream's writes through a queue, two new tasks and an asyncio.wait per message
            # (~0.2 ms a frame on the CPU tiny stack, hop stamps). Same target and options, so gRPC gives
            # both channels the same connection.
            step_channel = grpcutil.create_channel(self.addr, traced=False)
            reader = None
            try:
                info = await tower_pb2_grpc.TowerStub(channel).GetInfo(
                    tower_pb2.GetInfoRequest(), timeout=self.info_timeout_s)
                problem = self.mismatch(info)
                if problem:
                    raise _Refused(problem)
                self.info = info
                self._broken.clear()
                self._call, hello = await self._open_lane(info)
                self.transport = "grpc" if self._call is None else "lane"
                if self._call is None:
                    self._call = tower_pb2_grpc.TowerStub(step_channel).Step()
                else:
                    self.handoff = await self._set_up_handoff(self._call, hello)
                reader = asyncio.create_task(self._read(self._call), name="tower-reader")
                self._set_ready(True)
                log.info("tower %s connected (%s), Step stream over %s", self.addr, _describe(info),
                         "gRPC" if self.transport == "grpc" else f"the lane {info.step_socket}"
                         + (" (large requests through its shared memory)" if self._call.ring is not None
                            else " (no shared memory: every request through the socket)")
                         + (", decode steps' rows through GPU memory" if self.handoff is not None else "")
                         + (" and their frames back" if self.handoff is not None and self.handoff.frames_ready else ""))
                delay = self.backoff_min_s
                await self._broken.wait()
                log.warning("tower %s: Step stream lost", self.addr)
            except _Refused as exc:
                self.last_error = f"tower {self.addr} refused: {exc}"
                log.error("%s", self.last_error)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                self.last_error = f"tower {self.addr} unreachable: {_error_text(exc)}"
                log.debug("%s", self.last_error)
            finally:
                was_ready = self._ready
                self._set_ready(False)
                self._fail_pending()
                if reader is not None:
                    reader.cancel()
                if self._call is not None:
                    self._call.cancel()
                    self._call = None
                if self.handoff is not None:
                    # a decode step waiting on the GPU for the lost tower's frames goes on at once
                    # (its sessions fail with the stream), so close() waits for no 2 s timeout
                    self.handoff.abort()
                    self.handoff.close()
                    self.handoff = None
                self.transport = ""
                if was_ready and self.on_lost is not None:
                    self.on_lost()
                await step_channel.close()
                await channel.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _open_lane(self, info: tower_pb2.TowerInfo
                         ) -> tuple[local_lane.LaneCall | None, tower_pb2.TowerInfo | None]:
        """The tower's same-host lane and its hello, if it names one, we reach it, and it is the
        same tower; else (None, None)."""
        if not self.use_local_lane or not info.step_socket:
            return None, None
        try:
            call, hello = await local_lane.connect(info.step_socket, tower_pb2.TowerInfo,
                                                   tower_pb2.StepResponse, timeout_s=self.info_timeout_s)
        except (OSError, asyncio.TimeoutError, local_lane.LaneError) as exc:
            # another host or container: expected, so not a warning
            log.info("tower %s: Step lane %s not reachable (%s), using gRPC", self.addr, info.step_socket,
                     exc if str(exc) else type(exc).__name__)
            return None, None
        if hello.instance_id != info.instance_id:
            log.info("tower %s: %s belongs to another tower, using gRPC", self.addr, info.step_socket)
            call.cancel()
            return None, None
        return call, hello

    async def _set_up_handoff(self, call: local_lane.LaneCall,
                              hello: tower_pb2.TowerInfo) -> device_handoff.Mailbox | None:
        """A device hand-off with the tower behind `call`, before any step: when both stages say
        they can (one GPU, under MPS), a Mailbox of up to device_handoff.MAX_ROWS rows a step, its
        handle sent in a request with no rows; kept only if the tower answers handoff_ready."""
        if not hello.device_uuid or not device_handoff.enabled(self.device):
            return None
        if hello.device_uuid != device_handoff.device_uuid(self.device):
            log.info("tower %s is on another GPU: no device hand-off", self.addr)
            return None
        try:
            mailbox = device_handoff.Mailbox(min(self.max_rows, device_handoff.MAX_ROWS), self.hidden_dim,
                                             self.hidden_dtype, self.device,
                                             code_columns=device_handoff.frame_columns(self.codebooks))
        except device_handoff.HandoffError as exc:
            log.warning("no device hand-off (%s); decode steps' rows go through the lane", exc)
            return None
        self._step_id += 1
        try:
            await call.write(tower_pb2.StepRequest(step_id=self._step_id, handoff_handle=mailbox.handle,
                                                   handoff_rows=mailbox.rows, handoff_slots=mailbox.slots,
                                                   handoff_code_columns=mailbox.code_columns))
            response = await asyncio.wait_for(call.read(), self.info_timeout_s)
        except (OSError, asyncio.TimeoutError, local_lane.LaneError) as exc:
            mailbox.close()
            raise _Refused(f"the lane broke while setting up the device hand-off: {exc!r}") from None
        if response is grpc.aio.EOF or response.step_id != self._step_id or not response.handoff_ready:
            mailbox.close()
            log.info("tower %s declined the device hand-off; decode steps' rows go through the lane", self.addr)
            return None
        mailbox.frames_ready = response.handoff_frames_ready     # the way back too (scheduler: chained steps)
        return mailbox

    async def _read(self, call) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF or not self._pending:
                    break
                future, step_id, n_entries, handoff_seq = self._pending.popleft()
                if handoff_seq and self.handoff is not None:
                    self.handoff.answered(handoff_seq)
                try:
                    if response.step_id != step_id:
                        raise TowerUnavailable(f"StepResponse {response.step_id} for request {step_id}")
                    result = step_result(response, n_entries, self.codebooks)
                except TowerUnavailable as exc:
                    if not future.done():
                        future.set_exception(exc)
                    raise
                if not future.done():
                    future.set_result(result)
        except grpc.aio.AioRpcError as exc:
            self.last_error = f"Step stream: {_error_text(exc)}"
        except (local_lane.LaneError, OSError) as exc:
            self.last_error = f"Step lane: {exc!r}"
            log.error("tower %s: %s", self.addr, self.last_error)
        except TowerUnavailable as exc:      # the stages disagree: drop the stream, start over
            self.last_error = str(exc)
            log.error("tower %s: %s", self.addr, exc)
        finally:
            self._broken.set()
            self._fail_pending()

    def _fail_pending(self) -> None:
        while self._pending:
            future, _, _, _ = self._pending.popleft()
            if not future.done():
                future.set_exception(TowerUnavailable("the Step stream broke"))

    def _set_ready(self, ready: bool) -> None:
        if ready == self._ready:
            return
        self._ready = ready
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        if self.on_ready is not None:
            self.on_ready(ready)


class _Refused(Exception):
    """The tower answered GetInfo but cannot serve this backbone."""


def _describe(info: tower_pb2.TowerInfo) -> str:
    return (f"hidden {info.hidden_dim} {info.hidden_dtype}, {info.codebooks} codebooks, "
            f"pool {info.max_rows} x {info.max_context_tokens}")


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__

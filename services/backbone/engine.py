"""Sessions and batched steps over one Backbone (issue #4).

A session is a cache slot: `open()` hands out a free slot with zeroed state, `step(work)` appends
rows to any number of sessions in one forward and returns their final-norm hidden rows, and
`release(slot)` frees the slot. All cache memory is allocated once in __init__ (the pool), so a
running server never allocates per session.

Threads (the scheduler's prefill lane, scheduler.py): two `step` calls may run at once from two
threads on disjoint slots, e.g. a prefill step on the lane's thread and a decode step on the main
engine thread. A lock guards only the bookkeeping (open slots, lengths, the slots a step is
using); the forwards run outside it, so the two steps' GPU work overlaps. A slot is *busy* while
a step uses it: a second step on it is refused, and releasing it mid-step frees it only when the
step ends (it is not handed out again before). `open`, `release`, `restore`, `snapshot` may be
called from any thread meanwhile. The model's shared state (decode graphs, packed weights,
warm-up) is built before serving, never concurrently; the rotary table is built to max_context
here, so no forward grows it.
On CUDA the caller picks the stream (the current stream of its thread): `step` and `snapshot`
wait for their own stream's work before returning, so what they hand back and the slots they
touched are complete for any other stream; `open` and `restore` record an event after their
(asynchronous) reset or copy, and the slot's next `step` or `snapshot` waits for it on its stream.

On the CPU exact path a session's hidden rows are bit-identical however its prompt was split
into steps and whatever other sessions share the step (tests/test_backbone_engine.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.common import gpu_wait

from .attention import KVCache
from .layers import Segment
from .model import Backbone


class CapacityError(RuntimeError):
    """No free session slot."""


class ContextFullError(RuntimeError):
    """A session's rows plus the rows of this step would exceed max_context."""


@dataclass(frozen=True)
class Snapshot:
    """A session's cache state after its first `length` rows, copied out of the pool (same device
    and dtypes): for each per-slot cache tensor, in `BackboneCaches` order, the slot's part; an
    attention layer's keys and values only for rows [0, length). See `BackboneEngine.snapshot`."""

    length: int
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class PendingStep:
    """A launched step (BackboneEngine.launch_to_host) until its `finish`."""
    hidden: torch.Tensor                 # its rows, valid once the stream has run the step
    segments: list[Segment]
    slots: set[int]                      # busy until finish
    stream: torch.cuda.Stream | None     # the stream it was queued on (CUDA)
    published: int = 0                   # what `publish` returned (launch_to_host), else 0


class BackboneEngine:
    def __init__(self, model: Backbone, *, max_sessions: int, max_context: int):
        if max_sessions < 1 or max_context < 1:
            raise ValueError("max_sessions and max_context must be positive")
        self.model = model
        self.max_sessions, self.max_context = max_sessions, max_context
        self.hidden_size = model.config.hidden_size
        self.hidden_dtype = model.dtype
        self.num_codebooks = model.audio.num_codebooks if model.audio is not None else 0
        self.caches = model.allocate_caches(max_sessions, max_context)
        self.warm_up_phases: dict[str, float] = {}     # seconds per phase of the last warm_up
        self._lengths = [0] * max_sessions
        self._open = [False] * max_sessions
        self._busy: set[int] = set()                       # slots inside a running step
        self._ready: dict[int, torch.cuda.Event] = {}      # slot -> event after its open/restore (CUDA)
        self._device = model.device                         # the property costs ~5 µs a read (nn.Module lookups)
        self._cuda = self._device.type == "cuda"
        # poll the step's one wait for the GPU, the thread awake? (services/common/gpu_wait.py, off)
        self.spin_gpu_wait = gpu_wait.spin_default(self._device)
        spec = model.audio                                  # _bad_rows' bound per codebook column
        self._code_limits = None if spec is None else np.array(
            [spec.semantic_codebook_size] + [spec.residual_codebook_size] * (spec.num_codebooks - 1), dtype=np.uint64)
        # (semantic, residual) codebook sizes: a device fill's range check (launch_to_host)
        self.code_sizes = (0, 0) if spec is None else (spec.semantic_codebook_size, spec.residual_codebook_size)
        self._lock = threading.Lock()
        if not getattr(model, "kernels", False):
            # The exact and batched paths look rotary angles up in a table that grows on demand;
            # grown here to the whole context, no step (on whichever thread) ever replaces it.
            model.rotary().lookup(torch.tensor([max_context - 1], device=model.device))

    # ---- sessions --------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots `open` can hand out now (a slot released during a step is free when it ends)."""
        with self._lock:
            return sum(1 for slot, used in enumerate(self._open) if not used and slot not in self._busy)

    @property
    def open_sessions(self) -> int:
        return self._open.count(True)

    def open(self) -> int:
        """The lowest free slot, its state zeroed and length 0. CapacityError when none is free."""
        with self._lock:
            for slot, used in enumerate(self._open):
                if not used and slot not in self._busy:
                    self.caches.reset(slot)
                    self._mark_ready(slot)
                    self._open[slot], self._lengths[slot] = True, 0
                    return slot
            raise CapacityError(f"all {self.max_sessions} backbone sessions are in use")

    def release(self, slot: int) -> None:
        """Free a slot; releasing a free (or already released) slot does nothing. A slot released
        while a step uses it is handed out again only after that step."""
        with self._lock:
            if 0 <= slot < self.max_sessions:
                self._open[slot], self._lengths[slot] = False, 0

    def snapshot(self, slot: int) -> Snapshot:
        """Copy an open slot's state out of the pool (the voice-prefix cache, prefix_cache.py).

        Generic over the cache layout: every per-slot tensor of every layer's cache is copied
        along the slot dimension, attention KV cut to the rows held (the rows past a slot's
        length are never read). On the exact path the GDN cache holds the state at the start of
        the current 64-row chunk plus that chunk's earlier rows, so a restored slot continues
        bit-identically to one that never left the pool.
        """
        with self._lock:
            self._check_slot(slot)
            if slot in self._busy:
                raise ValueError(f"slot {slot} is in a step that has not ended")
            length = self._lengths[slot]
            self._wait_ready([slot])
            snapshot = Snapshot(length, tuple(view.clone() for view in self._slot_views(slot, length)))
        if self._cuda:      # complete before any other stream (restore's) may read it
            torch.cuda.current_stream(self.model.device).synchronize()
        return snapshot

    def restore(self, snapshot: Snapshot) -> int:
        """Open the lowest free slot with the snapshot's state and length (CapacityError when
        none is free). The snapshot is copied, so it can be dropped or evicted at any time."""
        slot = self.open()
        with self._lock:
            views = self._slot_views(slot, snapshot.length)
            if snapshot.length > self.max_context or len(views) != len(snapshot.tensors) or any(
                    v.shape != t.shape or v.dtype != t.dtype for v, t in zip(views, snapshot.tensors)):
                self._open[slot] = False
                raise ValueError("the snapshot does not fit this engine's cache layout")
            # One foreach copy, not one launch per layer tensor: a restore runs on the
            # scheduler's event loop, on the way to the session's Started and first prefill.
            torch._foreach_copy_(views, list(snapshot.tensors))
            for saved in snapshot.tensors:
                if saved.is_cuda:
                    # The snapshot may have been made on another stream and may be evicted (freed)
                    # before this copy runs: its memory must not be reused until then.
                    saved.record_stream(torch.cuda.current_stream(saved.device))
            self._mark_ready(slot)
            self._lengths[slot] = snapshot.length
            return slot

    def _slot_views(self, slot: int, length: int) -> list[torch.Tensor]:
        """Views of one slot's state in every per-slot cache tensor (tensors allocated with no
        slots, such as the exact-path chunk buffers on the batched path, are left out)."""
        views = []
        for cache in self.caches.layers:
            for tensor in cache.tensors():
                if tensor.shape[0] == 0:
                    continue
                if isinstance(cache, KVCache):      # [S, n_kv, max_context, d]
                    views.append(tensor[slot, :, :length])
                else:
                    views.append(tensor[slot])
        return views

    def length(self, slot: int) -> int:
        """Rows held by an open slot."""
        self._check_slot(slot)
        return self._lengths[slot]

    # ---- steps -----------------------------------------------------------------------------
    def step(self, work: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """One batched forward. work: (slot, token_ids int64 [n], frames int64 [n, N] or None).

        frames[i] all −1 marks a text row (token_ids[i] in [0, V)); otherwise frames[i] is an
        audio row's frame (c_0 in [0, Q_s), c_k in [0, Q_r)) and token_ids[i] must equal
        semantic_start_token_id + c_0. frames=None means all rows are text. Returns hidden
        [n, H] (hidden_dtype) per entry, in order. Every entry is checked before any cache is
        touched: ValueError (bad slot, shapes, ids or codes, a slot twice, a slot inside another
        thread's running step), ContextFullError. On CUDA the step runs on the calling thread's
        current stream and has finished on it when this returns.
        """
        if not work:
            return []
        hidden, segments = self._step(work, to_host=False)
        return [hidden[seg.rows] for seg in segments]

    def step_to_host(self, work: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        """`step`, its rows in one host tensor [R, H] (hidden_dtype; all entries' rows in order,
        pinned memory on CUDA): what the scheduler sends on. On CUDA the graph's output goes
        straight to pinned memory in one asynchronous copy before the step's one wait; `step`'s
        device copy, and the caller's concatenation and copy with a second wait, cost the host
        ~40 µs on the path of every frame."""
        return self.finish(self.launch_to_host(work))

    def launch_to_host(self, work: list[tuple[int, torch.Tensor, torch.Tensor | None]],
                       publish: Callable[[torch.Tensor], int] | None = None,
                       fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> "PendingStep":
        """`step_to_host` up to its wait: the step is queued on the calling thread's current
        stream (on CUDA; done at once elsewhere), its slots busy until `finish`, which must
        follow (on any thread). Why: the caller's host work between the two (the scheduler's
        frames out) runs while the GPU computes, not before the launch.
        `publish`: called with the step's rows on the device, on that stream, right after the
        step is queued (device_handoff.Mailbox.publish); its result is PendingStep.published, and
        the rows then stay on the device (`finish` returns the device tensor, valid until the
        next step).
        `fill(ids [R], codes [R, N])`: a decode step (every entry one audio row) whose rows' ids
        and codes are written on the device, queued on that stream before the step reads them
        (device_handoff.Mailbox.fill: the frames the tower published); the work's rows, checked
        as ever, only stand in for them."""
        if not work:
            return PendingStep(torch.empty(0, self.hidden_size, dtype=self.hidden_dtype), [], set(), None)
        return self._launch(work, to_host=True, publish=publish, fill=fill)

    def finish(self, pending: "PendingStep") -> torch.Tensor:
        """Wait for a launched step; its rows (see step_to_host). Its slots are free again, and
        the rows count for their lengths only if the wait returned."""
        done = False
        try:
            if pending.stream is not None:
                # Before the slots are let go: a slot released meanwhile may be reset on another
                # stream as soon as it is free, and the rows go to the host next anyway.
                gpu_wait.synchronize(pending.stream, self.spin_gpu_wait)
            done = True
        finally:
            with self._lock:
                self._busy.difference_update(pending.slots)
                for seg in pending.segments if done else ():
                    if self._open[seg.slot]:       # not released while the step ran
                        self._lengths[seg.slot] += seg.count
        return pending.hidden

    def _step(self, work, to_host: bool) -> tuple[torch.Tensor, list[Segment]]:
        pending = self._launch(work, to_host)
        return self.finish(pending), pending.segments

    def _launch(self, work, to_host: bool, publish: Callable[[torch.Tensor], int] | None = None,
                fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> "PendingStep":
        counts, all_ids, all_frames = self._check_work(work)
        if fill is not None and (not self.num_codebooks or any(n != 1 for n in counts)):
            raise ValueError("only a decode step of audio rows (one row an entry) takes its rows from the device")
        with self._lock:
            segments, offset, seen = [], 0, set()
            for index, ((slot, _, _), n) in enumerate(zip(work, counts)):
                self._check_slot(slot)
                if slot in seen:
                    raise ValueError(f"work[{index}]: slot {slot} appears twice in one step")
                if slot in self._busy:
                    raise ValueError(f"work[{index}]: slot {slot} is in another step that has not ended")
                seen.add(slot)
                if self._lengths[slot] + n > self.max_context:
                    raise ContextFullError(f"slot {slot}: {self._lengths[slot]} rows + {n} new rows exceed "
                                           f"max_context {self.max_context}")
                segments.append(Segment(slot, self._lengths[slot], n, offset))
                offset += n
            self._busy.update(seen)
            self._wait_ready(seen)
        try:
            device = self._device
            # a decode step replayed from a graph may take the ids as they are (Backbone.decode_from_ids)
            hidden = self.model.decode_from_ids(all_ids, all_frames if self.num_codebooks else None,
                                                segments, self.caches, fill=fill)
            if hidden is None:
                token_ids = all_ids.to(device)
                frames = all_frames.to(device) if self.num_codebooks else None
                if fill is not None:             # written in place: never the caller's tensors
                    token_ids, frames = token_ids.clone(), frames.clone()
                    fill(token_ids, frames)
                hidden = self.model.forward_rows(self.model.embed(token_ids, frames), segments, self.caches)
            published = 0
            if publish is not None:              # the rows go where `publish` puts them
                published = publish(hidden)
            # else one copy (the kernel path may return a graph's buffer, valid until its next
            # replay); on the CPU the rows are on the host already
            elif to_host and self._cuda:
                hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True).copy_(hidden, non_blocking=True)
            else:
                hidden = hidden.clone()
        except BaseException:
            with self._lock:
                self._busy.difference_update(seen)
            raise
        return PendingStep(hidden, segments, seen, torch.cuda.current_stream(device) if self._cuda else None,
                           published)

    def _mark_ready(self, slot: int) -> None:
        """After queuing a slot's reset or restore (CUDA): its next user, on any stream, waits for it."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.model.device))
            self._ready[slot] = event

    def _wait_ready(self, slots) -> None:
        """Make the current stream wait for the slots' pending reset or restore (under the lock)."""
        for slot in slots:
            event = self._ready.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.model.device).wait_event(event)

    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.max_sessions and self._open[slot]):
            raise ValueError(f"slot {slot!r} is not an open session")

    def _check_work(self, work) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Every entry of a step checked on the host: (rows per entry, token_ids int64 [R],
        frames int64 [R, N], text rows all −1), all entries' rows concatenated in order.

        Shapes and dtypes are checked entry by entry (attribute reads); the values once over all
        rows (`_bad_rows`): the ~15 small torch ops per entry that `_check_rows` runs took ~50 µs
        per entry on the host, ~6 ms of a 128-session decode step. A step with a bad row goes
        back to `_check_rows`, entry by entry, for the message naming the first bad one."""
        width = self.num_codebooks
        counts, ids, frames = [], [], []
        for index, (_, token_ids, entry_frames) in enumerate(work):
            n = self._check_shapes(index, token_ids, entry_frames)
            counts.append(n)
            ids.append(token_ids.cpu())
            frames.append(torch.full((n, width), -1, dtype=torch.int64) if entry_frames is None
                          else entry_frames.cpu())
        all_ids, all_frames = (ids[0], frames[0]) if len(ids) == 1 else (torch.cat(ids), torch.cat(frames))
        if bool(self._bad_rows(all_ids, all_frames).any()):
            for index, (_, token_ids, entry_frames) in enumerate(work):
                self._check_rows(index, token_ids, entry_frames)        # raises for the first bad entry
            raise AssertionError("_bad_rows flagged a row that _check_rows accepts")    # pragma: no cover
        return counts, all_ids, all_frames

    def _check_shapes(self, index: int, token_ids, frames) -> int:
        """An entry's types and shapes (no tensor op); returns its row count."""
        where = f"work[{index}]"
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype != torch.int64:
            raise ValueError(f"{where}: token_ids must be an int64 tensor [n]")
        n, width = token_ids.shape[0], self.num_codebooks
        if n < 1:
            raise ValueError(f"{where}: needs at least one row")
        if frames is not None and (not isinstance(frames, torch.Tensor) or frames.dtype != torch.int64
                                   or tuple(frames.shape) != (n, width)):
            raise ValueError(f"{where}: frames must be an int64 tensor [{n}, {width}]")
        return n

    def _bad_rows(self, token_ids: torch.Tensor, frames: torch.Tensor) -> np.ndarray:
        """bool [R]: the rows `_check_rows` refuses (the same conditions, all rows at once). In
        numpy on the tensors' memory (host tensors, no copy): each small torch op costs ~5 µs of
        host time, and this runs before every step's GPU work is queued (~70 -> ~20 µs a step).
        Bounds through the uint64 view, where a negative value is huge: `v < 0 or v >= n` in one
        comparison (a few µs less again; numpy's calls cost ~1 µs each at these sizes)."""
        vocab = self.model.config.vocab_size
        if token_ids.shape[0] <= self._FEW_ROWS:
            return np.array([self._bad_row(i, row, vocab) for i, row in zip(token_ids.tolist(), frames.tolist())],
                            dtype=bool).reshape(-1)
        ids = token_ids.numpy()
        bad = ids.view(np.uint64) >= vocab
        if frames.shape[1]:
            spec = self.model.audio
            codes = frames.numpy()
            audio = (codes != -1).any(axis=1)
            wrong = ((codes.view(np.uint64) >= self._code_limits).any(axis=1)
                     | (ids != spec.semantic_start_token_id + codes[:, 0]))
            bad |= audio & wrong
        return bad

    # Up to this many rows, _bad_rows checks in Python on the rows' lists: ~3 µs for a decode row
    # against ~15 for numpy's dozen calls (each ~1 µs at these sizes)
    _FEW_ROWS = 8

    def _bad_row(self, token_id: int, codes: list[int], vocab: int) -> bool:
        """One row of _bad_rows in plain Python (the same conditions)."""
        if not 0 <= token_id < vocab:
            return True
        if not codes or all(c == -1 for c in codes):
            return False                                    # a text row
        spec = self.model.audio
        return (not 0 <= codes[0] < spec.semantic_codebook_size
                or any(not 0 <= c < spec.residual_codebook_size for c in codes[1:])
                or token_id != spec.semantic_start_token_id + codes[0])

    def _check_rows(self, index: int, token_ids: torch.Tensor, frames: torch.Tensor | None) -> None:
        """One entry's values, with the message naming it (the slow path of `_check_work`, after
        `_check_shapes` has passed every entry)."""
        where = f"work[{index}]"
        vocab = self.model.config.vocab_size
        token_ids = token_ids.cpu()
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise ValueError(f"{where}: token ids must lie in [0, {vocab})")
        if frames is None:
            return
        frames = frames.cpu()
        audio = ~(frames == -1).all(dim=1)
        if audio.any():
            spec = self.model.audio
            codes = frames[audio]
            residual = codes[:, 1:]
            if (codes[:, 0] < 0).any() or (codes[:, 0] >= spec.semantic_codebook_size).any():
                raise ValueError(f"{where}: semantic codes must lie in [0, {spec.semantic_codebook_size})")
            if (residual < 0).any() or (residual >= spec.residual_codebook_size).any():
                raise ValueError(f"{where}: residual codes must lie in [0, {spec.residual_codebook_size}) "
                                 "(a row is text only when all its codes are -1)")
            if not torch.equal(token_ids[audio], spec.semantic_start_token_id + codes[:, 0]):
                raise ValueError(f"{where}: an audio row's token id must be semantic_start_token_id + c_0")

    # ---- warm-up ---------------------------------------------------------------------------
    def warm_up(self, prefill_rows: int | None = None, decode_steps: int = 2) -> list[int]:
        """Run the step shapes a server meets before it reports SERVING, so one-time costs (Triton
        compilation and autotuning, CUDA-graph capture, allocator growth) are not paid by the first
        request. Uses text rows and releases its slots, so the pool is back to its start state;
        returns the decode-graph buckets captured (empty without decode graphs).

        On CUDA: the decode graphs of every batch bucket up to max_sessions (Backbone.
        capture_decode_graphs) and the prefill graphs of every (bucket, pieces) shape
        (capture_prefill_graphs), then `cuda_warm_up_plan`'s steps, which cover what Triton
        compiles a kernel again for: integer arguments specialised by value (== 1, divisible by
        16), the MoE's two routing paths (at most / more than DECODE_MAX_PAIRS pairs), pieces starting at
        0 and after it, one and several segments, mixed decode + prefill steps, eager decode at
        batch 1 and 2. On CPU nothing compiles: a prefill crossing nothing and two decode steps."""
        cuda = self.model.device.type == "cuda"
        clock = _PhaseClock(self.model.device)
        if cuda and self.model.kernels:
            self.model.prepare()
            self.model.warm_route_tables()       # eager prefill's MoE block-table kernel, every piece size
        clock.lap("prepare")
        buckets = self.model.capture_decode_graphs(self.caches, self.max_sessions) if cuda else []
        clock.lap(f"{len(buckets)} decode graphs")
        if cuda:
            shapes = self.model.capture_prefill_graphs(self.caches)
            clock.lap(f"{len(shapes)} prefill graphs")
        slots = [self.open() for _ in range(min(3, self.free_slots))]
        if cuda and prefill_rows is None:
            plan = cuda_warm_up_plan(len(slots), self.max_context)
        else:
            plan = cpu_warm_up_plan(len(slots), self.max_context, 3 if prefill_rows is None else prefill_rows,
                                    decode_steps)
        gen = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        graphs, self.model.decode_graphs = self.model.decode_graphs, False
        try:
            for step, eager in plan:
                self.model.decode_graphs = graphs and not eager
                self.step([(slots[i], torch.randint(0, vocab, (n,), generator=gen), None) for i, n in step])
        finally:
            self.model.decode_graphs = graphs
            for slot in slots:
                self.release(slot)
        clock.lap(f"{len(plan)} steps")
        self.warm_up_phases = clock.phases
        return buckets

    # ---- accounting ------------------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """{"weights": bytes of parameters, "cache": bytes of the preallocated cache pool, "total"}."""
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        weights += sum(t.numel() * t.element_size() for t in self.model.buffers())
        cache = self.caches.nbytes()
        return {"weights": weights, "cache": cache, "total": weights + cache}


class _PhaseClock:
    """Seconds per phase of the warm-up, each ending when the device has finished its work (the
    server prints them: a slow start says which part grew)."""

    def __init__(self, device: torch.device):
        self.device, self.phases, self._last = device, {}, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[name], self._last = now - self._last, now


def cpu_warm_up_plan(sessions: int, context: int, prefill_rows: int, decode_steps: int):
    """[(step, eager)]: a prefill of every warm-up slot, then decode steps at batch 1 and 2;
    step = [(warm-up slot index, rows)]. Fits `sessions` slots of `context` rows."""
    used = min(2, sessions)
    decode_steps = max(0, min(decode_steps, (context - 1) // 2))
    prefill_rows = max(1, min(prefill_rows, context - 2 * decode_steps))
    plan = [([(i, prefill_rows) for i in range(used)], False)]
    for _ in range(decode_steps):
        plan += [([(0, 1)], False), ([(i, 1) for i in range(used)], False)]
    return plan


def cuda_warm_up_plan(sessions: int, context: int):
    """[(step, eager)] for the kernel path on CUDA (see BackboneEngine.warm_up); trimmed to fit
    `sessions` slots (at most 3 used) of `context` rows. Row counts: 72 and 40 (112 rows, 896 MoE
    pairs: the decode routing, divisible by 16, two segments from 0), 7 (one segment after its
    start, nothing divisible), 200 and 129 (1600 and 1032 pairs: the grouped routing, both
    remainders), 64 (one segment, divisible), then decode at batch 1 and 2 eagerly and mixed steps
    (graphed decode rows beside a prefill piece)."""
    want = [([(0, 72), (1, 40)], False), ([(0, 7)], False), ([(1, 200)], False), ([(2, 129)], False),
            ([(2, 64)], False),
            ([(0, 1)], True), ([(0, 1), (1, 1)], True), ([(0, 1), (2, 1)], False),
            ([(0, 1), (1, 1), (2, 20)], False), ([(1, 1), (2, 17)], False)]
    held = [0, 0, 0]
    plan = []
    for step, eager in want:
        step = [(i, n) for i, n in step if i < sessions]
        if not step:
            continue
        fitted = [(i, max(1, min(n, context - held[i]))) for i, n in step if held[i] < context]
        if not fitted:
            continue
        for i, n in fitted:
            held[i] += n
        plan.append((fitted, eager))
    return plan

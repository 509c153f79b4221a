"""The tower engine: session slots over a preallocated cache pool, and one call per Step message.

`TowerEngine.step` is API.md §3.5's StepRequest in tensor form: release first, then validate
every entry (a bad entry becomes a row error and is left out, the others go on), then ONE batched
`forward_rows` over the rows of all valid entries together (continuous batching: the trunk and
every residual layer run once per step over all rows, the draws run batched over all draw rows),
then the bookkeeping. Row errors use gRPC status names; the server maps them.

Sessions are keyed by (owner, session_id): the owner is the Step stream, so two backbone
workers never see each other's sessions and a closed stream frees exactly its own.

Voice-prefix snapshots (issue #8, services/backbone/prefix_cache.py): an entry with
`snapshot_key` leaves, after the step, a copy of its session's KV rows in every layer under that
key; an entry with `prefix_key` starts its session (first_row == prefix_rows) from that copy
instead of an empty cache. Snapshots are not per stream: the key names the backbone model and the
exact prefix rows, so any stream may use them. A restore whose snapshot was evicted is the row
error FAILED_PRECONDITION (the backbone then prefills the whole prompt).

On CUDA a step whose accepted entries are all single-row draws (the steady state) replays a
CUDA graph of `_decode_step` (graphs.DecodeGraphs); any other step (prompt pieces, non-drawing
rows, mixes, prefix restores) replays graphs of `_general_step` (graphs.StepGraphs: T rows as
single-row segments, D draws among them), unless the step has more draws than the largest graph
holds: that runs eagerly. With graphs the pool has one more slot than
max_sessions, the scratch slot the graphs' padding rows write into.

On CUDA the eager step runs its rows as single-row segments too, as the graphs do (with graphs
on or off): every row then attends through the same decode-attention kernel over its own
positions whichever path its step took, so a session's bits never depend on whether a
neighbour's restore sent the step down the eager path, nor on DRAMA_TOWER_GRAPHS (batch
invariance, issue #8); and a prompt's bits no longer depend on how it was cut into pieces. On
the CPU the eager step keeps its segments (attend_rowwise on the exact path, SDPA per segment
on the fast path, which is test-only there).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
import torch
from torch import Tensor

from services.backbone.prefix_cache import PrefixCache, default_capacity_mb
from services.common.config import DramaConfig
from services.tower import graphs as decode_graphs
from services.tower import kernels, sampling
from services.tower.graphs import FLOAT_FIELDS, INT_FIELDS, Bucket, DecodeGraphs, StepBucket, StepGraphs
from services.tower.model import RowBatch, Sampler, TowerModel, forward_rows


@dataclass
class StepEntry:
    """One `rows` entry of a StepRequest (API.md §3.5); the sampling fields matter only with draw."""
    session_id: str
    first_row: int
    n_rows: int
    draw: bool = False
    take_index: int = 0
    frame_index: int = 0
    seed: int = 0
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 0
    repetition_penalty: float = 1.0   # 0 (proto3's unset value) also means off
    prefix_key: str = ""              # start the session from this snapshot (first_row == prefix_rows)
    prefix_rows: int = 0
    snapshot_key: str = ""            # after this entry, store the session's state under this key


@dataclass(frozen=True)
class PrefixSnapshot:
    """A session's first `rows` KV entries in every layer (shared, then residual), copied out."""
    rows: int
    keys: tuple[Tensor, ...]          # per layer [K, rows, d]
    values: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class RowError:
    row_index: int
    code: str          # a grpc.StatusCode name: INVALID_ARGUMENT, NOT_FOUND, ...
    message: str


@dataclass
class StepResult:
    codes: Tensor                     # int64 [len(entries), N] on CPU; -1 without a draw / stopped
    stop: list[bool]
    row_errors: list[RowError] = field(default_factory=list)
    tower_us: int = 0

    @classmethod
    def all_failed(cls, num_entries: int, num_codebooks: int, code: str, message: str) -> "StepResult":
        """Every entry failed the same way (a malformed message as a whole)."""
        return cls(torch.full((num_entries, num_codebooks), -1, dtype=torch.int64), [False] * num_entries,
                   [RowError(i, code, message) for i in range(num_entries)])


@dataclass
class _Session:
    slot: int
    rows: int = 0


class _EntryError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _TargetFlags:
    """Per target row of a step, as Python bools: whether the frame mixes -1 and codes, has a
    code past its codebook, has any code. Computed once per step over all rows: checked entry
    by entry with torch ops, the targets took ~17 µs per entry of the host's time (2.1 ms of a
    128-session step on the 2-core dev CPU; 0.05 ms with torch ops over all rows). In numpy on
    the host tensor's memory: a frame's step pays ~12 µs instead of ~32 (dev CPU, 1 row)."""
    mixed: list[bool]
    out_of_range: list[bool]
    known: list[bool]

    @classmethod
    def of(cls, targets: Tensor, limits: np.ndarray) -> "_TargetFlags":
        """targets int [R, N]; limits int64 [N] (each codebook's size)."""
        codes = targets.cpu().numpy()                   # a no-op view for the server's host tensors
        known = codes >= 0
        any_known = known.any(axis=1)
        return cls((any_known & ~known.all(axis=1)).tolist(), (codes >= limits).any(axis=1).tolist(),
                   any_known.tolist())


class TowerEngine:
    def __init__(self, model: TowerModel, cfg: DramaConfig, *, max_sessions: int, max_context: int,
                 prefix_cache_mb: float | None = None, graphs: bool | None = None):
        """prefix_cache_mb: the voice-prefix snapshot budget (None: prefix_cache.default_capacity_mb
        for the device; 0: off, every restore is FAILED_PRECONDITION). graphs: CUDA graphs for
        decode steps, captured by `warm_up` (None: on for CUDA unless DRAMA_TOWER_GRAPHS=0)."""
        self.model = model
        self.cfg = cfg
        self.max_sessions = max_sessions
        self.max_context = max_context
        self.device = model.codebook_embeddings.weight.device
        self.hidden_dtype = model.codebook_embeddings.weight.dtype
        if graphs is None:
            graphs = decode_graphs.enabled_by_default(self.device)
        # On the CPU (tests only) "graphs" are the same staged step run without capture.
        self.use_graphs = bool(graphs)
        # Eager steps attend row by row as the graphs do (module docstring); the batch-invariant
        # path attends row by row anyway (attend_rowwise, over host-side segments).
        self.single_row_segments = self.device.type == "cuda" and not model.batch_invariant
        self.scratch_slot = max_sessions          # owned by no session; only the graphs use it
        pool_slots = max_sessions + (1 if self.use_graphs else 0)
        model.setup_caches(pool_slots, max_context)
        self._graphs: DecodeGraphs | None = None
        self._step_graphs: StepGraphs | None = None
        self._sessions: dict[tuple[Hashable, str], _Session] = {}
        self._free = list(range(max_sessions))   # lowest slot first
        self._code_limits = np.array([cfg.semantic_codebook_size]
                                     + [cfg.residual_codebook_size] * (cfg.num_codebooks - 1), dtype=np.int64)
        # The last ras_window semantic codes drawn in each slot's take, right-aligned, -1 = empty.
        self._ras_history = torch.full((pool_slots, cfg.sampling.ras_window), -1, dtype=torch.int64,
                                       device=self.device)
        # Draws and their bookkeeping in one launch each where the draws run on Triton
        # (kernels.FusedFrameDraws; DRAMA_TOWER_FUSED_DRAWS=0: the torch bookkeeping).
        self._fused_draws = all(kernels.FusedFrameDraws.fits(m) for m in (
            cfg.semantic_codebook_size + 1, cfg.residual_codebook_size))
        if prefix_cache_mb is None:
            prefix_cache_mb = default_capacity_mb(self.device.type)
        self.prefixes: PrefixCache[PrefixSnapshot] = PrefixCache.from_mb(prefix_cache_mb)

    # ---------------------------------------------------------------- pool
    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def rows_held(self, session_id: str, owner: Hashable = None) -> int | None:
        session = self._sessions.get((owner, session_id))
        return None if session is None else session.rows

    def release(self, session_ids: Sequence[str], owner: Hashable = None) -> None:
        """Free these sessions' slots; unknown ids are ignored (release is idempotent)."""
        for session_id in session_ids:
            session = self._sessions.pop((owner, session_id), None)
            if session is not None:
                self._free.append(session.slot)
                self._free.sort()

    def release_owner(self, owner: Hashable) -> None:
        """Free every session of one Step stream (the stream closed)."""
        self.release([sid for o, sid in list(self._sessions) if o == owner], owner)

    def _create(self, key) -> _Session:
        if not self._free:
            raise _EntryError("RESOURCE_EXHAUSTED", f"tower cache pool full ({self.max_sessions} sessions)")
        session = _Session(slot=self._free.pop(0))
        self._ras_history[session.slot] = -1
        self._sessions[key] = session
        return session

    # ---------------------------------------------------------------- step
    def step(self, entries: Sequence[StepEntry], hidden: Tensor, targets: Tensor,
             release: Sequence[str] = (), owner: Hashable = None,
             publish: Callable[[Tensor], None] | None = None) -> StepResult:
        """Process one StepRequest.

        hidden [sum n_rows, D] (any float dtype, any device); targets int [sum n_rows, N], -1 =
        none. Returns codes for every entry, stop flags and the failed entries' errors.
        `publish`: called with the step's frames on the device, int64 [entries, N + 1] (codes,
        then the stop flag), right after they are queued and before the wait for them, when every
        entry was accepted and draws (the device hand-off's way back); not called otherwise.
        """
        started = time.perf_counter()
        n = self.cfg.num_codebooks
        num_entries = len(entries)
        codes = torch.full((num_entries, n), -1, dtype=torch.int64)
        stop = [False] * num_entries
        self.release(release, owner)

        total_rows = sum(max(e.n_rows, 0) for e in entries)
        if hidden.shape != (total_rows, self.model.hidden_size) or targets.shape != (total_rows, n):
            message = (f"hidden {tuple(hidden.shape)} / targets {tuple(targets.shape)} do not match "
                       f"[{total_rows}, {self.model.hidden_size}] / [{total_rows}, {n}]")
            return StepResult.all_failed(num_entries, n, "INVALID_ARGUMENT", message)

        targets = targets.to(torch.int64)
        flags = _TargetFlags.of(targets, self._code_limits)
        errors: list[RowError] = []
        accepted: list[tuple[int, StepEntry, _Session, int]] = []   # (entry index, entry, session, row offset)
        seen: set[str] = set()
        offset = 0
        for index, entry in enumerate(entries):
            try:
                if entry.session_id in seen:
                    raise _EntryError("INVALID_ARGUMENT", f"session {entry.session_id!r} has two entries in one step")
                seen.add(entry.session_id)
                self._check_entry(entry, flags, offset)
                session = self._admit(entry, owner)
                accepted.append((index, entry, session, offset))
            except _EntryError as exc:
                errors.append(RowError(index, exc.code, str(exc)))
            offset += max(entry.n_rows, 0)

        if accepted:
            whole = len(accepted) == num_entries and all(entry.draw for entry in entries)
            frames, stopped = self._run(accepted, hidden, targets, publish if whole else None)
            draw_entries = [index for index, entry, _, _ in accepted if entry.draw]
            for index, frame, is_stopped in zip(draw_entries, frames, stopped):
                codes[index] = frame
                stop[index] = is_stopped
            for _, entry, session, _ in accepted:
                session.rows += entry.n_rows
                if entry.snapshot_key:
                    self.prefixes.put(entry.snapshot_key, self._snapshot(session))
        return StepResult(codes, stop, errors, _elapsed_us(started))

    def _check_entry(self, entry: StepEntry, flags: "_TargetFlags", offset: int) -> None:
        """An entry's fields, and its target rows (offset.. in the step) through the step's flags."""
        if entry.n_rows <= 0:
            raise _EntryError("INVALID_ARGUMENT", f"n_rows must be positive, got {entry.n_rows}")
        if entry.first_row < 0:
            raise _EntryError("INVALID_ARGUMENT", f"first_row must be >= 0, got {entry.first_row}")
        if entry.first_row + entry.n_rows > self.max_context:
            raise _EntryError("OUT_OF_RANGE", f"rows up to {entry.first_row + entry.n_rows} exceed the "
                                              f"tower's max_context_tokens {self.max_context}")
        rows = slice(offset, offset + entry.n_rows)
        if any(flags.mixed[rows]):
            raise _EntryError("INVALID_ARGUMENT", "a target frame mixes -1 and codes")
        if any(flags.out_of_range[rows]):
            raise _EntryError("INVALID_ARGUMENT", "a target code is out of its codebook's range")
        if entry.prefix_key and entry.prefix_rows != entry.first_row:
            raise _EntryError("INVALID_ARGUMENT", f"a restore starts at prefix_rows ({entry.prefix_rows}), "
                                                  f"got first_row {entry.first_row}")
        if entry.snapshot_key and entry.draw:
            raise _EntryError("INVALID_ARGUMENT", "a draw entry cannot store a prefix snapshot")
        if entry.draw:
            if flags.known[offset + entry.n_rows - 1]:
                raise _EntryError("INVALID_ARGUMENT", "the draw row's target must be -1")
            if not (math.isfinite(entry.temperature) and math.isfinite(entry.top_p)):
                raise _EntryError("INVALID_ARGUMENT", "temperature and top_p must be finite")
            penalty = entry.repetition_penalty
            if not math.isfinite(penalty) or penalty < 0:
                raise _EntryError("INVALID_ARGUMENT", f"repetition_penalty must be > 0 (0 = off), got {penalty}")

    def _admit(self, entry: StepEntry, owner) -> _Session:
        key = (owner, entry.session_id)
        if entry.prefix_key:
            snapshot = self.prefixes.get(entry.prefix_key)
            if snapshot is None or snapshot.rows != entry.prefix_rows:
                raise _EntryError("FAILED_PRECONDITION", f"no prefix snapshot {entry.prefix_key[:16]} of "
                                                         f"{entry.prefix_rows} rows (evicted or never stored)")
            self.release([entry.session_id], owner)   # a new timeline replaces any old one
            return self._restore(key, snapshot)
        if entry.first_row == 0:
            self.release([entry.session_id], owner)   # a new timeline replaces any old one
            return self._create(key)
        session = self._sessions.get(key)
        if session is None:
            raise _EntryError("NOT_FOUND", f"the tower holds no session {entry.session_id!r}")
        if entry.first_row != session.rows:
            raise _EntryError("INVALID_ARGUMENT", f"first_row {entry.first_row} but the tower holds "
                                                  f"{session.rows} rows of {entry.session_id!r}")
        return session

    def _snapshot(self, session: _Session) -> PrefixSnapshot:
        attention = [layer.self_attn for layer in self.model.layers()]
        rows = session.rows
        return PrefixSnapshot(rows, tuple(a.k_cache[session.slot, :, :rows].clone() for a in attention),
                              tuple(a.v_cache[session.slot, :, :rows].clone() for a in attention))

    def _restore(self, key, snapshot: PrefixSnapshot) -> _Session:
        """A new session holding the snapshot's rows (copied: the snapshot may be evicted later).
        Its RAS window starts empty, as after `_create`: a prefix holds no draws."""
        session = self._create(key)
        for layer, keys, values in zip(self.model.layers(), snapshot.keys, snapshot.values):
            layer.self_attn.k_cache[session.slot, :, :snapshot.rows] = keys
            layer.self_attn.v_cache[session.slot, :, :snapshot.rows] = values
        session.rows = snapshot.rows
        return session

    @torch.inference_mode()
    def _run(self, accepted, hidden: Tensor, targets: Tensor,
             publish: Callable[[Tensor], None] | None = None) -> tuple[Tensor, list[bool]]:
        """The batched computation over every accepted entry; returns the draw entries' frames.
        `publish` (every entry draws): see `step`; the general step graphs leave it uncalled."""
        if self._graphable(accepted):
            return self._run_graph(accepted, hidden, publish)
        step = _StepRows.of(accepted)
        chunks = self._step_plan(accepted, step)
        if chunks is not None:
            return self._run_step_graphs(chunks, accepted, step, hidden, targets)
        device = self.device
        index = torch.tensor(step.row_index, dtype=torch.int64)
        batch_hidden = hidden[index].to(device=device, dtype=self.hidden_dtype)
        batch_targets = targets[index].to(device)
        rows = self._eager_rows(step, decode_step=_frame_step(accepted))
        draws = [(entry, session) for _, entry, session, _ in accepted if entry.draw]
        if not draws:
            forward_rows(self.model, batch_hidden, batch_targets, rows)
            return torch.empty(0, self.cfg.num_codebooks, dtype=torch.int64), []

        draw_index = torch.tensor(step.draw_rows, dtype=torch.int64, device=device)
        ints, floats = _draw_columns(accepted)
        ints, floats = ints.to(device), floats.to(device)
        codes, stopped = self._draw_step(batch_hidden, batch_targets, rows, draw_index, ints, floats)
        if publish is not None:
            publish(torch.cat([codes[draw_index], stopped[:, None].to(torch.int64)], dim=1))
        return codes[draw_index].cpu(), stopped.cpu().tolist()

    def _eager_rows(self, step: "_StepRows", decode_step: bool) -> RowBatch:
        """The eager step's RowBatch: its segments, or (CUDA) every row a segment of its own."""
        if not self.single_row_segments:
            return RowBatch.from_segments(step.segments, self.device, decode_step)
        return RowBatch.decode_only(torch.tensor(step.slots, dtype=torch.int64, device=self.device),
                                    torch.tensor(step.positions, dtype=torch.int64, device=self.device),
                                    self.max_context - 1, decode_step)

    def _draw_step(self, hidden: Tensor, targets: Tensor, rows: RowBatch, draw_index: Tensor,
                   ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
        """forward_rows with the draws, then the RAS windows advanced: the part of a step shared
        by the eager path and the graphs. ints int64 [6, R] / floats float32 [3, R]: the draw
        rows' parameters in graphs.INT_FIELDS / FLOAT_FIELDS order, on the device."""
        if self._fused_draws and kernels.use_triton(hidden):     # the windows advance in draw 0
            draws = fused_frame_draws(self.cfg, self._ras_history, ints, floats)
            return forward_rows(self.model, hidden, targets, rows, draw_index, draws)
        slots = _field(ints, floats, "slot")
        history = self._ras_history[slots]
        codes, stopped = forward_rows(self.model, hidden, targets, rows, draw_index,
                                      self._sampler(history, ints, floats))
        advance_ras_windows(self._ras_history, slots, history, codes[draw_index, 0], stopped)
        return codes, stopped

    def _sampler(self, history: Tensor, ints: Tensor, floats: Tensor) -> Sampler:
        return torch_sampler(self.cfg, history, ints, floats)

    # ---------------------------------------------------------------- CUDA graphs
    def _graphable(self, accepted) -> bool:
        """A decode step: every accepted entry one row that draws, no prefix restore."""
        return self._graphs is not None and 0 < len(accepted) <= self._graphs.largest and _frame_step(accepted)

    def _run_graph(self, accepted, hidden: Tensor,
                   publish: Callable[[Tensor], None] | None = None) -> tuple[Tensor, list[bool]]:
        ints, floats = _draw_columns(accepted)
        offsets = [offset for _, _, _, offset in accepted]
        if offsets == list(range(len(offsets))):
            # every row of the request draws, in order (a decode step): no gather. Rows on the GPU
            # (the device hand-off's) would otherwise take a blocking copy of the index, which waits
            # for the rows themselves: the step's launch would wait until they land.
            rows = hidden[:len(offsets)]
        else:
            index = torch.tensor(offsets, dtype=torch.int64)
            if hidden.is_cuda:
                index = index.pin_memory().to(hidden.device, non_blocking=True)
            rows = hidden.index_select(0, index)
        out = self._graphs.run(ints, floats, rows, publish)
        n = self.cfg.num_codebooks
        return out[:, :n], out[:, n].bool().tolist()

    def _decode_step(self, bucket: Bucket) -> Tensor:
        """What a graph captures: `_draw_step` on a bucket's static buffers -> int64 [B, N + 1]."""
        rows = self._single_rows(bucket.int_field("slot"), bucket.int_field("position"), decode_step=True)
        codes, stopped = self._draw_step(bucket.hidden, bucket.targets, rows, bucket.draw_rows,
                                         bucket.ints, bucket.floats)
        return torch.cat([codes, stopped[:, None].to(torch.int64)], dim=1)

    def _single_rows(self, slots: Tensor, positions: Tensor, decode_step: bool) -> RowBatch:
        """Device slots/positions [T] as T single-row segments (`decode_step`: RowBatch's)."""
        if self.model.batch_invariant:    # CPU: attend_rowwise walks host-side segments
            return RowBatch.from_segments([(s, p, 1) for s, p in zip(slots.tolist(), positions.tolist())],
                                          self.device, decode_step)
        # built inside the capture: its rotary tables are too
        return RowBatch.decode_only(slots, positions, self.max_context - 1, decode_step)

    def _step_plan(self, accepted, step: "_StepRows"):
        """The general graphs' replays for this step, or None to run it eagerly (graphs off, or
        more draws than the largest graph holds). A prefix restore is no reason to run eagerly:
        `_admit` has queued its cache copies on this stream before the replay (the voice-prefix
        TTFA, issue #8, is this step's time)."""
        if self._step_graphs is None:
            return None
        return self._step_graphs.plan(len(step.row_index), step.draw_rows)

    def _run_step_graphs(self, chunks, accepted, step: "_StepRows", hidden: Tensor,
                         targets: Tensor) -> tuple[Tensor, list[bool]]:
        first, count = step.row_index[0], len(step.row_index)
        if step.row_index[-1] - first == count - 1:       # every entry accepted (or a run of them)
            hidden, targets = hidden[first:first + count], targets[first:first + count]
        else:                                             # failed entries in between: leave them out
            index = torch.tensor(step.row_index, dtype=torch.int64)
            hidden, targets = hidden[index.to(hidden.device)], targets[index.to(targets.device)]
        ints, floats = _draw_columns(accepted)
        out = self._step_graphs.run(chunks, hidden, targets.cpu(), torch.tensor(step.slots, dtype=torch.int64),
                                    torch.tensor(step.positions, dtype=torch.int64),
                                    torch.tensor(step.draw_rows, dtype=torch.int64), ints, floats)
        n = self.cfg.num_codebooks
        return out[:, :n], out[:, n].bool().tolist()

    def _general_step(self, bucket: StepBucket) -> Tensor:
        """What a general graph captures: `_draw_step` over a bucket's T rows (single-row
        segments: a piece's rows see each other through the pool, see the module docstring) and
        its D draws -> int64 [D, N + 1], the draw rows' codes and stop flags."""
        rows = self._single_rows(bucket.slots, bucket.positions, decode_step=False)
        codes, stopped = self._draw_step(bucket.hidden, bucket.targets, rows, bucket.draw_rows,
                                         bucket.ints, bucket.floats)
        return torch.cat([codes[bucket.draw_rows], stopped[:, None].to(torch.int64)], dim=1)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode and the general graphs (warm_up does this when graphs are on)."""
        if not self.use_graphs or (self.device.type == "cuda" and self.model.batch_invariant):
            return                        # the batch-invariant path syncs with the host per row
        sizes = dict(max_sessions=self.max_sessions, hidden_size=self.model.hidden_size,
                     hidden_dtype=self.hidden_dtype, num_codebooks=self.cfg.num_codebooks, device=self.device,
                     scratch_slot=self.scratch_slot)
        graphs = DecodeGraphs(self._decode_step, **sizes)
        step_graphs = StepGraphs(self._general_step, **sizes)
        if self.device.type == "cuda":
            graphs.capture()
            step_graphs.capture()
        self._graphs, self._step_graphs = graphs, step_graphs

    @property
    def graphs_captured(self) -> bool:
        """Both families captured (CUDA, graphs on, after warm_up)."""
        return (self._graphs is not None and self._graphs.captured
                and self._step_graphs is not None and self._step_graphs.captured)

    # ---------------------------------------------------------------- warm-up
    def warm_up(self) -> None:
        """One prefill row and one draw through every path, then the pool is as before."""
        owner = object()
        d, n = self.model.hidden_size, self.cfg.num_codebooks
        hidden = torch.zeros(2, d)
        targets = torch.full((2, n), -1, dtype=torch.int64)
        entry = StepEntry("warm-up", first_row=0, n_rows=2, draw=True, seed=0)
        self.step([entry], hidden, targets, owner=owner)
        # One eager decode step too (Triton compiles the decode attention and the draw kernels).
        self.step([StepEntry("warm-up", first_row=2, n_rows=1, draw=True, seed=0, frame_index=1)],
                  hidden[:1], targets[:1], owner=owner)
        self.release_owner(owner)
        self.capture_graphs()


@dataclass
class _StepRows:
    """Where a step's rows come from and go, on the host: the accepted entries' rows in order."""
    row_index: list[int]                        # [R] indices into the request's hidden/targets
    slots: list[int]                            # [R] pool slot of each row
    positions: list[int]                        # [R] position of each row in its slot
    draw_rows: list[int]                        # [d] the draw entries' last rows, ascending
    segments: list[tuple[int, int, int]]        # (slot, first position, rows) per entry

    @classmethod
    def of(cls, accepted) -> "_StepRows":
        step = cls([], [], [], [], [])
        for _, entry, session, offset in accepted:
            if entry.draw:
                step.draw_rows.append(len(step.row_index) + entry.n_rows - 1)
            step.row_index.extend(range(offset, offset + entry.n_rows))
            step.slots.extend([session.slot] * entry.n_rows)
            step.positions.extend(range(entry.first_row, entry.first_row + entry.n_rows))
            step.segments.append((session.slot, entry.first_row, entry.n_rows))
        return step


def _frame_step(accepted) -> bool:
    """A frame step: every accepted entry one row that draws, no prefix restore. Its rows take
    the decode graphs (with graphs on) and the decode GEMM (model.tower_linear); any other step,
    the general graphs and cuBLAS, so a row's kernels never depend on the rows beside it."""
    return all(e.draw and e.n_rows == 1 and not e.prefix_key for _, e, _, _ in accepted)


def torch_sampler(cfg: DramaConfig, history: Tensor, ints: Tensor, floats: Tensor) -> Sampler:
    """The draw callback for forward_rows in torch ops around kernels.draw: per-row parameters,
    the RAS switch and the repetition penalty (§6.2), noise keys. history int64 [R, W]: the draw
    rows' RAS windows; ints / floats as TowerEngine._draw_step's."""
    defaults = cfg.sampling
    field = functools.partial(_field, ints, floats)
    ras = sampling.ras_active(history, recent=defaults.ras_recent)
    temperature = torch.where(ras, defaults.ras_temperature, field("temperature"))
    top_p = torch.where(ras, defaults.ras_top_p, field("top_p"))
    top_k = torch.where(ras, defaults.ras_top_k, field("top_k"))
    penalty = field("penalty")
    num_semantic = cfg.semantic_codebook_size

    def sample(draw_index: int, logits: Tensor) -> Tensor:
        if draw_index == 0:   # the penalty touches semantic codes only, never EOS (§6.2)
            logits = torch.cat([sampling.apply_repetition_penalty(logits[:, :num_semantic], history, penalty),
                                logits[:, num_semantic:]], dim=1)
        return kernels.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=field("seed"),
                            takes=field("take"), frames=field("frame"), draw_index=draw_index)

    return sample


def advance_ras_windows(pool: Tensor, slots: Tensor, history: Tensor, semantic: Tensor, stopped: Tensor) -> None:
    """pool[slots] = history shifted left by one with the semantic code [R] appended, where the
    row did not stop (an EOS never enters its take's window)."""
    advanced = torch.cat([history[:, 1:], semantic[:, None]], dim=1)
    pool[slots] = torch.where(stopped[:, None], history, advanced)


def fused_frame_draws(cfg: DramaConfig, pool: Tensor, ints: Tensor, floats: Tensor) -> "kernels.FusedFrameDraws":
    """torch_sampler and advance_ras_windows as kernels.FusedFrameDraws (one launch per draw)
    over the RAS windows `pool` [S, W]; ints / floats as TowerEngine._draw_step's."""
    field = functools.partial(_field, ints, floats)
    return kernels.FusedFrameDraws(
        pool, slots=field("slot"), temperature=field("temperature"), top_p=field("top_p"), top_k=field("top_k"),
        penalty=field("penalty"), seeds=field("seed"), takes=field("take"), frames=field("frame"),
        defaults=cfg.sampling, eos=cfg.semantic_codebook_size)


def _field(ints: Tensor, floats: Tensor, name: str) -> Tensor:
    """One draw parameter [R] of the staged ints/floats, by its INT_FIELDS / FLOAT_FIELDS name."""
    return ints[INT_FIELDS.index(name)] if name in INT_FIELDS else floats[FLOAT_FIELDS.index(name)]


def _draw_columns(accepted) -> tuple[Tensor, Tensor]:
    """The draw entries' parameters as int64 [6, R] and float32 [3, R] host tensors
    (graphs.INT_FIELDS / FLOAT_FIELDS order): a couple of host-to-device copies per step."""
    draws = [(entry, session) for _, entry, session, _ in accepted if entry.draw]
    ints = torch.tensor([[session.slot for _, session in draws],
                         [entry.first_row + entry.n_rows - 1 for entry, _ in draws],
                         [entry.top_k for entry, _ in draws],
                         [sampling.as_int64(entry.seed) for entry, _ in draws],
                         [entry.take_index for entry, _ in draws],
                         [entry.frame_index for entry, _ in draws]], dtype=torch.int64)
    floats = torch.tensor([[entry.temperature for entry, _ in draws],
                           [entry.top_p for entry, _ in draws],
                           [entry.repetition_penalty or 1.0 for entry, _ in draws]], dtype=torch.float32)
    return ints.view(len(INT_FIELDS), len(draws)), floats.view(len(FLOAT_FIELDS), len(draws))


def _elapsed_us(started: float) -> int:
    return int((time.perf_counter() - started) * 1e6)

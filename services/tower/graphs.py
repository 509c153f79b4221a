"""CUDA graphs of the tower's steps: decode steps (`DecodeGraphs`) and every other step (`StepGraphs`).

Eager, a step is ~2700 small launches (host-bound: 15-40 ms); replayed from a graph it is one
launch from the host, plus one host-to-device copy of the inputs and one device-to-host copy of
the answer.

DecodeGraphs: every accepted entry a single-row draw (the steady state).

    buckets: batch sizes 1, 2, 4, 8, 16, 32, 48, 64, 96, 128 (BUCKETS), capped at max_sessions (a
    step of R rows replays the smallest bucket >= R). Rows past R point at the engine's scratch slot (a pool
    slot no session owns, position 0), so their cache and RAS writes touch nothing real; their
    other inputs are whatever the buffer last held (finite values of earlier rows).

    staging: per bucket one pinned host buffer and one device buffer with the same byte layout,

        hidden [B, D] (the model dtype) | int64 [6, B] slot, position, top_k, seed, take, frame
                                         | float32 [3, B] temperature, top_p, repetition penalty

    filled on the host, copied with one non-blocking copy, read by the graph through views.

    inside the graph: trunk, semantic head, 10 draws (RAS switch and repetition penalty
    included), 9 residual layers, the RAS history update, and codes + stop flags packed into one
    int64 [B, N + 1] tensor, copied back once.

The graph runs exactly the eager step's code (`TowerEngine._decode_step`) on the bucket's
buffers, so a graphed step equals an eager step over the same B rows bit for bit (a padded row
changes nothing in a real row: GEMM rows, attention rows and draws are computed per row; what
can differ between bucket sizes is cuBLAS's kernel choice, as between any two batch sizes).
Captured at warm-up (`TowerEngine.warm_up`), largest first, sharing one memory pool; replays
never overlap (every step runs on the server's event-loop thread), so sharing is safe.

StepGraphs: any other step (prompt pieces, non-drawing rows, mixes), as T rows + D draws.

    Every layer writes all rows' keys/values into the pool before it attends, so a prompt piece
    (consecutive positions of one slot) runs as T single-row segments: each row attends over
    positions 0..p of its slot, which holds the piece's earlier rows written in the same call,
    i.e. exactly causal prefill; every other op is row-wise. So a step is T rows of any
    sessions (slot, position, hidden, targets) and D draw rows (indices into the T rows, with
    their sampling parameters), and one graph per (T bucket, D bucket) takes every such step.

    shapes: T in 32, 128, 256, 512, 1024, 2048; D in 1, 16, 128, each capped at T and at
    max_sessions (a step never has more draws than sessions): 18 graphs at 128 sessions.
    Why these: on the GPU every projection runs in 128-row GEMM pieces (invariant.linear_rows)
    that each stream the whole weight (~0.7 ms per piece for the tower), so T buckets are
    powers of two from 128 rows on (a step pays at most twice its pieces); 32 serves the small
    mixes (a decode row beside a one-row piece), where the decode attention's per-row partials
    (~1 MB per row per layer) are the cost that scales. D only sizes the 10 draws' softmax/sort
    kernels (the heads' GEMMs are one 128-row piece for any D <= 128): 1 for a lone prompt
    (time to first audio), 16 for a few prompts or streams, 128 for a full mixed step. Each
    graph costs one warm-up run and one capture at start; they share one memory pool, whose
    peak is the largest shape's (the decode attention's float32 partials, 1 MiB per row at
    the full geometry: ~2 GiB at 2048 rows).

    padding: the last row of a T bucket is always padding (a bucket holds T - 1 real rows), so
    every graph has a row to point unused draws at. Padding rows sit at (scratch slot,
    position 0) with targets -1; unused draws point at row T - 1 with the scratch slot as their
    RAS slot. So their cache writes, code writes and RAS-window writes touch only the scratch
    slot and the padding row; a real row is never read or written by them.

    staging: per (T, D) one pinned host buffer and one device buffer, one non-blocking copy:

        hidden [T, D_model] | targets int64 [T, N] | rows int64 [2, T] slot, position
        | draw rows int64 [D] | int64 [6, D] (INT_FIELDS) | float32 [3, D] (FLOAT_FIELDS)

    output: int64 [D, N + 1], the draw rows' codes then the stop flag.

    A step of more rows than the largest bucket holds runs as several replays, cut at row
    boundaries in row order: a later replay's rows attend over the keys the earlier ones wrote,
    each draw row (one per entry, its last) goes with the replay that holds it, and every op is
    per row, so the cut changes no bit.

    These graphs are captured on their own stream and memory pool. cuBLAS keeps one workspace
    per capture stream and torch's default capture stream is shared by every graph in the
    process, so graphs that might replay concurrently with another family must capture on their
    own stream. The tower runs every step on one thread, so nothing replays concurrently
    today; the separate stream keeps it safe if that changes.

DRAMA_TOWER_GRAPHS=0 turns both families off (default on when the tower runs on CUDA). On the
CPU (tests only) the buckets run the same staged step without capture, so CI checks the staging,
padding and scratch-slot logic against the eager step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from services.common import cuda_graphs, gpu_wait, grpcutil

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)   # 48, 96: steps between powers of two pad less
ROW_BUCKETS = (32, 128, 256, 512, 1024, 2048)    # StepGraphs' T (each holds T - 1 real rows)
DRAW_BUCKETS = (1, 16, 128)                      # StepGraphs' D, capped at T and max_sessions
ENV = "DRAMA_TOWER_GRAPHS"

INT_FIELDS = ("slot", "position", "top_k", "seed", "take", "frame")
FLOAT_FIELDS = ("temperature", "top_p", "penalty")


def enabled_by_default(device: torch.device) -> bool:
    """Graphs on for CUDA unless DRAMA_TOWER_GRAPHS=0 (or false/off/no)."""
    return device.type == "cuda" and grpcutil.env_switch(ENV) is not False


def bucket_sizes(max_sessions: int) -> list[int]:
    return sorted({min(b, max_sessions) for b in BUCKETS})


def _aligned(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _staging(parts: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device
             ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """(host, staged, host views, device views) for `parts` = (name, dtype, shape) in buffer
    order: one pinned host buffer and one device buffer with the same byte layout, each part
    starting 64-byte aligned, so one copy moves every input of a step."""
    sizes = [torch.empty(0, dtype=dtype).element_size() * math.prod(shape) for _, dtype, shape in parts]
    offsets = [sum(_aligned(n) for n in sizes[:i]) for i in range(len(parts))]
    total = sum(_aligned(n) for n in sizes)
    host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staged = torch.zeros(total, dtype=torch.uint8, device=device)

    def views(buffer: Tensor) -> dict[str, Tensor]:
        return {name: buffer[offset:offset + size].view(dtype).view(shape)
                for (name, dtype, shape), offset, size in zip(parts, offsets, sizes)}

    return host, staged, views(host), views(staged)


class Bucket:
    """The static buffers, the graph and its output for one batch size."""

    def __init__(self, size: int, hidden_size: int, hidden_dtype: torch.dtype, num_codebooks: int,
                 device: torch.device):
        self.size = size
        self.host, self.staged, host, staged = _staging(
            [("hidden", hidden_dtype, (size, hidden_size)), ("ints", torch.int64, (len(INT_FIELDS), size)),
             ("floats", torch.float32, (len(FLOAT_FIELDS), size))], device)
        self.host_hidden, self.host_ints, self.host_floats = host["hidden"], host["ints"], host["floats"]
        self.hidden, self.ints, self.floats = staged["hidden"], staged["ints"], staged["floats"]
        self.targets = torch.full((size, num_codebooks), -1, dtype=torch.int64, device=device)
        self.draw_rows = torch.arange(size, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None
        self.host_output: Tensor | None = None     # pinned, the replay's output copied in (polled waits)

    def int_field(self, name: str) -> Tensor:
        return self.ints[INT_FIELDS.index(name)]

    def stage_idle(self, scratch_slot: int) -> None:
        """Every row on the scratch slot at position 0 with neutral parameters (for capture)."""
        self.host.zero_()
        self.host_ints[INT_FIELDS.index("slot")] = scratch_slot
        self.host_floats[FLOAT_FIELDS.index("temperature")] = 1.0
        self.host_floats[FLOAT_FIELDS.index("top_p")] = 1.0
        self.host_floats[FLOAT_FIELDS.index("penalty")] = 1.0
        self.staged.copy_(self.host)


class DecodeGraphs:
    """One graph per bucket of `step(bucket) -> int64 [B, N + 1]` (codes, then the stop flag)."""

    def __init__(self, step: Callable[[Bucket], Tensor], *, max_sessions: int, hidden_size: int,
                 hidden_dtype: torch.dtype, num_codebooks: int, device: torch.device, scratch_slot: int):
        self.step = step
        self.scratch_slot = scratch_slot
        self.buckets = [Bucket(size, hidden_size, hidden_dtype, num_codebooks, device)
                        for size in bucket_sizes(max_sessions)]
        self.largest = self.buckets[-1].size
        self.replays = 0
        # poll the replay's one wait for the GPU, the thread awake? (services/common/gpu_wait.py, off)
        self.spin_gpu_wait = gpu_wait.spin_default(device)

    def capture(self, warmup: int = 2) -> None:
        """Warm up on a side stream (Triton compilation, cuBLAS handles), then capture, largest
        bucket first so the smaller ones fit in the memory the first one left in the pool."""
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            bucket.stage_idle(self.scratch_slot)
            bucket.graph, bucket.output = cuda_graphs.capture(lambda: self.step(bucket), pool=pool, stream=stream,
                                                              warmup=warmup)
            if self.spin_gpu_wait:        # run()'s pinned copy before the polled wait
                bucket.host_output = torch.empty(bucket.output.shape, dtype=bucket.output.dtype, pin_memory=True)
        torch.cuda.synchronize()

    @property
    def captured(self) -> bool:
        return all(b.graph is not None for b in self.buckets)

    def bucket_for(self, rows: int) -> Bucket | None:
        return next((b for b in self.buckets if b.size >= rows), None)

    def run(self, ints: Tensor, floats: Tensor, hidden: Tensor, publish=None) -> Tensor:
        """ints int64 [6, R] and floats float32 [3, R] (INT_FIELDS, FLOAT_FIELDS order, on the
        host), hidden [R, D] (host or device): replay the bucket, return int64 [R, N + 1] on the
        host (one device-to-host copy, which also waits for the replay). `publish`: called with
        those rows on the device right after the replay is queued (the device hand-off's way
        back: TowerEngine.step)."""
        rows = ints.shape[1]
        bucket = self.bucket_for(rows)
        bucket.host_ints[:, :rows] = ints
        bucket.host_ints[INT_FIELDS.index("slot"), rows:] = self.scratch_slot
        bucket.host_ints[INT_FIELDS.index("position"), rows:] = 0
        bucket.host_floats[:, :rows] = floats
        if not hidden.is_cuda:
            bucket.host_hidden[:rows] = hidden
        bucket.staged.copy_(bucket.host, non_blocking=True)
        if hidden.is_cuda:
            bucket.hidden[:rows] = hidden
        if bucket.graph is None:          # not captured (CPU: the same code, run op by op)
            bucket.output = self.step(bucket)
        else:
            bucket.graph.replay()
            self.replays += 1
        if publish is not None:
            publish(bucket.output[:rows])
        if bucket.graph is not None and self.spin_gpu_wait:
            # the codes to pinned memory behind the replay, then the polled wait (a .cpu()
            # after it would wait for the GPU a second time: +0.06 ms a step)
            host = bucket.host_output[:rows]
            host.copy_(bucket.output[:rows], non_blocking=True)
            gpu_wait.synchronize(torch.cuda.current_stream(), spin=True)
            return host.clone()           # the next replay of this bucket overwrites host_output
        return bucket.output[:rows].cpu()


# --------------------------------------------------------------------------------------------
# general steps: T rows of any sessions, D draws among them
# --------------------------------------------------------------------------------------------

def step_shapes(max_sessions: int, row_buckets=None, draw_buckets=None) -> list[tuple[int, int]]:
    """The (T, D) shapes of StepGraphs, smallest first: every T with each D capped at T and at
    max_sessions. (Defaults read at call time, so a test can shrink them.)"""
    row_buckets = ROW_BUCKETS if row_buckets is None else row_buckets
    draw_buckets = DRAW_BUCKETS if draw_buckets is None else draw_buckets
    return [(t, d) for t in sorted(set(row_buckets))
            for d in sorted({min(d, t, max_sessions) for d in draw_buckets})]


class StepBucket:
    """The static buffers, the graph and its output of one (T, D) shape."""

    def __init__(self, rows: int, draws: int, hidden_size: int, hidden_dtype: torch.dtype,
                 num_codebooks: int, device: torch.device):
        self.rows, self.draws = rows, draws
        self.host, self.staged, self.host_views, device_views = _staging(
            [("hidden", hidden_dtype, (rows, hidden_size)), ("targets", torch.int64, (rows, num_codebooks)),
             ("rows", torch.int64, (2, rows)), ("draw_rows", torch.int64, (draws,)),
             ("ints", torch.int64, (len(INT_FIELDS), draws)),
             ("floats", torch.float32, (len(FLOAT_FIELDS), draws))], device)
        self.hidden, self.targets = device_views["hidden"], device_views["targets"]
        self.slots, self.positions = device_views["rows"][0], device_views["rows"][1]
        self.draw_rows, self.ints, self.floats = device_views["draw_rows"], device_views["ints"], device_views["floats"]
        # The host buffer may be rewritten only once the last copy out of it has run: a step
        # without draws returns without waiting for the GPU (as the eager step does).
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None

    def int_field(self, name: str) -> Tensor:
        return self.ints[INT_FIELDS.index(name)]

    def stage(self, scratch_slot: int, hidden: Tensor, targets: Tensor, slots: Tensor, positions: Tensor,
              draw_rows: Tensor, ints: Tensor, floats: Tensor) -> None:
        """Fill the host buffer with R real rows and d real draws (host tensors, except hidden
        which may be on the device: then it is copied in after the staging copy), pad the rest
        (rows: scratch slot, position 0, targets -1; draws: row T - 1, scratch slot, neutral
        parameters) and start the one copy to the device."""
        rows, draws = slots.shape[0], draw_rows.shape[0]
        if not (rows < self.rows and draws <= self.draws):
            raise ValueError(f"{rows} rows / {draws} draws do not fit bucket ({self.rows}, {self.draws})")
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host_views
        if not hidden.is_cuda:
            host["hidden"][:rows] = hidden
        host["targets"][:rows] = targets
        host["targets"][rows:] = -1
        host["rows"][0, :rows] = slots
        host["rows"][0, rows:] = scratch_slot
        host["rows"][1, :rows] = positions
        host["rows"][1, rows:] = 0
        host["draw_rows"][:draws] = draw_rows
        host["draw_rows"][draws:] = self.rows - 1
        host["ints"][:, :draws] = ints
        host["ints"][:, draws:] = 0
        host["ints"][INT_FIELDS.index("slot"), draws:] = scratch_slot
        host["floats"][:, :draws] = floats
        host["floats"][:, draws:] = 1.0              # temperature, top_p, penalty: all neutral
        self.staged.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if hidden.is_cuda:
            self.hidden[:rows] = hidden

    def stage_idle(self, scratch_slot: int) -> None:
        """No real row or draw, hidden rows zero (for warm-up and capture)."""
        self.host_views["hidden"].zero_()
        no_rows = torch.empty(0, dtype=torch.int64)
        self.stage(scratch_slot, self.host_views["hidden"][:0], self.host_views["targets"][:0], no_rows, no_rows,
                   no_rows, self.host_views["ints"][:, :0], self.host_views["floats"][:, :0])


@dataclass(frozen=True)
class Chunk:
    """One replay of a step: its rows [start, stop) and draws [first_draw, last_draw)."""
    start: int
    stop: int
    first_draw: int
    last_draw: int
    bucket: StepBucket


class StepGraphs:
    """One graph per (T, D) of `step(bucket) -> int64 [D, N + 1]` (draw rows' codes, stop flag)."""

    def __init__(self, step: Callable[[StepBucket], Tensor], *, max_sessions: int, hidden_size: int,
                 hidden_dtype: torch.dtype, num_codebooks: int, device: torch.device, scratch_slot: int,
                 row_buckets=None, draw_buckets=None):
        self.step = step
        self.scratch_slot = scratch_slot
        self.buckets = {shape: StepBucket(*shape, hidden_size, hidden_dtype, num_codebooks, device)
                        for shape in step_shapes(max_sessions, row_buckets, draw_buckets)}
        self.row_sizes = sorted({t for t, _ in self.buckets})
        self.largest_rows = self.row_sizes[-1] - 1          # real rows per replay, at most
        self.replays = 0

    def capture(self, warmup: int = 1) -> None:
        """Warm up each shape on the capture stream (Triton specialisations, cuBLAS's workspace
        for this stream), then capture it; largest first, so the smaller graphs fit in the
        memory the first one left in the shared pool."""
        device = next(iter(self.buckets.values())).staged.device
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)                  # this family's own (see the docstring)
        for shape in sorted(self.buckets, reverse=True):
            bucket = self.buckets[shape]
            bucket.stage_idle(self.scratch_slot)
            bucket.graph, bucket.output = cuda_graphs.capture(lambda: self.step(bucket), pool=pool, stream=stream,
                                                              warmup=warmup)
        torch.cuda.synchronize()
        # The warm-up runs' blocks (the largest shape's activations, ~2 GB at 2048 rows) stay
        # cached for the capture stream, which nothing else allocates on: give them back.
        torch.cuda.empty_cache()

    @property
    def captured(self) -> bool:
        return all(b.graph is not None for b in self.buckets.values())

    def bucket_for(self, rows: int, draws: int) -> StepBucket | None:
        """The smallest shape with a padding row to spare (T > rows) and room for the draws."""
        for t in self.row_sizes:
            if t > rows:
                fitting = [d for tt, d in self.buckets if tt == t and d >= max(draws, 1)]
                return self.buckets[(t, min(fitting))] if fitting else None
        return None

    def plan(self, rows: int, draw_rows: list[int]) -> list[Chunk] | None:
        """The replays of a step of `rows` rows whose draws sit at `draw_rows` (ascending), or
        None when a replay's draws fit no shape (more draws than the largest D)."""
        chunks, start, first_draw = [], 0, 0
        while start < rows:
            stop = min(rows, start + self.largest_rows)
            last_draw = first_draw
            while last_draw < len(draw_rows) and draw_rows[last_draw] < stop:
                last_draw += 1
            bucket = self.bucket_for(stop - start, last_draw - first_draw)
            if bucket is None:
                return None
            chunks.append(Chunk(start, stop, first_draw, last_draw, bucket))
            start, first_draw = stop, last_draw
        return chunks

    def run(self, chunks: list[Chunk], hidden: Tensor, targets: Tensor, slots: Tensor, positions: Tensor,
            draw_rows: Tensor, ints: Tensor, floats: Tensor) -> Tensor:
        """Replay `plan`'s chunks over a step's R rows: hidden [R, D] (host or device), targets
        int64 [R, N], slots/positions int64 [R], draw_rows int64 [d] (ascending), ints int64
        [6, d] / floats float32 [3, d] (INT_FIELDS, FLOAT_FIELDS order), all on the host but
        hidden. Returns int64 [d, N + 1] on the host; with no draws, an empty tensor at once
        (no wait for the GPU, as the eager step)."""
        answers = []
        for chunk in chunks:
            bucket = chunk.bucket
            rows, draws = slice(chunk.start, chunk.stop), slice(chunk.first_draw, chunk.last_draw)
            bucket.stage(self.scratch_slot, hidden[rows], targets[rows], slots[rows], positions[rows],
                         draw_rows[draws] - chunk.start, ints[:, draws], floats[:, draws])
            if bucket.graph is None:      # not captured (CPU: the same code, run op by op)
                bucket.output = self.step(bucket)
            else:
                bucket.graph.replay()
                self.replays += 1
            if chunk.last_draw > chunk.first_draw:
                # the next replay of this shape overwrites the output: keep a copy (on the device)
                answers.append(bucket.output[:chunk.last_draw - chunk.first_draw].clone())
        if not answers:
            return torch.empty(0, targets.shape[1] + 1, dtype=torch.int64)
        return torch.cat(answers).cpu()

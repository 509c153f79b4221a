"""CUDA graphs of the tower's decode step: every accepted entry a single-row draw (the steady state).

Eager, a decode step is ~2700 small launches; replayed from a graph it is one launch from the
host, plus one host-to-device copy of the inputs and one device-to-host copy of the answer.

    buckets: batch sizes 1, 2, 4, 8, 16, 32, 64, 128, capped at max_sessions (a step of R rows
    replays the smallest bucket >= R). Rows past R point at the engine's scratch slot (a pool
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
never overlap (one worker thread), so sharing is safe.

DRAMA_TOWER_GRAPHS=0 turns them off (default on when the tower runs on CUDA). On the CPU (tests
only) the buckets run the same staged step without capture, so CI checks the staging, padding
and scratch-slot logic against the eager step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from services.common import grpcutil

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
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


class Bucket:
    """The static buffers, the graph and its output for one batch size."""

    def __init__(self, size: int, hidden_size: int, hidden_dtype: torch.dtype, num_codebooks: int,
                 device: torch.device):
        self.size = size
        element = torch.empty(0, dtype=hidden_dtype).element_size()
        hidden_bytes = _aligned(size * hidden_size * element)
        int_bytes = _aligned(len(INT_FIELDS) * size * 8)
        float_bytes = _aligned(len(FLOAT_FIELDS) * size * 4)
        total = hidden_bytes + int_bytes + float_bytes
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.staged = torch.zeros(total, dtype=torch.uint8, device=device)

        def views(buffer: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            hidden = buffer[:size * hidden_size * element].view(hidden_dtype).view(size, hidden_size)
            ints = buffer[hidden_bytes:hidden_bytes + len(INT_FIELDS) * size * 8].view(torch.int64)
            floats = buffer[hidden_bytes + int_bytes:hidden_bytes + int_bytes + len(FLOAT_FIELDS) * size * 4]
            return hidden, ints.view(len(INT_FIELDS), size), floats.view(torch.float32).view(len(FLOAT_FIELDS), size)

        self.host_hidden, self.host_ints, self.host_floats = views(self.host)
        self.hidden, self.ints, self.floats = views(self.staged)
        self.targets = torch.full((size, num_codebooks), -1, dtype=torch.int64, device=device)
        self.draw_rows = torch.arange(size, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None

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

    def capture(self, warmup: int = 2) -> None:
        """Warm up on a side stream (Triton compilation, cuBLAS handles), then capture, largest
        bucket first so the smaller ones fit in the memory the first one left in the pool."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            bucket.stage_idle(self.scratch_slot)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self.step(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                bucket.output = self.step(bucket)
            bucket.graph = graph
        torch.cuda.synchronize()

    @property
    def captured(self) -> bool:
        return all(b.graph is not None for b in self.buckets)

    def bucket_for(self, rows: int) -> Bucket | None:
        return next((b for b in self.buckets if b.size >= rows), None)

    def run(self, ints: Tensor, floats: Tensor, hidden: Tensor) -> Tensor:
        """ints int64 [6, R] and floats float32 [3, R] (INT_FIELDS, FLOAT_FIELDS order, on the
        host), hidden [R, D] (host or device): replay the bucket, return int64 [R, N + 1] on the
        host (one device-to-host copy, which also waits for the replay)."""
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
        return bucket.output[:rows].cpu()

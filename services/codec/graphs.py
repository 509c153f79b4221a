"""Streaming decode through CUDA graphs: a device slot pool of stream states, one graph per
(chunk length t, batch bucket B) (issue #3 / #7).

An eager decode step is ~1000 small kernels whose launches cost ~10x their GPU time. Here every
session's stream state (state.py) lives in one row ("slot") of preallocated pool tensors on the
device, and a captured graph does a whole tick for B sessions: gather the B slots' states, run
`Codec._step`, scatter the new states back, and quantise the audio to PCM16. Its only inputs are
one int64 tensor [B, 1 + N·t] (each row: slot index, then the codes) and the pool; rows past the
real batch point at a scratch slot, whose contents are garbage nobody reads.

    streams = GraphedDecoder(codec, slots=256)      # codec prepared on CUDA (or CPU: eager ticks)
    streams.capture()                               # at start-up, before SERVING
    slot = streams.acquire()                        # PoolFull when all slots are taken
    pcm = streams.decode_pcm16([slot, ...], [codes [N, t], ...])   # int16 LE bytes per chunk
    streams.release(slot)
    audio = streams.decode(codes [B, N, T])         # offline, through the B=1 graphs

Chunk lengths: the gateway sends what the backbone emits (API.md §2.1 `latency`): a first message
of 2, 4 or 8 frames, then 8 per message, and the rest (1-7) at each text chunk's end, so the
server sees t = 1…8. `lengths` defaults to 1, 2, 4 and 8, each with a graph per batch bucket: a
rest of 3, 5, 6 or 7 frames (once per text chunk) runs as two or three replays. Every length
is one more graph per bucket, and with the codec's cuDNN autotuning (Codec.cudnn_autotuned) a
graph's warm-up costs ~0.5 s of algorithm timing, so 1-8 would double the start. A longer
chunk (a client sending a whole utterance, or an offline decode) is split exactly into the
`long_lengths` (16, 32, 64, 128 frames: graphs at batch 1 only) and the stream lengths; the
pieces run in successive ticks, in order, so 10 s (215 frames) is 128 + 64 + 16 + 4 + 2 + 1:
six replays instead of 27 of the 8-frame graph (a replay has a fixed cost: ~560 kernels, most of
them tiny at short lengths). A batch larger than the largest bucket runs as several ticks.
Without a graph (graphs off, or on CPU) the same tick body runs eagerly.

Slot life: `acquire` hands out a free slot marked fresh; the next tick that decodes it first
zeroes it (on the model thread, so a tick still in flight for the slot's previous owner cannot
overwrite the reset); `release` returns it. Handles are per session, so a late tick of a
released session writes only into a slot that is zeroed again before its next owner reads it.

Graphs share one memory pool: captured largest first, one at a time, each graph's intermediates
reuse the same blocks; only the static inputs and outputs are graph-private. The model thread
replays one graph at a time, so sharing is safe. The pool is as large as the largest capture's
intermediates, which scale with batch x frames: a 128-frame graph at batch 1 needs a quarter of
the 8-frame graph at the 64 bucket, so the long lengths add only their own inputs and outputs
(audio float32 + PCM16, 1.5 MB at 128 frames). The graphs hold the codec's weight tensors:
`Codec.prepare` after capture invalidates them (make a new GraphedDecoder).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from services.codec.state import StreamState

log = logging.getLogger(__name__)

STREAM_LENGTHS = (1, 2, 4, 8)
# 12, 24 and 48 too: at 128 streams a tick holds ~12-14 sessions, which padded to 16 before. Two
# A/B pairs of 128-stream stacks on the H200 (docs/perf.md, session 11): streams without underrun
# 180/180 against 163/168, and 117/164 against 83/154, for 12 more graphs at start.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
LONG_LENGTHS = (16, 32, 64, 128)
CAPTURE_PROGRESS_S = 5.0          # a progress line at most this often while capturing
# Cost model for splitting an offline decode: a replay costs about as much as this many frames.
REPLAY_COST_FRAMES = 30


class PoolFull(RuntimeError):
    """Every stream slot is taken (the server answers RESOURCE_EXHAUSTED)."""


@dataclass(eq=False)
class Slot:
    """One session's handle on a pool row."""
    index: int
    fresh: bool = True           # zero the row before its first tick
    released: bool = False
    frames: int = 0              # frames decoded (host-side count, for tests and logs)


@dataclass
class _Graph:
    length: int
    batch: int
    inputs: Tensor               # int64 [B, 1 + N·t] on the device
    audio: Tensor                # float32 [B, t·frame_samples]
    pcm: Tensor                  # int16 [B, t·frame_samples]
    graph: "torch.cuda.CUDAGraph | None" = None


@dataclass
class _Piece:
    """Frames [start, end) of chunk `chunk` of a call, decoded into slot `slot`."""
    chunk: int
    slot: Slot
    start: int
    end: int
    outputs: list = field(default_factory=list)


def split_length(length: int, lengths: tuple[int, ...]) -> list[int]:
    """Exact split of a chunk into available lengths, largest first (1 must be available)."""
    pieces, left = [], length
    for size in sorted(lengths, reverse=True):
        while left >= size:
            pieces.append(size)
            left -= size
    if left:
        raise ValueError(f"{length} frames cannot be split into lengths {lengths}")
    return pieces


def plan_offline(frames: int, lengths: tuple[int, ...],
                 replay_cost: int = REPLAY_COST_FRAMES) -> list[int]:
    """Pieces covering at least `frames` frames (the last may be padded: decoding is causal, so
    frames appended at the end change nothing before them), minimising Σ (replay_cost + piece)."""
    if frames <= 0:
        return []
    best = [0] + [None] * frames          # best[n]: (cost, first piece) to cover n frames
    for n in range(1, frames + 1):
        for size in lengths:
            rest = max(0, n - size)
            cost = best[rest][0] + replay_cost + size if rest else replay_cost + size
            if best[n] is None or cost < best[n][0]:
                best[n] = (cost, size)
    pieces, n = [], frames
    while n > 0:
        size = best[n][1]
        pieces.append(size)
        n = max(0, n - size)
    return sorted(pieces, reverse=True)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in sorted(buckets) if b >= batch)


class GraphedDecoder:
    """The slot pool plus the captured graphs; every decode call runs on the model thread."""

    def __init__(self, codec, slots: int = 256, *, lengths: tuple[int, ...] = STREAM_LENGTHS,
                 buckets: tuple[int, ...] = BATCH_BUCKETS,
                 long_lengths: tuple[int, ...] = LONG_LENGTHS, use_graphs: bool | None = None):
        if 1 not in lengths:
            raise ValueError("lengths must include 1 (any chunk must split into graphed lengths)")
        if 1 not in buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive and include 1 (a lone session's tick), got {buckets}")
        if min(long_lengths, default=1) < 1:
            raise ValueError(f"long_lengths must be positive, got {long_lengths}")
        self.codec = codec
        self.device = codec.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.lengths, self.buckets = tuple(sorted(lengths)), tuple(sorted(buckets))
        # batch-1 lengths for long chunks; one that is also a stream length keeps its buckets
        self.long_lengths = tuple(sorted(set(long_lengths) - set(lengths)))
        self.slots = slots
        self.scratch = slots                           # the extra row padded rows write into
        pool = codec.new_state(slots + 1)
        self.position, self.tensors = pool.position, pool.tensors
        self._free = list(range(slots - 1, -1, -1))    # pop() hands out the lowest index first
        self._lock = threading.Lock()                  # acquire/release may come from any thread
        self._graphs: dict[tuple[int, int], _Graph] = {}      # (length, bucket) -> graph
        self._mempool = None
        self.capture_seconds = 0.0
        self.ticks = 0                                 # tick bodies run (graph replays + eager)
        self._limits: Tensor | None = None             # [N, 1] code bounds (_check)

    # -- slots ----------------------------------------------------------------------------------

    @property
    def open_slots(self) -> int:
        return self.slots - len(self._free)

    def acquire(self) -> Slot:
        with self._lock:
            if not self._free:
                raise PoolFull(f"codec stream pool full ({self.slots} sessions)")
            return Slot(self._free.pop())

    def release(self, slot: Slot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            self._free.append(slot.index)

    def state_of(self, slot: Slot) -> StreamState:
        """A copy of one slot's stream state (tests: compare with an eager stream)."""
        if slot.fresh:
            self._reset([slot])
        i = slot.index
        return StreamState(self.position[i:i + 1].clone(),
                           {k: v[i:i + 1].clone() for k, v in self.tensors.items()})

    def _reset(self, slots: list[Slot]) -> None:
        index = torch.tensor([s.index for s in slots], device=self.device)
        self.position.index_fill_(0, index, 0)
        for tensor in self.tensors.values():
            tensor.index_fill_(0, index, 0)
        for s in slots:
            s.fresh = False

    # -- the tick body (captured, or run eagerly) -----------------------------------------------

    def _tick(self, inputs: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """inputs int64 [B, 1 + N·t] (slot index, codes) -> (audio float32, pcm int16) [B, t·2048].

        Gathers the rows' states, runs one step, scatters the new states back into the pool.
        Padded rows all point at the scratch slot (index_copy_ keeps one of them; any will do).
        """
        batch = inputs.shape[0]
        index = inputs[:, 0]
        codes = inputs[:, 1:].view(batch, self.codec.num_codebooks, length)
        state = StreamState(self.position.index_select(0, index),
                            {k: v.index_select(0, index) for k, v in self.tensors.items()})
        audio = self.codec._step(codes, state)
        self.position.index_copy_(0, index, state.position)
        for key, tensor in self.tensors.items():
            tensor.index_copy_(0, index, state.tensors[key])
        # PCM16 (MODEL.md §7.4 step 6) on the device: half the bytes to copy out, no host math.
        pcm = torch.round(audio.clamp(-1.0, 1.0) * 32767.0).to(torch.int16)
        return audio, pcm

    def _new_graph(self, length: int, batch: int) -> _Graph:
        inputs = torch.zeros(batch, 1 + self.codec.num_codebooks * length, dtype=torch.int64,
                             device=self.device)
        inputs[:, 0] = self.scratch
        return _Graph(length, batch, inputs, None, None)

    def _capture_one(self, length: int, batch: int) -> _Graph:
        entry = self._new_graph(length, batch)
        # Warm-up on a side stream (cuDNN/cuBLAS handles, Triton compiles, algorithm choice),
        # then capture; both touch only the scratch slot.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            self._tick(entry.inputs, length)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._mempool, stream=stream):
            entry.audio, entry.pcm = self._tick(entry.inputs, length)
        if self._mempool is None:
            self._mempool = graph.pool()
        entry.graph = graph
        return entry

    def buckets_for(self, length: int) -> tuple[int, ...]:
        """The batch buckets a chunk length runs in: every bucket for a stream length, batch 1 for
        a long one (a long piece is big enough to fill the GPU alone)."""
        return self.buckets if length in self.lengths else (1,)

    def capture(self) -> None:
        """Capture every (length, bucket) graph, largest first so later captures fit in the
        blocks earlier ones freed."""
        if not self.use_graphs:
            return
        started = time.perf_counter()
        wanted = [(t, b) for t in self.lengths + self.long_lengths for b in self.buckets_for(t)]
        jobs = sorted((job for job in wanted if job not in self._graphs),
                      key=lambda job: job[0] * job[1], reverse=True)
        reported = started
        for done, (length, batch) in enumerate(jobs, 1):
            self._graphs[(length, batch)] = self._capture_one(length, batch)
            if time.perf_counter() - reported >= CAPTURE_PROGRESS_S and done < len(jobs):
                # each warm-up times cuDNN's algorithms for its shapes (Codec.cudnn_autotuned):
                # ~0.5-1 s per graph on the H200, so a start shows where it is
                reported = time.perf_counter()
                log.info("codec: %d of %d decode graphs captured (%.0f s)", done, len(jobs), reported - started)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - started
        log.info("codec: %d decode graphs captured in %.1f s (lengths %s, buckets %s, long lengths %s)",
                 len(jobs), time.perf_counter() - started, self.lengths, self.buckets,
                 self.long_lengths)

    # -- running ticks ----------------------------------------------------------------------------

    def _run(self, length: int, rows: list[tuple[int, Tensor]], graph: _Graph | None,
             bucket: int) -> tuple[Tensor, Tensor]:
        """One tick: rows = (slot index, codes [N, length]); returns the graph's (or eager) outputs,
        valid until the next tick."""
        host = torch.zeros(bucket, 1 + self.codec.num_codebooks * length, dtype=torch.int64)
        host[:, 0] = self.scratch
        host[:len(rows), 0] = torch.tensor([index for index, _ in rows])
        host[:len(rows), 1:] = torch.stack([codes.reshape(-1) for _, codes in rows])
        self.ticks += 1
        if graph is not None:
            graph.inputs.copy_(host)
            graph.graph.replay()
            return graph.audio, graph.pcm
        return self._tick(host.to(self.device), length)

    def _stream_pieces(self, slots: list[Slot], chunks: list[Tensor]) -> list[list[_Piece]]:
        """Rounds of pieces: a chunk longer than the graphed lengths becomes several pieces, piece
        r of every chunk in round r (a slot's pieces stay in order); a slot named twice in one
        call gets its second chunk in later rounds."""
        rounds: list[list[_Piece]] = []
        next_round: dict[int, int] = {}
        for number, (slot, chunk) in enumerate(zip(slots, chunks)):
            start = 0
            first = next_round.get(slot.index, 0)
            pieces = (split_length(chunk.shape[-1], self.lengths + self.long_lengths)
                      if chunk.shape[-1] else [])
            for offset, size in enumerate(pieces):
                while len(rounds) <= first + offset:
                    rounds.append([])
                rounds[first + offset].append(_Piece(number, slot, start, start + size))
                start += size
            next_round[slot.index] = first + len(pieces)
        return rounds

    @torch.inference_mode()
    def _decode(self, slots: list[Slot], chunks: list[Tensor], pcm16: bool) -> list[Tensor]:
        """Host tensors per chunk: int16 PCM (pcm16) or float32 audio, [t·frame_samples]."""
        chunks = [torch.as_tensor(c).cpu() for c in chunks]
        self._check(chunks)
        chunks = [c.to(torch.int64) for c in chunks]
        # A released slot may already belong to a new session: never reset it for the old one.
        fresh = [s for s in dict.fromkeys(slots) if s.fresh and not s.released]
        if fresh:
            self._reset(fresh)
        pieces_of: list[list[Tensor]] = [[] for _ in chunks]
        for round_pieces in self._stream_pieces(slots, chunks):
            by_length: dict[int, list[_Piece]] = {}
            for piece in round_pieces:
                by_length.setdefault(piece.end - piece.start, []).append(piece)
            for length, members in by_length.items():
                buckets = self.buckets_for(length)
                for first in range(0, len(members), buckets[-1]):
                    group = members[first:first + buckets[-1]]
                    bucket = bucket_for(len(group), buckets)
                    graph = self._graphs.get((length, bucket))
                    # released slots (a session gone while its chunk waited) write into scratch
                    rows = [(self.scratch if p.slot.released else p.slot.index,
                             chunks[p.chunk][:, p.start:p.end]) for p in group]
                    audio, pcm = self._run(length, rows, graph, bucket)
                    out = (pcm if pcm16 else audio)[:len(group)].cpu()     # one copy per tick
                    for row, piece in enumerate(group):
                        pieces_of[piece.chunk].append(out[row])
                        piece.slot.frames += length
        empty = torch.zeros(0, dtype=torch.int16 if pcm16 else torch.float32)
        return [torch.cat(p) if len(p) > 1 else (p[0] if p else empty) for p in pieces_of]

    def _check(self, chunks: list[Tensor]) -> None:
        """Validate every chunk before any state changes (an out-of-range code would index past a
        codebook inside the graph). One vector compare per chunk; Codec.check_codes words the
        error."""
        if self._limits is None:
            codec = self.codec
            self._limits = torch.tensor([codec.semantic_codebook_size]
                                        + [codec.codebook_size] * (codec.num_codebooks - 1))[:, None]
        for chunk in chunks:
            if chunk.dim() != 2 or chunk.shape[0] != self.codec.num_codebooks or (
                    chunk.dtype.is_floating_point or chunk.dtype == torch.bool) or (
                    chunk.numel() and bool(((chunk < 0) | (chunk >= self._limits)).any())):
                self.codec.check_codes(chunk[None])
                raise ValueError(f"codes must be [{self.codec.num_codebooks}, t], got {list(chunk.shape)}")

    def decode_streams(self, slots: list[Slot], chunks: list[Tensor]) -> list[Tensor]:
        """Codec.decode_streams over slots: float32 [t_i·frame_samples] per chunk (on the host)."""
        return self._decode(slots, chunks, pcm16=False)

    def decode_pcm16(self, slots: list[Slot], chunks: list[Tensor]) -> list[bytes]:
        """The server's call: int16 little-endian PCM bytes per chunk (MODEL.md §7.4 step 6)."""
        return [pcm.numpy().astype("<i2", copy=False).tobytes()
                for pcm in self._decode(slots, chunks, pcm16=True)]

    # -- offline ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """Offline decode, codes [B, N, T] -> float32 [B, T·frame_samples] on the device.

        Each row streams through the batch-1 lengths (long and stream) in pieces planned by
        plan_offline: the stream ends here, so the last piece may be padded with code 0 when one
        replay fewer is worth it (10 s: 128 + 64 + 32, 9 frames of padding). Takes a pool slot
        per row for the duration of the call. Equal to a stream of the same frames within F16
        rounding (other piece lengths, other conv shapes), not bit for bit.
        """
        codes = torch.as_tensor(codes)
        self.codec.check_codes(codes)
        codes = codes.to(torch.int64).cpu()
        batch, _, frames = codes.shape
        frame_samples = self.codec.frame_samples
        out = torch.empty(batch, frames * frame_samples, device=self.device)
        plan = plan_offline(frames, self.lengths + self.long_lengths)
        for row in range(batch):
            slot = self.acquire()
            try:
                self._reset([slot])
                start = 0
                for size in plan:
                    piece = codes[row, :, start:start + size]
                    real = piece.shape[-1]
                    if real < size:
                        piece = torch.cat([piece, piece.new_zeros(piece.shape[0], size - real)], -1)
                    audio, _ = self._run(size, [(slot.index, piece)], self._graphs.get((size, 1)), 1)
                    out[row, start * frame_samples:(start + real) * frame_samples] = \
                        audio[0, :real * frame_samples]
                    start += real
            finally:
                self.release(slot)
        return out

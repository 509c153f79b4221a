"""Gathers the pending decode chunks of all sessions into one model call per tick (API.md §3.3).

A tick starts when a chunk arrives and closes when the oldest pending chunk has waited
`max_wait_s` (5 ms), the batch is full, or every open stream has its chunk pending (a stream
waits for its chunk's PCM before it sends the next, so no one else could join: a lone stream's
first audio does not wait out the window); the call runs on the model worker thread, so the event
loop keeps serving I/O meanwhile. Chunks that arrive during a call form the next tick at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from opentelemetry import metrics

from services.codec.state import StreamState
from services.common import aio
from services.common.telemetry import BATCH_SIZE_BUCKETS, STEP_SECONDS_BUCKETS

log = logging.getLogger(__name__)

# API.md §1.7; no-ops until a MeterProvider is set (telemetry.setup_telemetry when exporting).
_meter = metrics.get_meter("services.codec")
_decode_seconds = _meter.create_histogram(
    "drama_codec_decode_seconds", unit="s", description="time of one batched decode call",
    explicit_bucket_boundaries_advisory=STEP_SECONDS_BUCKETS)
_batch_size = _meter.create_histogram(
    "drama_codec_batch_size", unit="{session}", description="sessions per batched decode call",
    explicit_bucket_boundaries_advisory=BATCH_SIZE_BUCKETS)


def pcm16_bytes(samples: torch.Tensor) -> bytes:
    """float [S] -> int16 little-endian bytes: round(clamp(x, -1, 1) · 32767) (MODEL.md §7.4)."""
    values = torch.round(samples.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16)
    return values.numpy().astype("<i2", copy=False).tobytes()


@dataclass
class _Pending:
    state: StreamState           # or a GraphedDecoder slot
    codes: torch.Tensor          # [N, t]
    future: asyncio.Future
    arrived: float


class DecodeBatcher:
    """Collects pending chunks of all sessions and decodes them together on the worker thread."""

    def __init__(self, codec, worker: ThreadPoolExecutor, *, max_wait_s: float = 0.005,
                 max_batch: int = 64, open_streams: Callable[[], int] | None = None):
        """open_streams: how many Decode streams are open now (the server's count); 0 or None:
        unknown, the tick waits out its window."""
        self.codec, self.worker = codec, worker
        self.max_wait_s, self.max_batch = max_wait_s, max_batch
        self.open_streams = open_streams
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="codec-batcher")
        self.batches = 0                 # decode calls made (tests and logs)
        self.largest_batch = 0

    async def decode(self, state: StreamState, codes: torch.Tensor) -> bytes:
        """Queue one chunk (codes [N, t], already validated) and wait for its int16 PCM bytes."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(state, codes, future, time.monotonic()))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            # Wait until the oldest chunk has waited max_wait_s, unless the batch is full.
            while len(self._pending) < self.max_batch:
                streams = self.open_streams() if self.open_streams is not None else 0
                if streams and len(self._pending) >= streams:
                    break                    # every open stream is here: nobody else can join
                left = self._pending[0].arrived + self.max_wait_s - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                # not asyncio.wait_for: it can lose close()'s cancel (aio.wait_event)
                if not await aio.wait_event(self._wake, left):
                    break
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            batch = [p for p in batch if not p.future.done()]     # cancelled callers
            if self._pending:
                self._wake.set()
            if not batch:
                continue
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            try:
                outputs = await loop.run_in_executor(
                    self.worker, self._decode_pcm16, [p.state for p in batch], [p.codes for p in batch])
            except Exception as exc:  # a model failure fails this tick's callers, not the batcher
                log.exception("codec decode failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, pcm in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(pcm)

    def _decode_pcm16(self, states: list, chunks: list[torch.Tensor]) -> list[bytes]:
        """On the worker thread: decode, and bring the samples to the host as PCM16 there, so the
        event loop never waits on a device copy. `codec` is the Codec (states: StreamState) or a
        GraphedDecoder (states: its slots), which quantises on the device itself.

        Timed here: both paths end with the PCM on the host, so the time includes the GPU's."""
        started = time.perf_counter()
        decode_pcm16 = getattr(self.codec, "decode_pcm16", None)
        if decode_pcm16 is not None:
            pcm = decode_pcm16(states, chunks)
        else:
            pcm = [pcm16_bytes(pcm.cpu()) for pcm in self.codec.decode_streams(states, chunks)]
        _decode_seconds.record(time.perf_counter() - started)
        _batch_size.record(len(states))
        return pcm

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        for p in self._pending:
            if not p.future.done():
                p.future.cancel()

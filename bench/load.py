"""Load generator (issue #9): N concurrent streaming requests held for a fixed time, one table.

    python -m bench.load --concurrency 32 --duration 60                 a local CPU stack (tiny checkpoint)
    python -m bench.load --url http://127.0.0.1:8000 --concurrency 8   a running gateway
    python -m bench.load ... --json PATH                                also write the figures

Each of the N workers sends `POST /v1/audio/speech` (progressive body, `stream_format: audio`,
formats taken in turn from --formats) and reads it to the end, then sends the next, until the
duration is over; requests still running then are read to their end, so the wall time is a bit
longer than the duration. Without --url a local stack (services.launcher.Stack: three stage
processes and the gateway on loopback) is started first and stopped afterwards.

Per request it records:
- an *error*: no 200 (the status and error code are counted), or a connection error before the
  first body byte;
- a *truncation*: a 200 whose body was cut: a connection error mid-body (httpx raises
  RemoteProtocolError on a chunked body without its terminating chunk), a pcm body whose length is
  not a whole number of 16-bit samples, or a wav body shorter than its header or with a partial
  sample;
- TTFA: request sent -> first body byte; E2E: request sent -> last byte;
- audio seconds: PCM bytes / 2 / X-Sample-Rate (for wav after its 44-byte header).

Throughput = audio seconds of all completed requests / wall seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WAV_HEADER_BYTES = 44
TEXTS = (
    "Hello there, how are you today?",
    "<|speaker:0|>The quick brown fox [laughs] jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Please hold the line; your call is important to us.",
)


@dataclass
class RequestOutcome:
    status: int | None            # HTTP status, None when the connection failed before one came
    error_code: str | None        # the envelope's error.code, or the exception's class name
    truncated: bool
    ttfa_s: float | None
    e2e_s: float
    audio_s: float
    body_bytes: int


@dataclass
class LoadResult:
    concurrency: int
    duration_s: float
    wall_s: float
    requests: int
    ok: int
    errors: int
    truncated: int
    error_kinds: dict[str, int]
    ttfa_p50_ms: float | None
    ttfa_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    audio_s: float
    throughput: float             # audio seconds per wall second
    requests_per_s: float
    outcomes: list[RequestOutcome] = field(default_factory=list, repr=False)

    def table(self) -> str:
        def ms(value):
            return "-" if value is None else f"{value:.0f}"

        rows = [
            ("concurrency", str(self.concurrency)),
            ("duration (s)", f"{self.duration_s:g}"),
            ("wall (s)", f"{self.wall_s:.1f}"),
            ("requests", str(self.requests)),
            ("ok", str(self.ok)),
            ("errors", str(self.errors) + (f" {dict(self.error_kinds)}" if self.error_kinds else "")),
            ("truncated bodies", str(self.truncated)),
            ("TTFA p50 / p99 (ms)", f"{ms(self.ttfa_p50_ms)} / {ms(self.ttfa_p99_ms)}"),
            ("E2E p50 / p99 (ms)", f"{ms(self.e2e_p50_ms)} / {ms(self.e2e_p99_ms)}"),
            ("audio (s)", f"{self.audio_s:.1f}"),
            ("throughput (audio s / wall s)", f"{self.throughput:.2f}"),
            ("requests / s", f"{self.requests_per_s:.2f}"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'figure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def body_is_whole(fmt: str, body_bytes: int) -> bool:
    """A complete pcm/wav body holds whole 16-bit samples (wav: after its 44-byte header)."""
    if fmt == "pcm":
        return body_bytes % 2 == 0
    if fmt == "wav":
        return body_bytes >= WAV_HEADER_BYTES and (body_bytes - WAV_HEADER_BYTES) % 2 == 0
    return body_bytes > 0


def audio_seconds(fmt: str, body_bytes: int, sample_rate: int) -> float:
    pcm_bytes = body_bytes - (WAV_HEADER_BYTES if fmt == "wav" else 0)
    return max(0, pcm_bytes) / 2 / sample_rate if fmt in ("pcm", "wav") else 0.0


def _error_code(response: httpx.Response, body: bytes) -> str:
    try:
        return json.loads(body)["error"]["code"] or f"http_{response.status_code}"
    except (ValueError, KeyError, TypeError):
        return f"http_{response.status_code}"


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestOutcome:
    """Send one progressive request and read it to the end; never raises for HTTP-level trouble."""
    fmt = body.get("response_format", "mp3")
    started = time.monotonic()
    ttfa = None
    received = 0
    status = None
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            status = response.status_code
            if status != 200:
                data = await response.aread()
                return RequestOutcome(status, _error_code(response, data), False, None,
                                      time.monotonic() - started, 0.0, len(data))
            rate = int(response.headers.get("x-sample-rate", "24000"))
            async for piece in response.aiter_raw():
                if piece and ttfa is None:
                    ttfa = time.monotonic() - started
                received += len(piece)
    except (httpx.HTTPError, OSError) as exc:
        # Before a status: an error; after a 200: the body was cut.
        return RequestOutcome(status, type(exc).__name__, status == 200, ttfa,
                              time.monotonic() - started, 0.0, received)
    whole = body_is_whole(fmt, received)
    return RequestOutcome(200, None if whole else "partial_sample", not whole, ttfa,
                          time.monotonic() - started, audio_seconds(fmt, received, rate), received)


def request_body(index: int, formats: list[str], max_new_tokens: int, voice: str = "alloy") -> dict:
    return {"model": "drama-3", "input": TEXTS[index % len(TEXTS)], "voice": voice,
            "response_format": formats[index % len(formats)], "max_new_tokens": max_new_tokens,
            "seed": index, "latency": "low"}


async def run_load(url: str, *, concurrency: int, duration_s: float, max_new_tokens: int = 8,
                   formats: tuple[str, ...] = ("pcm", "wav"), request_timeout_s: float = 120.0,
                   headers: dict[str, str] | None = None) -> LoadResult:
    """Hold `concurrency` requests in flight for `duration_s`; returns the figures."""
    url = url.rstrip("/")
    outcomes: list[RequestOutcome] = []
    counter = iter(range(10 ** 9))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.monotonic()
    stop_at = started + duration_s

    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits, headers=headers) as client:
        async def worker():
            while time.monotonic() < stop_at:
                body = request_body(next(counter), list(formats), max_new_tokens)
                outcomes.append(await one_request(client, url, body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - started

    ok = [o for o in outcomes if o.status == 200 and not o.truncated]
    errors = [o for o in outcomes if o.status != 200]
    kinds = collections.Counter(f"{o.status}:{o.error_code}" for o in outcomes if o.error_code)
    ttfas = [o.ttfa_s * 1000 for o in ok if o.ttfa_s is not None]
    e2es = [o.e2e_s * 1000 for o in ok]
    audio = sum(o.audio_s for o in ok)
    return LoadResult(
        concurrency=concurrency, duration_s=duration_s, wall_s=wall, requests=len(outcomes), ok=len(ok),
        errors=len(errors), truncated=sum(o.truncated for o in outcomes), error_kinds=dict(kinds),
        ttfa_p50_ms=percentile(ttfas, 50), ttfa_p99_ms=percentile(ttfas, 99),
        e2e_p50_ms=percentile(e2es, 50), e2e_p99_ms=percentile(e2es, 99), audio_s=audio,
        throughput=audio / wall if wall else 0.0, requests_per_s=len(outcomes) / wall if wall else 0.0,
        outcomes=outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="gateway URL (default: start a local CPU stack)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint for the local stack (default: tiny)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to keep starting requests")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="frames per request (short takes)")
    parser.add_argument("--formats", default="pcm,wav", help="comma-separated, taken in turn")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    stack = None
    url = args.url
    if url is None:
        from services.launcher import Stack, ensure_checkpoint

        checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_checkpoint()
        stack = Stack(checkpoint, 0)
        print(f"starting a local stack from {checkpoint} (logs in {stack.log_dir}) ...", file=sys.stderr)
        stack.start()
        url = stack.url
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        result = asyncio.run(run_load(url, concurrency=args.concurrency, duration_s=args.duration,
                                      max_new_tokens=args.max_new_tokens,
                                      formats=tuple(args.formats.split(",")), headers=headers))
    finally:
        if stack is not None:
            stack.stop()
    print(result.table())
    if args.json:
        figures = {k: v for k, v in asdict(result).items() if k != "outcomes"}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if result.errors == 0 and result.truncated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Load generator (issue #9): N concurrent streaming requests held for a fixed time, one table.

    python -m bench.load --concurrency 32 --duration 60                 a local CPU stack (tiny checkpoint)
    python -m bench.load --url http://127.0.0.1:8000 --concurrency 8   a running gateway
    python -m bench.load ... --json PATH                                also write the figures
    python -m bench.load --requests 1000 --cancel-fraction 0.3          nothing lost (see below)

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

With --requests N the run is counted instead of timed: N requests at --concurrency, a fraction
(--cancel-fraction) of them cancelled by the client at a random point (before the status line,
or after a random number of body bytes). Every request not cancelled must complete whole. On a
local stack the stages' open sessions and free cache slots (GetInfo) and every process's RSS are
read before (after a warm-up) and after; the run fails unless the sessions and slots are back to
their start values.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
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
    underrun_s: float = 0.0       # largest playback deficit, played in real time from the first byte
    underrun_after_1s: float = 0.0  # the same with one second buffered before playback starts


def playback_deficit(arrivals: list[tuple[float, float]], buffer_s: float = 0.0) -> float:
    """Largest deficit of a stream played in real time from its first byte (plus `buffer_s`).

    arrivals: (seconds since the first byte, audio seconds received up to and including that
    piece), in order. Playback needs `t - buffer_s` seconds of audio at time t; the deficit is worst
    just before a piece arrives, when only the earlier pieces' audio is there."""
    worst, before = 0.0, 0.0
    for t, total in arrivals:
        worst = max(worst, t - buffer_s - before)
        before = total
    return worst


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
    underrun_max_s: float = 0.0
    streams_without_underrun: int = 0   # whole streams with no deficit after a 1 s start buffer
    rtf_p50: float | None = None        # per stream: request wall time / audio duration
    started_unix: float = 0.0           # wall clock of the level's start and end (bench/stage_metrics.py
    ended_unix: float = 0.0             # lines the stages' metric exports up with the levels)
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
            ("RTF p50 (wall / audio)", "-" if self.rtf_p50 is None else f"{self.rtf_p50:.2f}"),
            ("underrun max (s)", f"{self.underrun_max_s:.2f}"),
            ("streams without underrun after 1 s", f"{self.streams_without_underrun} / {self.ok}"),
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
    arrivals: list[tuple[float, float]] = []
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            status = response.status_code
            if status != 200:
                data = await response.aread()
                return RequestOutcome(status, _error_code(response, data), False, None,
                                      time.monotonic() - started, 0.0, len(data))
            rate = int(response.headers.get("x-sample-rate", "24000"))
            async for piece in response.aiter_raw():
                if not piece:
                    continue
                now = time.monotonic()
                if ttfa is None:
                    ttfa = now - started
                received += len(piece)
                arrivals.append((now - started - ttfa, audio_seconds(fmt, received, rate)))
    except (httpx.HTTPError, OSError) as exc:
        # Before a status: an error; after a 200: the body was cut.
        return RequestOutcome(status, type(exc).__name__, status == 200, ttfa,
                              time.monotonic() - started, 0.0, received)
    whole = body_is_whole(fmt, received)
    return RequestOutcome(200, None if whole else "partial_sample", not whole, ttfa,
                          time.monotonic() - started, audio_seconds(fmt, received, rate), received,
                          playback_deficit(arrivals), playback_deficit(arrivals, buffer_s=1.0))


def request_body(index: int, formats: list[str], max_new_tokens: int, voice: str = "alloy",
                 sample_rate: int | None = None) -> dict:
    body = {"model": "drama-3", "input": TEXTS[index % len(TEXTS)], "voice": voice,
            "response_format": formats[index % len(formats)], "max_new_tokens": max_new_tokens,
            "seed": index, "latency": "low"}
    if sample_rate:
        body["sample_rate"] = sample_rate
    return body


async def run_load(url: str, *, concurrency: int, duration_s: float, max_new_tokens: int = 8,
                   formats: tuple[str, ...] = ("pcm", "wav"), request_timeout_s: float = 120.0,
                   headers: dict[str, str] | None = None, ramp_s: float = 0.0,
                   sample_rate: int | None = None) -> LoadResult:
    """Hold `concurrency` requests in flight for `duration_s`; returns the figures.

    ramp_s: worker i sends its first request i/concurrency * ramp_s seconds after the start, so
    the first requests arrive spread over the ramp instead of all in the same millisecond (0: all
    at once, the worst case for the first TTFAs)."""
    url = url.rstrip("/")
    outcomes: list[RequestOutcome] = []
    counter = iter(range(10 ** 9))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.monotonic()
    started_unix = time.time()
    stop_at = started + duration_s

    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits, headers=headers) as client:
        async def worker(index: int):
            await asyncio.sleep(ramp_s * index / concurrency)
            while time.monotonic() < stop_at:
                body = request_body(next(counter), list(formats), max_new_tokens, sample_rate=sample_rate)
                outcomes.append(await one_request(client, url, body))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
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
        underrun_max_s=max((o.underrun_s for o in ok), default=0.0),
        streams_without_underrun=sum(o.underrun_after_1s <= 0.0 for o in ok),
        rtf_p50=percentile([o.e2e_s / o.audio_s for o in ok if o.audio_s > 0], 50),
        started_unix=started_unix, ended_unix=time.time(), outcomes=outcomes)


# --------------------------------------------------------------------------------------------
# Nothing lost: cancelled requests, stage sessions, RSS
# --------------------------------------------------------------------------------------------

@dataclass
class CancelResult:
    requests: int
    completed: int               # not cancelled, 200 with a whole body
    cancelled_before_body: int   # cancelled before the first body byte
    cancelled_mid_body: int
    failed: list[str]            # not cancelled but not whole: status/error of each
    wall_s: float


async def _cancelled_request(client: httpx.AsyncClient, url: str, body: dict, rng: random.Random,
                             by_bytes: bool) -> str:
    """A request the client abandons: after a random delay (possibly before the status line) or,
    with `by_bytes`, after a random number of body bytes. Returns where it was cut: 'before_body'
    or 'mid_body'."""
    received = 0
    cut_after_bytes = rng.randint(1, 8192) if by_bytes else None

    async def read():
        nonlocal received
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            async for piece in response.aiter_raw():
                received += len(piece)
                if cut_after_bytes is not None and received >= cut_after_bytes:
                    return         # leaving the block closes the connection mid-body

    task = asyncio.ensure_future(read())
    if cut_after_bytes is None:
        await asyncio.wait({task}, timeout=rng.uniform(0.0, 1.5))
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return "mid_body" if received else "before_body"


async def run_with_cancellations(url: str, *, requests: int, cancel_fraction: float = 0.3,
                                 concurrency: int = 8, max_new_tokens: int = 6, seed: int = 0,
                                 request_timeout_s: float = 120.0) -> CancelResult:
    """`requests` requests at `concurrency`, `cancel_fraction` of them cancelled at random points."""
    url = url.rstrip("/")
    rng = random.Random(seed)
    cancelled = sorted(rng.sample(range(requests), round(requests * cancel_fraction)))
    # Cancelled requests alternate between a cut by time and a cut by bytes.
    plan = [None] * requests
    for turn, index in enumerate(cancelled):
        plan[index] = "bytes" if turn % 2 else "time"
    counts = collections.Counter()
    failed: list[str] = []
    queue = iter(enumerate(plan))
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:
        async def worker():
            for index, cancel in queue:
                body = request_body(index, ["pcm", "wav"], max_new_tokens)
                if cancel is not None:
                    counts[await _cancelled_request(client, url, body, rng, cancel == "bytes")] += 1
                    continue
                outcome = await one_request(client, url, body)
                if outcome.status == 200 and not outcome.truncated:
                    counts["completed"] += 1
                else:
                    failed.append(f"{outcome.status}:{outcome.error_code}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return CancelResult(requests=requests, completed=counts["completed"],
                        cancelled_before_body=counts["before_body"], cancelled_mid_body=counts["mid_body"],
                        failed=failed, wall_s=time.monotonic() - started)


async def stage_counts(backbone_addr: str, tower_addr: str, codec_addr: str) -> dict[str, int]:
    """Open sessions and free cache slots as each stage reports them (GetInfo)."""
    import grpc

    from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
    from drama.codec.v1 import codec_pb2, codec_pb2_grpc
    from drama.tower.v1 import tower_pb2, tower_pb2_grpc

    async with grpc.aio.insecure_channel(backbone_addr) as b, grpc.aio.insecure_channel(tower_addr) as t, \
            grpc.aio.insecure_channel(codec_addr) as c:
        backbone = await backbone_pb2_grpc.BackboneStub(b).GetInfo(backbone_pb2.GetInfoRequest(), timeout=5)
        tower = await tower_pb2_grpc.TowerStub(t).GetInfo(tower_pb2.GetInfoRequest(), timeout=5)
        codec = await codec_pb2_grpc.CodecStub(c).GetInfo(codec_pb2.GetInfoRequest(), timeout=5)
    return {"backbone.open_sessions": backbone.open_sessions, "backbone.queued_sessions": backbone.queued_sessions,
            "backbone.free_slots": backbone.free_slots, "tower.open_sessions": tower.open_sessions,
            "tower.free_slots": tower.free_slots, "codec.open_sessions": codec.open_sessions}


def stack_addresses(stack) -> dict[str, str]:
    """{'backbone'|'tower'|'codec': 'host:port'} of a services.launcher.Stack, from its commands."""
    addresses = {}
    for process in stack.processes:
        if process.name != "gateway":
            argv = process.argv
            addresses[process.name] = f"127.0.0.1:{argv[argv.index('--port') + 1]}"
    return addresses


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stack_rss_mb(stack) -> dict[str, float]:
    return {process.name: rss_mb(process.popen.pid) for process in stack.processes}


async def settled_counts(addresses: dict[str, str], expected: dict[str, int],
                         timeout_s: float = 15.0) -> dict[str, int]:
    """Poll GetInfo until the counts equal `expected` (sessions are freed at the next step) or
    `timeout_s` passes; returns the last counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await stage_counts(addresses["backbone"], addresses["tower"], addresses["codec"])
        if counts == expected or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


def nothing_lost(stack, *, requests: int, cancel_fraction: float, concurrency: int,
                 max_new_tokens: int, warmup: int = 16) -> dict:
    """The whole check on a running local Stack; returns a report (counts, RSS, outcome)."""
    addresses = stack_addresses(stack)
    start = asyncio.run(stage_counts(addresses["backbone"], addresses["tower"], addresses["codec"]))
    # The warm-up lets lazy allocations (buffers, caches, allocator pools) happen before RSS is read.
    asyncio.run(run_with_cancellations(stack.url, requests=warmup, cancel_fraction=cancel_fraction,
                                       concurrency=concurrency, max_new_tokens=max_new_tokens, seed=1))
    asyncio.run(settled_counts(addresses, start))
    rss_before = stack_rss_mb(stack)
    result = asyncio.run(run_with_cancellations(stack.url, requests=requests, cancel_fraction=cancel_fraction,
                                                concurrency=concurrency, max_new_tokens=max_new_tokens))
    after = asyncio.run(settled_counts(addresses, start))
    rss_after = stack_rss_mb(stack)
    return {"result": result, "start": start, "after": after, "rss_before_mb": rss_before,
            "rss_after_mb": rss_after}


def print_nothing_lost(report: dict) -> None:
    result: CancelResult = report["result"]
    print(f"{result.requests} requests in {result.wall_s:.1f} s: {result.completed} completed, "
          f"{result.cancelled_before_body} cancelled before the body, {result.cancelled_mid_body} mid-body, "
          f"{len(result.failed)} failed {result.failed[:5]}")
    print("| stage figure | start | after |\n|---|---|---|")
    for key, value in report["start"].items():
        print(f"| {key} | {value} | {report['after'][key]} |")
    print("| process | RSS before (MB) | RSS after (MB) |\n|---|---|---|")
    for name, before in report["rss_before_mb"].items():
        print(f"| {name} | {before:.0f} | {report['rss_after_mb'][name]:.0f} |")


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
    parser.add_argument("--requests", type=int, default=None,
                        help="nothing-lost mode: this many requests (local stack only)")
    parser.add_argument("--cancel-fraction", type=float, default=0.3)
    parser.add_argument("--sample-rate", type=int, default=None,
                        help="ask for this output rate (e.g. 44100, the codec's own: no resampling)")
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="spread the workers' first requests over this many seconds (default 0: all at once)")
    parser.add_argument("--sweep", default=None, metavar="C1,C2,...",
                        help="run the load once per concurrency (e.g. 1,8,32,64,128) and print one table")
    args = parser.parse_args(argv)
    if args.requests is not None and args.url is not None:
        parser.error("--requests needs the local stack (it reads the stages' GetInfo and RSS)")

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
        if args.requests is not None:
            report = nothing_lost(stack, requests=args.requests, cancel_fraction=args.cancel_fraction,
                                  concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)
            print_nothing_lost(report)
            return 0 if not report["result"].failed and report["after"] == report["start"] else 1
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        levels = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.concurrency]
        results = [asyncio.run(run_load(url, concurrency=level, duration_s=args.duration,
                                        max_new_tokens=args.max_new_tokens,
                                        formats=tuple(args.formats.split(",")), headers=headers,
                                        ramp_s=args.ramp_s, sample_rate=args.sample_rate))
                   for level in levels]
        result = results[-1]
    finally:
        if stack is not None:
            stack.stop()
    print(sweep_table(results) if len(results) > 1 else result.table())
    if args.json:
        figures = [{k: v for k, v in asdict(r).items() if k != "outcomes"} for r in results]
        Path(args.json).write_text(json.dumps(figures if len(figures) > 1 else figures[0], indent=2) + "\n")
    return 0 if all(r.errors == 0 and r.truncated == 0 for r in results) else 1


def sweep_table(results: list[LoadResult]) -> str:
    """One row per concurrency level (issue #8's sweep)."""
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    lines = ["| streams | requests | errors | cut | TTFA p50 / p99 ms | RTF p50 | underrun max s "
             "| no underrun after 1 s | audio s / wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.concurrency} | {r.requests} | {r.errors} | {r.truncated} | "
                     f"{ms(r.ttfa_p50_ms)} / {ms(r.ttfa_p99_ms)} | "
                     f"{'-' if r.rtf_p50 is None else f'{r.rtf_p50:.2f}'} | {r.underrun_max_s:.2f} | "
                     f"{r.streams_without_underrun} / {r.ok} | {r.throughput:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

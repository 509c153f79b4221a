"""One request's way through the stages, in milliseconds from its arrival at the gateway.

    python -m bench.timeline --random-weights full --device cuda --requests 10      (its own stack)
    python -m bench.timeline --url URL --log-dir DIR --requests 10                  (a running stack)

Where the time to first audio goes between the stages cannot be read from any one of them: each
stage sees its own share, and the hops between them (gRPC, event loops, worker threads) belong to
none. Every stage already traces its work with OpenTelemetry (API.md §3.6), so this sends
sequential 20-word requests (bench.e2e's request) to a stack whose processes print their spans
(OTEL_TRACES_EXPORTER=console) and whose backbone traces every step (DRAMA_STEP_SPAN_SAMPLE=1),
reads the spans back from the stage logs, and lines up per request, on one clock (the host's):

- the gateway's spans and events (arrival, prepare, Generate sent, admitted, first frames, first
  PCM back from the codec, first byte written),
- the backbone's Generate span: received, admitted, and its first-audio milestones
  (`first_audio.*` events: prompt computed and sent, first frame back, first decode row computed
  and sent, second frame, first message),
- the first backbone steps of the session and the tower steps they caused (start and end),
- the codec's Decode span: opened, first frames received, first PCM sent.

It prints each point's mean over the requests (the first one, which pays one-time costs, is
left out with --skip 1) with the step from the point before, so a hop is a line whose step is not
compute. With its own stack (no --url) it starts `bench.stack` with that environment itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

GATEWAY_ROOT = "POST /v1/audio/speech"
STEPS_SHOWN = 3          # the session's first backbone steps (and their tower steps) on the timeline


def read_spans(log_dir: Path) -> dict[str, list[dict]]:
    """Every span the console exporter printed into LOG_DIR/<stage>.log, by stage name.
    The exporter writes each span as an indented JSON object among the log lines."""
    decoder = json.JSONDecoder()
    spans: dict[str, list[dict]] = {}
    for log in sorted(log_dir.glob("*.log")):
        text, found, at = log.read_text(errors="replace"), [], 0
        while (start := text.find('{\n    "name"', at)) >= 0:
            try:
                span, at = decoder.raw_decode(text, start)
            except json.JSONDecodeError:      # a span cut off by the end of the log
                break
            found.append(span)
        spans[log.stem] = found
    return spans


def seconds(stamp: str) -> float:
    """The exporter's ISO-8601 UTC stamp (microseconds) as epoch seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def request_timelines(spans: dict[str, list[dict]]) -> list[dict[str, float]]:
    """Per gateway request (oldest first): {point: ms from the request's arrival}."""
    by_trace: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    steps_by_link: dict[str, list[dict]] = defaultdict(list)   # request trace -> backbone steps
    towers: dict[str, list[dict]] = defaultdict(list)           # step trace -> tower steps
    for stage, found in spans.items():
        for span in found:
            trace_id = span["context"]["trace_id"]
            if span["name"] == "backbone.step":
                for link in span.get("links", []):
                    steps_by_link[link["context"]["trace_id"]].append(span)
            elif span["name"] == "tower.step":
                towers[trace_id].append(span)
            else:
                by_trace[trace_id].append((stage, span))
    timelines = []
    for trace_id, members in by_trace.items():
        roots = [s for stage, s in members if stage == "gateway" and s["name"] == GATEWAY_ROOT]
        if not roots:
            continue
        t0 = seconds(roots[0]["start_time"])
        points: dict[str, float] = {}

        def at(name: str, stamp: str) -> None:
            points.setdefault(name, (seconds(stamp) - t0) * 1000.0)

        for stage, span in members:
            name = span["name"].rsplit("/", 1)[-1]
            kind = span["kind"].split(".")[-1].lower()
            if kind in ("client", "server") and name not in ("GetInfo",):
                at(f"{stage}: {name} {'sent' if kind == 'client' else 'received'}", span["start_time"])
            elif stage == "gateway" and span["name"].startswith("text_to_speech"):
                at("gateway: prepare starts", span["start_time"])
            elif name == "prefill":
                at("backbone: prefill span starts", span["start_time"])
                at("backbone: prefill span ends", span["end_time"])
            for event in span.get("events", []):
                at(f"{stage}: {event['name']}", event["timestamp"])
        steps = sorted(steps_by_link.get(trace_id, []), key=lambda s: s["start_time"])
        for index, step in enumerate(steps[:STEPS_SHOWN], 1):
            rows = step.get("attributes", {}).get("drama.batch.rows", "?")
            lane = " (lane)" if step.get("attributes", {}).get("drama.step.lane") else ""
            at(f"backbone: step {index}{lane}, {rows} rows, starts", step["start_time"])
            at(f"backbone: step {index} done (its frames back)", step["end_time"])
            for tower in sorted(towers.get(step["context"]["trace_id"], []), key=lambda s: s["start_time"]):
                at(f"tower: step {index} starts", tower["start_time"])
                at(f"tower: step {index} ends", tower["end_time"])
        timelines.append((t0, points))
    return [points for _, points in sorted(timelines, key=lambda item: item[0])]


HOPS = ("backbone compute (step start -> computed)", "send (computed -> write returned)",
        "wire + tower loop (write returned -> tower step starts)", "tower step",
        "back (tower step ends -> backbone routes the frame)",
        "schedule (routed -> next backbone step starts)")


def steady_hops(spans: dict[str, list[dict]], skip_steps: int = STEPS_SHOWN) -> dict[str, list[float]]:
    """A single-row decode frame cut at its hand-offs, ms per frame over every session's steps after
    its first `skip_steps`: the backbone step's span (its `computed` and `sent` events, its end when
    the frame is routed), the tower step's span, and the session's next backbone step's start.
    A frame whose next step was chained on it (scheduler._plan_chained: queued on the GPU before
    this frame came back) has no such hops, and the chained step's `computed` is when it was
    waited for: both are left out (with DRAMA_CHAIN_STEPS=0 every frame has them)."""
    tower_by_trace = {s["context"]["trace_id"]: s for s in spans.get("tower", []) if s["name"] == "tower.step"}
    by_session: dict[str, list[dict]] = defaultdict(list)
    for span in spans.get("backbone", []):
        attributes = span.get("attributes", {})
        if (span["name"] == "backbone.step" and attributes.get("drama.batch.rows") == 1
                and not attributes.get("drama.step.lane") and len(span.get("links", [])) == 1):
            by_session[span["links"][0]["context"]["trace_id"]].append(span)
    hops: dict[str, list[float]] = {name: [] for name in HOPS}
    for steps in by_session.values():
        steps.sort(key=lambda s: s["start_time"])
        for step, following in zip(steps[skip_steps:], steps[skip_steps + 1:]):
            if step.get("attributes", {}).get("drama.step.chained") or \
                    following.get("attributes", {}).get("drama.step.chained"):
                continue
            events = {e["name"]: seconds(e["timestamp"]) for e in step.get("events", [])}
            tower = tower_by_trace.get(step["context"]["trace_id"])
            if tower is None or "computed" not in events or "sent" not in events:
                continue
            marks = [seconds(step["start_time"]), events["computed"], events["sent"],
                     seconds(tower["start_time"]), seconds(tower["end_time"]), seconds(step["end_time"]),
                     seconds(following["start_time"])]
            if events["sent"] < events["computed"]:
                # a device hand-off (services/common/device_handoff.py): sent before its wait, the
                # tower's step queued behind the rows on its GPU; no send or wire of its own, and
                # the tower's part counted from when the backbone's host saw its step done
                marks[2:4] = [events["computed"]] * 2
            for name, begin, end in zip(HOPS, marks, marks[1:]):
                hops[name].append((end - begin) * 1000.0)
    return hops


CHUNK_PARTS = ("chunk end -> prompt step starts (the last frame routed, the next chunk opened and planned)",
               "backbone prompt compute (step start -> computed)", "send (computed -> write returned)",
               "wire + tower loop (write returned -> tower step starts)", "tower prompt step + first draw",
               "back (tower step ends -> backbone routes the first frame)",
               "schedule (routed -> first decode step starts)")


def is_prompt(step: dict) -> bool:
    """A backbone step of prompt rows: a prefill lane step, or more than one row."""
    attributes = step.get("attributes", {})
    return bool(attributes.get("drama.step.lane")) or attributes.get("drama.batch.rows", 1) > 1


def chunk_boundaries(spans: dict[str, list[dict]]) -> tuple[dict[str, list[float]], list[int]]:
    """A long request's chunk boundaries (MODEL.md §8.3: each chunk after the first opens a fresh
    timeline whose prompt goes through both stages), cut at their hand-offs: ms per boundary
    from the last frame of chunk i-1 being routed (its step's end) to chunk i's first decode
    step, through chunk i's prompt step (one lane piece of the whole prompt, or pieces: the
    first one's start to the last one's tower step). Also the prompt rows of each boundary."""
    tower_by_trace = {s["context"]["trace_id"]: s for s in spans.get("tower", []) if s["name"] == "tower.step"}
    by_session: dict[str, list[dict]] = defaultdict(list)
    for span in spans.get("backbone", []):
        if span["name"] == "backbone.step" and len(span.get("links", [])) == 1:
            by_session[span["links"][0]["context"]["trace_id"]].append(span)
    parts: dict[str, list[float]] = {name: [] for name in CHUNK_PARTS}
    rows: list[int] = []
    for steps in by_session.values():
        steps.sort(key=lambda s: s["start_time"])
        for index in range(1, len(steps) - 1):
            step, before = steps[index], steps[index - 1]
            # a chunk's prompt after the first: a prompt step right behind a decode step
            if not is_prompt(step) or is_prompt(before):
                continue
            last = index
            while last + 1 < len(steps) and is_prompt(steps[last + 1]):
                last += 1
            if last + 1 >= len(steps):
                continue
            first_events = {e["name"]: seconds(e["timestamp"]) for e in step.get("events", [])}
            final = steps[last]
            final_events = {e["name"]: seconds(e["timestamp"]) for e in final.get("events", [])}
            tower = tower_by_trace.get(final["context"]["trace_id"])
            if tower is None or "computed" not in first_events or "sent" not in final_events:
                continue
            marks = [seconds(before["end_time"]), seconds(step["start_time"]), first_events["computed"],
                     final_events["sent"], seconds(tower["start_time"]), seconds(tower["end_time"]),
                     seconds(final["end_time"]), seconds(steps[last + 1]["start_time"])]
            for name, begin, end in zip(CHUNK_PARTS, marks, marks[1:]):
                parts[name].append((end - begin) * 1000.0)
            rows.append(sum(s.get("attributes", {}).get("drama.batch.rows", 0) for s in steps[index:last + 1]))
    return parts, rows


def hop_table(hops: dict[str, list[float]]) -> str:
    frames = len(hops[HOPS[0]])          # steady_hops appends one value per part per frame
    if not frames:
        return "(no traced single-row decode steps)"
    lines = ["| a decode frame's part | median ms | p90 ms |", "|---|---:|---:|"]
    total = 0.0
    for name, values in hops.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        total += median
        lines.append(f"| {name} | {median:.3f} | {ordered[int(0.9 * (len(ordered) - 1))]:.3f} |")
    lines.append(f"| **frame (sum of medians; {frames} frames)** | **{total:.3f}** | |")
    return "\n".join(lines)


def chunk_table(parts: dict[str, list[float]], rows: list[int]) -> str:
    boundaries = len(parts[CHUNK_PARTS[0]])
    if not boundaries:
        return "(no chunk boundaries: a request of one text chunk, or its steps were not traced)"
    lines = ["| a chunk boundary's part | median ms | max ms |", "|---|---:|---:|"]
    total = 0.0
    for name, values in parts.items():
        median = statistics.median(values)
        total += median
        lines.append(f"| {name} | {median:.2f} | {max(values):.2f} |")
    lines.append(f"| **boundary (sum of medians; {boundaries} boundaries, prompts of "
                 f"{min(rows)}-{max(rows)} rows)** | **{total:.2f}** | |")
    return "\n".join(lines)


def summarise(timelines: list[dict[str, float]]) -> list[tuple[str, float, float, int]]:
    """(point, mean ms, min ms, requests that have it), in the order of the means."""
    values: dict[str, list[float]] = defaultdict(list)
    for points in timelines:
        for name, ms in points.items():
            values[name].append(ms)
    rows = [(name, statistics.fmean(v), min(v), len(v)) for name, v in values.items()]
    return sorted(rows, key=lambda row: row[1])


def table(rows: list[tuple[str, float, float, int]], client_ttfa: list[float]) -> str:
    lines = ["| ms from arrival (mean) | step | min | point |", "|---:|---:|---:|---|"]
    previous = 0.0
    for name, mean, low, count in rows:
        lines.append(f"| {mean:.1f} | +{mean - previous:.1f} | {low:.1f} | {name}"
                     f"{'' if count == len(client_ttfa) or not client_ttfa else f' ({count} requests)'} |")
        previous = mean
    if client_ttfa:
        lines.append(f"| {statistics.fmean(client_ttfa):.1f} | | {min(client_ttfa):.1f} | client: first byte "
                     f"(TTFA as the caller sees it, from sending) |")
    return "\n".join(lines)


def stack_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OTEL_TRACES_EXPORTER": "console", "DRAMA_STEP_SPAN_SAMPLE": "1"})
    env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")
    return env


def measure(url: str, log_dir: Path, requests: int, words: int, frames: int, skip: int,
            preset: str = "tiny") -> dict:
    import httpx

    from bench.e2e import speak
    from services.common.random_weights import preset_config

    cfg = preset_config(preset)        # text chunk length, frame size and rate, as bench.e2e's requests
    audio = (cfg.text_chunking.text_chunk_size, cfg.codec.frame_samples, cfg.codec.sample_rate)

    with httpx.Client(timeout=120.0) as client:
        spoken = [speak(client, url, words, frames, *audio) for _ in range(requests)]
    time.sleep(float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500")) / 1000 + 2.0)   # spans exported
    spans = read_spans(log_dir)
    timelines = request_timelines(spans)[-requests:]
    hops = steady_hops(spans)
    boundaries, boundary_rows = chunk_boundaries(spans)
    kept, ttfa = timelines[skip:], [s.ttfa_ms for s in spoken[skip:]]
    rows = summarise(kept)
    return {"requests": len(kept), "words": words, "frames": frames, "client_ttfa_ms": ttfa,
            "points": [{"point": name, "mean_ms": mean, "min_ms": low, "requests": count}
                       for name, mean, low, count in rows],
            "table": table(rows, ttfa), "hops_ms": hops, "hop_table": hop_table(hops),
            "chunk_boundaries_ms": boundaries, "chunk_boundary_rows": boundary_rows,
            "chunk_table": chunk_table(boundaries, boundary_rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running stack's gateway (else: start one)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the stage logs of that stack (bench.stack --log-dir); with its own stack, "
                             "where to keep them (default: a temporary directory)")
    parser.add_argument("--random-weights", choices=["full", "tiny"], default=None)
    parser.add_argument("--checkpoint", type=Path, default=None, help="for its own stack (default: the tiny one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--skip", type=int, default=1, help="first requests left out of the means")
    parser.add_argument("--words", type=int, default=20)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.requests <= args.skip:
        parser.error("--requests must be more than --skip")
    if args.url is not None:
        if args.log_dir is None:
            parser.error("--url needs --log-dir (the stack's logs, where its spans are)")
        result = measure(args.url, args.log_dir, args.requests, args.words, args.frames, args.skip,
                         args.random_weights or "tiny")
    else:
        import tempfile

        from bench.stack import background

        scratch = tempfile.TemporaryDirectory(prefix="bench-timeline-")
        log_dir = args.log_dir or Path(scratch.name)
        stack_args = ["--device", args.device, "--max-sessions", "4", "--log-dir", str(log_dir)]
        if args.random_weights:
            stack_args += ["--random-weights", args.random_weights]
        elif args.checkpoint:
            stack_args += ["--checkpoint", str(args.checkpoint)]
        with background(stack_args, env=stack_environment(), timeout_s=900) as url:
            result = measure(url, log_dir, args.requests, args.words, args.frames, args.skip,
                             args.random_weights or "tiny")
    print(f"one request through the stages ({result['requests']} requests of {args.words} words, "
          f"{args.frames} frames; spans on the host's clock):")
    print(result["table"])
    print("\na decode frame cut at its hand-offs (every traced single-row step after a session's first "
          f"{STEPS_SHOWN}; host clock):")
    print(result["hop_table"])
    print("\na chunk boundary of a long request (MODEL.md §8.3), cut at its hand-offs (host clock):")
    print(result["chunk_table"])
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in result.items()
                                         if k not in ("table", "hop_table", "chunk_table")},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

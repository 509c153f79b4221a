"""Where a load run's time went, per stage: the stages' own step histograms, window by window.

    python -m bench.stage_metrics LOG_DIR [--load load.json] [--json PATH]

The stages export their series (API.md §1.7, docs/metrics.md) as one JSON line per export when
started with OTEL_METRICS_EXPORTER=console (bench/h200_serving.sh does this; the export period is
OTEL_METRIC_EXPORT_INTERVAL ms). This reads those lines from the stage logs in LOG_DIR and, for
each window (each level of a `bench.load --json` sweep, or the whole run without --load), prints
per stage: how many steps (decode calls) ran, their mean and approximate p90 time, the mean batch
(rows per backbone step, sessions per codec call), and **busy** = steps x mean time / the time the
two exports span: the share of it the stage's worker spent computing. A stage near 100 % busy is the one that
holds the others back.

The histograms are cumulative, so a window's figures are the difference between the last export
at or before its start and the last export at or before its end; p90 is the upper bound of the
bucket where the window's cumulative count passes 90 %.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# (stage, series) -> what the table calls it
TIME_SERIES = {"backbone": "drama_backbone_step_seconds", "backbone lane": "drama_backbone_lane_step_seconds",
               "tower": "drama_tower_step_seconds", "codec": "drama_codec_decode_seconds"}
SIZE_SERIES = {"backbone": "drama_backbone_batch_rows", "backbone lane": "drama_backbone_lane_batch_rows",
               "codec": "drama_codec_batch_size"}


@dataclass
class Snapshot:
    time_s: float
    count: int
    total: float
    buckets: list[int]
    bounds: list[float]


@dataclass
class Series:
    snapshots: list[Snapshot] = field(default_factory=list)

    def at(self, when: float) -> Snapshot | None:
        """The last snapshot at or before `when` (None: none yet, i.e. all zeros)."""
        before = [s for s in self.snapshots if s.time_s <= when]
        return before[-1] if before else None


# The backbone's first-audio milestones (services/backbone/scheduler.py FIRST_AUDIO_PHASES): one
# series per `phase` attribute, read apart (read_logs sums a metric's data points).
PHASE_SERIES = "drama_backbone_first_audio_seconds"


def read_logs(log_dir: Path, split_by: str | None = None) -> dict[str, Series]:
    """series name -> cumulative snapshots (summed over data points), from every *.log. With
    split_by=NAME only that metric is read, one series per value of its `phase` attribute."""
    found: dict[str, Series] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith('{"resource_metrics"'):
                continue
            try:
                document = json.loads(line)
            except ValueError:
                continue                      # a line cut by a crash
            for resource in document["resource_metrics"]:
                for scope in resource["scope_metrics"]:
                    for metric in scope["metrics"]:
                        points = metric["data"].get("data_points") or []
                        if not points or "bucket_counts" not in points[0]:
                            continue          # gauges and counters: not used here
                        if split_by is not None:
                            if metric["name"] == split_by:
                                for point in points:
                                    phase = (point.get("attributes") or {}).get("phase", "?")
                                    found.setdefault(phase, Series()).snapshots.append(Snapshot(
                                        point["time_unix_nano"] / 1e9, point["count"], point["sum"],
                                        list(point["bucket_counts"]), list(point["explicit_bounds"])))
                            continue
                        buckets = [sum(p["bucket_counts"][i] for p in points)
                                   for i in range(len(points[0]["bucket_counts"]))]
                        found.setdefault(metric["name"], Series()).snapshots.append(Snapshot(
                            max(p["time_unix_nano"] for p in points) / 1e9, sum(p["count"] for p in points),
                            sum(p["sum"] for p in points), buckets, list(points[0]["explicit_bounds"])))
    for series in found.values():
        series.snapshots.sort(key=lambda s: s.time_s)
    return found


def window(series: Series | None, start: float, end: float) -> dict | None:
    """count, mean and p90 of the observations between two times (None without data)."""
    if series is None or not series.snapshots:
        return None
    last = series.at(end)
    if last is None:
        return None
    first = series.at(start)
    count = last.count - (first.count if first else 0)
    if count <= 0:
        return {"count": 0, "mean": None, "p90": None, "sum": 0.0, "span": end - start}
    total = last.total - (first.total if first else 0.0)
    buckets = [b - (first.buckets[i] if first else 0) for i, b in enumerate(last.buckets)]
    running, p90 = 0, None
    for i, n in enumerate(buckets):
        running += n
        if running >= 0.9 * count:
            p90 = last.bounds[i] if i < len(last.bounds) else float("inf")
            break
    span = last.time_s - (first.time_s if first else start)     # what the difference covers
    return {"count": count, "mean": total / count, "p90": p90, "sum": total, "span": span}


def summarise(series: dict[str, Series], windows: list[tuple[str, float, float]]) -> list[dict]:
    rows = []
    for name, start, end in windows:
        row = {"window": name, "seconds": end - start}
        for stage, time_name in TIME_SERIES.items():
            timing = window(series.get(time_name), start, end)
            size = window(series.get(SIZE_SERIES[stage]), start, end) if stage in SIZE_SERIES else None
            if timing is None:
                row[stage] = None
                continue
            row[stage] = {"steps": timing["count"], "mean_ms": None if timing["mean"] is None else timing["mean"] * 1000,
                          "p90_ms": None if timing["p90"] is None else timing["p90"] * 1000,
                          "busy": timing["sum"] / timing["span"] if timing["span"] > 0 else None,
                          "mean_batch": size["mean"] if size and size["count"] else None}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def cell(stage_row: dict | None) -> str:
        if stage_row is None:
            return "no data"
        if not stage_row["steps"]:
            return "0 steps"
        batch = f", batch {stage_row['mean_batch']:.1f}" if stage_row["mean_batch"] else ""
        p90 = "-" if stage_row["p90_ms"] is None else f"{stage_row['p90_ms']:.3g}"
        busy = "-" if stage_row["busy"] is None else f"{stage_row['busy']:.0%}"
        return f"{stage_row['steps']} x {stage_row['mean_ms']:.2f} ms (p90 <= {p90}){batch}, busy {busy}"
    lane = any(row.get("backbone lane") for row in rows)   # the prefill lane's steps (DRAMA_PREFILL_LANE)
    head = "| window | s | backbone steps |" + (" backbone lane (prefill) steps |" if lane else "")
    lines = [head + " tower steps | codec decode calls |", "|---|---|---|" + ("---|" if lane else "") + "---|---|"]
    for row in rows:
        lane_cell = f" {cell(row.get('backbone lane'))} |" if lane else ""
        lines.append(f"| {row['window']} | {row['seconds']:.1f} | {cell(row['backbone'])} |{lane_cell} "
                     f"{cell(row['tower'])} | {cell(row['codec'])} |")
    return "\n".join(lines)


def phase_rows(phases: dict[str, Series], windows: list[tuple[str, float, float]]) -> list[dict]:
    """Per window: mean ms from a session's submission to each first-audio milestone (and how
    many sessions reached it), in the order FIRST_AUDIO_PHASES lists them."""
    from services.backbone.scheduler import FIRST_AUDIO_PHASES

    order = [p for p in FIRST_AUDIO_PHASES if p in phases] + sorted(set(phases) - set(FIRST_AUDIO_PHASES))
    rows = []
    for name, start, end in windows:
        row = {"window": name}
        for phase in order:
            w = window(phases[phase], start, end)
            row[phase] = None if not w or not w["count"] else {"sessions": w["count"], "mean_ms": w["mean"] * 1000}
        rows.append(row)
    return rows


def phase_table(rows: list[dict]) -> str:
    """The milestones as a table: mean ms from submission (+ step from the milestone before)."""
    phases = [k for k in rows[0] if k != "window"] if rows else []
    lines = ["| window | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for row in rows:
        cells, last = [], 0.0
        for phase in phases:
            value = row[phase]
            if value is None:
                cells.append("-")
                continue
            cells.append(f"{value['mean_ms']:.1f} (+{value['mean_ms'] - last:.1f})")
            last = value["mean_ms"]
        lines.append(f"| {row['window']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stage_metrics", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path, help="the stages' logs (bench.stack --log-dir)")
    parser.add_argument("--load", type=Path, help="bench.load --json output: one window per level")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    series = read_logs(args.log_dir)
    if not series:
        print(f"bench.stage_metrics: no metric exports in {args.log_dir}/*.log "
              "(start the stages with OTEL_METRICS_EXPORTER=console)", file=sys.stderr)
        return 1
    if args.load:
        levels = json.loads(args.load.read_text())
        levels = levels if isinstance(levels, list) else [levels]
        windows = [(f"{level['concurrency']} streams", level["started_unix"], level["ended_unix"])
                   for level in levels if level.get("started_unix")]
    else:
        times = [s.time_s for one in series.values() for s in one.snapshots]
        windows = [("whole run", 0.0, max(times))]
    rows = summarise(series, windows)
    print(table(rows))
    phases = read_logs(args.log_dir, split_by=PHASE_SERIES)
    milestones = phase_rows(phases, windows) if phases else []
    if milestones:
        print("\nbackbone, submission to each first-audio milestone of a session's first chunk, mean ms "
              "(+ step from the one before):")
        print(phase_table(milestones))
    if args.json:
        args.json.write_text(json.dumps(rows + [{"first_audio_milestones": milestones}] if milestones else rows,
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

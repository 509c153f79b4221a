"""Two source trees' backbone figures in one call, processes alternating, one table (issue #7).

    python3 bench/ab.py --prepare c9c0079                  # here: that commit's code into _ab/old
    python3 bench/ab.py --runs 2 -- --preset full --device cuda --prefill 256 1024 --batch 1 128 \\
        --decode-graphs --served-warm-up                    # there: this tree against _ab/old

Why: the lent GPU machines differ by 5-10% between calls (docs/perf.md, session 14: one machine
ran every figure slower, decode included), and the batch-1 step by up to ~0.3 ms between processes
on one machine. So a change is measured against the code before it in the same call, each tree in
fresh processes, alternating (new, old, then old, new, ...), and judged by the spread of its own
runs. Each run is `bench/backbone.py <args> --out <json>` started in that tree (its own
`services/` first on the path); the table lists every run's figure per row: prefill ms per
prompt length, graphed or eager decode step ms (median) per batch.

`--prepare REV` writes `git archive REV` (services, drama, bench) into the old tree's folder. `_ab/`
is git-ignored: on the lent machine, name it in the device tool's `carry`. Both trees share one
Triton cache (its entries are keyed by kernel source).

A switch instead of a commit: `--old . --new-env DRAMA_DECODE_FROM_IDS=1` runs this tree against
itself, the "new" processes with that variable set (`--new-env` repeats; nothing to carry).

`--bench e2e` runs `python -m bench.e2e <args> --json <json>` in each tree instead: a whole stack
per run, whose stage processes import that tree too (they start in it). Its rows are a single
stream's ms per frame and TTFA at 20 and 200 words. The stacks differ by ~0.3 ms per frame with
the same code (docs/perf.md, session 23), so give it 2-3 runs a tree; under MPS, run ab.py itself
under bench/with_mps.sh (one daemon for every stack):

    bash bench/with_mps.sh python3 bench/ab.py --bench e2e --runs 3 --timeout 140 -- \
        --preset full --device cuda --skip-micro
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OLD = ROOT / "_ab" / "old"
TREE_PARTS = ("services", "drama", "bench", "gateway")
BENCHES = {"backbone": "bench/backbone.py", "e2e": "bench/e2e.py"}


def prepare(rev: str, into: Path) -> None:
    """`git archive rev` of the code a backbone benchmark imports, unpacked into `into` (replaced)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, *TREE_PARTS], stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(into, filter="data")
    print(f"{rev} -> {into}")


def run_tree(tree: Path, args: list[str], timeout: float, extra_env: dict[str, str] | None = None,
             bench: str = "backbone") -> dict:
    """One benchmark process in `tree` (with `extra_env` added to the environment): bench/backbone.py
    or `python -m bench.e2e`; its JSON (an "error" key when it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{bench}.json"
        env = dict(os.environ, **(extra_env or {}))
        env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p and Path(p).resolve() != ROOT])
        command = ([sys.executable, "-m", "bench.e2e", *args, "--json", str(out)] if bench == "e2e"
                   else [sys.executable, str(tree / "bench" / "backbone.py"), *args, "--out", str(out)])
        try:
            proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode or not out.exists():
            return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"}
        return json.loads(out.read_text())


# bench.e2e's requests and the figures of each that make a row
_E2E_ROWS = (("short", "steady_ms_per_frame", "20w ms/frame"), ("long", "steady_ms_per_frame", "200w ms/frame"),
             ("short", "ttfa_ms", "20w TTFA ms"), ("long", "ttfa_ms", "200w TTFA ms"))


def figures(result: dict) -> dict[str, float]:
    """A run's figures by row name. bench/backbone.py: 'prefill N' (ms), 'decode bN graphs|eager'
    (median ms); bench.e2e: a single stream's ms per frame and TTFA at 20 and 200 words."""
    if "requests" in result:
        requests = result["requests"]
        return {row: requests[name][key] for name, key, row in _E2E_ROWS
                if requests.get(name, {}).get(key) is not None}
    rows = {f"prefill {r['rows']}" + (f" x{r['sessions']}" if r.get("sessions", 1) != 1 else ""): r["ms"]
            for r in result.get("prefill", [])}
    rows.update({f"decode b{r['batch']} {'graphs' if r.get('graphs') else 'eager'}": r["median_ms"]
                 for r in result.get("decode", [])})
    return rows


def table(runs: dict[str, list[dict]]) -> list[dict]:
    """One entry per row name: each tree's figures in run order and the medians' difference."""
    names: list[str] = []
    for results in runs.values():
        for result in results:
            names += [n for n in figures(result) if n not in names]
    out = []
    for name in names:
        entry = {"row": name}
        for tree, results in runs.items():
            entry[tree] = [figures(r).get(name) for r in results]
        new = [v for v in entry.get("new", []) if v is not None]
        old = [v for v in entry.get("old", []) if v is not None]
        entry["new - old"] = statistics.median(new) - statistics.median(old) if new and old else None
        out.append(entry)
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", metavar="REV", help="write REV's code into --old and exit")
    parser.add_argument("--old", type=Path, default=DEFAULT_OLD, help="the old tree (default _ab/old)")
    parser.add_argument("--new", type=Path, default=ROOT, help="the new tree (default: this one)")
    parser.add_argument("--runs", type=int, default=2, help="processes per tree")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per process")
    parser.add_argument("--json", type=Path, help="write the runs and the table here")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="backbone",
                        help="bench/backbone.py in-process (default) or bench.e2e's whole stack")
    parser.add_argument("--new-env", action="append", default=[], metavar="VAR=VALUE",
                        help="set VAR in the new tree's processes only (with --old .: a switch A/B)")
    args = parser.parse_args(argv[:split])
    new_env = {}
    for item in args.new_env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            parser.error(f"--new-env wants VAR=VALUE, got {item!r}")
        new_env[name] = value
    bench_args = argv[split + 1:]
    if args.prepare:
        prepare(args.prepare, args.old)
        return {}
    if not (args.old / BENCHES[args.bench]).exists():
        sys.exit(f"{args.old} holds no {BENCHES[args.bench]}: make it with --prepare REV (here, then carry _ab)")
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    for i in range(args.runs):
        for tree in (("new", "old") if i % 2 == 0 else ("old", "new")):
            result = (run_tree(args.new, bench_args, args.timeout, new_env, bench=args.bench) if tree == "new"
                      else run_tree(args.old, bench_args, args.timeout, bench=args.bench))
            runs[tree].append(result)
            shown = result.get("error") or ", ".join(f"{k} {v:.2f}" for k, v in figures(result).items())
            print(f"run {i + 1} {tree}: {shown}", flush=True)
    rows = table(runs)
    print(f"\n{'row':<24} {'new (ms, each run)':<28} {'old (ms, each run)':<28} {'new - old':>10}")
    for entry in rows:
        cells = [" / ".join("-" if v is None else f"{v:.2f}" for v in entry[t]) for t in ("new", "old")]
        diff = entry["new - old"]
        print(f"{entry['row']:<24} {cells[0]:<28} {cells[1]:<28} {'-' if diff is None else f'{diff:+.2f}':>10}")
    report = {"runs": runs, "table": rows, "bench": args.bench, "bench_args": bench_args,
              "trees": {"new": str(args.new), "old": str(args.old)}, "new_env": new_env}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

"""Where each stage's host (Python) time goes during single-stream requests: py-spy, one table.

    python -m bench.host_profile --stack-info INFO [--requests 30] [--frames 4] [--json PATH]
    python -m bench.host_profile --device cpu          (starts a tiny CPU stack; bench/stack.py)

Why: the time to first audio is the stages' compute plus hops (gRPC, asyncio, serialisation,
scheduling), and on the H200 the hops were about a third of it (docs/perf.md, the gateway's
`drama_speech_phase_seconds`). Which Python code those hops spend their time in is a sampling
profiler's question, asked of every process of a running stack at once.

What it does: attaches `py-spy record --threads --gil -f raw` (sampling --rate per second, only
the thread holding the GIL: time in epoll, in a GIL-free wait or in native code that released
the GIL, such as a CUDA synchronise, is not counted) to the gateway and the three stages of a stack started by `bench.stack --info-file`,
sends --requests sequential streamed requests (bench.voice_prefix's 19-word sentence, voice
alloy, latency `low`, --frames frames each)
while it samples, and prints per process and thread the CPU milliseconds per request, then the
functions with the most inclusive time per request (a function counted once per sample however
deep it recurs). The raw sample files are kept in --out for a flame graph. py-spy needs ptrace
rights over the stage processes (root, or kernel.yama.ptrace_scope = 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.stack import background
from bench.voice_prefix import ttfa_ms

PROCESSES = ("gateway", "backbone", "tower", "codec")
# frames every sample of a thread passes through (thread, runpy, asyncio, executor and nn.Module
# plumbing): left out of the function list, where they would only repeat the thread totals
PLUMBING = {"Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run", "_worker", "_WorkItem.run",
            "_run_module_as_main", "_run_code", "<module>", "main", "run", "Runner.run", "asyncio_run",
            "BaseEventLoop.run_until_complete", "BaseEventLoop.run_forever", "BaseEventLoop._run_once",
            "Module._wrapped_call_impl", "Module._call_impl", "context_decorator.<locals>.decorate_context",
            "run_stage", "Server.run"}


def py_spy_binary(explicit: str | None) -> str:
    """py-spy on PATH, next to this Python, or under a --target install's bin (device runs)."""
    for candidate in (explicit, shutil.which("py-spy"), str(Path(sys.executable).with_name("py-spy")),
                      *(str(Path(p) / "bin" / "py-spy") for p in os.environ.get("PYTHONPATH", "").split(":") if p)):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("py-spy not found: pip install py-spy (or pass --py-spy PATH)")


def frame_name(frame: str) -> str:
    """'f (path/file.py:12)' -> 'f (file.py)': one name per function whatever the line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


def summarise(raw: Path, rate: float, requests: int, top: int, wall_s: float) -> dict:
    """Per thread: CPU ms per request and GIL share of the wall time; per function: inclusive ms
    per request (top ones). With many streams the share says how close a process is to being
    bound by its one GIL."""
    threads: Counter = Counter()
    functions: Counter = Counter()
    if raw.is_file():
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
            threads[thread] += n
            for name in {frame_name(f) for f in frames[1:]}:
                if name.split(" (")[0] not in PLUMBING:
                    functions[name] += n
    per_request = 1000.0 / rate / max(1, requests)
    return {"threads_ms_per_request": {t: n * per_request for t, n in threads.most_common()},
            "gil_share_of_wall": sum(threads.values()) / rate / max(wall_s, 1e-9),
            "functions_ms_per_request": {f: n * per_request for f, n in functions.most_common(top)}}


def run_requests(url: str, requests: int, frames: int, concurrency: int = 1) -> list[float]:
    """TTFA ms of `requests` requests (bench.voice_prefix's sentence, voice alloy), `concurrency` of
    them in flight at a time (each of that many threads sends its share one after another)."""
    def one_stream(count: int) -> list[float]:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            return [ttfa_ms(client, url, "alloy", frames, seed=7) for _ in range(count)]
    if concurrency <= 1:
        return one_stream(requests)
    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        return [ms for stream in pool.map(one_stream, [n for n in shares if n]) for ms in stream]


def profile(url: str, pids: dict[str, int], args) -> dict:
    spy = py_spy_binary(args.py_spy)
    out = args.out or Path(tempfile.mkdtemp(prefix="host-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    run_requests(url, 2, args.frames)                     # warm the path first, unprofiled
    duration = args.max_seconds
    spies = {name: subprocess.Popen([spy, "record", "-p", str(pid), "-f", "raw", "--threads", "--gil", "-r", str(args.rate),
                                     "-d", str(duration), "-o", str(out / f"{name}.txt"), "--nonblocking"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, pid in pids.items()}
    time.sleep(1.0)                                        # py-spy attaches
    started = time.perf_counter()
    ttfa = run_requests(url, args.requests, args.frames, args.concurrency)
    wall = time.perf_counter() - started
    for process in spies.values():                         # stop sampling now: SIGINT writes the file
        process.send_signal(2)
    errors = {}
    for name, process in spies.items():
        try:
            _, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if not (out / f"{name}.txt").is_file():
            errors[name] = err.decode(errors="replace")[-300:]
    ttfa.sort()
    return {"requests": args.requests, "frames": args.frames, "concurrency": args.concurrency,
            "wall_s": wall, "rate": args.rate,
            "ttfa_ms_median": ttfa[len(ttfa) // 2], "raw_dir": str(out), "errors": errors,
            "note": "sampling started ~1 s before the requests and stopped right after them",
            "processes": {name: summarise(out / f"{name}.txt", args.rate, args.requests, args.top, wall)
                          for name in pids}}


def print_report(result: dict) -> None:
    print(f"{result['requests']} requests of {result['frames']} frames, {result['concurrency']} at a time, "
          f"in {result['wall_s']:.1f} s, "
          f"TTFA median {result['ttfa_ms_median']:.1f} ms; py-spy at {result['rate']:g} Hz, raw samples in "
          f"{result['raw_dir']}")
    for name, error in result["errors"].items():
        print(f"{name}: py-spy failed: {error}")
    for name, summary in result["processes"].items():
        threads = ", ".join(f"{t} {ms:.1f}" for t, ms in summary["threads_ms_per_request"].items())
        print(f"\n== {name}: GIL held {summary['gil_share_of_wall']:.0%} of the wall time; "
              f"CPU ms per request by thread: {threads or '-'}")
        for function, ms in summary["functions_ms_per_request"].items():
            print(f"  {ms:8.2f}  {function}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--stack-info", type=Path, help="bench.stack --info-file of a running stack")
    parser.add_argument("--device", default="cpu", help="without --stack-info: start a tiny stack here")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--frames", type=int, default=4, help="max_new_tokens per request")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at a time")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--max-seconds", type=int, default=120, help="py-spy's own time limit")
    parser.add_argument("--top", type=int, default=40, help="functions listed per process")
    parser.add_argument("--py-spy", default=None, help="path of the py-spy binary")
    parser.add_argument("--out", type=Path, default=None, help="directory for the raw sample files")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.stack_info:
            info = json.loads(args.stack_info.read_text())
            url, pids = info["url"], {k: int(v) for k, v in info["pids"].items()}
        else:
            info_file = Path(tempfile.mkdtemp(prefix="host-profile-")) / "info.json"
            url = stack.enter_context(background(["--device", args.device, "--info-file", str(info_file)]))
            pids = {k: int(v) for k, v in json.loads(info_file.read_text())["pids"].items()}
        result = profile(url, {k: pids[k] for k in PROCESSES if k in pids}, args)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start to ready per stage from a real checkpoint on disk (issue #7), one script, one table.

    python -m bench.start_to_ready --make --preset full --device cuda --json PATH   (the device run)
    python -m bench.start_to_ready --checkpoint DIR --device cuda --together        (an existing one)
    python -m bench.start_to_ready --make --preset tiny --device cpu                (CI smoke test)

What it does, in order:
1. With --make, writes the checkpoint with `make_checkpoint` (what `dramaturg checkpoint make`
   runs: one process per core, progress per shard), times it and validates it as
   `dramaturg checkpoint inspect` does (unless --no-inspect). The directory: --checkpoint, else
   a temporary one for tiny, else the first of <repo>/out/ckpt-<preset>, /tmp, /var/tmp whose file
   system has room (the free space and what is needed are printed first; /dev/shm, which is RAM,
   only as a last resort, and then "cold" cannot mean a cold read).
2. For each cache state (--cache cold|warm|both) and start order (--order sequential|together|
   both; --together = --order together):
   - cold: every checkpoint file is fsynced and dropped from the page cache with
     posix_fadvise(POSIX_FADV_DONTNEED) (no root needed; /proc/meminfo's Cached before and after
     is printed as the check), so the stages read from the disk as after a reboot;
   - warm: every checkpoint file is read once first, so the stages read from the page cache;
   - sequential: codec, tower, backbone, then the gateway, each started once the one before is
     SERVING (the backbone needs the tower for SERVING anyway), so each figure is that stage
     alone; together: all four at once, as `dramaturg up` and compose start them, sharing the
     disk, the CPUs and the GPU while loading (the backbone's figure then includes waiting for
     the tower).
   Each stage is started exactly as production starts it: `python -m services.<stage>
   --checkpoint DIR --device D --host 127.0.0.1 --port P` (the backbone with --tower ADDR), the
   gateway as `python -m gateway --checkpoint DIR ...`, with the production pool sizes unless
   --max-rows / --max-context are given. start_to_ready_s = from the spawn of the process to its
   first SERVING answer of the grpc.health.v1 service (polled every 0.1 s; the gateway: its first
   `GET /ready` 200). Also recorded: listening_s (its first answer of any kind: the Python start
   and imports are behind it) and, for the backbone, loaded_s (its memory line, printed after the
   weights are on the device and before the warm-up). Each run gets a fresh, empty Triton/Inductor cache (unless
   --keep-compile-cache), as a fresh container has, so kernel compilation is counted every time
   and runs differ only in what the table says.
3. GPU memory per process: nvidia-smi's used_memory per PID, sampled every 0.5 s while the
   stages start; the peak per stage (CUDA context included).

Prints a table and, with --json, writes {"start_to_ready_s": {stage: s} per run, the make time,
the checkpoint's size, the peaks}. --logs PATH writes every process's whole log into one file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.launcher import LOOPBACK, ManagedProcess, StackError, free_ports, stop_processes  # noqa: E402

STAGES = ("codec", "tower", "backbone")
TARGET_BACKBONE_S = 60.0     # issue #7: the backbone <= 60 s, warm-up included
POLL_S = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.start_to_ready", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (written there with --make)")
    parser.add_argument("--make", action="store_true", help="write the checkpoint first, timed")
    parser.add_argument("--preset", default="full", choices=["full", "tiny"], help="with --make (default full)")
    parser.add_argument("--workers", type=int, help="--make's processes (default one per core)")
    parser.add_argument("--device", default="cuda", help="cpu or cuda (every stage on this one device)")
    parser.add_argument("--cache", default="both", choices=["cold", "warm", "both"])
    parser.add_argument("--order", default="sequential", choices=["sequential", "together", "both"])
    parser.add_argument("--together", action="store_const", const="together", dest="order",
                        help="start all stages at once (= --order together)")
    parser.add_argument("--no-gateway", action="store_true", help="stages only")
    parser.add_argument("--no-codec", action="store_true", help="tower and backbone only (implies "
                        "--no-gateway): the backbone's start alone, faster")
    parser.add_argument("--max-rows", type=int, help="DRAMA_MAX_ROWS for the stages (default: production's)")
    parser.add_argument("--max-context", type=int, help="DRAMA_MAX_CONTEXT_TOKENS (default: production's)")
    parser.add_argument("--keep-compile-cache", action="store_true",
                        help="share one Triton/Inductor cache between runs (default: a fresh one per run)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="per stage, seconds")
    parser.add_argument("--budget-s", type=float,
                        help="skip a run that would likely end after this many seconds of the script")
    parser.add_argument("--smi-period", type=float, default=0.5)
    parser.add_argument("--keep", action="store_true", help="keep a checkpoint this script made in a temp dir")
    parser.add_argument("--no-inspect", action="store_true",
                        help="skip `dramaturg checkpoint inspect` of the checkpoint made with --make")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--logs", type=Path, help="write every process's log into this one file")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------
# the checkpoint and the page cache
# --------------------------------------------------------------------------------------------

def pick_directory(preset: str, needed: int) -> tuple[Path, bool]:
    """(a directory for a `preset` checkpoint, whether it is a temporary one to delete): tiny in
    a temp dir; full on the first file system with room for it and 2 GiB more."""
    if preset == "tiny":
        return Path(tempfile.mkdtemp(prefix="s2r-tiny-")) / "ckpt", True
    candidates = [ROOT / "out", Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")]
    lines = []
    for base in candidates:
        try:
            base.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(base).free
        except OSError as exc:
            lines.append(f"  {base}: {exc}")
            continue
        lines.append(f"  {base}: {free / 2**30:.1f} GiB free")
        if free >= needed + 2 * 2 ** 30:
            if base == Path("/dev/shm"):
                print("warning: only /dev/shm (RAM) has room: 'cold' runs read from memory", flush=True)
            return base / f"ckpt-{preset}", False
    raise SystemExit(f"no file system has {needed / 2**30:.1f} GiB + 2 GiB free for the {preset} checkpoint:\n"
                     + "\n".join(lines))


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint_files(directory))


def meminfo_gib(key: str = "Cached") -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def sync_files(directory: Path) -> float:
    """fsync every file (what is still dirty after writing goes to the disk); returns seconds."""
    start = time.perf_counter()
    for path in checkpoint_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def drop_from_page_cache(directory: Path) -> dict:
    """fsync + posix_fadvise(POSIX_FADV_DONTNEED) every file, so the next read comes from the disk
    (needs no root: only this directory's pages go). Returns Cached GiB before and after."""
    before = meminfo_gib()
    sync_s = sync_files(directory)
    if not hasattr(os, "posix_fadvise"):
        return {"dropped": False, "why": "no posix_fadvise on this platform", "sync_s": sync_s}
    for path in checkpoint_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"dropped": True, "sync_s": round(sync_s, 2), "cached_gib_before": _r(before),
            "cached_gib_after": _r(meminfo_gib())}


def read_into_page_cache(directory: Path) -> dict:
    """Read every file once (16 MiB at a time), so the stages find them in the page cache."""
    start = time.perf_counter()
    total = 0
    for path in checkpoint_files(directory):
        with open(path, "rb", buffering=0) as fh:
            while chunk := fh.read(16 * 2 ** 20):
                total += len(chunk)
    seconds = time.perf_counter() - start
    return {"read_gib": round(total / 2 ** 30, 2), "read_s": round(seconds, 2),
            "cached_gib_after": _r(meminfo_gib())}


def _r(x, digits: int = 2):
    return None if x is None else round(x, digits)


# --------------------------------------------------------------------------------------------
# one start of the stages
# --------------------------------------------------------------------------------------------

@dataclass
class Run:
    cache: str
    order: str
    prepare: dict = field(default_factory=dict)
    start_to_ready_s: dict[str, float] = field(default_factory=dict)
    listening_s: dict[str, float] = field(default_factory=dict)    # first health answer of any kind
    loaded_s: dict[str, float] = field(default_factory=dict)       # the backbone's memory line
    peak_gpu_gib: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None
    smi_error: str | None = None


def commands(checkpoint: Path, device: str, gateway: bool) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each process's argv, as `dramaturg up` (services/launcher.py) starts them, and the addresses."""
    codec_port, tower_port, backbone_port, http_port = free_ports(4)
    python = [sys.executable, "-m"]
    stage = ["--checkpoint", str(checkpoint), "--device", device, "--host", LOOPBACK]
    addrs = {"codec": f"{LOOPBACK}:{codec_port}", "tower": f"{LOOPBACK}:{tower_port}",
             "backbone": f"{LOOPBACK}:{backbone_port}", "gateway": f"http://{LOOPBACK}:{http_port}"}
    argv = {
        "codec": python + ["services.codec", *stage, "--port", str(codec_port)],
        "tower": python + ["services.tower", *stage, "--port", str(tower_port)],
        "backbone": python + ["services.backbone", *stage, "--port", str(backbone_port),
                              "--tower", addrs["tower"]],
    }
    if gateway:
        argv["gateway"] = python + ["gateway", "--checkpoint", str(checkpoint), "--host", LOOPBACK,
                                    "--port", str(http_port), "--backbone", addrs["backbone"],
                                    "--codec", addrs["codec"]]
    return argv, addrs


def stage_env(args: argparse.Namespace, compile_cache: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("DRAMA_CHECKPOINT", "DRAMA_RANDOM_WEIGHTS", "DRAMA_MAX_ROWS", "DRAMA_MAX_CONTEXT_TOKENS"):
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "DRAMA_GRACE_S": "2", "DRAMA_LOG_LEVEL": "INFO"})
    if args.max_rows:
        env["DRAMA_MAX_ROWS"] = str(args.max_rows)
    if args.max_context:
        env["DRAMA_MAX_CONTEXT_TOKENS"] = str(args.max_context)
    if compile_cache is not None:
        env["TRITON_CACHE_DIR"] = str(compile_cache / "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def status(name: str, addr: str) -> str:
    """'SERVING' when ready; 'NOT_SERVING' (or an HTTP status) once it answers at all; else
    'UNREACHABLE'."""
    if name == "gateway":
        import httpx

        try:
            code = httpx.get(f"{addr}/ready", timeout=1.0).status_code
            return "SERVING" if code == 200 else f"HTTP {code}"
        except httpx.HTTPError:
            return "UNREACHABLE"
    from services.common.grpcutil import check_health

    return asyncio.run(check_health(addr, timeout=1.0))


# The backbone prints its memory line once the weights are loaded and the cache pool is built,
# before its warm-up (services/backbone/server.py): the split between loading and warming up.
LOADED_MARKERS = {"backbone": "backbone memory:"}


def wait_until_ready(names: list[str], processes: dict[str, ManagedProcess], spawned: dict[str, float],
                     addrs: dict[str, str], run: Run, timeout_s: float) -> None:
    """Poll `names` until each is ready, recording spawn -> listening (its first answer: Python
    start and imports done), spawn -> loaded (where the stage prints a marker) and spawn ->
    ready; StackError if one dies or the timeout passes."""
    waiting = list(names)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for name in list(waiting):
            answer = status(name, addrs[name])
            now = round(time.monotonic() - spawned[name], 2)
            if answer != "UNREACHABLE":
                run.listening_s.setdefault(name, now)
            marker = LOADED_MARKERS.get(name)
            if marker and name not in run.loaded_s and marker in processes[name].log_tail(200):
                run.loaded_s[name] = now
            if answer == "SERVING":
                run.start_to_ready_s[name] = now
                print(f"    {name}: ready after {now:.1f} s (listening after {run.listening_s[name]:.1f} s"
                      + (f", loaded after {run.loaded_s[name]:.1f} s" if name in run.loaded_s else "") + ")",
                      flush=True)
                waiting.remove(name)
            elif not processes[name].alive():
                raise StackError(processes[name].describe_exit())
        if waiting and time.monotonic() > deadline:
            raise StackError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
        if waiting:
            time.sleep(POLL_S)


def start_stages(args: argparse.Namespace, checkpoint: Path, run: Run, log_dir: Path) -> list[ManagedProcess]:
    from bench.e2e import GpuMemorySampler

    argv, addrs = commands(checkpoint, args.device, not (args.no_gateway or args.no_codec))
    if args.no_codec:
        del argv["codec"]
    compile_cache = None if args.keep_compile_cache else Path(tempfile.mkdtemp(prefix="s2r-compile-"))
    env = stage_env(args, compile_cache)
    processes: dict[str, ManagedProcess] = {}
    spawned: dict[str, float] = {}
    pids: dict[int, str] = {}
    sampler = GpuMemorySampler(pids, args.smi_period) if args.device.startswith("cuda") and shutil.which(
        "nvidia-smi") else None
    if sampler:
        sampler.start()

    def spawn(name: str) -> None:
        log = log_dir / f"{run.cache}-{run.order}-{name}.log"
        spawned[name] = time.monotonic()
        processes[name] = ManagedProcess(name, argv[name], log).start(env)
        pids[processes[name].popen.pid] = name

    start = time.monotonic()
    try:
        if run.order == "together":
            for name in argv:
                spawn(name)
            wait_until_ready(list(argv), processes, spawned, addrs, run, args.ready_timeout)
        else:
            for name in argv:
                spawn(name)
                wait_until_ready([name], processes, spawned, addrs, run, args.ready_timeout)
    except StackError as exc:
        run.error = str(exc)
        print(f"    failed: {exc}", flush=True)
    finally:
        run.wall_s = round(time.monotonic() - start, 2)
        if sampler:
            time.sleep(args.smi_period)   # one more sample with everything loaded
            sampler.stop()
            run.peak_gpu_gib = {k: round(v, 2) for k, v in sampler.peak_gb().items()}
            run.smi_error = sampler.error
        stop_processes(list(processes.values()), grace_s=20.0)
        if compile_cache is not None:
            shutil.rmtree(compile_cache, ignore_errors=True)
    return list(processes.values())


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def headline(result: dict) -> None:
    """Top-level start_to_ready_s: the first complete run, cold before warm, sequential (each
    stage alone) before together; `start_to_ready_run` names it."""
    complete = [r for r in result["runs"] if not r.get("error")]
    rank = {("cold", "sequential"): 0, ("cold", "together"): 1, ("warm", "sequential"): 2, ("warm", "together"): 3}
    if complete:
        best = min(complete, key=lambda r: rank[(r["cache"], r["order"])])
        result["start_to_ready_s"] = best["start_to_ready_s"]
        result["start_to_ready_run"] = f"{best['cache']} page cache, {best['order']}"
        result["backbone_within_target"] = best["start_to_ready_s"].get("backbone", 1e9) <= TARGET_BACKBONE_S


def table(result: dict) -> str:
    stages = [s for s in (*STAGES, "gateway") if any(s in r["start_to_ready_s"] for r in result["runs"])]
    lines = []
    if result.get("make_s") is not None:
        lines.append(f"checkpoint made in {result['make_s']:.1f} s (+ {result.get('sync_s', 0):.1f} s fsync) "
                     f"by {result['make_workers']} process(es)")
    lines.append(f"checkpoint {result['checkpoint']}: {result['size_bytes'] / 1e9:.3f} GB; "
                 f"device {result['device']}")
    head = f"{'run':<22}" + "".join(f"{s + ' s':>12}" for s in stages) + f"{'wall s':>10}"
    lines += [head, "-" * len(head)]
    for r in result["runs"]:
        name = f"{r['cache']} {r['order']}"
        cells = "".join(f"{r['start_to_ready_s'][s]:>12.1f}" if s in r["start_to_ready_s"] else f"{'-':>12}"
                        for s in stages)
        lines.append(f"{name:<22}{cells}{r['wall_s']:>10.1f}" + ("  FAILED" if r.get("error") else ""))
        if r.get("listening_s"):
            lines.append(f"{'  listening s':<22}" + "".join(
                f"{r['listening_s'][s]:>12.1f}" if s in r["listening_s"] else f"{'-':>12}" for s in stages))
        if r.get("loaded_s"):
            lines.append(f"{'  loaded s':<22}" + "".join(
                f"{r['loaded_s'][s]:>12.1f}" if s in r["loaded_s"] else f"{'-':>12}" for s in stages))
        if r.get("peak_gpu_gib"):
            lines.append(f"{'  peak GPU GiB':<22}" + "".join(
                f"{r['peak_gpu_gib'][s]:>12.1f}" if s in r["peak_gpu_gib"] else f"{'-':>12}" for s in stages))
    lines.append(f"target: backbone <= {TARGET_BACKBONE_S:.0f} s (issue #7)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    from services.common.config import DramaConfig
    from services.common.make_checkpoint import (
        checkpoint_nbytes,
        default_workers,
        make_checkpoint,
        plan_shards,
        preset_raw,
    )

    temporary = False
    if args.make:
        needed = checkpoint_nbytes(args.preset)
        if args.checkpoint is None:
            args.checkpoint, temporary = pick_directory(args.preset, needed)
        args.checkpoint.mkdir(parents=True, exist_ok=True)
        print(f"disk: {args.checkpoint} needs {needed / 2**30:.1f} GiB; "
              f"{shutil.disk_usage(args.checkpoint).free / 2**30:.1f} GiB free there", flush=True)
    elif args.checkpoint is None:
        raise SystemExit("--checkpoint DIR is required without --make")
    checkpoint = args.checkpoint.resolve()

    result = {"command": shlex.join([sys.executable, "-m", "bench.start_to_ready", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "checkpoint": str(checkpoint), "device": describe_device(args.device),
              "cpu_cores": os.cpu_count(), "target_backbone_s": TARGET_BACKBONE_S,
              "make_s": None, "runs": []}
    log_dir = Path(tempfile.mkdtemp(prefix="s2r-logs-"))

    def save() -> None:
        """The JSON and the logs so far (after the make and after each run, so a command killed
        at its time limit still leaves what it measured)."""
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        if args.logs:
            args.logs.parent.mkdir(parents=True, exist_ok=True)
            with open(args.logs, "w", encoding="utf-8", errors="replace") as out:
                for log in sorted(log_dir.glob("*.log")):
                    out.write(f"===== {log.name} =====\n{log.read_text(errors='replace')}\n")

    try:
        if args.make:
            t0 = time.perf_counter()
            make_checkpoint(checkpoint, preset=args.preset, workers=args.workers)
            result["make_s"] = round(time.perf_counter() - t0, 2)
            result["make_workers"] = args.workers or default_workers(needed, len(plan_shards(
                DramaConfig.from_dict(preset_raw(args.preset)))) + 1)
            result["sync_s"] = round(sync_files(checkpoint), 2)
            print(f"made in {result['make_s']:.1f} s; fsync of what was still dirty: {result['sync_s']:.1f} s",
                  flush=True)
            if not args.no_inspect:
                from services.common.checkpoint_report import inspect_checkpoint

                t0 = time.perf_counter()
                report = inspect_checkpoint(checkpoint)   # `dramaturg checkpoint inspect`
                result["inspect"] = {"ok": report.ok, "seconds": round(time.perf_counter() - t0, 2),
                                     "problems": report.problems[:20]}
                print(f"dramaturg checkpoint inspect: {'OK' if report.ok else report.problems[:5]} "
                      f"({result['inspect']['seconds']:.1f} s)", flush=True)
            save()
        result["size_bytes"] = dir_bytes(checkpoint)
        result["size_gb"] = round(result["size_bytes"] / 1e9, 3)
        caches = ["cold", "warm"] if args.cache == "both" else [args.cache]
        orders = ["sequential", "together"] if args.order == "both" else [args.order]
        longest = 0.0
        for order in orders:
            for cache in caches:
                run = Run(cache, order)
                elapsed = time.monotonic() - started
                if args.budget_s and longest and elapsed + 1.3 * longest > args.budget_s:
                    print(f"skipping {cache} {order}: {elapsed:.0f} s gone, a run takes ~{longest:.0f} s, "
                          f"budget {args.budget_s:.0f} s", flush=True)
                    run.error = "skipped (budget)"
                    result["runs"].append(run.__dict__)
                    continue
                print(f"run: {cache} page cache, {order}", flush=True)
                run.prepare = drop_from_page_cache(checkpoint) if cache == "cold" else read_into_page_cache(checkpoint)
                print(f"    {run.prepare}", flush=True)
                t0 = time.monotonic()
                start_stages(args, checkpoint, run, log_dir)
                longest = max(longest, time.monotonic() - t0)
                result["runs"].append(run.__dict__)
                headline(result)
                save()
        print(table(result), flush=True)
    finally:
        save()
        shutil.rmtree(log_dir, ignore_errors=True)
        if temporary and not args.keep:
            shutil.rmtree(checkpoint.parent if args.preset == "tiny" else checkpoint, ignore_errors=True)
    failed = [r for r in result["runs"] if r.get("error") and r["error"] != "skipped (budget)"]
    return 1 if failed or not result["runs"] else 0


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return device
    return f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    sys.exit(main())

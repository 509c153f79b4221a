"""End-to-end latency through the staged gRPC stack (issue #7), one script, one table.

    python -m bench.e2e --preset full --device cuda          full geometry, random weights on the GPU
    python -m bench.e2e --preset tiny --device cpu           the same table on CPU (CI smoke test)
    python -m bench.e2e ... --json PATH --markdown PATH      also write the figures / the table

What it does, in order:
1. Starts backbone, tower and codec as separate gRPC server processes (`python -m services.<stage>
   --random-weights PRESET`: the preset's geometry with random values made on the device, no
   checkpoint files) and the gateway on `make_checkpoint(dir, PRESET, dry_run=True)` (config.json
   and tokenizer.json only), all on loopback, all on the one device. Start to ready is timed per
   process: from its spawn to its first SERVING health answer (the gateway: `GET /ready` 200).
   The four start together, as `dramaturg up` starts them, so they share the CPU and the GPU
   while loading; the backbone turns SERVING only once the tower is.
2. Through the gateway (`POST /v1/audio/speech`, stream, pcm at the codec's own 44.1 kHz (no
   resampling), voice `alloy` (seeded, no reference to encode), latency `low`, fixed seed): a
   first request (its one-time costs shown apart), a warm-up request, then a 20-word and a
   200-word request. Random weights rarely end on their own, so `max_new_tokens` caps the frames
   of each text chunk: the target frame count (default: FRAMES_PER_WORD per word, the length of
   the words spoken) divided over the chunks the gateway cuts the text into. TTFA = request sent
   -> first audio byte.
   RTF = request wall time / audio seconds. E2E ms per frame = (last byte - first byte) / frames
   after the first piece: for the short request (one text chunk) the steady decode, for the long
   one with its text-chunk prefills. With --budget-s, the frame counts shrink when the warm-up
   says the two requests would not finish in that time (the table says so).
3. GPU memory per process: `nvidia-smi --query-compute-apps` sampled every --smi-period seconds
   while the stack runs (CUDA context included); the peak per stage.
4. The stack is stopped, then each stage's compute is timed IN THIS PROCESS at batch 1 (the
   stages expose no timings): backbone `BackboneEngine.step` of one row (bench/backbone.py),
   tower `TowerEngine.step` of one frame (bench/tower.py), codec `decode_streams` of a 4-frame
   chunk after a full window (bench/codec.py). Overhead = e2e ms per frame - (backbone + tower +
   codec chunk / 4): gRPC, serialisation, scheduling, the HTTP leg, minus any overlap.
5. The transformers peer (Qwen3.5-MoE decode step, batch 1) is read from
   docs/perf/kernels-latest.json (bench/kernels.py --peer), with its source in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import io
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from services.common.random_weights import preset_config
from services.launcher import LOOPBACK, ManagedProcess, StackError, free_ports, stop_processes, wait_ready

ROOT = Path(__file__).resolve().parents[1]
KERNELS_JSON = ROOT / "docs" / "perf" / "kernels-latest.json"
STAGES = ("codec", "tower", "backbone")
SEED = 1234
VOICE = "alloy"

# Issue #7 targets (H200, full size), shown beside the figures.
TARGETS = {"ttfa_ms_20w": "<= 60", "rtf_single": "<= 0.06", "codec_chunk_ms_4f": "<= 3",
           "backbone_start_s": "<= 60", "speedup": ">= 50x"}

WORDS = ("the morning train left the station while seven quiet travellers watched the river "
         "turn silver under a low autumn sky and somebody at the back began to hum an old song "
         "about harbours lanterns letters and the long road home").split()


# Frames a word takes spoken: a frame is 2048 samples at 44.1 kHz (46.4 ms) and conversational
# speech runs at ~150-160 words a minute (0.38-0.40 s a word), so 8.1-8.6 frames. Random weights
# rarely stop on their own, so the requests ask for this many (max_new_tokens): the long request's
# text chunks then each carry as much audio as they would spoken (until session 24 the default was
# 100 / 400 frames for 20 / 200 words, 2-4x faster than speech, so every chunk's prompt weighed on
# a few frames).
FRAMES_PER_WORD = 8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda", help="cpu or cuda (every process on this one device)")
    parser.add_argument("--words", type=int, nargs=2, default=[20, 200], metavar=("SHORT", "LONG"))
    parser.add_argument("--frames", type=int, nargs=2, metavar=("SHORT", "LONG"),
                        help="frames to generate for each request (max_new_tokens over its text chunks); "
                             f"default: {FRAMES_PER_WORD} per word, as long as the words take spoken")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="shrink the frame counts when the warm-up predicts more than this for both")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--micro-steps", type=int, help="timed steps per stage in step 4 (default 20 cuda, 4 cpu)")
    parser.add_argument("--micro-context", type=int, help="rows before the timed steps (default 256 cuda, 32 cpu)")
    parser.add_argument("--skip-micro", action="store_true", help="leave out step 4")
    parser.add_argument("--stack-info", type=Path,
                        help="measure a stack that is already up (bench.stack --info-file) instead of "
                             "starting one; its start-to-ready times come from that file")
    parser.add_argument("--stack-json", type=Path,
                        help="with --micro-only: the stack figures of an earlier run (its --json)")
    parser.add_argument("--micro-only", action="store_true",
                        help="only step 4, merged with --stack-json's stack figures")
    parser.add_argument("--smi-period", type=float, default=0.5,
                        help="seconds between nvidia-smi samples (each one costs the host some CPU)")
    parser.add_argument("--log-dir", type=Path, help="the processes' logs (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--markdown", type=Path, help="write the command and the table here")
    args = parser.parse_args(argv)
    if args.frames is None:
        args.frames = [FRAMES_PER_WORD * w for w in args.words]
    cuda = args.device.startswith("cuda")
    args.micro_steps = args.micro_steps or (20 if cuda else 4)
    args.micro_context = args.micro_context or (256 if cuda else 32)
    return args


# --------------------------------------------------------------------------------------------
# the stack
# --------------------------------------------------------------------------------------------

@dataclass
class RunningStack:
    processes: dict[str, ManagedProcess]
    addrs: dict[str, str]
    url: str
    spawned: dict[str, float]                          # time.monotonic() at spawn
    ready_s: dict[str, float] = field(default_factory=dict)

    def stop(self) -> None:
        stop_processes(list(self.processes.values()), grace_s=20.0)


def stage_env() -> dict[str, str]:
    """One stream: small cache pools (the defaults size 64 sessions x 8192 rows)."""
    env = dict(os.environ)
    env.update({"DRAMA_MAX_ROWS": env.get("DRAMA_MAX_ROWS", "4"),
                "DRAMA_MAX_CONTEXT_TOKENS": env.get("DRAMA_MAX_CONTEXT_TOKENS", "4096"),
                "DRAMA_GRACE_S": "2", "PYTHONUNBUFFERED": "1", "DRAMA_LOG_LEVEL": "INFO"})
    env.pop("DRAMA_CHECKPOINT", None)
    env.pop("DRAMA_RANDOM_WEIGHTS", None)
    return env


def start_stack(weights: str | list[str], device: str, config_dir: Path, log_dir: Path) -> RunningStack:
    """Spawn the four processes. `weights`: a preset name (random weights of that geometry made on
    the device) or the stages' weight arguments as a list (e.g. ["--checkpoint", DIR])."""
    codec_port, tower_port, backbone_port, http_port = free_ports(4)
    python = [sys.executable, "-m"]
    weight_args = ["--random-weights", weights] if isinstance(weights, str) else list(weights)
    stage = [*weight_args, "--device", device, "--host", LOOPBACK]
    addrs = {"codec": f"{LOOPBACK}:{codec_port}", "tower": f"{LOOPBACK}:{tower_port}",
             "backbone": f"{LOOPBACK}:{backbone_port}"}
    argv = {
        "codec": python + ["services.codec", *stage, "--port", str(codec_port)],
        "tower": python + ["services.tower", *stage, "--port", str(tower_port)],
        "backbone": python + ["services.backbone", *stage, "--port", str(backbone_port),
                              "--tower", addrs["tower"]],
        "gateway": python + ["gateway", "--checkpoint", str(config_dir), "--host", LOOPBACK,
                             "--port", str(http_port), "--backbone", addrs["backbone"],
                             "--codec", addrs["codec"]],
    }
    env = stage_env()
    stack = RunningStack({}, addrs, f"http://{LOOPBACK}:{http_port}", {})
    for name, command in argv.items():
        stack.processes[name] = ManagedProcess(name, command, log_dir / f"{name}.log").start(env)
        stack.spawned[name] = time.monotonic()
    return stack


def wait_stack_ready(stack: RunningStack, timeout_s: float) -> None:
    """Wait for the gateway's /ready and every stage's SERVING, timing each one's first."""
    from services.common.grpcutil import check_health

    deadline = time.monotonic() + timeout_s
    done = threading.Event()

    def poll_stages():
        waiting = list(STAGES)
        while waiting and not done.is_set():
            for name in list(waiting):
                if asyncio.run(check_health(stack.addrs[name])) == "SERVING":
                    stack.ready_s[name] = time.monotonic() - stack.spawned[name]
                    waiting.remove(name)
            time.sleep(0.1)

    poller = threading.Thread(target=poll_stages, daemon=True)
    poller.start()
    try:
        wait_ready(stack.url, list(stack.processes.values()), timeout_s, poll_s=0.1)
        stack.ready_s["gateway"] = time.monotonic() - stack.spawned["gateway"]
        poller.join(timeout=max(0.0, deadline - time.monotonic()))   # /ready may come first
    finally:
        done.set()
    missing = [name for name in STAGES if name not in stack.ready_s]
    if missing:
        raise StackError(f"not SERVING after {timeout_s:.0f} s: {', '.join(missing)}")


class GpuMemorySampler:
    """Peak `used_memory` per PID from nvidia-smi every `period_s` (nothing without nvidia-smi)."""

    def __init__(self, pids: dict[int, str], period_s: float = 0.5):
        self.pids, self.period_s = pids, period_s
        self.peak_mib: dict[str, float] = {}
        self.peak_total_mib = 0.0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def sample(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        apps = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
        for line in apps.strip().splitlines():
            pid, used = (part.strip() for part in line.split(","))
            if not (pid.isdigit() and used.isdigit()):        # "[N/A]" where the VM hides it
                self.error = f"nvidia-smi compute-apps line {line!r}"
                continue
            name = self.pids.get(int(pid), f"pid {pid}")
            self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), float(used))
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
        self.peak_total_mib = max(self.peak_total_mib, float(total.split()[0]))

    def peak_gb(self) -> dict[str, float]:
        """GiB per stage (in STAGES order, then anything else seen), and the card's memory.used."""
        order = [n for n in (*STAGES, "gateway") if n in self.peak_mib]
        order += [n for n in self.peak_mib if n not in order]
        peak = {name: self.peak_mib[name] / 1024 for name in order}
        if self.peak_total_mib:
            peak["card total (memory.used)"] = self.peak_total_mib / 1024
        return peak

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self._stop.wait(self.period_s)


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------

def make_text(words: int) -> str:
    """`words` words in sentences of ten, always the same."""
    out = []
    for i in range(words):
        word = WORDS[(7 * i) % len(WORDS)]
        out.append((word.capitalize() if i % 10 == 0 else word) + ("." if i % 10 == 9 or i == words - 1 else ""))
    return " ".join(out)


def count_chunks(text: str, chunk_size: int) -> int:
    """How many text chunks the gateway cuts `text` into (gateway/prompt.py PromptBuilder.build)."""
    from gateway.chunking import split_text
    from gateway.prompt import with_speaker

    return len(split_text(with_speaker(text, 0), chunk_size))


@dataclass
class Spoken:
    words: int
    chunks: int
    max_new_tokens: int
    frames: float
    audio_s: float
    ttfa_ms: float
    wall_ms: float
    steady_ms_per_frame: float | None
    phases_ms: dict | None = None        # the gateway's milestones of this request, ms from arrival
    pcm_sha256: str = ""                 # of the audio bytes
    codes_sha256: str = ""               # of the take's codes (GET /v1/takes/{id}): a fixed seed gives the
    # same codes, so two stacks (say, a switch on and off) can be compared request by request

    @property
    def rtf(self) -> float:
        return self.wall_ms / 1000 / self.audio_s if self.audio_s else float("inf")


def speak(client, url: str, words: int, frames: int, chunk_size: int, frame_samples: int,
          sample_rate: int) -> Spoken:
    text = make_text(words)
    chunks = count_chunks(text, chunk_size)
    max_new_tokens = max(1, math.ceil(frames / chunks))
    body = {"model": "drama-3", "input": text, "voice": VOICE, "response_format": "pcm", "stream": True,
            "sample_rate": sample_rate, "seed": SEED, "max_new_tokens": max_new_tokens, "latency": "low"}
    pieces: list[tuple[float, int]] = []                   # (seconds since sent, bytes)
    digest = hashlib.sha256()
    before = gateway_phases(client, url)
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        rate = int(response.headers.get("x-sample-rate") or sample_rate)
        for piece in response.iter_bytes():
            if piece:
                pieces.append((time.perf_counter() - started, len(piece)))
                digest.update(piece)
        take_id = response.headers.get("x-take-id")
    wall = time.perf_counter() - started
    if not pieces:
        raise RuntimeError(f"{words}-word request returned no audio")
    codes_digest = ""
    if take_id:               # the take's codes (the seed contract is about these, not the PCM)
        take = client.get(f"{url}/v1/takes/{take_id}")
        if take.status_code == 200:
            codes_digest = hashlib.sha256(json.dumps(take.json()["vq_codes"]).encode()).hexdigest()
    total = sum(n for _, n in pieces)
    bytes_per_frame = 2 * frame_samples * rate / sample_rate     # int16 mono at the response's rate
    later = (total - pieces[0][1]) / bytes_per_frame
    steady = (pieces[-1][0] - pieces[0][0]) * 1000 / later if later >= 1 else None
    after = gateway_phases(client, url)
    phases = {}                                          # in milestone order
    for phase in PHASES:
        (total_s, count), (total0, count0) = after.get(phase, (0.0, 0)), before.get(phase, (0.0, 0))
        if count > count0:
            phases[phase] = (total_s - total0) * 1000 / (count - count0)
    return Spoken(words, chunks, max_new_tokens, total / bytes_per_frame, total / 2 / rate,
                  pieces[0][0] * 1000, wall * 1000, steady, phases or None, digest.hexdigest(), codes_digest)


PHASES = ("admitted", "first_frames", "first_pcm", "first_byte")


def gateway_phases(client, url: str) -> dict[str, tuple[float, int]]:
    """phase -> (sum s, count) of the gateway's drama_speech_phase_seconds (arrival -> each
    milestone of a request); the difference around one request is that request's timeline."""
    out: dict[str, list] = {}
    try:
        text = client.get(f"{url}/metrics").text
    except Exception:                                    # a breakdown is a bonus, never a failure
        return {}
    for line in text.splitlines():
        for part, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("drama_speech_phase_seconds" + part) and 'phase="' in line:
                phase = line.split('phase="')[1].split('"')[0]
                out.setdefault(phase, [0.0, 0])[index] = float(line.rsplit(" ", 1)[1])
    return {phase: (total, int(count)) for phase, (total, count) in out.items()}


def phase_line(phases: dict | None) -> str:
    """'admitted 12; first_frames 55 (+43); ...' ms from arrival, each with its step from the last
    (';' between them: the line goes into a markdown table's cell, where '|' would split it)."""
    if not phases:
        return "-"
    parts, last = [], 0.0
    for phase in PHASES:
        if phase in phases:
            parts.append(f"{phase} {phases[phase]:.1f} (+{phases[phase] - last:.1f})")
            last = phases[phase]
    return "; ".join(parts)


def plan_frames(frames: list[int], chunks: list[int], warmup: Spoken,
                budget_s: float | None) -> tuple[list[int], str | None]:
    """Frame counts that fit `budget_s`, predicted from the warm-up: its TTFA for each text
    chunk's prefill, its steady ms per frame for each frame."""
    if not budget_s or warmup.steady_ms_per_frame is None:
        return frames, None
    prefill_s = sum(chunks) * warmup.ttfa_ms / 1000
    frame_s = warmup.steady_ms_per_frame / 1000
    predicted = prefill_s + sum(frames) * frame_s
    if predicted <= budget_s:
        return frames, None
    scale = max(0.0, budget_s - prefill_s) / (sum(frames) * frame_s)
    reduced = [max(8, int(f * scale)) for f in frames]
    return reduced, (f"frames reduced from {frames[0]}/{frames[1]} to {reduced[0]}/{reduced[1]} to fit "
                     f"{budget_s:.0f} s: the warm-up ran {warmup.ttfa_ms:.0f} ms to the first audio and "
                     f"{warmup.steady_ms_per_frame:.0f} ms per frame, {predicted:.0f} s predicted")


# --------------------------------------------------------------------------------------------
# per-stage compute, in this process
# --------------------------------------------------------------------------------------------

def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def micro_backbone(preset: str, device: torch.device, context: int, steps: int) -> dict[str, float]:
    """Decode step at batch 1 as the server runs it (on CUDA: replayed from the decode graph the
    engine's warm-up captures, DRAMA_DECODE_GRAPHS' default), and the same step eager."""
    from bench.backbone import bench_decode
    from services.backbone.engine import BackboneEngine
    from services.common.random_weights import random_backbone_stage

    model = random_backbone_stage(preset, device, decode_graphs=device.type == "cuda")
    engine = BackboneEngine(model, max_sessions=1, max_context=context + 2 * steps + 16)
    can_graph = model.decode_graphs
    if can_graph:
        model.capture_decode_graphs(engine.caches, 1)
    args = SimpleNamespace(context=context, warmup=3, steps=steps)
    out = {}
    with torch.inference_mode():
        for key, graphs in (("backbone_step_ms_b1", can_graph), ("backbone_step_ms_b1_eager", False)):
            model.decode_graphs = graphs
            out[key] = bench_decode(engine, 1, args, torch.Generator().manual_seed(0), device)["median_ms"]
    out["backbone_path"] = (f"kernels={model.kernels}, exact={model.exact}, "
                            f"{'CUDA-graph replay' if can_graph else 'eager'}")
    del engine, model
    _free(device)
    return out


def micro_tower(preset: str, device: torch.device, context: int, steps: int) -> float:
    from bench.tower import bench_batch, parse_args
    from services.common.random_weights import random_tower_stage
    from services.tower.engine import TowerEngine

    model, cfg = random_tower_stage(preset, device)
    engine = TowerEngine(model, cfg, max_sessions=1, max_context=context + steps + 8)
    engine.warm_up()                   # as the server does: captures the decode graphs on CUDA
    args = parse_args(["--context", str(context), "--warmup", "3", "--steps", str(steps)])   # back to back
    with torch.inference_mode():
        result = bench_batch(engine, 1, args, torch.Generator().manual_seed(0))
    del engine, model
    _free(device)
    return result["median_ms"]


def micro_codec(preset: str, device: torch.device, history: int, repeats: int) -> float:
    """A 4-frame chunk of one stream `history` frames in, as the server decodes it: through the
    slot pool (services/codec/graphs.py), replayed from a CUDA graph on CUDA, PCM16 on the host."""
    from bench.codec import random_codes, timed
    from services.codec.graphs import GraphedDecoder
    from services.common.random_weights import random_codec_stage

    codec = random_codec_stage(preset, device)
    pool = GraphedDecoder(codec, 2, lengths=(1, 4), buckets=(1,))
    with torch.inference_mode():
        pool.capture()
        slot = pool.acquire()
        pool.decode_streams([slot], [random_codes(codec, history)[0]])
        chunk = random_codes(codec, 4)[0]
        times = timed(lambda: pool.decode_pcm16([slot], [chunk]), device, repeats, warmup=2)
    pool = codec = None              # freed before _free (not `del`: the lambda above names pool)
    _free(device)
    return statistics.median(times)


def micro_timings(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)          # as the servers' model threads run on CPU
    out, errors = {}, {}
    cases = {
        "backbone": lambda: micro_backbone(args.preset, device, args.micro_context, args.micro_steps),
        "tower": lambda: {"tower_step_ms_b1": micro_tower(args.preset, device, args.micro_context,
                                                          args.micro_steps)},
        "codec": lambda: {"codec_chunk_ms_4f": micro_codec(args.preset, device, 200 if device.type == "cuda"
                                                           else 16, args.micro_steps)},
    }
    for stage, run in cases.items():
        started = time.perf_counter()
        try:
            figures = run()
        except Exception as exc:           # one stage failing must not cost the others' figures
            errors[stage] = f"{type(exc).__name__}: {exc}"
            figures = {}
        out.update(figures)
        shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        print(f"  {stage}: {shown or errors[stage]} ({time.perf_counter() - started:.0f} s)", flush=True)
    out["errors"] = errors
    return out


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def transformers_peer(preset: str, device: str) -> tuple[float | None, str | None]:
    """transformers' decode step at batch 1 from bench/kernels.py's saved run (fla GDN kernels)."""
    if preset != "full" or not device.startswith("cuda") or not KERNELS_JSON.is_file():
        return None, None
    data = json.loads(KERNELS_JSON.read_text())
    peer = data.get("peers", {}).get("fla")
    if not peer:
        return None, None
    source = (f"docs/perf/kernels-latest.json peers.fla: bench/kernels.py --peer, {peer.get('transformers')}, "
              f"GDN through fla, {data.get('device')}, {data.get('date')}")
    return peer["decode_ms_median"], source


def commit() -> str:
    """BENCH_COMMIT when set (the lent GPU's copy of the tree carries a stale .git, so its
    `git rev-parse` names an old commit: pass the real one in the command), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):     # a copy without .git (the device machine)
        return os.environ.get("BENCH_COMMIT", "unknown")


def _fmt(value, digits=1, unit="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def build_table(r: dict) -> str:
    """The figures as one markdown table (printed as is)."""
    words = r["settings"]["words"]
    short, long = r["requests"].get("short") or {}, r["requests"].get("long") or {}
    ms = lambda v, d=2: _fmt(v, d, " ms")   # noqa: E731

    def audio(req: dict) -> str:
        return f"{req['frames']:.0f} frames, {req['audio_s']:.1f} s audio" if req else "not run"

    rows = [
        (f"TTFA, {words[0]} words ({short.get('chunks', '-')} text chunk(s))", ms(r["ttfa_ms_20w"], 0),
         TARGETS["ttfa_ms_20w"] + " ms"),
        (f"TTFA, {words[1]} words ({long.get('chunks', '-')} text chunks)", ms(r["ttfa_ms_200w"], 0), ""),
        (f"TTFA of the first request after ready ({words[0]} words)", ms(r["ttfa_ms_first_request"], 0),
         "one-time costs"),
        (f"TTFA phases, {words[0]} words (gateway, ms from arrival (+ step))", phase_line(short.get("phases_ms")), ""),
        (f"RTF, {words[0]} words ({audio(short)})", _fmt(short.get("rtf"), 3), ""),
        (f"RTF, {words[1]} words ({audio(long)}) = rtf_single", _fmt(r["rtf_single"], 3), TARGETS["rtf_single"]),
        (f"E2E ms per frame, {words[0]} words (steady decode)", ms(r["e2e_ms_per_frame"]), "46.4 ms = real time"),
        (f"E2E ms per frame, {words[1]} words (text-chunk prefills included)",
         ms(long.get("steady_ms_per_frame")), ""),
        (f"backbone step, batch 1 (in-process; {r['backbone_path']})", ms(r["backbone_step_ms_b1"]), ""),
        ("backbone step, batch 1, eager (in-process; for comparison)", ms(r["backbone_step_ms_b1_eager"]), ""),
        ("tower step, batch 1 (in-process)", ms(r["tower_step_ms_b1"]), ""),
        ("codec 4-frame chunk (in-process)", ms(r["codec_chunk_ms_4f"]), TARGETS["codec_chunk_ms_4f"] + " ms"),
        ("gRPC/IPC + scheduling per frame (E2E - stage sum)", ms(r["overhead_ms_per_frame"]), ""),
        ("transformers decode step, batch 1 (kernels-latest.json)", ms(r["transformers_step_ms_b1"], 1),
         "" if r["transformers_step_ms_b1"] else "full preset on CUDA only"),
        ("backbone speed-up vs transformers", _fmt(r["backbone_speedup_vs_transformers_b1"], 1, "x"),
         TARGETS["speedup"]),
    ]
    rows += [(f"peak GPU memory, {name} (nvidia-smi)", _fmt(gb, 2, " GiB"), "")
             for name, gb in r["peak_gpu_gb"].items()]
    rows += [(f"start to ready, {name}", _fmt(r["start_to_ready_s"].get(name), 1, " s"),
              TARGETS["backbone_start_s"] + " s" if name == "backbone" else "")
             for name in (*STAGES, "gateway")]
    lines = ["| metric | value | target (issue #7) |", "|---|---|---|"]
    lines += [f"| {metric} | {value} | {target} |" for metric, value, target in rows]
    return "\n".join(lines)


def summarise(args, stack: StackRun, micro: dict) -> dict:
    """Every figure by its JSON key (None where it was not measured)."""
    requests = {name: {"words": q.words, "chunks": q.chunks, "max_new_tokens_per_chunk": q.max_new_tokens,
                       "frames": q.frames, "audio_s": q.audio_s, "ttfa_ms": q.ttfa_ms, "wall_ms": q.wall_ms,
                       "rtf": q.rtf, "steady_ms_per_frame": q.steady_ms_per_frame, "phases_ms": q.phases_ms,
                       "pcm_sha256": q.pcm_sha256, "codes_sha256": q.codes_sha256}
                for name, q in stack.requests.items()}
    short, long = requests.get("short", {}), requests.get("long", {})
    backbone, tower, codec = (micro.get(k) for k in ("backbone_step_ms_b1", "tower_step_ms_b1", "codec_chunk_ms_4f"))
    stage_sum = backbone + tower + codec / 4 if None not in (backbone, tower, codec) else None
    e2e = short.get("steady_ms_per_frame")
    peer_ms, peer_source = transformers_peer(args.preset, args.device)
    return {
        "rtf_single": long.get("rtf"),
        "ttfa_ms_20w": short.get("ttfa_ms"),
        "ttfa_ms_200w": long.get("ttfa_ms"),
        "ttfa_ms_first_request": requests.get("first", {}).get("ttfa_ms"),
        "backbone_step_ms_b1": backbone,
        "transformers_step_ms_b1": peer_ms,
        "transformers_step_source": peer_source,
        "backbone_speedup_vs_transformers_b1": peer_ms / backbone if peer_ms and backbone else None,
        "backbone_step_ms_b1_eager": micro.get("backbone_step_ms_b1_eager"),
        "backbone_path": micro.get("backbone_path"),
        "tower_step_ms_b1": tower,
        "codec_chunk_ms_4f": codec,
        "stage_compute_source": "in-process micro-timing at batch 1 after the stack stopped, on the "
                                "servers' paths (decode graphs, the codec's slot pool)",
        "e2e_ms_per_frame": e2e,
        "stage_sum_ms_per_frame": stage_sum,
        "overhead_ms_per_frame": e2e - stage_sum if e2e is not None and stage_sum is not None else None,
        "peak_gpu_gb": stack.peak_gpu_gb,
        "peak_gpu_source": f"nvidia-smi --query-compute-apps used_memory every {args.smi_period:g} s, "
                           "CUDA context included"
                           + (f"; sampler error: {stack.peak_gpu_note}" if stack.peak_gpu_note else ""),
        "start_to_ready_s": stack.ready_s,
        "backbone_memory_report": stack.backbone_memory,
        "tower_step_stream": stack.tower_stream,
        "requests": requests,
        "frames_note": stack.frames_note,
        "stack_error": stack.error,
        "micro_errors": micro.get("errors", {}),
        "settings": {"preset": args.preset, "device": args.device, "words": list(args.words),
                     "frames_asked": list(args.frames), "budget_s": args.budget_s, "seed": SEED, "voice": VOICE,
                     "latency": "low", "response_format": "pcm", "stream": True,
                     "sample_rate": preset_config(args.preset).codec.sample_rate,
                     **stack.pool,
                     "micro_context": args.micro_context, "micro_steps": args.micro_steps,
                     "stack": (f"attached ({args.stack_info})" if args.stack_info
                               else f"from {args.stack_json}" if args.micro_only else "own")},
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

@dataclass
class StackRun:
    """What the stack part measured; `error` says why anything is missing."""
    ready_s: dict[str, float] = field(default_factory=dict)
    requests: dict[str, Spoken] = field(default_factory=dict)     # first, warmup, short, long
    peak_gpu_gb: dict[str, float] = field(default_factory=dict)
    peak_gpu_note: str | None = None
    frames_note: str | None = None
    backbone_memory: str | None = None                              # the backbone's own report line
    tower_stream: str | None = None           # "lane" (+ the hand-off), or "grpc" (backbone log)
    error: str | None = None
    pool: dict = field(default_factory=lambda: {k: stage_env()[k] for k in ("DRAMA_MAX_ROWS",
                                                                           "DRAMA_MAX_CONTEXT_TOKENS")})


def measure_requests(args, url: str, out: StackRun) -> None:
    """Step 2 against a ready gateway: the first, warm-up, short and long requests."""
    import httpx

    cfg = preset_config(args.preset)
    chunk_size = cfg.text_chunking.text_chunk_size
    audio = (chunk_size, cfg.codec.frame_samples, cfg.codec.sample_rate)
    with httpx.Client(timeout=httpx.Timeout(1800.0, connect=10.0)) as client:
        # The first request after ready pays one-time costs (kernel compilation); the
        # second one is the yardstick for the frame budget.
        for name, n in (("first", 8), ("warmup", 24)):
            warmup = out.requests[name] = speak(client, url, args.words[0], n, *audio)
            print(f"{name} request: TTFA {warmup.ttfa_ms:.0f} ms, {warmup.frames:.0f} frames in "
                  f"{warmup.wall_ms:.0f} ms", flush=True)
        chunks = [count_chunks(make_text(w), chunk_size) for w in args.words]
        frames, out.frames_note = plan_frames(list(args.frames), chunks, warmup, args.budget_s)
        if out.frames_note:
            print(out.frames_note, flush=True)
        for name, words, n in (("short", args.words[0], frames[0]), ("long", args.words[1], frames[1])):
            r = out.requests[name] = speak(client, url, words, n, *audio)
            print(f"{words} words: TTFA {r.ttfa_ms:.0f} ms, {r.frames:.0f} frames, RTF {r.rtf:.3f}, "
                  f"{_fmt(r.steady_ms_per_frame, 2)} ms per frame; phases {phase_line(r.phases_ms)}", flush=True)


def run_attached(args) -> StackRun:
    """Steps 2-3 against a stack that is already up (bench.stack --info-file); it is left running."""
    info = json.loads(args.stack_info.read_text())
    out = StackRun(ready_s={k: float(v) for k, v in info["ready_s"].items()})
    out.pool = {"DRAMA_MAX_ROWS": str(info.get("max_sessions")), "DRAMA_MAX_CONTEXT_TOKENS": str(info.get("max_context"))}
    sampler = None
    if args.device.startswith("cuda"):
        sampler = GpuMemorySampler({int(pid): name for name, pid in info["pids"].items()}, args.smi_period).start()
    try:
        measure_requests(args, info["url"], out)
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        print(f"bench.e2e: {out.error}", file=sys.stderr)
    finally:
        stop_sampler(sampler, out)
    log = Path(info["log_dir"]) / "backbone.log"
    if log.is_file():
        lines = log.read_text().splitlines()
        out.backbone_memory, out.tower_stream = memory_line(lines), tower_stream(lines)
    return out


def stop_sampler(sampler: "GpuMemorySampler | None", out: StackRun) -> None:
    if sampler is not None:
        sampler.stop()
        out.peak_gpu_gb = sampler.peak_gb()
        out.peak_gpu_note = sampler.error


def memory_line(log_lines: list[str]) -> str | None:
    """The backbone's own "backbone memory: ..." report line."""
    return next((line for line in log_lines if line.startswith("backbone memory:")), None)


def tower_stream(log_lines: list[str]) -> str | None:
    """How the backbone's Step stream to the tower ran, from its "... Step stream over ..." line
    (the last connect): "lane" (services/common/local_lane.py) or "grpc"; with the device hand-off
    (services/common/device_handoff.py) "lane, rows through GPU memory", or "lane, rows and
    frames through GPU memory" when decode steps may chain on the tower's frames."""
    for line in reversed(log_lines):
        if "Step stream over the lane" in line:
            if "and their frames back" in line:
                return "lane, rows and frames through GPU memory"
            if "rows through GPU memory" in line:
                return "lane, rows through GPU memory"
            return "lane"
        if "Step stream over gRPC" in line:
            return "grpc"
    return None


def stack_from_json(path: Path) -> StackRun:
    """The stack figures of an earlier `--json` (for --micro-only)."""
    data = json.loads(path.read_text())
    requests = {name: Spoken(**{k: q[k] for k in ("words", "chunks", "frames", "audio_s", "ttfa_ms",
                                                   "wall_ms", "steady_ms_per_frame")},
                             max_new_tokens=q["max_new_tokens_per_chunk"], phases_ms=q.get("phases_ms"))
                for name, q in data["requests"].items()}
    note = data["peak_gpu_source"].partition("; sampler error: ")[2] or None
    return StackRun(ready_s=data["start_to_ready_s"], requests=requests, peak_gpu_gb=data["peak_gpu_gb"],
                    peak_gpu_note=note, frames_note=data["frames_note"],
                    backbone_memory=data["backbone_memory_report"], tower_stream=data.get("tower_step_stream"),
                    error=data["stack_error"],
                    pool={k: data["settings"][k] for k in ("DRAMA_MAX_ROWS", "DRAMA_MAX_CONTEXT_TOKENS")})


def run_stack(args) -> StackRun:
    """Steps 1-3: start the stack, time the requests, stop it. Failures are recorded, not raised,
    so that the per-stage timings still run."""
    from services.common.make_checkpoint import make_checkpoint

    out = StackRun()
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        config_dir = Path(tmp) / "config"
        with contextlib.redirect_stdout(io.StringIO()):          # the dry run prints the shard plan
            make_checkpoint(config_dir, preset=args.preset, dry_run=True)
        log_dir = args.log_dir or Path(tmp) / "logs"
        print(f"starting the stack ({args.preset} on {args.device}, logs in {log_dir}) ...", flush=True)
        stack = start_stack(args.preset, args.device, config_dir, log_dir)
        out.ready_s = stack.ready_s
        sampler = None
        if args.device.startswith("cuda"):
            pids = {p.popen.pid: name for name, p in stack.processes.items()}
            sampler = GpuMemorySampler(pids, args.smi_period).start()
        try:
            wait_stack_ready(stack, args.ready_timeout)
            print("ready: " + ", ".join(f"{k} {v:.1f} s" for k, v in stack.ready_s.items()), flush=True)
            measure_requests(args, stack.url, out)
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            print(f"bench.e2e: {out.error}", file=sys.stderr)
            for process in stack.processes.values():
                print(f"--- {process.name} ---\n{process.log_tail(20)}", file=sys.stderr)
        finally:
            stop_sampler(sampler, out)
            stack.stop()
            lines = stack.processes["backbone"].log_tail(200).splitlines()
            out.backbone_memory, out.tower_stream = memory_line(lines), tower_stream(lines)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m bench.e2e " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.micro_only:
        if not args.stack_json:
            raise SystemExit("bench.e2e: --micro-only needs --stack-json")
        stack = stack_from_json(args.stack_json)
    elif args.stack_info:
        stack = run_attached(args)
    else:
        stack = run_stack(args)
    micro = {"errors": {}}
    if not args.skip_micro:
        print("per-stage compute in this process (batch 1):", flush=True)
        micro = micro_timings(args)
    result = summarise(args, stack, micro)
    result["command"] = command
    table = build_table(result)
    gpu = f" ({result['gpu']})" if result["gpu"] else ""
    header = (f"bench.e2e: preset {args.preset} on {args.device}{gpu}, {result['date']}, "
              f"commit {result['commit'][:10]}"
              + "".join(f"\nnote: {result[k]}" for k in ("frames_note", "stack_error") if result[k]))
    print(f"\n{header}\n\n{table}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"Command: `{command}`\n\n{header}\n\n{table}\n")
    return 1 if stack.error else 0


if __name__ == "__main__":
    sys.exit(main())

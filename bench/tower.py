"""Tower per-frame step at the real Drama 3 geometry (MODEL.md §11), one script, one table.

    python bench/tower.py                                   full geometry on cuda, batch 1/8/32/64/128,
                                                            CUDA-graph and eager rows
    python bench/tower.py --graphs off                      eager only (--graphs on: graphs only)
    python bench/tower.py --invariance 8 32                 also: is a session's take the same alone
                                                            and inside batches of 8 and 32? (issue #8)
    python bench/tower.py --preset tiny --device cpu        smoke test (CI-sized)
    python bench/tower.py --out tower.json                  also write the numbers as JSON
    python bench/tower.py --batch 1 --prompt 134 --prompt-profile   also a request's first step:
                                                            134 prompt rows, first frame (+ profile)
    python bench/tower.py --graphs on --decode-gemm off on down,fc   the projections on cuBLAS (off), on
                                                            the Triton decode GEMM (on, the default)
                                                            or some kinds of each, in turn, one process

Random weights are made on the device (no checkpoint). For each batch size B the engine's pool is
emptied, B sessions are prefilled with `--context` rows each (one Step per session, the last row
drawing), then `--steps` frame steps of B draw rows are timed. A timed step is what the server
does per StepRequest after decoding the bytes: `TowerEngine.step` with CPU hidden rows (so the
host-to-device copy is included), the trunk over B rows, the semantic head, 10 batched draws
and 9 residual layers, and the codes back on the host. Reported: median and p90 ms per step,
frames/s (B / median), and the real-time budget share (a real-time session needs a frame per
1/21.5 s = 46.4 ms for backbone, tower and both transfers together, API.md §3.5).

Measured on one H200 (2026-11-29, torch 2.11, `python3 bench/tower.py --steps 20 --warmup 3
--invariance 8 32 --invariance-steps 16`, context 1000), median ms per step at batch 1/8/32/64/128:
graphs 3.06 / 3.40 / 4.38 / 6.31 / 8.04, eager 15.5 / 16.6 / 18.0 / 18.7 / 20.9 (before issue #7's
work: 79 ms at batch 1, 123 ms at batch 64).

`graphs` rows replay the engine's CUDA graphs (captured by warm_up; a step of B rows replays
bucket B), `eager` rows run the same step op by op (DRAMA_TOWER_GRAPHS=0 in the server).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.step_settings import SETTINGS, applied  # noqa: E402
from services.common.config import DramaConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402
from services.tower import model as tower_model  # noqa: E402
from services.tower.engine import StepEntry, TowerEngine  # noqa: E402
from services.tower.weights import random_tower  # noqa: E402

FRAME_PERIOD_MS = 2048 / 44100 * 1000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=1000, help="prefill rows per session")
    parser.add_argument("--steps", type=int, default=50, help="timed frame steps per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed frame steps first")
    parser.add_argument("--graphs", choices=["on", "off", "both"], help="default: both on cuda, off elsewhere")
    parser.add_argument("--invariance", type=int, nargs="*", default=[],
                        help="batch sizes to compare one session's frames in against batch 1 (graph path)")
    parser.add_argument("--invariance-steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, nargs="*", default=[], metavar="ROWS",
                        help="also time a new session's prompt step of ROWS rows (the rows through the "
                        "trunk, the first frame drawn), as the server runs a request's first Step")
    parser.add_argument("--prompt-profile", action="store_true", help="a torch.profiler table of each "
                        "--prompt step")
    parser.add_argument("--decode-gemm", nargs="+", metavar="KINDS",
                        help="the tower's frame-step projections through kernels/decode_gemm or cuBLAS in "
                        "128-row pieces: off (none), on (all) or kinds like qkv,o_proj,fc "
                        "(services/tower/model.PROJECTIONS), one engine per entry in turn "
                        "(default: DRAMA_TOWER_DECODE_GEMM's)")
    parser.add_argument("--fused-draws", nargs="+", choices=["on", "off"],
                        help="each draw and its bookkeeping in one launch (kernels.FusedFrameDraws) or the torch "
                        "bookkeeping around kernels.draw, one engine per entry in turn, crossed with --decode-gemm "
                        "(default: DRAMA_TOWER_FUSED_DRAWS's)")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS),
                        help="kernel settings (bench/step_settings.py: the decode GEMM's configs, where its split "
                        "reduce runs), one engine per entry in turn, crossed with the others (default: as the "
                        "process has them)")
    parser.add_argument("--throwaway", action="store_true",
                        help="time the first setting once more before the others and drop it: a process's first "
                        "engine ran ~0.2 ms slow (docs/perf.md, session 21)")
    parser.add_argument("--idle-ms", type=float, default=0.0, help="wait this long before each timed step "
                        "(a served step follows ~5 ms of the other stages' work): does a step after a wait run slower?")
    parser.add_argument("--idle-spin", action="store_true", help="wait --idle-ms spinning, not asleep")
    parser.add_argument("--clocks", action="store_true",
                        help="read the GPU's SM clock (NVML: nvidia-ml-py, carried in .whl) after each wait and "
                        "after each timed step: is a step after --idle-ms slower because the clock dropped?")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _idle(seconds: float, spin: bool) -> None:
    """The gap a served step follows (the backbone's step and the hops, ~5 ms at batch 1): asleep,
    as a server waiting on its socket, or spinning, which keeps the core awake."""
    if spin:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    elif seconds > 0:
        time.sleep(seconds)


class SmClock:
    """The SM clock in MHz of the GPU `device` names, through NVML. What a served step follows
    (the other stages' work, the hops: ~5 ms at batch 1) made the tower's step 2.03 -> 2.37 ms
    (docs/perf.md, session 19), ~0.2 ms of it on the GPU's side: this says whether the clock is
    the part that moves. NVML's figure is the driver's latest sample, not an instant reading."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise SystemExit(f"--clocks reads a CUDA GPU's clock; the engine is on {device}")
        try:
            import pynvml
        except ImportError:
            raise SystemExit("--clocks needs nvidia-ml-py (pynvml): bash bench/device_wheels.sh carries it") from None
        pynvml.nvmlInit()
        self._nvml = pynvml
        # NVML numbers the machine's GPUs as CUDA does without CUDA_VISIBLE_DEVICES (the lent machines)
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)

    def mhz(self) -> int:
        return self._nvml.nvmlDeviceGetClockInfo(self.handle, self._nvml.NVML_CLOCK_SM)


def _median_min(values: list[int]) -> dict:
    return {"median": statistics.median(values), "min": min(values)}


def bench_batch(engine: TowerEngine, batch: int, args, generator: torch.Generator) -> dict:
    cfg = engine.cfg
    hidden_size, n = engine.model.hidden_size, cfg.num_codebooks
    engine.release([f"s{i}" for i in range(engine.max_sessions)])

    # Prefill: one Step per session, teacher-forced with no targets, the last row drawing.
    started = time.perf_counter()
    for i in range(batch):
        hidden = torch.randn(args.context, hidden_size, generator=generator)
        targets = torch.full((args.context, n), -1, dtype=torch.int64)
        result = engine.step([StepEntry(f"s{i}", 0, args.context, draw=True, seed=i)], hidden, targets)
        assert not result.row_errors, result.row_errors
    _sync(engine.device)
    prefill_s = time.perf_counter() - started

    times = []
    clock = SmClock(engine.device) if args.clocks else None
    mhz_before, mhz_after = [], []
    for step in range(args.warmup + args.steps):
        row = args.context + step
        entries = [StepEntry(f"s{i}", row, 1, draw=True, seed=i, frame_index=step + 1) for i in range(batch)]
        hidden = torch.randn(batch, hidden_size, generator=generator)
        targets = torch.full((batch, n), -1, dtype=torch.int64)
        _idle(args.idle_ms / 1000, args.idle_spin)
        before = clock.mhz() if clock is not None else 0
        started = time.perf_counter()
        result = engine.step(entries, hidden, targets)   # returns host codes: synchronised
        elapsed = time.perf_counter() - started
        assert not result.row_errors, result.row_errors
        if step >= args.warmup:
            times.append(elapsed * 1000)
            if clock is not None:
                mhz_before.append(before)
                mhz_after.append(clock.mhz())
    times.sort()
    median = statistics.median(times)
    clocks = {"sm_mhz_before": _median_min(mhz_before), "sm_mhz_after": _median_min(mhz_after)} if clock else {}
    return {"batch": batch, "median_ms": median, "p90_ms": times[int(0.9 * (len(times) - 1))],
            "frames_per_s": batch / median * 1000, "budget_share": median / FRAME_PERIOD_MS,
            "prefill_rows_per_s": batch * args.context / prefill_s, **clocks}


def bench_prompt(engine: TowerEngine, rows: int, args, generator: torch.Generator) -> dict:
    """A new session's first Step: `rows` prompt rows, the last one drawing (the server's step 1
    of a request, what bench.timeline shows as 'tower: step 1'). Median over --steps repeats, each
    on a fresh session (the previous one released)."""
    cfg = engine.cfg
    hidden = torch.randn(rows, engine.model.hidden_size, generator=generator)
    targets = torch.full((rows, cfg.num_codebooks), -1, dtype=torch.int64)
    engine.release([f"s{i}" for i in range(engine.max_sessions)])

    def step():
        engine.release(["p"])
        result = engine.step([StepEntry("p", 0, rows, draw=True, seed=5)], hidden, targets)
        assert not result.row_errors, result.row_errors

    times = []
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        step()                                  # the codes come back on the host: synchronised
        if i >= args.warmup:
            times.append((time.perf_counter() - started) * 1000)
    if args.prompt_profile:
        from bench.stage_profile import report
        report(f"tower prompt step of {rows} rows", step, engine.device, steps=5, top=25)
    engine.release(["p"])
    return {"prompt_rows": rows, "median_ms": statistics.median(times), "min_ms": min(times)}


def invariance(engine: TowerEngine, sizes: list[int], args) -> list[dict]:
    """Issue #8: the frames of one session ("t", fixed inputs and seed) decoded alone, then with
    B - 1 companions (random inputs) in every step, for each B in `sizes`; compared frame by
    frame with the frames decoded alone."""
    cfg = engine.cfg
    hidden_size, n = engine.model.hidden_size, cfg.num_codebooks
    context = min(args.context, engine.max_context - args.invariance_steps - 1)

    def take(batch: int) -> torch.Tensor:
        engine.release(["t"] + [f"{p}{i}" for p in "cs" for i in range(engine.max_sessions)])
        fixed = torch.Generator().manual_seed(1234)
        noise = torch.Generator().manual_seed(batch)
        targets = torch.full((context, n), -1, dtype=torch.int64)
        prefills = [engine.step([StepEntry("t", 0, context, draw=True, seed=77)],
                                torch.randn(context, hidden_size, generator=fixed), targets)]
        for i in range(batch - 1):
            prefills.append(engine.step([StepEntry(f"c{i}", 0, context, draw=True, seed=i)],
                                        torch.randn(context, hidden_size, generator=noise), targets))
        assert not any(r.row_errors for r in prefills), [r.row_errors for r in prefills]
        frames = []
        for step in range(args.invariance_steps):
            row = context + step
            entries = [StepEntry("t", row, 1, draw=True, seed=77, frame_index=step + 1)]
            entries += [StepEntry(f"c{i}", row, 1, draw=True, seed=i, frame_index=step + 1) for i in range(batch - 1)]
            hidden = torch.cat([torch.randn(1, hidden_size, generator=fixed),
                                torch.randn(batch - 1, hidden_size, generator=noise)])
            result = engine.step(entries, hidden, torch.full((batch, n), -1, dtype=torch.int64))
            assert not result.row_errors, result.row_errors
            frames.append(result.codes[0])
        return torch.stack(frames)

    alone = take(1)
    out = []
    for batch in sizes:
        frames = take(batch)
        same = (frames == alone).all(dim=1)
        first = int((~same).nonzero()[0]) if not same.all() else None
        out.append({"batch": batch, "frames": len(same), "identical_frames": int(same.sum()),
                    "first_different_frame": first, "codes_equal_fraction": float((frames == alone).float().mean())})
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = DramaConfig.from_dict(preset_raw(args.preset))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = random_tower(cfg, device=device, dtype=dtype, seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    modes = {"on": ["graphs"], "off": ["eager"], "both": ["graphs", "eager"]}[
        args.graphs or ("both" if device.type == "cuda" else "off")]
    print(f"tower {args.preset} on {device} ({dtype}): {parameters / 1e9:.3f} B parameters, "
          f"{len(model.layers())} layers, context {args.context}, {args.steps} timed steps", flush=True)
    print(f"{'mode':>10} {'batch':>5} {'median ms':>10} {'p90 ms':>8} {'frames/s':>9} {'of 46.4 ms':>10} "
          f"{'prefill rows/s':>15}", flush=True)
    switch = tower_model.TOWER_DECODE_GEMM
    # parsed before any engine is built, so a typo fails at once
    settings = [tower_model.decode_gemm_kinds(g) for g in args.decode_gemm] if args.decode_gemm else [switch]
    try:
        results, checks, meta_modes = _run(args, model, cfg, device, modes, settings, args.fused_draws or [None],
                                           args.settings or [None])
    finally:
        tower_model.TOWER_DECODE_GEMM = switch           # as the process had it
    if args.out:
        meta = {"preset": args.preset, "device": str(device), "dtype": str(dtype), "context": args.context,
                "steps": args.steps, "torch": torch.__version__, "modes": meta_modes,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        args.out.write_text(json.dumps({"meta": meta, "results": results, "invariance": checks}, indent=2) + "\n")
    return results


def _run(args, model, cfg, device, modes: list[str], settings: list[frozenset],
         fused_draws: list[str | None], kernel_settings: list[str | None]) -> tuple[list, list, dict]:
    """main's timings: one engine per (decode GEMM kinds, fused draws, kernel setting, mode), in turn."""
    results, checks, meta_modes = [], [], {}
    combos = [(k, f, c, m) for k in settings for f in fused_draws for c in kernel_settings for m in modes]
    if args.throwaway:                   # timed and printed, not returned
        kinds, fused, setting, base_mode = combos[0]
        print("(throw-away engine first)", flush=True)
        with applied(setting):
            _run_one(args, model, cfg, device, kinds, fused, setting, base_mode, [], [], {})
    for kinds, fused, setting, base_mode in combos:
        with applied(setting):
            _run_one(args, model, cfg, device, kinds, fused, setting, base_mode, results, checks, meta_modes)
    return results, checks, meta_modes


def _run_one(args, model, cfg, device, kinds, fused, setting, base_mode, results, checks, meta_modes) -> None:
    """One engine under one setting: its timings appended to results, checks and meta_modes."""
    # tower_linear reads the switch at each call, the kernels their settings: eager steps and
    # the graphs captured below follow them
    tower_model.TOWER_DECODE_GEMM = kinds
    mode = (base_mode + ("" if not kinds else "+dg" if kinds == set(tower_model.PROJECTIONS)
                         else "+" + ",".join(sorted(kinds))) + {None: "", "on": "+fd", "off": "-fd"}[fused]
            + ("" if setting is None else "+" + setting))
    # One engine at a time: a new engine re-allocates the model's caches (and the old
    # engine's graphs point at the old ones).
    engine = TowerEngine(model, cfg, max_sessions=max(args.batch + args.invariance),
                         max_context=max([args.context + args.warmup + args.steps + 1, *args.prompt]),
                         graphs=base_mode == "graphs")
    if fused is not None:            # before warm_up: the graphs capture the draws it picks
        engine._fused_draws = fused == "on" and engine._fused_draws
    started = time.perf_counter()
    engine.warm_up()
    _sync(device)
    meta_modes[mode] = {"warm_up_s": time.perf_counter() - started, "graphs_captured": engine.graphs_captured}
    generator = torch.Generator().manual_seed(0)
    for batch in args.batch:
        r = {"mode": mode, **bench_batch(engine, batch, args, generator)}
        results.append(r)
        print(f"{mode:>10} {r['batch']:>5} {r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['frames_per_s']:>9.1f} "
              f"{r['budget_share']:>10.1%} {r['prefill_rows_per_s']:>15.0f}", flush=True)
        if args.clocks:
            b, a = r["sm_mhz_before"], r["sm_mhz_after"]
            print(f"{'':>10} SM clock MHz before a step: median {b['median']:.0f} (min {b['min']}), "
                  f"after it: median {a['median']:.0f} (min {a['min']})", flush=True)
    for rows in args.prompt:
        r = {"mode": mode, **bench_prompt(engine, rows, args, generator)}
        results.append(r)
        print(f"{mode:>10} prompt step of {rows} rows: median {r['median_ms']:.2f} ms, "
              f"min {r['min_ms']:.2f} ms", flush=True)
    if args.invariance:
        for c in invariance(engine, args.invariance, args):
            checks.append({"mode": mode, **c})
            print(f"{mode:>10} invariance: batch {c['batch']} vs alone: {c['identical_frames']}/{c['frames']} "
                  f"frames identical (first different: {c['first_different_frame']}), "
                  f"{c['codes_equal_fraction']:.1%} of codes equal", flush=True)
    del engine


if __name__ == "__main__":
    main()

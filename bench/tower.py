"""Tower per-frame step at the real Drama 3 geometry (MODEL.md §11), one script, one table.

    python bench/tower.py                                   full geometry on cuda, batch 1/8/32/64
    python bench/tower.py --preset tiny --device cpu        smoke test (CI-sized)
    python bench/tower.py --out tower.json                  also write the numbers as JSON

Random weights are made on the device (no checkpoint). For each batch size B the engine's pool is
emptied, B sessions are prefilled with `--context` rows each (one Step per session, the last row
drawing), then `--steps` frame steps of B draw rows are timed. A timed step is what the server
does per StepRequest after decoding the bytes: `TowerEngine.step` with CPU hidden rows (so the
host-to-device copy is included), the trunk over B rows, the semantic head, 10 batched draws
and 9 residual layers, and the codes back on the host. Reported: median and p90 ms per step,
frames/s (B / median), and the real-time budget share (a real-time session needs a frame per
1/21.5 s = 46.4 ms for backbone, tower and both transfers together, API.md §3.5).
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

from services.common.config import DramaConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402
from services.tower.engine import StepEntry, TowerEngine  # noqa: E402
from services.tower.weights import random_tower  # noqa: E402

FRAME_PERIOD_MS = 2048 / 44100 * 1000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=1000, help="prefill rows per session")
    parser.add_argument("--steps", type=int, default=50, help="timed frame steps per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed frame steps first")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    for step in range(args.warmup + args.steps):
        row = args.context + step
        entries = [StepEntry(f"s{i}", row, 1, draw=True, seed=i, frame_index=step + 1) for i in range(batch)]
        hidden = torch.randn(batch, hidden_size, generator=generator)
        targets = torch.full((batch, n), -1, dtype=torch.int64)
        started = time.perf_counter()
        result = engine.step(entries, hidden, targets)   # returns host codes: synchronised
        elapsed = time.perf_counter() - started
        assert not result.row_errors, result.row_errors
        if step >= args.warmup:
            times.append(elapsed * 1000)
    times.sort()
    median = statistics.median(times)
    return {"batch": batch, "median_ms": median, "p90_ms": times[int(0.9 * (len(times) - 1))],
            "frames_per_s": batch / median * 1000, "budget_share": median / FRAME_PERIOD_MS,
            "prefill_rows_per_s": batch * args.context / prefill_s}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = DramaConfig.from_dict(preset_raw(args.preset))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = random_tower(cfg, device=device, dtype=dtype, seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    engine = TowerEngine(model, cfg, max_sessions=max(args.batch),
                         max_context=args.context + args.warmup + args.steps + 1)
    generator = torch.Generator().manual_seed(0)
    print(f"tower {args.preset} on {device} ({dtype}): {parameters / 1e9:.3f} B parameters, "
          f"{len(model.layers())} layers, context {args.context}, {args.steps} timed steps")
    print(f"{'batch':>5} {'median ms':>10} {'p90 ms':>8} {'frames/s':>9} {'of 46.4 ms':>10} {'prefill rows/s':>15}")
    results = []
    for batch in args.batch:
        r = bench_batch(engine, batch, args, generator)
        results.append(r)
        print(f"{r['batch']:>5} {r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['frames_per_s']:>9.1f} "
              f"{r['budget_share']:>10.1%} {r['prefill_rows_per_s']:>15.0f}")
    if args.out:
        meta = {"preset": args.preset, "device": str(device), "dtype": str(dtype), "context": args.context,
                "steps": args.steps, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()

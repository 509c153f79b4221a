"""Where a stage's step spends its time: torch.profiler over a few steps, one table per case.

    python bench/stage_profile.py                         tower decode step (batch 1, 8) and codec chunk on cuda
    python bench/stage_profile.py --preset tiny --device cpu --cases tower
    python bench/stage_profile.py --cases tower --graphs --batch 1 128   the served (graphed) tower step

Random weights at the real geometry (MODEL.md §11), made on the device. Prints, per case, the
wall time per step, the number of kernels launched per step, and the top operators by self
device time and by self host time: enough to tell launch-bound from bandwidth-bound and to find
host syncs (cudaStreamSynchronize / cudaMemcpy rows in the host table).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from services.common.config import CodecConfig, DramaConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report(name: str, step, device: torch.device, steps: int = 5, top: int = 25) -> None:
    for _ in range(3):
        step()
    _sync(device)
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        _sync(device)
        walls.append((time.perf_counter() - started) * 1000)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n=== {name}: wall median {statistics.median(walls):.2f} ms/step, "
          f"{kernels / steps:.0f} device kernels/step ===")
    if device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def tower_case(args, device, batch: int):
    from services.tower.engine import StepEntry, TowerEngine
    from services.tower.weights import random_tower

    cfg = DramaConfig.from_dict(preset_raw(args.preset))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = random_tower(cfg, device=device, dtype=dtype, seed=0)
    engine = TowerEngine(model, cfg, max_sessions=batch, max_context=args.context + 64,
                         graphs=args.graphs and device.type == "cuda")
    if engine.use_graphs:
        engine.warm_up()                     # captures the graphs the server replays
    n, d = cfg.num_codebooks, model.hidden_size
    for i in range(batch):
        engine.step([StepEntry(f"s{i}", 0, args.context, draw=True, seed=i)],
                    torch.randn(args.context, d), torch.full((args.context, n), -1, dtype=torch.int64))
    state = {"row": args.context}

    def step():
        row = state["row"]
        state["row"] += 1
        entries = [StepEntry(f"s{i}", row, 1, draw=True, seed=i, frame_index=row) for i in range(batch)]
        result = engine.step(entries, torch.randn(batch, d), torch.full((batch, n), -1, dtype=torch.int64))
        assert not result.row_errors, result.row_errors

    return step


def codec_case(args, device, frames: int):
    from bench.codec import random_codec, random_codes

    cfg = CodecConfig.from_dict(preset_raw(args.preset)["codec_config"])
    codec = random_codec(cfg, device).prepare(device, torch.float16 if device.type == "cuda" else torch.float32)
    history = random_codes(codec, 200)
    chunk = random_codes(codec, frames)[0]
    state = codec.new_state()
    with torch.inference_mode():
        codec.decode_streams([state], [history[0]])

    def step():
        with torch.inference_mode():
            codec.decode_streams([state], [chunk])

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="+", default=["tower", "codec"], choices=["tower", "codec"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--graphs", action="store_true", help="tower: replay the engine's CUDA graphs "
                        "(captured by warm_up, as served) instead of eager steps")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if "tower" in args.cases:
        for batch in args.batch:
            report(f"tower decode step, batch {batch}, context {args.context}",
                   tower_case(args, device, batch), device)
    if "codec" in args.cases:
        for frames in (1, 4):
            report(f"codec stream chunk of {frames} frames", codec_case(args, device, frames), device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

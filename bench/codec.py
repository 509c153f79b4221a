"""Codec decode/encode at the real geometry (MODEL.md §7.1), one script, one table.

    python bench/codec.py                                   full geometry on cuda, FP16 and FP32
    python bench/codec.py --preset tiny --device cpu        smoke test (CI-sized)
    python bench/codec.py --out codec.json                  also write the numbers as JSON

Random weights are made on the device (no checkpoint; the decode cost does not depend on the
values). Timed, per decode dtype:
- offline decode of 1, 4 and 215 frames (215 frames = 10 s), one stream;
- a 4-frame streaming chunk of a stream that is already 200 frames in (full attention window);
- a server tick: B sessions with a 4-frame chunk each in one `decode_streams` call;
and encode of 10 s of audio (always float32, §7.3). Reported: median and p90 ms and the
real-time factor (audio seconds per compute second). On CPU the codec runs its bit-exact
frame-serial path, as the server does.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.codec.model import Codec  # noqa: E402
from services.common.config import CodecConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402

DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", nargs="+", default=["fp16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 4, 215], help="offline decode lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="sessions per server tick")
    parser.add_argument("--encode-seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, help="timed calls per case (default 10 on GPU, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, help="intra-op threads (default 1 on CPU, as the server's "
                        "model thread; torch's default on GPU)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def random_codec(cfg: CodecConfig, device: torch.device, seed: int = 0) -> Codec:
    """The codec with §10.2-style random weights, built directly on `device`, float32."""
    torch.manual_seed(seed)
    with torch.device(device):
        codec = Codec(cfg)
    with torch.no_grad():
        for name, p in codec.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gamma"):
                p.uniform_(0.05, 0.2)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("codebook.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
    return codec


def random_codes(codec: Codec, frames: int, batch: int = 1) -> torch.Tensor:
    semantic = torch.randint(0, codec.semantic_codebook_size, (batch, 1, frames))
    residual = torch.randint(0, codec.codebook_size, (batch, codec.num_codebooks - 1, frames))
    return torch.cat([semantic, residual], dim=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Wall milliseconds of `fn()` per repeat (synchronised), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - started) * 1000)
    return times


def summary(name: str, dtype: str, times: list[float], audio_seconds: float) -> dict:
    median = statistics.median(times)
    p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
    return {"case": name, "dtype": dtype, "median_ms": median, "p90_ms": p90,
            "rtf_x": audio_seconds / (median / 1000) if median > 0 else float("inf")}


def bench_decode(codec: Codec, dtype_name: str, args, device: torch.device) -> list[dict]:
    codec.prepare(device, DTYPES[dtype_name])
    frame_s = codec.frame_samples / codec.sample_rate
    rows = []
    for frames in args.frames:
        codes = random_codes(codec, frames)
        times = timed(lambda: codec.decode(codes), device, args.repeats, args.warmup)
        rows.append(summary(f"decode {frames} frames", dtype_name, times, frames * frame_s))

    # A streaming chunk of 4 frames once the post module's window is full.
    history, chunk = random_codes(codec, 200), random_codes(codec, 4)
    state = codec.new_state()
    codec.decode_streams([state], [history[0]])

    def one_chunk():
        fresh = type(state)(state.position.clone(), {k: v.clone() for k, v in state.tensors.items()})
        codec.decode_streams([fresh], [chunk[0]])

    times = timed(one_chunk, device, args.repeats, args.warmup)
    rows.append(summary("stream chunk of 4 (after 200)", dtype_name, times, 4 * frame_s))

    for batch in args.batch:
        states = [codec.new_state() for _ in range(batch)]
        chunks = list(random_codes(codec, 4, batch).unbind(0))
        times = timed(lambda: codec.decode_streams(states, chunks), device, args.repeats, args.warmup)
        rows.append(summary(f"tick: {batch} sessions x 4 frames", dtype_name, times, batch * 4 * frame_s))
    return rows


def bench_encode(codec: Codec, args, device: torch.device) -> dict:
    codec.prepare(device, torch.float32)
    seconds = args.encode_seconds
    t = torch.arange(int(seconds * codec.sample_rate)) / codec.sample_rate
    audio = (0.5 * torch.sin(2 * math.pi * 220 * t))[None]
    times = timed(lambda: codec.encode(audio, codec.sample_rate), device, max(1, args.repeats // 2),
                  max(1, args.warmup // 2))
    return summary(f"encode {seconds:g} s", "fp32", times, seconds)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.repeats is None:
        args.repeats = 10 if device.type == "cuda" else 3
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    cfg = CodecConfig.from_dict(preset_raw(args.preset)["codec_config"])
    codec = random_codec(cfg, device)
    params = sum(p.numel() for p in codec.parameters())
    print(f"codec {args.preset}: {params / 1e6:.1f} M parameters, {cfg.num_codebooks} codebooks, "
          f"{cfg.frame_samples} samples/frame, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtype:
            rows += bench_decode(codec, dtype_name, args, device)
        rows.append(bench_encode(codec, args, device))
    print(f"{'case':<36} {'dtype':<6} {'median ms':>10} {'p90 ms':>10} {'x real time':>12}")
    for row in rows:
        print(f"{row['case']:<36} {row['dtype']:<6} {row['median_ms']:>10.2f} {row['p90_ms']:>10.2f} "
              f"{row['rtf_x']:>12.1f}")
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "device": str(device), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

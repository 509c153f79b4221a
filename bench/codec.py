"""Codec decode/encode at the real geometry (MODEL.md §7.1), one script, one table.

    python bench/codec.py                                   full geometry on cuda, FP16 and FP32
    python bench/codec.py --preset tiny --device cpu        smoke test (CI-sized)
    python bench/codec.py --out codec.json                  also write the numbers as JSON
    python bench/codec.py --ablate --profile                + rows with single GPU fast paths off,
                                                              + torch.profiler tables

Random weights are made on the device (no checkpoint; the decode cost does not depend on the
values). Timed, per decode dtype, on two paths:
- eager (`Codec.decode` / `Codec.decode_streams`, the GPU fast paths on where the device is CUDA):
  offline decode of 1, 4 and 215 frames (215 frames = 10 s), one stream; a streaming chunk of 1
  and of 4 frames of a stream already 200 frames in (full attention window); a server tick: B
  sessions with a 4-frame chunk each in one `decode_streams` call;
- graphed (services/codec/graphs.py; on CPU the same pool with eager ticks, "pool (eager)"): the
  same chunks and ticks through the slot pool as the server runs them (`decode_pcm16`: replay,
  PCM16 on the device, copy to the host); per --frames length the offline decode (`decode`:
  batch-1 graphs, last piece padded, 215 frames = 128 + 64 + 32) and "server chunk of N frames",
  one Decode message of all N frames on a fresh slot (exact split, 215 = 128 + 64 + 16 + 7);
and encode of 10 s of audio (always float32, §7.3). Reported: median and p90 ms and the
real-time factor (audio seconds per compute second). On CPU the codec runs its bit-exact
frame-serial path, as the server does. --ablate adds FP16 rows (eager 215 frames and chunk of
4, graphed server chunk of 215) with the reference ops (fast=False), with each fast path flipped
alone (narrow_conv=False is the last conv on cuDNN again, pointwise_gemm=False the residual 1x1
convs, channels_last=True the F16 NHWC decoder), and with cudnn.benchmark on.

Before/after switches (issue #3, 10 s in <= 15 ms FP16): `--long-lengths` alone drops the
batch-1 long graphs (a long chunk runs as 8-frame replays, as before); `--options narrow_conv=0
pointwise_gemm=0 fused_windows=0` is the decoder as before (last conv on cuDNN's generic kernel,
1x1 convs on cuDNN plus a skip add, torch.cat windows and bias adds); the server takes the same
as DRAMA_CODEC_LONG_LENGTHS=none and DRAMA_CODEC_OPTIONS=narrow_conv=0,pointwise_gemm=0,...

Measured on one H200 (torch 2.11, 2026-11-29, `--ablate --profile`, cut off at 78 s before the
ablation rows), with channels_last still on in FP16 (median ms):
                                  FP16 eager  FP16 graphed  FP32 eager  FP32 graphed
  stream chunk of 1 (after 200)         8.44          1.94       12.33          2.51
  stream chunk of 4 (after 200)         8.82          2.34       12.58          3.07
  tick: 8 / 32 / 64 sessions x 4   82 / 298 / 303  75 / 292 / 298   16 / 21 / 43   7.0 / 18.3 / 34.3
  decode 215 frames (10 s)            488           574          30.2          32.3
  encode 10 s (FP32)                   25.5
Before (issue #7): FP16 eager chunk 17-23 ms, 10 s 37.8 ms. The FP16 rows that grow with the
frame count (~2.3 ms per frame) are cuDNN's F16 NHWC convs, so Codec.prepare keeps F16 in torch's
default layout now (channels_last only in float32); those rows are not re-measured yet.
Then with F16 in the default layout (H200, `--dtype fp16 fp32 --frames 1 4 215 --profile`, before
issue #3's changes): decode 215 frames FP16 eager 28.1 ms, graphed 24.8 (one padded 256-frame
replay); FP32 eager 27.9, graphed 32.7; FP16 graphed stream chunk of 4: 2.52. Profile of the
eager FP16 215-frame decode: cuDNN's generic implicit_convolve_sgemm (the last conv, 1 output
channel) ~4.8 ms of the GPU time, then the NCHW<->NHWC transforms around every F16 conv, the
causal-padding concatenations and elementwise kernels (conv bias adds, skip adds). Issue #3's
changes (narrow_conv, pointwise_gemm, fused_windows, the long graphs) are not measured on the
GPU yet.
Accuracy (24 frames, vs float32 without TF32 on the same weights): decoder convs x0.5 (speech
level, nothing saturated): reference ops 8.7e-4, fast eager 7.9e-4, graphed 7.9e-4; §10.2's
random weights as they are saturate tanh on 89% of samples and are chaotic: 6.7e-2 / 6.1e-2 /
6.0e-2 (reference ops included), so the 1e-2 target is measured on the x0.5 recipe.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.codec.graphs import LONG_LENGTHS, STREAM_LENGTHS, GraphedDecoder  # noqa: E402
from services.codec.model import Codec, decode_options_from_env  # noqa: E402
from services.common.config import CodecConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402

DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", nargs="+", default=["fp16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 4, 215], help="offline decode lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64], help="sessions per server tick")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4], help="streaming chunk lengths")
    parser.add_argument("--no-graphs", action="store_true", help="eager rows only")
    parser.add_argument("--ablate", action="store_true", help="FP16 rows (eager, and the graphed "
                        "server chunk of 215 frames) with each fast path flipped alone")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables (eager FP16 "
                        "4-frame chunk and 215-frame offline decode)")
    parser.add_argument("--long-lengths", type=int, nargs="*", default=list(LONG_LENGTHS),
                        help="batch-1 graph lengths for long chunks and the offline decode (default "
                        f"{' '.join(map(str, LONG_LENGTHS))}; none: the flag alone, as before issue #3)")
    parser.add_argument("--options", nargs="*", default=[], metavar="NAME=0|1",
                        help="decode fast-path switches for every fast prepare, e.g. narrow_conv=0 "
                        "channels_last=1 (sets DRAMA_CODEC_OPTIONS; Codec.FAST_OPTIONS has the names)")
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


def _row(name: str, path: str, dtype: str, times: list[float], audio_seconds: float) -> dict:
    row = summary(name, dtype, times, audio_seconds)
    row["path"] = path
    return row


def bench_eager(codec: Codec, dtype_name: str, args, device: torch.device, path: str = "eager",
                frames_list=None, chunks=None, batches=None) -> list[dict]:
    frame_s = codec.frame_samples / codec.sample_rate
    rows = []
    for frames in args.frames if frames_list is None else frames_list:
        codes = random_codes(codec, frames)
        times = timed(lambda: codec.decode(codes), device, args.repeats, args.warmup)
        rows.append(_row(f"decode {frames} frames", path, dtype_name, times, frames * frame_s))

    # A streaming chunk once the post module's window is full; the stream keeps going (its cost
    # does not change past 128 frames), so nothing but the decode is timed.
    history = random_codes(codec, 200)
    for length in args.chunks if chunks is None else chunks:
        state = codec.new_state()
        codec.decode_streams([state], [history[0]])
        chunk = random_codes(codec, length)[0]
        times = timed(lambda: codec.decode_streams([state], [chunk]), device, args.repeats, args.warmup)
        rows.append(_row(f"stream chunk of {length} (after 200)", path, dtype_name, times, length * frame_s))

    for batch in args.batch if batches is None else batches:
        states = [codec.new_state() for _ in range(batch)]
        chunk_list = list(random_codes(codec, 4, batch).unbind(0))
        times = timed(lambda: codec.decode_streams(states, chunk_list), device, args.repeats, args.warmup)
        rows.append(_row(f"tick: {batch} sessions x 4 frames", path, dtype_name, times, batch * 4 * frame_s))
    return rows


def bench_graphed(codec: Codec, dtype_name: str, args, device: torch.device) -> list[dict]:
    frame_s = codec.frame_samples / codec.sample_rate
    pool = graphed_pool(codec, args)
    path = "graphed" if pool.use_graphs else "pool (eager)"       # CPU: the same pool, eager ticks
    memory = (f", {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak allocated"
              if device.type == "cuda" else "")
    print(f"{dtype_name}: {len(pool._graphs)} graphs captured in {pool.capture_seconds:.1f} s, pool of "
          f"{pool.slots} slots, long lengths {pool.long_lengths}{memory}", flush=True)
    rows = []
    for frames in args.frames:
        codes = random_codes(codec, frames)
        times = timed(lambda: pool.decode(codes), device, args.repeats, args.warmup)
        rows.append(_row(f"decode {frames} frames", path, dtype_name, times, frames * frame_s))
        # The server's path for one Decode message of all the frames: a fresh slot, the chunk
        # split into long and stream lengths (no padding: the stream could go on), PCM16 bytes.
        times = timed(lambda: server_chunk(pool, codes[0]), device, args.repeats, args.warmup)
        rows.append(_row(f"server chunk of {frames} frames", path, dtype_name, times, frames * frame_s))
    history = random_codes(codec, 200)[0]
    for length in args.chunks:
        slot = pool.acquire()
        pool.decode_streams([slot], [history])
        chunk = random_codes(codec, length)[0]
        times = timed(lambda: pool.decode_pcm16([slot], [chunk]), device, args.repeats, args.warmup)
        rows.append(_row(f"stream chunk of {length} (after 200)", path, dtype_name, times,
                         length * frame_s))
        pool.release(slot)
    for batch in args.batch:
        slot_list = [pool.acquire() for _ in range(batch)]
        chunk_list = list(random_codes(codec, 4, batch).unbind(0))
        times = timed(lambda: pool.decode_pcm16(slot_list, chunk_list), device, args.repeats, args.warmup)
        rows.append(_row(f"tick: {batch} sessions x 4 frames", path, dtype_name, times,
                         batch * 4 * frame_s))
        for slot in slot_list:
            pool.release(slot)
    return rows


def graphed_pool(codec: Codec, args) -> GraphedDecoder:
    """The slot pool as the server has it (stream lengths 1-8, plus any other benchmarked chunk
    length) with the benchmarked buckets and long lengths, captured."""
    slots = max([1] + args.batch)
    pool = GraphedDecoder(codec, slots + 1, lengths=tuple(sorted(set(args.chunks) | set(STREAM_LENGTHS))),
                          buckets=tuple(sorted({1} | set(args.batch))), long_lengths=tuple(args.long_lengths))
    pool.capture()
    return pool


def server_chunk(pool: GraphedDecoder, codes: torch.Tensor) -> list[bytes]:
    slot = pool.acquire()
    try:
        return pool.decode_pcm16([slot], [codes])
    finally:
        pool.release(slot)


def bench_ablations(codec: Codec, args, device: torch.device, add) -> None:
    """FP16 eager 4-frame chunk and 215-frame decode, and the graphed server chunk of 215 frames
    (a batch-1 pool), with the reference ops, each fast path flipped alone, and cudnn.benchmark
    on: what each piece is worth. The graphed row is the one without host overhead in it."""
    frame_s = codec.frame_samples / codec.sample_rate
    codes = random_codes(codec, 215)[0]

    def measure(label: str, **options) -> None:
        codec.prepare(device, torch.float16, **options)
        rows = bench_eager(codec, "fp16", args, device, path=label, frames_list=[215], chunks=[4], batches=[])
        if not args.no_graphs:
            pool = GraphedDecoder(codec, 2, lengths=STREAM_LENGTHS, buckets=(1,),
                                  long_lengths=tuple(args.long_lengths))
            pool.capture()
            times = timed(lambda: server_chunk(pool, codes), device, args.repeats, args.warmup)
            kind = "graphed" if pool.use_graphs else "pool"
            rows.append(_row("server chunk of 215 frames", f"{label} {kind}", "fp16", times, 215 * frame_s))
            del pool
            gc.collect()
        add(rows)

    codec.prepare(device, torch.float16)
    defaults = dict(codec.decode_options)
    measure("reference ops", fast=False)
    for name, on in defaults.items():
        measure(f"{name}={not on}", **{name: not on})
    torch.backends.cudnn.benchmark = True
    try:
        measure("cudnn.benchmark")
    finally:
        torch.backends.cudnn.benchmark = False
    codec.prepare(device, torch.float16)


def measure_accuracy(codec: Codec, device: torch.device, graphs: bool, frames: int = 24) -> list[dict]:
    """FP16 PCM against float32 (relative RMS error), for §10.2's random weights as they are and
    with the decoder's conv weights halved.

    The float32 reference runs the reference ops without TF32 on the same weights, which the
    first FP16 prepare has already rounded to F16, so this is the error of the decode arithmetic.
    As they are, the random weights drive tanh into saturation on most samples and the decoder is
    chaotic (any rounding moves samples by O(1)); halved, the output is speech-level.
    """
    codes = random_codes(codec, frames)
    results = []
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    for recipe, scale in (("§10.2 random", 1.0), ("decoder convs x0.5", 0.5)):
        if scale != 1.0:
            with torch.no_grad():
                for name, p in codec.decoder.named_parameters():
                    if name.endswith("conv.weight"):
                        p.mul_(scale)           # a power of two: F16 values stay F16 values
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            reference = codec.prepare(device, torch.float32, fast=False).decode(codes)
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        entry = {"recipe": recipe, "frames": frames,
                 "saturated": float((reference.abs() > 0.99).float().mean()),
                 "rms": float(reference.pow(2).mean().sqrt())}
        entry["fp16 reference ops"] = _rel(codec.prepare(device, torch.float16, fast=False).decode(codes), reference)
        entry["fp16 eager"] = _rel(codec.prepare(device, torch.float16).decode(codes), reference)
        if graphs:
            pool = GraphedDecoder(codec, 2, lengths=(1, 4), buckets=(1,), long_lengths=(16,))
            pool.capture()
            slot = pool.acquire()
            step = 4
            streamed = torch.cat([pool.decode_streams([slot], [codes[0, :, i:i + step]])[0]
                                  for i in range(0, frames, step)])
            entry["fp16 graphed stream"] = _rel(streamed[None], reference)
            pool.release(slot)
            entry["fp16 graphed offline (long graphs)"] = _rel(pool.decode(codes), reference)
            del pool
        results.append(entry)
        print("accuracy vs float32:", json.dumps(entry), flush=True)
        if scale != 1.0:
            codec.prepare(device, torch.float32)
            with torch.no_grad():
                for name, p in codec.decoder.named_parameters():
                    if name.endswith("conv.weight"):
                        p.div_(scale)
    codec.prepare(device, torch.float16)
    return results


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return float((actual - expected).norm() / expected.norm())


def profile_eager(codec: Codec, device: torch.device, args) -> None:
    from bench.stage_profile import report

    codec.prepare(device, torch.float16)
    history, chunk = random_codes(codec, 200)[0], random_codes(codec, 4)[0]
    state = codec.new_state()
    codec.decode_streams([state], [history])
    report("codec eager FP16 stream chunk of 4 frames", lambda: codec.decode_streams([state], [chunk]),
           device, steps=5, top=20)
    codes = random_codes(codec, 215)
    report("codec eager FP16 offline decode of 215 frames", lambda: codec.decode(codes), device,
           steps=3, top=30)
    if device.type == "cuda" and not args.no_graphs:
        # The graphs' kernels, as the server runs them (the tables are per call of 215 frames).
        pool = graphed_pool(codec, args)
        report("codec graphed FP16 server chunk of 215 frames", lambda: server_chunk(pool, codes[0]),
               device, steps=3, top=30)


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
    if args.options:
        os.environ["DRAMA_CODEC_OPTIONS"] = ",".join(args.options)
        decode_options_from_env()                      # a bad name fails here, not mid-run
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
    rows: list[dict] = []
    print(f"{'case':<36} {'path':<30} {'dtype':<6} {'median ms':>10} {'p90 ms':>10} {'x real time':>12}",
          flush=True)

    def add(new_rows: list[dict]) -> None:
        """Print rows as they come and rewrite the JSON: a run cut short keeps what it measured."""
        for row in new_rows:
            print(f"{row['case']:<36} {row['path']:<30} {row['dtype']:<6} {row['median_ms']:>10.2f} "
                  f"{row['p90_ms']:>10.2f} {row['rtf_x']:>12.1f}", flush=True)
        rows.extend(new_rows)
        if args.out:
            args.out.write_text(json.dumps({"preset": args.preset, "device": str(device), "rows": rows,
                                            "accuracy": accuracy}, indent=2))

    accuracy: list[dict] = []
    with torch.inference_mode():
        for dtype_name in args.dtype:
            codec.prepare(device, DTYPES[dtype_name])
            print(f"{dtype_name}: decode options {codec.decode_options}", flush=True)
            add(bench_eager(codec, dtype_name, args, device))
            if not args.no_graphs:              # on CPU: the server's pool with eager ticks
                add(bench_graphed(codec, dtype_name, args, device))
                gc.collect()                    # the graphs and their pool go before the next prepare
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        add([dict(bench_encode(codec, args, device), path="eager")])
        if device.type == "cuda":
            accuracy += measure_accuracy(codec, device, graphs=not args.no_graphs)
            add([])
        if args.ablate:
            bench_ablations(codec, args, device, add)
    if args.profile:
        with torch.inference_mode():
            profile_eager(codec, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

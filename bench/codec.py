"""Codec decode/encode at the real geometry (MODEL.md §7.1), one script, one table.

    python bench/codec.py                                   full geometry on cuda, FP16 and FP32
    python bench/codec.py --preset tiny --device cpu        smoke test (CI-sized)
    python bench/codec.py --out codec.json                  also write the numbers as JSON
    python bench/codec.py --ablate --profile                + rows with single GPU fast paths off,
                                                              + torch.profiler tables
    python bench/codec.py --conv-table [FRAMES ...]         + first, every decoder conv shape alone

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
4, graphed server chunk of 215) with the reference ops (fast=False); the layout and the wide
convs' methods (LAYOUT_ROWS: channels_last on and off, each with the per-conv choice Codec.prepare
measures and with the GEMM path everywhere, and the default layout with cuDNN everywhere, as
before the shifted GEMM; channels_last with cuDNN everywhere is left out: ~0.5 s per 10 s); each
other fast path flipped alone (narrow_conv=False is the last conv on cuDNN again,
pointwise_gemm=False the residual 1x1 convs); and cudnn.benchmark on. Every FP16 prepare prints
the wide convs that left cuDNN, by which method (and, where it measured, the ms it measured).

--conv-table times every distinct decoder conv shape alone (batch 1; at 215 frames and at the
pieces of the graphed 215-frame chunk unless given frame counts; FP16 on CUDA as CUDA graph
replays, float32 wall clock on CPU): cuDNN in both layouts against the codec's GEMM paths, its
Triton implicit-GEMM kernel (wide convs, default layout, CUDA with Triton) and two candidates
(CONV_LEGEND), with the kernels cuDNN runs for the wide and transposed convs, and per frame count
the sum over the decoder's convs for each layout with shifted_gemm off, on for every wide conv,
Triton for every wide conv, and "per-conv choice" (each wide conv by Codec.prepare's rule,
decoder.choose_conv_method, applied to the table's numbers: what prepare should pick).

Before/after switches (issue #3, 10 s in <= 15 ms FP16): `--long-lengths` alone drops the
batch-1 long graphs (a long chunk runs as 8-frame replays, as before); `--options narrow_conv=0
pointwise_gemm=0 fused_windows=0` is the decoder as before (last conv on cuDNN's generic kernel,
1x1 convs on cuDNN plus a skip add, torch.cat windows and bias adds); the server takes the same
as DRAMA_CODEC_LONG_LENGTHS=none and DRAMA_CODEC_OPTIONS=narrow_conv=0,pointwise_gemm=0,...
`--options shifted_gemm=0` is the wide convs on cuDNN as before the shifted GEMM (and in F16
torch's default layout, which follows shifted_gemm unless channels_last is given);
`--conv-methods gemm --options channels_last=0` is the decoder before the per-conv choice
(shifted GEMM everywhere, default layout); `--conv-methods triton` every wide conv on the Triton
kernel (conv_triton.implicit_conv1d; F16 stays in the default layout, the kernel's).

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
import torch.nn.functional as F  # noqa: E402

from services.codec import conv_triton  # noqa: E402
from services.codec.conv import (CONV_METHODS, CausalConv1d, CausalConvTranspose1d,  # noqa: E402
                                 as_channels_last, conv_taps, shifted_gemm_conv1d, stacked_taps,
                                 taps_conv1d)
from services.codec.decoder import choose_conv_method  # noqa: E402
from services.codec.graphs import LONG_LENGTHS, STREAM_LENGTHS, GraphedDecoder, split_length  # noqa: E402
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
    parser.add_argument("--conv-methods", choices=list(CONV_METHODS),
                        help="every wide decoder conv one way instead of the per-conv choice that "
                        "Codec.prepare measures (Codec.prepare's conv_methods)")
    parser.add_argument("--conv-table", type=int, nargs="*", metavar="FRAMES",
                        help="first, time every distinct decoder conv shape alone at these frame "
                        "counts, cuDNN against the GEMM paths (bare: 215 and the pieces of the "
                        "graphed 215-frame server chunk)")
    parser.add_argument("--conv-table-only", action="store_true", help="the conv table and nothing else")
    parser.add_argument("--cudnn-benchmark-limit", type=int, help="torch.backends.cudnn.benchmark_limit: "
                        "how many cuDNN algorithms the cudnn_benchmark option times per conv shape "
                        "(Codec.cudnn_benchmark_limit, 3; torch's default 10; 0 all)")
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


# --ablate's layout rows: label -> Codec.prepare options (FP16; the other fast paths as default;
# the Triton row only where Triton runs).
LAYOUT_ROWS = {
    "channels_last=1, per-conv choice": dict(channels_last=True, shifted_gemm=True),   # the default
    "channels_last=0, per-conv choice": dict(channels_last=False, shifted_gemm=True),
    "channels_last=1, GEMM everywhere": dict(channels_last=True, shifted_gemm=True, conv_methods="gemm"),
    "channels_last=0, GEMM everywhere": dict(channels_last=False, shifted_gemm=True,
                                             conv_methods="gemm"),                        # before
    "channels_last=0, shifted_gemm=0": dict(channels_last=False, shifted_gemm=False),
    "channels_last=0, Triton everywhere": dict(channels_last=False, shifted_gemm=True,
                                               conv_methods="triton"),
}


def print_conv_methods(codec: Codec, label: str) -> None:
    """One line: how many wide decoder convs run each method, and which left cuDNN for which
    (with prepare's ms where it measured: cuDNN's -> the taken method's)."""
    timings = codec.conv_timings
    off = [name.removeprefix("model.") + f" {method}"
           + (f" ({timings[name]['cudnn_ms']:.3f} -> {timings[name][method + '_ms']:.3f} ms)"
              if name in timings else "")
           for name, method in codec.conv_methods.items() if method != "cudnn"]
    methods = list(codec.conv_methods.values())
    counts = ", ".join(f"{method} {methods.count(method)}" for method in CONV_METHODS)
    layout = "channels_last" if codec.decoder.channels_last else "default layout"
    print(f"{label}: {layout}, wide convs {counts}{': ' + ', '.join(off) if off else ''}", flush=True)


def bench_ablations(codec: Codec, args, device: torch.device, add) -> None:
    """FP16 eager 4-frame chunk and 215-frame decode, and the graphed server chunk of 215 frames
    (a batch-1 pool), with the reference ops, each fast path flipped alone, and cudnn.benchmark
    on: what each piece is worth. The graphed row is the one without host overhead in it."""
    frame_s = codec.frame_samples / codec.sample_rate
    codes = random_codes(codec, 215)[0]

    def measure(label: str, **options) -> None:
        codec.prepare(device, torch.float16, **options)
        print_conv_methods(codec, label)
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
    for label, options in LAYOUT_ROWS.items():
        if options.get("conv_methods") == "triton" and not conv_triton.available():
            continue
        measure(label, **options)
    for name, on in defaults.items():
        if name not in ("channels_last", "shifted_gemm"):        # LAYOUT_ROWS has those
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


# --------------------------------------------------------------------------------------------
# --conv-table: every distinct decoder conv shape alone, cuDNN against the GEMM paths
# --------------------------------------------------------------------------------------------

CONV_COLUMNS = ("cudnn", "cudnn_cl", "gemm", "gemm_u", "triton", "gemm_cl", "acc_cl", "im2col_cl")
CONV_LEGEND = """columns: ms per call, batch 1, no bias; '-' where a column does not apply
  cudnn      F.conv1d / F.conv_transpose1d on the [1, C, W] window, as the default (F16) layout calls cuDNN
  cudnn_cl   F.conv2d / F.conv_transpose2d on the 4-D channels_last window, as the channels_last decoder
  gemm       the codec's GEMM path in the default layout: shifted_gemm (wide convs; tail rounded up to
             8), pointwise_gemm (1x1; here without its skip add), narrow_conv (the last conv)
  gemm_u     shifted_gemm with the tail left at (k-1)d: the GEMM's leading dimension unaligned
  triton     the codec's Triton implicit-GEMM kernel (wide convs, default layout; tail (k-1)d),
             autotuned on its first call per shape (CUDA with Triton only)
  gemm_cl    the same GEMM paths on channels_last windows
  acc_cl     candidate, not in the codec: k GEMMs on shifted row views accumulating into one output
  im2col_cl  candidate, not in the codec: an im2col copy [L, k·C_in] and one GEMM
  err        the largest relative RMS difference of any column from cudnn"""


def decoder_conv_shapes(codec: Codec, frames: int) -> list[dict]:
    """Every decoder conv at `frames` frames in decode order: name, kind (wide: shifted_gemm's;
    pointwise; narrow: narrow_conv's; transposed), channels, kernel, dilation, stride, input and
    output length, GFLOP."""
    length = frames * codec.frame_samples // math.prod(codec.cfg.decoder_rates)
    shapes = []
    for name, module in codec.decoder.named_modules():
        if not isinstance(module, (CausalConv1d, CausalConvTranspose1d)):
            continue
        conv = module.conv
        shape = dict(name=f"decoder.{name}", c_in=conv.in_channels, c_out=conv.out_channels,
                     kernel=conv.kernel_size[0], stride=module.stride, l_in=length)
        if isinstance(module, CausalConvTranspose1d):
            length *= module.stride
            shape.update(kind="transposed", dilation=1, history=module.history)
        else:
            # a 1x1 conv is a residual unit's (pointwise_gemm's, even where it counts as narrow)
            kind = ("pointwise" if shape["kernel"] == 1 else "narrow" if module.narrow
                    else "wide" if module.wide else "other")
            shape.update(kind=kind, dilation=module.dilation)
        shape["l_out"] = length
        # a transposed conv with k = 2s adds 2 taps into each output
        taps = 2 if shape["kind"] == "transposed" else shape["kernel"]
        shape["gflop"] = 2 * length * shape["c_in"] * shape["c_out"] * taps / 1e9
        shapes.append(shape)
    return shapes


def _rows(window_cl: torch.Tensor) -> torch.Tensor:
    """4-D channels_last [1, C, 1, W] -> its memory as a [W, C] matrix (a view)."""
    return window_cl[0].permute(1, 2, 0).reshape(window_cl.shape[-1], window_cl.shape[1])


def accumulate_rows_conv(window_cl: torch.Tensor, weight_t: torch.Tensor, dilation: int) -> torch.Tensor:
    """Candidate (bench only): y [L, C_out] = Σ_j rows[j·d : j·d + L] · W_jᵀ, k GEMMs adding into
    one output; weight_t [k, C_in, C_out] (W_jᵀ per tap, contiguous)."""
    rows = _rows(window_cl)
    kernel = weight_t.shape[0]
    length = rows.shape[0] - (kernel - 1) * dilation
    y = rows[:length] @ weight_t[0]
    for j in range(1, kernel):
        y.addmm_(rows[j * dilation: j * dilation + length], weight_t[j])
    return y


def im2col_rows_conv(window_cl: torch.Tensor, weight_stack: torch.Tensor, dilation: int) -> torch.Tensor:
    """Candidate (bench only): cols [L, k·C_in] (a copy: the reshape cannot be a view) times
    weight_stack [k·C_in, C_out] -> y [L, C_out]."""
    rows = _rows(window_cl)
    channels = rows.shape[1]
    kernel = weight_stack.shape[0] // channels
    length = rows.shape[0] - (kernel - 1) * dilation
    cols = rows.as_strided((length, kernel, channels), (channels, dilation * channels, 1))
    return cols.reshape(length, kernel * channels) @ weight_stack


def conv_variants(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """column -> a no-argument callable: the conv of one random window of `shape`, that way."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c_in, c_out, kernel, dilation = shape["c_in"], shape["c_out"], shape["kernel"], shape["dilation"]

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device, dtype)

    if shape["kind"] == "transposed":
        stride, history = shape["stride"], shape["history"]
        weight = rand(c_in, c_out, kernel, scale=(c_in * 2) ** -0.5)
        window = rand(1, c_in, history + shape["l_in"])
        window_cl, weight_4d = as_channels_last(window.unsqueeze(2)), as_channels_last(weight.unsqueeze(2))
        crop = history * stride            # CausalConvTranspose1d's dense crop: exactly L·s outputs
        return {"cudnn": lambda: F.conv_transpose1d(window, weight, None, stride=stride, padding=crop),
                "cudnn_cl": lambda: F.conv_transpose2d(window_cl, weight_4d, None, stride=(1, stride),
                                                       padding=(0, crop))}
    weight = rand(c_out, c_in, kernel, scale=(c_in * kernel) ** -0.5)
    weight_4d = as_channels_last(weight.unsqueeze(2))
    span = (kernel - 1) * dilation
    x = rand(1, c_in, shape["l_out"])
    window = F.pad(x, (span, 0))
    window_cl = as_channels_last(window.unsqueeze(2))
    variants = {"cudnn": lambda: F.conv1d(window, weight, None, dilation=dilation),
                "cudnn_cl": lambda: F.conv2d(window_cl, weight_4d, None, dilation=(1, dilation))}
    if shape["kind"] == "wide":
        taps = stacked_taps(weight)
        aligned = -(-span // 8) * 8                                    # CausalConv1d.tail_length
        window8 = F.pad(x, (aligned, 0))
        weight_t = weight.permute(2, 1, 0).contiguous()                 # [k, C_in, C_out]
        weight_stack = weight_t.reshape(kernel * c_in, c_out)
        if device.type == "cuda" and conv_triton.available():
            packed = conv_triton.pack_weight(weight)
            variants["triton"] = lambda: conv_triton.implicit_conv1d(window, packed, None, c_out,
                                                                     kernel, dilation)
        variants.update(
            gemm=lambda: shifted_gemm_conv1d(window8, taps, None, c_out, kernel, dilation,
                                             start=aligned - span),
            gemm_u=lambda: shifted_gemm_conv1d(window, taps, None, c_out, kernel, dilation),
            gemm_cl=lambda: shifted_gemm_conv1d(window_cl, taps, None, c_out, kernel, dilation),
            acc_cl=lambda: accumulate_rows_conv(window_cl, weight_t, dilation),
            im2col_cl=lambda: im2col_rows_conv(window_cl, weight_stack, dilation))
    elif shape["kind"] == "pointwise":
        matrix = weight[..., 0]
        variants.update(gemm=lambda: torch.bmm(matrix[None], window),      # pointwise_residual_'s GEMM
                        gemm_cl=lambda: _rows(window_cl) @ matrix.t())
    elif shape["kind"] == "narrow":
        taps = conv_taps(weight)
        variants.update(gemm=lambda: taps_conv1d(window, taps, None, c_out, kernel, dilation),
                        gemm_cl=lambda: taps_conv1d(window_cl.squeeze(2), taps, None, c_out, kernel,
                                                    dilation))
    return variants


def _channels_first(y: torch.Tensor, c_out: int) -> torch.Tensor:
    """A column's result ([1, C, L], 4-D channels_last, or rows [L, C_out]) as float [C_out, L]."""
    if y.dim() == 2:
        return y.t().float()
    return y.reshape(c_out, -1).float()


def device_ms(fn, device: torch.device, repeats: int, inner: int = 10) -> float:
    """Median ms per call of fn. On CUDA the call is captured as a CUDA graph and replayed, as the
    server runs the decoder (no launch overhead in the number; eager if capture fails); on CPU
    the wall clock."""
    if device.type != "cuda":
        return statistics.median(timed(fn, device, repeats, 1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError as error:
        print(f"        (capture failed, eager timing: {str(error).splitlines()[0][:80]})")
        run = fn
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    del graph
    return statistics.median(times)


def cuda_kernels(fn, top: int = 3, width: int = 70) -> str:
    """The top device kernels of one call of fn by time, 'name ms | …' (names cut to `width`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "self_device_time_total", None)
            kernels.append((event.key, us if us is not None else event.self_cuda_time_total))
    kernels.sort(key=lambda kv: -kv[1])
    return " | ".join(f"{name[:width]} {us / 1000:.3f}" for name, us in kernels[:top]) or "(none)"


# Per-conv choice sums: config -> (cuDNN column, GEMM column, Triton column or None, the config
# the other kinds follow); each wide conv takes the column Codec.prepare's rule
# (choose_conv_method) picks, with the Triton column where the table has it.
PER_CONV_CHOICE = {
    "default layout, per-conv choice": ("cudnn", "gemm", "triton", "default layout, shifted_gemm=1"),
    "channels_last=1, per-conv choice": ("cudnn_cl", "gemm_cl", None, "channels_last=1, shifted_gemm=1"),
}

# What each decode configuration runs per kind of conv (CONV_COLUMNS).
CONV_CONFIGS = {
    "default layout, shifted_gemm=0": {"wide": "cudnn", "pointwise": "gemm", "narrow": "gemm",
                                       "transposed": "cudnn"},
    "default layout, shifted_gemm=1": {"wide": "gemm", "pointwise": "gemm", "narrow": "gemm",
                                       "transposed": "cudnn"},
    "default layout, triton": {"wide": "triton", "pointwise": "gemm", "narrow": "gemm",
                               "transposed": "cudnn"},           # only where the table has Triton
    "channels_last=1, shifted_gemm=0": {"wide": "cudnn_cl", "pointwise": "gemm_cl", "narrow": "gemm_cl",
                                        "transposed": "cudnn_cl"},
    "channels_last=1, shifted_gemm=1": {"wide": "gemm_cl", "pointwise": "gemm_cl", "narrow": "gemm_cl",
                                        "transposed": "cudnn_cl"},
}


def conv_table(codec: Codec, args, device: torch.device) -> list[dict]:
    """Time every distinct decoder conv shape at each --conv-table frame count (CONV_LEGEND): one
    row per shape (on CUDA, for the wide and transposed convs, the kernels cuDNN runs), then per
    frame count the sum over the decoder's convs for each decode configuration (CONV_CONFIGS;
    the Triton one only where Triton runs)."""
    frames_list = args.conv_table or sorted({215} | set(split_length(
        215, tuple(sorted(set(args.long_lengths) | set(STREAM_LENGTHS))))), reverse=True)
    dtype = DTYPES[args.dtype[0]] if device.type == "cuda" else torch.float32
    timing = "CUDA graph replays, median of 5 x 10" if device.type == "cuda" else "wall clock, median"
    print(f"\nconv table: {str(dtype).removeprefix('torch.')} on {device}, frames {frames_list} ({timing})")
    print(CONV_LEGEND)
    print(f"{'frames':>6} {'conv':<24} {'kind':<10} {'C_in':>5} {'C_out':>5} {'k':>2} {'d':>2} {'s':>2} "
          f"{'L_out':>7} {'GFLOP':>6} " + " ".join(f"{c:>9}" for c in CONV_COLUMNS) + f" {'err':>8}",
          flush=True)
    with_triton = device.type == "cuda" and conv_triton.available()
    configs = {config: columns for config, columns in CONV_CONFIGS.items()
               if with_triton or "triton" not in columns.values()}
    rows = []
    for frames in frames_list:
        totals = dict.fromkeys([*configs, *PER_CONV_CHOICE], 0.0)
        for shape in decoder_conv_shapes(codec, frames):
            if shape["kind"] == "other":
                continue
            variants = conv_variants(shape, dtype, device)
            reference = _channels_first(variants["cudnn"](), shape["c_out"])
            err = max(float((_channels_first(fn(), shape["c_out"]) - reference).norm() / reference.norm())
                      for fn in variants.values())
            times = {name: device_ms(fn, device, 5 if device.type == "cuda" else args.repeats)
                     for name, fn in variants.items()}
            row = dict(shape, frames=frames, ms=times, err=err)
            rows.append(row)
            cells = " ".join(f"{times[c]:>9.3f}" if c in times else f"{'-':>9}" for c in CONV_COLUMNS)
            print(f"{frames:>6} {shape['name'].removeprefix('decoder.model.'):<24} {shape['kind']:<10} "
                  f"{shape['c_in']:>5} {shape['c_out']:>5} {shape['kernel']:>2} {shape['dilation']:>2} "
                  f"{shape['stride']:>2} {shape['l_out']:>7} {shape['gflop']:>6.1f} {cells} {err:>8.1e}",
                  flush=True)
            if device.type == "cuda" and shape["kind"] in ("wide", "transposed"):
                for column in ("cudnn", "cudnn_cl"):
                    row[f"kernels_{column}"] = cuda_kernels(variants[column])
                    print(f"{'':>8}{column} kernels: {row[f'kernels_{column}']}", flush=True)
            for config, choice in configs.items():
                totals[config] += times[choice[shape["kind"]]]
            for config, (cudnn, gemm, triton, others) in PER_CONV_CHOICE.items():
                if shape["kind"] == "wide":
                    column = {"cudnn": cudnn, "gemm": gemm, "triton": triton}[choose_conv_method(
                        times[cudnn], times[gemm], triton_ms=times.get(triton))]
                    row.setdefault("choice", {})[config] = column
                else:
                    column = CONV_CONFIGS[others][shape["kind"]]
                totals[config] += times[column]
            if "choice" in row:
                print(f"{'':>8}per-conv choice: " + ", ".join(f"{config.split(',')[0]} {column}"
                                                              for config, column in row["choice"].items()),
                      flush=True)
            del variants
            if device.type == "cuda":
                torch.cuda.empty_cache()     # the timing graphs' pools (P: up to ~0.6 GB at 215 frames)
        print(f"{frames:>6} sum over the decoder's convs (ms): " +
              "; ".join(f"{config} {ms:.3f}" for config, ms in totals.items()), flush=True)
        rows.append({"frames": frames, "totals_ms": totals})
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
    if args.options:
        os.environ["DRAMA_CODEC_OPTIONS"] = ",".join(args.options)
        decode_options_from_env()                      # a bad name fails here, not mid-run
    if args.cudnn_benchmark_limit is not None:
        Codec.cudnn_benchmark_limit = args.cudnn_benchmark_limit
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
                                            "accuracy": accuracy, "conv_table": conv_rows,
                                            "conv_methods": conv_choices}, indent=2))

    accuracy: list[dict] = []
    conv_choices: dict[str, dict] = {}
    conv_rows: list[dict] = []
    if args.conv_table is not None or args.conv_table_only:
        with torch.inference_mode():
            conv_rows += conv_table(codec, args, device)
        add([])
        if args.conv_table_only:
            return 0
    with torch.inference_mode():
        for dtype_name in args.dtype:
            codec.prepare(device, DTYPES[dtype_name], conv_methods=args.conv_methods)
            print(f"{dtype_name}: decode options {codec.decode_options}", flush=True)
            print_conv_methods(codec, dtype_name)
            conv_choices[dtype_name] = {"methods": dict(codec.conv_methods),
                                        "timings": dict(codec.conv_timings)}
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

"""`python -m services.codec --checkpoint DIR [--port 50053] [--host H] [--device cpu|cuda]`
or `python -m services.codec --random-weights tiny|full ...` (no checkpoint read: the preset's
geometry with random values made on the device, services/common/random_weights.py).

Flags left out fall back to DRAMA_CHECKPOINT, DRAMA_RANDOM_WEIGHTS, DRAMA_HOST, DRAMA_DEVICE;
DRAMA_GRACE_S (30) bounds the SIGTERM drain, DRAMA_CODEC_MAX_ENCODE_SECONDS (60) caps one Encode
request and DRAMA_CODEC_CPU_THREADS (1) sets the model thread's intra-op threads on CPU (0:
torch's default). DRAMA_CODEC_GRAPHS: unset = streaming decode through CUDA graphs on a CUDA
device (graphs.py), 0 = eager, 1 = the graph slot pool on any device (eager ticks on CPU);
DRAMA_CODEC_SLOTS (256) is that pool's session count (a full pool refuses new sessions).
DRAMA_CODEC_GRAPH_LENGTHS: the chunk lengths that get a CUDA graph, e.g. "1,2,4,8" (unset: 1,2,4,8;
must include 1: other lengths are split into these). DRAMA_CODEC_GRAPH_BUCKETS: the batch sizes
(sessions per tick) that get a graph per length (unset: 1,2,4,8,12,16,24,32,48,64; must include 1: a tick
pads to the next bucket, a larger one runs as several). DRAMA_CODEC_LONG_LENGTHS: the batch-1 graph
lengths a longer chunk is split into first (unset: 16,32,64,128; "none" or 0: none).
DRAMA_CODEC_OPTIONS: decode fast-path switches, e.g. "narrow_conv=0" (model.decode_options_from_env).
DRAMA_CODEC_DTYPE: the decode dtype, float16 | bfloat16 | float32 (unset: float16 on CUDA, float32
on CPU; encode always runs in float32). On the H200 FP16 and FP32 trade places by case
(docs/perf.md), so an operator can pick what their GPU runs fastest.
"""

from __future__ import annotations

import argparse
import sys

import torch

from services.codec.server import serve
from services.common import random_weights
from services.common.grpcutil import env_default, env_switch, run_stage, serve_until_signalled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.codec", description="Drama 3 codec stage (gRPC)")
    parser.add_argument("--checkpoint", default=env_default("DRAMA_CHECKPOINT"),
                        help="checkpoint directory with config.json and codec.pth (DRAMA_CHECKPOINT)")
    parser.add_argument("--host", default=env_default("DRAMA_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=50053)
    parser.add_argument("--device", default=env_default("DRAMA_DEVICE", "cpu"), help="cpu or cuda[:i]")
    random_weights.add_argument(parser)
    args = parser.parse_args(argv)
    if not args.checkpoint and not args.random_weights:
        parser.error("--checkpoint (or DRAMA_CHECKPOINT) is required, unless --random-weights")
    args.grace_s = env_default("DRAMA_GRACE_S", 30.0, float)
    args.max_encode_seconds = env_default("DRAMA_CODEC_MAX_ENCODE_SECONDS", 60.0, float)
    args.cpu_threads = env_default("DRAMA_CODEC_CPU_THREADS", 1, int) or None
    args.graphs = env_switch("DRAMA_CODEC_GRAPHS")   # unset: on for CUDA devices
    args.slots = env_default("DRAMA_CODEC_SLOTS", 256, int)
    args.graph_lengths = _positive_ints(parser, "DRAMA_CODEC_GRAPH_LENGTHS", need_one=True)
    args.graph_buckets = _positive_ints(parser, "DRAMA_CODEC_GRAPH_BUCKETS", need_one=True)
    long_lengths = env_default("DRAMA_CODEC_LONG_LENGTHS", None)
    if long_lengths is not None and long_lengths.strip().lower() in ("none", "0"):
        args.long_lengths = ()
    else:
        args.long_lengths = _positive_ints(parser, "DRAMA_CODEC_LONG_LENGTHS")
    dtype = env_default("DRAMA_CODEC_DTYPE", None)
    if dtype is not None and dtype.strip().lower() not in DECODE_DTYPES:
        parser.error(f"DRAMA_CODEC_DTYPE must be one of {', '.join(DECODE_DTYPES)}, got {dtype!r}")
    args.dtype = None if dtype is None else DECODE_DTYPES[dtype.strip().lower()]
    return args


DECODE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _positive_ints(parser: argparse.ArgumentParser, name: str, need_one: bool = False) -> tuple[int, ...] | None:
    """The variable `name` as sorted distinct positive integers ("8, 4,2,1" -> (1, 2, 4, 8)); None
    when unset. need_one: 1 must be among them (every other size is split into or padded from
    these, and a single frame or session must fit). A bad value stops the stage, naming it."""
    raw = env_default(name, None)
    if raw is None:
        return None
    try:
        values = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
    except ValueError:
        parser.error(f"{name} must be comma-separated integers, got {raw!r}")
    if not values or min(values) < 1 or (need_one and 1 not in values):
        parser.error(f"{name} must be positive integers{' including 1' if need_one else ''}, got {raw!r}")
    return values


async def run(args: argparse.Namespace) -> None:
    codec = None
    if args.random_weights:
        codec = random_weights.random_codec_stage(args.random_weights, args.device, dtype=args.dtype)
    server, _, health, servicer = await serve(None if codec else args.checkpoint, host=args.host,
                                              port=args.port, device=args.device,
                                              max_encode_seconds=args.max_encode_seconds,
                                              cpu_threads=args.cpu_threads, codec=codec,
                                              graphs=args.graphs, slots=args.slots, dtype=args.dtype,
                                              graph_lengths=args.graph_lengths,
                                              graph_buckets=args.graph_buckets,
                                              long_lengths=args.long_lengths)
    # The grace period lets open Decode streams finish their audio while no new call is admitted.
    await serve_until_signalled(server, health, grace_s=args.grace_s, on_shutdown=servicer.stop_admitting)
    await servicer.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_stage("drama-codec", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

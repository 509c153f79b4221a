"""`python -m services.tower --checkpoint DIR [--port 50052] [--host H] [--device cpu|cuda]`
or `python -m services.tower --random-weights tiny|full ...` (no checkpoint read: the preset's
geometry with random values made on the device, services/common/random_weights.py).

Flags left out fall back to DRAMA_CHECKPOINT, DRAMA_RANDOM_WEIGHTS, DRAMA_HOST, DRAMA_DEVICE;
the cache pool reads DRAMA_MAX_ROWS (64 sessions) and DRAMA_MAX_CONTEXT_TOKENS (8192 rows each),
the same variables the backbone sizes its pool with (API.md §3.5), DRAMA_PREFIX_CACHE_MB the
voice-prefix snapshots (default 64 on the CPU, 1024 on a GPU; 0 turns them off),
DRAMA_SPIN_WAIT_MS (from a response on, the event loop spins this long while the stream's next
request is due, instead of sleeping: 10 on CUDA, 0 on the CPU; TowerServicer) and DRAMA_GRACE_S
(30) bounds the SIGTERM drain. DRAMA_TOWER_STEP_SOCKET (--step-socket) is the Unix socket of
the Step stream's same-host lane (services/common/local_lane.py: the same messages without
grpc's threads, ~0.5 ms a frame): <tmp>/dramaturg-<uid>/tower-<port>.sock by default, `off` for
none. DRAMA_TOWER_GRAPHS=0 turns off the CUDA graphs of the decode step and of every other step
(prompt pieces, mixes; graphs.StepGraphs) (default on with --device cuda; read by TowerEngine,
captured during warm-up).
"""

from __future__ import annotations

import argparse
import sys

from services.common import aio, local_lane, random_weights
from services.common.grpcutil import env_default, run_stage, serve_until_signalled
from services.tower.server import serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.tower", description="Drama 3 tower stage (gRPC)")
    parser.add_argument("--checkpoint", default=env_default("DRAMA_CHECKPOINT"),
                        help="checkpoint directory (DRAMA_CHECKPOINT)")
    parser.add_argument("--host", default=env_default("DRAMA_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--device", default=env_default("DRAMA_DEVICE", "cpu"), help="cpu or cuda[:i]")
    parser.add_argument("--step-socket", default=env_default("DRAMA_TOWER_STEP_SOCKET"),
                        help="the Step lane's Unix socket, or off (DRAMA_TOWER_STEP_SOCKET; default "
                             "<tmp>/dramaturg-<uid>/tower-<port>.sock)")
    random_weights.add_argument(parser)
    args = parser.parse_args(argv)
    args.step_socket = local_lane.socket_path(args.step_socket, args.port)
    if not args.checkpoint and not args.random_weights:
        parser.error("--checkpoint (or DRAMA_CHECKPOINT) is required, unless --random-weights")
    args.max_sessions = env_default("DRAMA_MAX_ROWS", 64, int)
    args.max_context = env_default("DRAMA_MAX_CONTEXT_TOKENS", 8192, int)
    args.prefix_cache_mb = env_default("DRAMA_PREFIX_CACHE_MB", None, float)
    args.spin_wait_ms = env_default("DRAMA_SPIN_WAIT_MS", None, float)
    args.grace_s = env_default("DRAMA_GRACE_S", 30.0, float)
    return args


async def run(args: argparse.Namespace) -> None:
    model = cfg = None
    if args.random_weights:
        model, cfg = random_weights.random_tower_stage(args.random_weights, args.device)
    server, _, health, servicer = await serve(
        args.checkpoint, host=args.host, port=args.port, device=args.device,
        max_sessions=args.max_sessions, max_context=args.max_context,
        prefix_cache_mb=args.prefix_cache_mb, spin_wait_s=aio.spin_wait_s(args.spin_wait_ms, args.device),
        step_socket=args.step_socket, model=model, cfg=cfg)
    try:
        await serve_until_signalled(server, health, grace_s=args.grace_s)
    finally:
        servicer.close_lane()
        servicer.worker.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_stage("drama-tower", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

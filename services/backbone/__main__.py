"""`python -m services.backbone --checkpoint DIR --port P --tower ADDR` (API.md §3.2, §3.4),
or `--random-weights tiny|full` instead of `--checkpoint` (DRAMA_RANDOM_WEIGHTS): the preset's
geometry with random values made on the device (services/common/random_weights.py).

Flags left out fall back to DRAMA_CHECKPOINT, DRAMA_TOWER_ADDR, DRAMA_DEVICE, DRAMA_HOST,
DRAMA_MEMORY_BUDGET_GB; the pool and scheduler read DRAMA_MAX_ROWS (64),
DRAMA_MAX_CONTEXT_TOKENS (8192), DRAMA_MAX_QUEUE (256), DRAMA_PREFILL_CHUNK_TOKENS (2048),
DRAMA_PREFILL_INTERVAL_MS (0: while streams decode, prefill steps at most this often; Scheduler),
DRAMA_PREFILL_LANE (prefill pieces on their own thread, CUDA stream and tower steps beside the
decode groups: on by default on CUDA, off on the CPU; 1 or 0 forces it),
DRAMA_SESSION_BUFFER_FRAMES (1024), DRAMA_STEP_SPAN_SAMPLE (0.01), DRAMA_MAX_INFLIGHT_STEPS (1:
Step requests at the tower at once, capped by the tower's own; 2 pipelines two groups of sessions,
for a backbone and a tower on separate GPUs, see server.Settings), DRAMA_INLINE_STEPS (the decode
steps on the event loop's thread, two thread hand-offs fewer per frame: on by default on CUDA
with one step in flight; 1 or 0 forces it), DRAMA_PREFIX_CACHE_MB (voice-prefix
cache; 64 on CPU, 1024 on GPU, 0 off), DRAMA_DECODE_GRAPHS (CUDA graphs for the decode rows of each
step on the kernel path, captured before SERVING: on by default on CUDA, 0 turns them off),
DRAMA_PREFILL_GRAPHS (the prefill pieces of a step as padded pieces replayed from CUDA graphs,
several sessions' pieces packed in one replay: on with the decode graphs, 0 turns them off; read
by Backbone), DRAMA_FIRST_AUDIO_HOLD_MS (a session sits out the decode steps this long after its
first frames message, so the codec's first chunk has the GPU: 5 on CUDA, 0 on the CPU),
DRAMA_SPIN_WAIT_MS (while a step is at the tower the scheduler's loop spins this long before it
sleeps: 10 on CUDA, 0 on the CPU), DRAMA_TOWER_LOCAL_LANE (the Step stream over the tower's
same-host lane when it names one and it is reachable: on by default, 0 keeps gRPC),
DRAMA_CHAIN_STEPS (with a device hand-off that passes frames back, a decode step queued behind a
GPU wait for the frames of the step at the tower: on by default, 0 waits for each response) and
DRAMA_GRACE_S (30).
Prints the memory figures at start and refuses to start when weights + cache pool exceed the
budget. SIGTERM drains gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

from services.backbone.server import MemoryBudgetError, Settings, decode_graphs_for, serve
from services.common import grpcutil, random_weights
from services.common.grpcutil import env_default, env_switch


def parse_args(argv: list[str] | None = None) -> Settings:
    return parse_args_and_preset(argv)[0]


def parse_args_and_preset(argv: list[str] | None = None) -> tuple[Settings, str | None]:
    """The settings and the --random-weights preset (None: load --checkpoint). With a preset and
    no checkpoint, settings.checkpoint is a temporary directory with the preset's config.json."""
    parser = argparse.ArgumentParser(prog="python -m services.backbone",
                                     description="Drama 3 backbone stage (gRPC)")
    parser.add_argument("--checkpoint", default=env_default("DRAMA_CHECKPOINT"),
                        help="checkpoint directory (DRAMA_CHECKPOINT)")
    parser.add_argument("--tower", default=env_default("DRAMA_TOWER_ADDR", "127.0.0.1:50052"),
                        help="tower address host:port (DRAMA_TOWER_ADDR)")
    parser.add_argument("--host", default=env_default("DRAMA_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--device", default=env_default("DRAMA_DEVICE", "cpu"), help="cpu or cuda[:i]")
    parser.add_argument("--memory-budget-gb", type=float,
                        default=env_default("DRAMA_MEMORY_BUDGET_GB", None, float))
    random_weights.add_argument(parser)
    args = parser.parse_args(argv)
    if not args.checkpoint and not args.random_weights:
        parser.error("--checkpoint (or DRAMA_CHECKPOINT) is required, unless --random-weights")
    if args.random_weights and not args.checkpoint:
        args.checkpoint = str(random_weights.write_config_dir(
            args.random_weights, tempfile.mkdtemp(prefix="drama-backbone-config-")))
    return Settings(
        checkpoint=args.checkpoint, tower_addr=args.tower, host=args.host, port=args.port,
        device=args.device, memory_budget_gb=args.memory_budget_gb,
        max_rows=env_default("DRAMA_MAX_ROWS", 64, int),
        max_context_tokens=env_default("DRAMA_MAX_CONTEXT_TOKENS", 8192, int),
        max_queue=env_default("DRAMA_MAX_QUEUE", 256, int),
        prefill_chunk_tokens=env_default("DRAMA_PREFILL_CHUNK_TOKENS", 2048, int),
        prefill_interval_ms=env_default("DRAMA_PREFILL_INTERVAL_MS", 0.0, float),
        session_buffer_frames=env_default("DRAMA_SESSION_BUFFER_FRAMES", 1024, int),
        step_span_sample=env_default("DRAMA_STEP_SPAN_SAMPLE", 0.01, float),
        max_inflight_steps=env_default("DRAMA_MAX_INFLIGHT_STEPS", 1, int),
        inline_steps=env_switch("DRAMA_INLINE_STEPS"),
        decode_graphs=env_switch("DRAMA_DECODE_GRAPHS"),
        prefill_lane=env_switch("DRAMA_PREFILL_LANE"),
        first_audio_hold_ms=env_default("DRAMA_FIRST_AUDIO_HOLD_MS", None, float),
        load_overlap=env_switch("DRAMA_LOAD_OVERLAP"),
        spin_wait_ms=env_default("DRAMA_SPIN_WAIT_MS", None, float),
        tower_local_lane=env_switch("DRAMA_TOWER_LOCAL_LANE") is not False,
        chain_steps=env_switch("DRAMA_CHAIN_STEPS") is not False,
        grace_s=env_default("DRAMA_GRACE_S", 30.0, float)), args.random_weights


async def serve_random_weights(settings: Settings, preset: str) -> None:
    """`serve(settings)` with the model built at PRESET's geometry, random values on the device."""
    model = await asyncio.to_thread(random_weights.random_backbone_stage, preset, settings.device,
                                    decode_graphs=decode_graphs_for(settings))
    await serve(settings, loaded_model=model)


def main(argv: list[str] | None = None) -> int:
    settings, preset = parse_args_and_preset(argv)
    try:
        return grpcutil.run_stage("drama-backbone", lambda: serve_random_weights(settings, preset)
                                  if preset else serve(settings))
    except MemoryBudgetError as exc:
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

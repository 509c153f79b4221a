"""TTFA with and without the voice-prefix cache (issue #8), through real Generate calls.

    python -m bench.prefix_cache [--reference-s 20] [--repeats 3] [--device cpu]

Makes the tiny checkpoint in a temporary directory, starts the tower (`python -m services.tower`)
and, in this process, a backbone with the cache off and one with it on. Each sends the same
request (a system turn with `--reference-s` seconds of reference codes at 21.5 frames/s, one
short user turn), `--repeats` times one after another, after one warm-up request: TTFA = request
sent -> first frames message (first_message_frames = 1). With the cache on, the first request
stores the prefix (a miss) and the others restore it (hits). The cache-off backbone also times
the request without a reference (no system turn), the issue's yardstick. Prints a markdown
table: prompt rows, rows prefilled per request, median TTFA, and whether the frames equal the
cache-off frames.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from services.backbone import server as backbone_server
from services.common import grpcutil
from services.common.make_checkpoint import make_checkpoint
from services.common.tensors import codes_from_wire, codes_to_wire, ids_to_bytes

FRAME_RATE = 44100 / 2048          # frames per second of audio
IM_START, IM_END, VOICE, SPEAKER0 = 258, 259, 263, 268   # tiny tokenizer ids (MODEL.md §10.2)


def _ids(text: str) -> list[int]:
    return list(text.encode())       # the tiny tokenizer: byte b has id b


def request(session_id: str, reference_frames: int, seed: int = 5) -> backbone_pb2.GenerateRequest:
    gen = torch.Generator().manual_seed(1234)
    codes = torch.randint(0, 32, (10, reference_frames), generator=gen)
    codes[0] = torch.randint(0, 64, (reference_frames,), generator=gen)
    system = [] if reference_frames == 0 else [backbone_pb2.Segment(tokens=ids_to_bytes(
                  [IM_START] + _ids("system\nconvert the provided text to speech reference to the "
                                    "following:\n\nText:\n") + [SPEAKER0] + _ids("a reference text\n\nSpeech:\n"))),
              backbone_pb2.Segment(codes=codes_to_wire(codes)),
              backbone_pb2.Segment(tokens=ids_to_bytes([IM_END] + _ids("\n")))]
    return backbone_pb2.GenerateRequest(
        session_id=session_id, model="drama-3", system=system,
        chunks=[backbone_pb2.Chunk(user_turn=ids_to_bytes(
            [IM_START] + _ids("user\n") + [SPEAKER0] + _ids("hello, how are you today?") + [IM_END]))],
        assistant_open=ids_to_bytes([IM_START] + _ids("assistant\n") + [VOICE]),
        assistant_close=ids_to_bytes([IM_END]),
        sampling=backbone_pb2.Sampling(temperature=0.8, top_p=0.9, seed=seed, max_new_tokens=4),
        emit=backbone_pb2.Emit(first_message_frames=1, message_frames=4))


async def timed(stub, req) -> tuple[float, torch.Tensor, int, float]:
    """(TTFA seconds, the frames [N, T], prompt rows, CPU seconds of this process until the first
    frame: the backbone's work, less sensitive than wall time to other load on the machine)."""
    sent, cpu = time.perf_counter(), time.process_time()
    ttfa, cpu_ttfa, frames, rows = None, None, [], 0
    async for message in stub.Generate(req):
        kind = message.WhichOneof("msg")
        if kind == "started":
            rows = message.started.prompt_text_tokens + message.started.prompt_audio_frames
        elif kind == "frames":
            if ttfa is None:
                ttfa, cpu_ttfa = time.perf_counter() - sent, time.process_time() - cpu
            frames.append(codes_from_wire(message.frames.codes, 10))
    return ttfa, torch.cat(frames, dim=1), rows, cpu_ttfa


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(reference_s: float, repeats: int, device: str) -> str:
    reference_frames = round(reference_s * FRAME_RATE)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "tiny")
        make_checkpoint(checkpoint, preset="tiny", seed=0, progress=False)
        port = _free_port()
        tower = subprocess.Popen([sys.executable, "-m", "services.tower", "--checkpoint", checkpoint,
                                  "--port", str(port), "--device", device],
                                 env=dict(os.environ, DRAMA_MAX_ROWS="4", DRAMA_MAX_CONTEXT_TOKENS="2048"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while await grpcutil.check_health(f"127.0.0.1:{port}", timeout=0.5) != "SERVING":
                await asyncio.sleep(0.1)
            lines = ["| cache | requests | prompt rows | rows prefilled | TTFA ms (median) | "
                     "backbone CPU ms to first frame (median) | frames equal |",
                     "|---|---|---:|---:|---:|---:|---|"]
            reference = None
            for cache_mb in (0, 64):
                running = await backbone_server.start(backbone_server.Settings(
                    checkpoint=checkpoint, tower_addr=f"127.0.0.1:{port}", port=0, device=device,
                    max_rows=4, max_context_tokens=2048, prefix_cache_mb=cache_mb))
                await running.tower.wait_ready(30)
                channel = grpcutil.create_channel(f"127.0.0.1:{running.port}")
                stub = backbone_pb2_grpc.BackboneStub(channel)
                try:
                    await timed(stub, request(f"warm-{cache_mb}", 0))
                    if cache_mb == 0:
                        bare = [await timed(stub, request(f"bare-{i}", 0)) for i in range(repeats)]
                        ttfa = statistics.median(r[0] for r in bare) * 1000
                        cpu = statistics.median(r[3] for r in bare) * 1000
                        lines.append(f"| off, no reference | {repeats} | {bare[0][2]} | {bare[0][2]} | "
                                     f"{ttfa:.0f} | {cpu:.0f} | - |")
                    results, skipped = [], []
                    for i in range(repeats):
                        before = running.scheduler.prefix_rows_skipped
                        results.append(await timed(stub, request(f"r{cache_mb}-{i}", reference_frames)))
                        skipped.append(running.scheduler.prefix_rows_skipped - before)
                finally:
                    await channel.close()
                    await running.stop()
                reference = reference if reference is not None else results[0][1]
                groups = [("off", results, skipped)] if cache_mb == 0 else [
                    ("on, first use", results[:1], skipped[:1]), ("on, hit", results[1:], skipped[1:])]
                for name, group, rows_skipped in groups:
                    rows = group[0][2]
                    ttfa = statistics.median(r[0] for r in group) * 1000
                    cpu = statistics.median(r[3] for r in group) * 1000
                    equal = all(torch.equal(r[1], reference) for r in group)
                    lines.append(f"| {name} | {len(group)} | {rows} | {rows - rows_skipped[0]} | "
                                 f"{ttfa:.0f} | {cpu:.0f} | {'yes' if equal else 'NO'} |")
            return "\n".join(lines)
        finally:
            tower.kill()
            tower.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--reference-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print(asyncio.run(run(args.reference_s, args.repeats, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

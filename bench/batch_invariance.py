"""Same seed -> same audio, alone or inside a batch of other streams (issue #8), through the gateway.

    python -m bench.batch_invariance --url http://127.0.0.1:8000 [--batches 8 32] [--frames 24]
    python -m bench.batch_invariance --device cpu          (starts a tiny CPU stack; bench/stack.py)

A probe request (fixed text, voice, seed; pcm) is sent alone, then again while `B - 1` other
requests (other texts and seeds) run beside it, started together so the stages batch their rows
(backbone decode rows in one step, tower draws in one step, codec chunks in one tick). Batch
invariance holds when the probe's PCM bytes are identical in every case. The probe is also
repeated alone once more (same seed, nothing else running), which separates "not
deterministic" from "not batch-invariant". Prints a table and `batch_invariant` (true/false).

On the CPU float32 exact path this must hold bit for bit (tests/test_bench_serving.py runs it);
on the GPU it depends on every kernel computing a row independently of the batch's size
(cuBLAS picks kernels by the number of rows, so it usually does not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
from pathlib import Path

import httpx

from bench.stack import background

PROBE = "The quiet harbour lights came on one by one as the last boat turned for home."
OTHERS = ("Seven travellers watched the silver river under a low autumn sky.",
          "Please hold the line; your call is important to us.",
          "It was the best of times, it was the worst of times.",
          "Somebody at the back of the carriage began to hum an old song.")


def body(text: str, seed: int, frames: int) -> dict:
    return {"model": "drama-3", "input": text, "voice": "alloy", "response_format": "pcm", "stream": True,
            "seed": seed, "max_new_tokens": frames, "latency": "low"}


async def fetch(client: httpx.AsyncClient, url: str, payload: dict) -> bytes:
    response = await client.post(f"{url}/v1/audio/speech", json=payload)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.content


async def run(url: str, batches: list[int], frames: int) -> dict:
    url = url.rstrip("/")
    probe = body(PROBE, 4242, frames)
    limits = httpx.Limits(max_connections=max(batches) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
        alone = await fetch(client, url, probe)
        again = await fetch(client, url, probe)
        cases = [{"case": "alone", "streams": 1, "bytes": len(alone), "equal": True,
                  "sha256": hashlib.sha256(alone).hexdigest()[:16]},
                 {"case": "alone, repeated", "streams": 1, "bytes": len(again), "equal": again == alone,
                  "sha256": hashlib.sha256(again).hexdigest()[:16]}]
        for batch in batches:
            others = [body(OTHERS[i % len(OTHERS)], 1000 + i, frames) for i in range(batch - 1)]
            # The probe goes in the middle so it is neither the first nor the last row of a step.
            payloads = others[: len(others) // 2] + [probe] + others[len(others) // 2:]
            results = await asyncio.gather(*(fetch(client, url, p) for p in payloads))
            got = results[len(others) // 2]
            cases.append({"case": f"inside a batch of {batch}", "streams": batch, "bytes": len(got),
                          "equal": got == alone, "sha256": hashlib.sha256(got).hexdigest()[:16]})
    return {"frames": frames, "cases": cases, "deterministic": cases[1]["equal"],
            "batch_invariant": all(c["equal"] for c in cases)}


def table(result: dict) -> str:
    lines = ["| probe | streams | PCM bytes | sha256 (16) | equal to alone |", "|---|---:|---:|---|---|"]
    for c in result["cases"]:
        lines.append(f"| {c['case']} | {c['streams']} | {c['bytes']} | {c['sha256']} | {'yes' if c['equal'] else 'NO'} |")
    lines.append(f"\nbatch_invariant: {str(result['batch_invariant']).lower()} "
                 f"(deterministic alone: {str(result['deterministic']).lower()})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_invariance", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running gateway (default: start a tiny stack)")
    parser.add_argument("--device", default="cpu", help="device of the stack this starts without --url")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--frames", type=int, default=24, help="max_new_tokens of each request")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(background(["--device", args.device, "--max-sessions", str(max(args.batches))]))
        result = asyncio.run(run(url, args.batches, args.frames))
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

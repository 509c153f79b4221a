"""Same seed -> same codes, alone or inside a batch of other streams (issue #8), through the gateway.

    python -m bench.batch_invariance --url http://127.0.0.1:8000 [--batches 8 32] [--frames 24]
    python -m bench.batch_invariance --device cpu          (starts a tiny CPU stack; bench/stack.py)

A probe request (fixed text, voice, seed; pcm) is sent alone, then again while `B - 1` other
requests (other texts and seeds) run beside it, started together so the stages batch their rows
(backbone decode rows in one step, tower draws in one step, codec chunks in one tick). The seed
contract (API.md, "Seed contract") is about codes: each response names its take (`X-Take-Id`),
and `GET /v1/takes/{id}` returns the take's `vq_codes`, which are compared with the probe's
alone. `batch_invariant` is true when the codes are identical in every case. The PCM bytes are
compared beside them (`pcm_invariant`): the codec's batched convolutions are outside the
contract, so equal codes with different PCM points at the codec, different codes at the backbone
or the tower. The probe is also repeated alone once more (same seed, nothing else running),
which separates "not deterministic" from "not batch-invariant". Prints a table.

On the CPU float32 exact path both must hold bit for bit (tests/test_bench_serving.py runs it);
on the GPU codes hold when every kernel computes a row independently of the batch's size
(services/common/invariant.py: cuBLAS picks kernels by the number of rows unless it is fixed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.stack import background

PROBE = "The quiet harbour lights came on one by one as the last boat turned for home."
OTHERS = ("Seven travellers watched the silver river under a low autumn sky.",
          "Please hold the line; your call is important to us.",
          "It was the best of times, it was the worst of times.",
          "Somebody at the back of the carriage began to hum an old song.")


@dataclass(frozen=True)
class Take:
    """One response: its PCM bytes and its take's codes ([codebook][frame], as `vq_codes`)."""
    pcm: bytes
    codes: list[list[int]]

    @property
    def frames(self) -> int:
        return len(self.codes[0]) if self.codes else 0


def body(text: str, seed: int, frames: int) -> dict:
    return {"model": "drama-3", "input": text, "voice": "alloy", "response_format": "pcm", "stream": True,
            "seed": seed, "max_new_tokens": frames, "latency": "low"}


async def fetch(client: httpx.AsyncClient, url: str, payload: dict) -> Take:
    """POST the request, read the whole body, then GET its take (stored before the body ends)."""
    response = await client.post(f"{url}/v1/audio/speech", json=payload)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    take_id = response.headers.get("X-Take-Id")
    if not take_id:
        raise RuntimeError("the response has no X-Take-Id header")
    take = await client.get(f"{url}/v1/takes/{take_id}")
    if take.status_code != 200:
        raise RuntimeError(f"GET /v1/takes/{take_id}: HTTP {take.status_code}: {take.text[:300]}")
    return Take(response.content, take.json()["vq_codes"])


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first frame index at which two takes' codes differ (any codebook, or one take ends),
    None when they are identical."""
    if a == b:
        return None
    frames_a, frames_b = (len(c[0]) if c else 0 for c in (a, b))
    if len(a) != len(b):
        return 0
    for frame in range(min(frames_a, frames_b)):
        if any(ca[frame] != cb[frame] for ca, cb in zip(a, b)):
            return frame
    return min(frames_a, frames_b)


def case(name: str, streams: int, got: Take, alone: Take) -> dict:
    return {"case": name, "streams": streams, "frames": got.frames,
            "codes_equal": got.codes == alone.codes, "first_differing_frame": first_difference(got.codes, alone.codes),
            "codes_sha256": hashlib.sha256(json.dumps(got.codes).encode()).hexdigest()[:16],
            "bytes": len(got.pcm), "pcm_equal": got.pcm == alone.pcm,
            "sha256": hashlib.sha256(got.pcm).hexdigest()[:16]}


async def run(url: str, batches: list[int], frames: int) -> dict:
    url = url.rstrip("/")
    probe = body(PROBE, 4242, frames)
    limits = httpx.Limits(max_connections=max(batches) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
        alone = await fetch(client, url, probe)
        again = await fetch(client, url, probe)
        cases = [case("alone", 1, alone, alone), case("alone, repeated", 1, again, alone)]
        for batch in batches:
            others = [body(OTHERS[i % len(OTHERS)], 1000 + i, frames) for i in range(batch - 1)]
            # The probe goes in the middle so it is neither the first nor the last row of a step.
            payloads = others[: len(others) // 2] + [probe] + others[len(others) // 2:]
            results = await asyncio.gather(*(fetch(client, url, p) for p in payloads))
            cases.append(case(f"inside a batch of {batch}", batch, results[len(others) // 2], alone))
    return {"frames": frames, "cases": cases, **verdict(cases)}


def verdict(cases: list[dict]) -> dict:
    """cases[0] is the probe alone, cases[1] the probe alone again, the rest inside batches:
    deterministic (the repeat equals the first), batch_invariant (codes: the API's seed contract),
    pcm_invariant (the audio bytes too)."""
    return {"deterministic": cases[1]["codes_equal"] and cases[1]["pcm_equal"],
            "batch_invariant": all(c["codes_equal"] for c in cases),
            "pcm_invariant": all(c["pcm_equal"] for c in cases)}


def table(result: dict) -> str:
    lines = ["| probe | streams | frames | codes sha256 (16) | codes equal to alone | first differing frame "
             "| PCM bytes | PCM sha256 (16) | PCM equal to alone |",
             "|---|---:|---:|---|---|---:|---:|---|---|"]
    for c in result["cases"]:
        diff = "-" if c["first_differing_frame"] is None else str(c["first_differing_frame"])
        lines.append(f"| {c['case']} | {c['streams']} | {c['frames']} | {c['codes_sha256']} "
                     f"| {'yes' if c['codes_equal'] else 'NO'} | {diff} | {c['bytes']} | {c['sha256']} "
                     f"| {'yes' if c['pcm_equal'] else 'NO'} |")
    lines.append(f"\nbatch_invariant (codes): {str(result['batch_invariant']).lower()}; "
                 f"pcm_invariant: {str(result['pcm_invariant']).lower()} "
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

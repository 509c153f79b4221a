"""TTFA with a cloned voice against TTFA with none, through the gateway (issue #8's yardstick).

    python -m bench.voice_prefix --url http://127.0.0.1:8000 [--reference-s 20] [--repeats 5]
    python -m bench.voice_prefix --device cpu        (starts a tiny CPU stack; bench/stack.py)

Uploads a voice (`POST /v1/audio/voices`) whose sample is `--reference-s` seconds of a synthetic
signal (a gliding tone with a syllable-rate envelope: the codec encodes any audio, and with
random weights the content does not matter, only its length does), then sends the same short
request (`POST /v1/audio/speech`, pcm, stream, fixed seed, a few frames) with:
- voice `alloy` (no reference: the yardstick), `--repeats` times;
- the uploaded voice, once (the first use: the codec encodes the sample, the backbone and the
  tower prefill the whole system turn and store its snapshot), then `--repeats` times (hits: the
  stages restore the snapshot and prefill only the rows after it).
TTFA = request sent -> first audio byte. Prints a table and `voice_prefix_ttfa_ratio` = median
TTFA of the hits / median TTFA without a reference (the issue's target: <= 1.10).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from bench.e2e import PHASES, gateway_phases, phase_line
from bench.stack import background

TEXT = ("The morning train left the station while seven quiet travellers watched the river turn "
        "silver under a low sky.")
REF_TEXT = "A long reference recording of the speaker reading a few calm sentences aloud."


def reference_wav(seconds: float, rate: int = 44100) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.3 * t)                   # a slow glide, 100-180 Hz
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2          # ~4 syllables per second
    signal = 0.25 * envelope * (np.sin(phase) + 0.3 * np.sin(2 * phase) + 0.1 * np.sin(3 * phase))
    buffer = io.BytesIO()
    sf.write(buffer, signal.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def ttfa_ms(client: httpx.Client, url: str, voice: str, frames: int, seed: int,
            phases: list | None = None) -> float:
    """TTFA of one request; with `phases`, appends the gateway's milestones of it (ms from arrival)."""
    before = gateway_phases(client, url) if phases is not None else {}
    body = {"model": "drama-3", "input": TEXT, "voice": voice, "response_format": "pcm", "stream": True,
            "seed": seed, "max_new_tokens": frames, "latency": "low"}
    started = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"voice {voice!r}: HTTP {response.status_code} {response.read()[:300]!r}")
        for piece in response.iter_bytes():
            if piece and first is None:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"voice {voice!r}: no audio")
    if phases is not None:
        after = gateway_phases(client, url)
        phases.append({phase: (after[phase][0] - before.get(phase, (0.0, 0))[0]) * 1000
                       for phase in PHASES if phase in after
                       and after[phase][1] == before.get(phase, (0.0, 0))[1] + 1})
    return first * 1000


def median_phases(samples: list[dict]) -> dict:
    """phase -> median ms over the requests that reported it."""
    return {phase: statistics.median(s[phase] for s in samples if phase in s)
            for phase in PHASES if any(phase in s for s in samples)}


def measure(url: str, *, reference_s: float, repeats: int, frames: int, seed: int = 7) -> dict:
    url = url.rstrip("/")
    name = f"bench-ref-{int(time.time() * 1000) % 10**8}"
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        response = client.post(f"{url}/v1/audio/voices",
                               data={"name": name, "consent": "bench", "ref_text": REF_TEXT},
                               files={"audio_sample": ("ref.wav", reference_wav(reference_s), "audio/wav")})
        if response.status_code != 200:
            raise RuntimeError(f"voice upload: HTTP {response.status_code} {response.text[:300]}")
        voice = response.json()["id"]
        try:
            ttfa_ms(client, url, "alloy", frames, seed)                      # warm the path once
            plain_phases, hit_phases = [], []
            plain = [ttfa_ms(client, url, "alloy", frames, seed, plain_phases) for _ in range(repeats)]
            first = ttfa_ms(client, url, voice, frames, seed)
            hits = [ttfa_ms(client, url, voice, frames, seed, hit_phases) for _ in range(repeats)]
        finally:
            client.delete(f"{url}/v1/audio/voices/{voice}")
    plain_ms, hit_ms = statistics.median(plain), statistics.median(hits)
    return {"reference_s": reference_s, "repeats": repeats, "frames": frames,
            "ttfa_ms_no_reference": plain_ms, "ttfa_ms_reference_first_use": first,
            "ttfa_ms_reference_cached": hit_ms, "voice_prefix_ttfa_ratio": hit_ms / plain_ms,
            "samples_ms": {"no_reference": plain, "cached": hits},
            "phases_ms": {"no_reference": median_phases(plain_phases), "cached": median_phases(hit_phases)}}


def table(result: dict) -> str:
    return "\n".join([
        "| request | TTFA ms (median) |", "|---|---:|",
        f"| no reference (voice alloy), {result['repeats']}x | {result['ttfa_ms_no_reference']:.1f} |",
        f"| {result['reference_s']:g} s reference, first use (encode + full prefill + snapshot) | "
        f"{result['ttfa_ms_reference_first_use']:.1f} |",
        f"| {result['reference_s']:g} s reference, cached prefix, {result['repeats']}x | "
        f"{result['ttfa_ms_reference_cached']:.1f} |",
        f"| ratio cached / no reference (target <= 1.10) | {result['voice_prefix_ttfa_ratio']:.3f} |",
        f"| phases, no reference (gateway, ms from arrival) | {phase_line(result['phases_ms']['no_reference'])} |",
        f"| phases, cached prefix | {phase_line(result['phases_ms']['cached'])} |"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.voice_prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running gateway (default: start a tiny stack)")
    parser.add_argument("--device", default="cpu", help="device of the stack this starts without --url")
    parser.add_argument("--reference-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frames", type=int, default=4, help="max_new_tokens of each request")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(background(["--device", args.device]))
        result = measure(url, reference_s=args.reference_s, repeats=args.repeats, frames=args.frames)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

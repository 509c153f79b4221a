"""The Gated DeltaNet decode kernel (kernels/gdn.py `gdn_decode_inplace`) per layer, tile by tile.

    python3 bench/gdn_decode.py [--batch 1 32 128]

Full geometry (Hk 16, Hv 32, K = V = 128), the state a slot pool [B + 1, Hv, K, V] float32 read and
written in place: 2 · B · 2 MiB per call, the byte floor. Prints µs per call and TB/s for each
(block_v, num_warps), median of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv=None) -> None:
    import triton.testing

    from services.backbone.kernels import gdn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    args = parser.parse_args(argv)
    hk, hv, d = 16, 32, 128
    print(f"{'B':>4} {'block_v':>7} {'warps':>5} {'us':>8} {'TB/s':>6}")
    for bsz in args.batch:
        q = torch.randn(bsz, hk, d, device="cuda").bfloat16()
        k = torch.randn(bsz, hk, d, device="cuda").bfloat16()
        v = torch.randn(bsz, hv, d, device="cuda").bfloat16()
        a = torch.randn(bsz, hv, device="cuda").bfloat16()
        b = torch.randn(bsz, hv, device="cuda").bfloat16()
        A_log = torch.rand(hv, device="cuda")
        dt_bias = torch.randn(hv, device="cuda")
        state = torch.randn(bsz + 1, hv, d, d, device="cuda") * 0.01
        slots = torch.randperm(bsz + 1, device="cuda")[:bsz]
        reference = state.clone()
        base = gdn.gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, reference, slots=slots)
        nbytes = 2 * bsz * hv * d * d * 4
        for block_v in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                work = state.clone()
                out = gdn.gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, work, slots=slots,
                                             block_v=block_v, num_warps=warps)
                same = torch.equal(out, base) and torch.equal(work, reference)
                ms = triton.testing.do_bench(lambda: gdn.gdn_decode_inplace(
                    q, k, v, a, b, A_log, dt_bias, state, slots=slots, block_v=block_v, num_warps=warps),
                    warmup=10, rep=50, return_mode="median")
                print(f"{bsz:>4} {block_v:>7} {warps:>5} {ms * 1e3:>8.1f} {nbytes / (ms * 1e-3) / 1e12:>6.2f}"
                      f"{'' if same else '  (differs from block_v 16)'}", flush=True)


if __name__ == "__main__":
    main()

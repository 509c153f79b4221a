"""The front of a decode step's MoE, 40 layers: the router's F32 logits, top-k and the
quantisation of u, path by path, one table (issue #7).

    python3 bench/router_decode.py                 full geometry (H 2048, E 256, k 8) on cuda
    python3 bench/router_decode.py --rows 1 128

Paths (each the same routing, moe_decode.DecodeRoute):
    separate    u's F32 copy, the router GEMM through invariant.linear_rows (cuBLAS, 128 padded
                rows), fp8_moe.router_topk, fp8_moe.quantize_rows_fp8_triton and a zeroed counter
                (the decode step before route_decode)
    cublas      u's F32 copy, the same GEMM, then route_decode's one routing + quantising launch
    gemv RB..   route_decode's own GEMV (_router_partial_kernel) in the given layout, then the same
Each layer has its own router (40 x 2 MB: L2 holds little between layers); the 40 calls are one
CUDA graph, replayed (median of triton.testing.do_bench). Before timing, every path's ids are
checked against the first path's, and each GEMV layout's rows alone against the same rows
inside the largest batch (bit for bit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

H, E, K, LAYERS = 2048, 256, 8, 40
LAYOUTS = [dict(RB=8, BE=16, BK=32, SPLIT=16), dict(RB=16, BE=16, BK=32, SPLIT=8),
           dict(RB=16, BE=16, BK=32, SPLIT=16, DOT=True), dict(RB=16, BE=32, BK=32, SPLIT=16, DOT=True),
           dict(RB=16, BE=16, BK=64, SPLIT=8, DOT=True), dict(RB=16, BE=64, BK=32, SPLIT=16, DOT=True),
           dict(RB=16, BE=32, BK=16, SPLIT=32, DOT=True)]


def main(argv=None) -> None:
    import triton.testing

    from services.backbone.kernels import fp8_moe, moe_decode
    from services.common.invariant import empty_rows, linear_rows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    routers = [torch.randn(E, H, device="cuda") / H ** 0.5 for _ in range(LAYERS)]

    def separate(u, w):
        u32 = empty_rows(u.shape[0], H, dtype=torch.float32, device=u.device)
        ids, weights = fp8_moe.router_topk(linear_rows(u32.copy_(u), w), K)
        xq, xa = fp8_moe.quantize_rows_fp8_triton(u)
        return moe_decode.DecodeRoute(ids, weights, xq, xa, torch.zeros(1, dtype=torch.int32, device=u.device))

    def cublas(u, w):
        u32 = empty_rows(u.shape[0], H, dtype=torch.float32, device=u.device)
        return moe_decode.route_decode(u, w, K, logits=linear_rows(u32.copy_(u), w))

    paths = {"separate": separate, "cublas": cublas}
    for lay in LAYOUTS:
        name = "gemv " + " ".join(f"{k} {v}" for k, v in lay.items())
        paths[name] = lambda u, w, lay=lay: moe_decode.route_decode(u, w, K, layout=lay)

    big = max(args.rows)
    u_big = torch.randn(big, H, device="cuda").to(torch.bfloat16)
    first = None
    for name, fn in paths.items():
        ids = fn(u_big, routers[0]).ids
        if first is None:
            first = ids
        same = float((ids == first).all(dim=1).float().mean())
        alone = all(torch.equal(fn(u_big[r:r + 1], routers[0]).ids, ids[r:r + 1]) for r in (0, big // 2, big - 1))
        print(f"check {name:40s} rows routed as '{next(iter(paths))}': {same:.3f}  alone == in batch: {alone}")

    print(f"{'path':40s} " + " ".join(f"{'T=' + str(t):>9s}" for t in args.rows) + "   (us per layer)")
    for name, fn in paths.items():
        cells = []
        for t in args.rows:
            u = u_big[:t].clone()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in routers[:2]:
                    fn(u, w)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for w in routers:
                        fn(u, w)
            torch.cuda.current_stream().wait_stream(stream)
            ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
            cells.append(f"{ms * 1000 / LAYERS:9.2f}")
        print(f"{name:40s} " + " ".join(cells))


if __name__ == "__main__":
    main()

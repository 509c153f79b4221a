"""The front of a decode step's MoE, 40 layers: the router's F32 logits, top-k and the
quantisation of u, path by path, one table (issue #7).

    python3 bench/router_decode.py                 full geometry (H 2048, E 256, k 8) on cuda
    python3 bench/router_decode.py --rows 1 128 --layouts new --route-warps 4 2 1 --topk argmax keyed

Paths (each the same routing, moe_decode.DecodeRoute):
    separate    u's F32 copy, the router GEMM through invariant.linear_rows (cuBLAS, 128 padded
                rows), fp8_moe.router_topk, fp8_moe.quantize_rows_fp8_triton and a zeroed counter
                (the decode step before route_decode; no shared gate logit)
    cublas      u's F32 copy, the same GEMM, then route_decode's one routing + quantising launch
    today       route_decode as it was before ROUTE_CONFIG: the GEMV's K loop not unrolled
                (TODAY_LAYOUT), 4 warps and the two-reduction top-k in the routing launch
    gemv ..     route_decode's own GEMV (_router_partial_kernel) in the given layout (--layouts),
                then the routing launch as ROUTE_CONFIG has it
    route ..    ROUTER_LAYOUT's GEMV, then the routing launch with each --route-warps and --topk
Every route_decode path also computes the shared expert's gate logit, as the served decode step
does. Each layer has its own router (40 x 2 MB: L2 holds little between layers); the 40 calls are
one CUDA graph, replayed (median of triton.testing.do_bench).

Before timing, each path is checked: its ids against the first path's (the share of rows routed
alike), every output of a few rows alone against the same rows inside the largest batch (bit for
bit: batch invariance, issue #8), and every output against `today`'s (bits: 'all' or the fields
that differ; a new top-k or an unrolled loop must say 'all', a new num_warps or layout may
change the last bit of weights and the gate logit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

H, E, K, LAYERS = 2048, 256, 8, 40
# layouts measured before (docs/perf.md, 2026-11-30), K loop not unrolled
OLD_LAYOUTS = [dict(RB=8, BE=16, BK=32, SPLIT=16), dict(RB=16, BE=16, BK=32, SPLIT=8),
               dict(RB=16, BE=16, BK=32, SPLIT=16, DOT=True), dict(RB=16, BE=32, BK=32, SPLIT=16, DOT=True),
               dict(RB=16, BE=16, BK=64, SPLIT=8, DOT=True), dict(RB=16, BE=64, BK=32, SPLIT=16, DOT=True),
               dict(RB=16, BE=32, BK=16, SPLIT=32, DOT=True)]
# unrolled K steps: the default; fewer partials for the routing launch to add (SPLIT 8); more,
# shorter programs (BE 8 on 2 warps: 512 programs of 4 KB at T = 1); fewer, wider steps (BK 64);
# more experts per program (RB 4 BE 32); 16 rows per program (half the L2 reads of W at 128 rows)
NEW_LAYOUTS = [dict(RB=8, BE=16, BK=32, SPLIT=16, UNROLL=True), dict(RB=8, BE=16, BK=32, SPLIT=8, UNROLL=True),
               dict(RB=8, BE=8, BK=32, SPLIT=16, UNROLL=True, num_warps=2),
               dict(RB=8, BE=16, BK=64, SPLIT=16, UNROLL=True), dict(RB=4, BE=32, BK=32, SPLIT=16, UNROLL=True),
               dict(RB=16, BE=16, BK=16, SPLIT=16, UNROLL=True),
               dict(RB=16, BE=64, BK=32, SPLIT=16, DOT=True, UNROLL=True)]
TOPK = {"argmax": False, "keyed": True}     # --topk name -> ROUTE_CONFIG's KEYED_TOPK
# route_decode before ROUTE_CONFIG (2026-11-30): the reference for the bits check
TODAY_LAYOUT, TODAY_ROUTE = dict(RB=8, BE=16, BK=32, SPLIT=16), dict(num_warps=4, KEYED_TOPK=False)


def bits(x: torch.Tensor) -> torch.Tensor:
    """x as integers of its width: equal bits compare equal, NaN included."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def row(route, r: int):
    """Row r of a DecodeRoute (num_active left out: it is the step's, not the row's)."""
    return route._replace(**{f: None if f == "num_active" or x is None else x[r:r + 1]
                             for f, x in zip(route._fields, route)})


def differing(a, b) -> str:
    """'all' when every field of two DecodeRoutes has the same bits, else the fields that differ."""
    fields = [name for name, x, y in zip(a._fields, a, b)
              if x is not None and y is not None and not torch.equal(bits(x), bits(y))]
    return "all" if not fields else "differ: " + " ".join(fields)


def main(argv=None) -> None:
    import triton.testing

    from services.backbone.kernels import fp8_moe, moe_decode
    from services.common.invariant import empty_rows, linear_rows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--layouts", choices=["all", "new", "none"], default="all",
                        help="GEMV layouts to time: the old ones and the new (unrolled) ones, the new ones, none")
    parser.add_argument("--route-warps", type=int, nargs="+", default=[4, 2, 1],
                        help="num_warps of the routing launch (_route_quant_kernel)")
    parser.add_argument("--topk", choices=sorted(TOPK), nargs="+", default=["argmax", "keyed"],
                        help="argmax: two block reductions per pick (as before); keyed: one int64 max")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    routers = [torch.randn(E, H, device="cuda") / H ** 0.5 for _ in range(LAYERS)]
    gates = [(torch.randn(H, device="cuda") / H ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]

    def separate(u, w, g):
        u32 = empty_rows(u.shape[0], H, dtype=torch.float32, device=u.device)
        ids, weights = fp8_moe.router_topk(linear_rows(u32.copy_(u), w), K)
        xq, xa = fp8_moe.quantize_rows_fp8_triton(u)
        return moe_decode.DecodeRoute(ids, weights, xq, xa, torch.zeros(1, dtype=torch.int32, device=u.device))

    def cublas(u, w, g):
        u32 = empty_rows(u.shape[0], H, dtype=torch.float32, device=u.device)
        return moe_decode.route_decode(u, w, K, logits=linear_rows(u32.copy_(u), w), shared_gate=g)

    def route(layout, config):
        return lambda u, w, g: moe_decode.route_decode(u, w, K, layout=layout, shared_gate=g, route_config=config)

    paths = {"separate": separate, "cublas": cublas, "today": route(TODAY_LAYOUT, TODAY_ROUTE)}
    layouts = {"all": OLD_LAYOUTS + NEW_LAYOUTS, "new": NEW_LAYOUTS, "none": []}[args.layouts]
    for lay in layouts:
        name = "gemv " + " ".join(f"{k} {int(v)}" for k, v in lay.items())
        paths[name] = route(lay, None)
    for warps in args.route_warps:
        for topk in args.topk:
            paths[f"route warps {warps} {topk}"] = route(None, dict(num_warps=warps, KEYED_TOPK=TOPK[topk]))

    big = max(args.rows)
    u_big = torch.randn(big, H, device="cuda").to(torch.bfloat16)
    first, today = None, paths["today"](u_big, routers[0], gates[0])
    width = max(len(name) for name in paths) + 1
    for name, fn in paths.items():
        got = fn(u_big, routers[0], gates[0])
        first = got.ids if first is None else first
        same = float((got.ids == first).all(dim=1).float().mean())
        alone = all(differing(row(fn(u_big[r:r + 1], routers[0], gates[0]), 0), row(got, r)) == "all"
                    for r in (0, big // 2, big - 1))
        print(f"check {name:{width}s} rows routed as '{next(iter(paths))}': {same:.3f}  alone == in batch: {alone}"
              f"  bits as today: {differing(got, today)}")

    print(f"{'path':{width + 6}s} " + " ".join(f"{'T=' + str(t):>9s}" for t in args.rows) + "   (us per layer)")
    for name, fn in paths.items():
        cells = []
        for t in args.rows:
            u = u_big[:t].clone()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w, g in zip(routers[:2], gates[:2]):
                    fn(u, w, g)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for w, g in zip(routers, gates):
                        fn(u, w, g)
            torch.cuda.current_stream().wait_stream(stream)
            ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
            cells.append(f"{ms * 1000 / LAYERS:9.2f}")
        print(f"{name:{width + 6}s} " + " ".join(cells))


if __name__ == "__main__":
    main()

"""The small kernels of a prefill piece at the real geometry, one table per part (issue #7).

    python3 bench/prefill_parts.py                 256 rows on cuda
    python3 bench/prefill_parts.py --rows 512

A 256-row piece is ~16 ms, ~9.3 of them the routed experts (bench/moe_decode.py --prefill); the
rest is ~570 short kernels. This times the ones with a knob that cannot change a bit, each
variant against the served one, and checks the bits:
- the recurrent states' gather and scatter around fla's chunk kernel (indexing against
  index_select / index_copy_; one piece's state is 32 x 128 x 128 F32, 2 MB);
- the GDN front (kernels/gdn.prefill_front) by rows x channels per program (gdn.FRONT_TILE);
- the gated norm by heads per program (gdn.GATED_NORM_HEADS, one warp each);
- the router: K-range partials from strided-batched cuBLAS GEMMs + the routing launch (what
  pieces run, moe_decode.router_partials) by the number of ranges, against one cuBLAS SGEMM
  (served before session 15) and moe_decode.route_decode's own Triton GEMV in other layouts
  (IEEE F32 throughout; the same experts is checked, not the same bits: other sums).
Each time is the mean of 20 calls replayed from one CUDA graph (triton.testing.do_bench median).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

H, E, K = 2048, 256, 8
HK, DK, HV, DV = 16, 128, 32, 128


def graphed_us(fn, calls: int = 20) -> float:
    """µs per call of fn, replayed `calls` times from one CUDA graph (warmed up before capture)."""
    from bench.moe_decode import do_bench
    from services.backbone.kernels.decode_graph import GraphedStep
    step = GraphedStep(lambda: [fn() for _ in range(calls)], warmup=1)
    return do_bench(step.replay) * 1e3 / calls


def states(rows: int) -> None:
    pool = torch.randn(4, HV, DK, DV, device="cuda")
    slots = torch.tensor([2], device="cuda")
    state = torch.randn(1, HV, DK, DV, device="cuda")

    def put():
        pool[slots] = state
    print(f"state gather  pool[slots] {graphed_us(lambda: pool[slots]):6.2f} us | "
          f"index_select {graphed_us(lambda: pool.index_select(0, slots)):6.2f} us | same: "
          f"{torch.equal(pool[slots], pool.index_select(0, slots))}")
    print(f"state scatter pool[slots] = s {graphed_us(put):6.2f} us | "
          f"index_copy_ {graphed_us(lambda: pool.index_copy_(0, slots, state)):6.2f} us")


def front(rows: int) -> None:
    from services.backbone.kernels import gdn
    channels = 2 * HK * DK + HV * DV
    proj = torch.randn(rows, channels + HV * DV + 2 * HV, device="cuda").bfloat16()
    weight = torch.randn(channels, 4, device="cuda").bfloat16()
    conv = torch.randn(4, channels, 3, device="cuda").bfloat16()
    a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
    seg = dict(seg_slots=torch.tensor([1], device="cuda"), seg_first=torch.tensor([0], device="cuda"),
               seg_rows=torch.tensor([rows], device="cuda"), row_seg=torch.zeros(rows, dtype=torch.int32, device="cuda"))
    mask = torch.ones(rows, device="cuda")
    served = gdn.FRONT_TILE

    def run(state):      # the front replaces the piece's conv state: timed runs reuse one copy
        return gdn.prefill_front(proj, weight, state, a_log, dt_bias, **seg, heads=(HK, DK, HV, DV), row_mask=mask)
    ref, timed = run(conv.clone()), conv.clone()
    for tile in [served, (16, 256), (32, 256), (64, 128), (16, 512), (8, 512)]:
        gdn.FRONT_TILE = tile
        same = all(torch.equal(x, y) for x, y in zip(run(conv.clone()), ref))
        print(f"GDN front {tile[0]:>3} x {tile[1]:<4} {graphed_us(lambda: run(timed)):7.2f} us  same bits: {same}"
              f"{'  (served)' if tile == served else ''}")
    gdn.FRONT_TILE = served


def gated_norm(rows: int) -> None:
    from services.backbone.kernels import gdn
    o = torch.randn(rows, HV, DV, device="cuda").bfloat16()
    z = torch.randn(rows, HV * DV + 40, device="cuda").bfloat16()[:, :HV * DV].view(rows, HV, DV)
    w = torch.randn(DV, device="cuda").bfloat16()
    served = gdn.GATED_NORM_HEADS
    gdn.GATED_NORM_HEADS = 1
    ref = gdn.gated_rms_norm(o, z, w)
    for heads in (1, 2, 4, 8):
        gdn.GATED_NORM_HEADS = heads
        print(f"gated norm, {heads} head(s) per program: {graphed_us(lambda: gdn.gated_rms_norm(o, z, w)):6.2f} us  "
              f"same bits: {torch.equal(gdn.gated_rms_norm(o, z, w), ref)}{'  (served)' if heads == served else ''}")
    gdn.GATED_NORM_HEADS = served


def router(rows: int) -> None:
    from services.backbone import model
    from services.backbone.kernels import moe_decode
    from services.common import invariant
    weight = torch.randn(E, H, device="cuda") * 0.02
    u = torch.randn(rows, H, device="cuda").bfloat16()
    tile = model.piece_gemm_rows(rows) if rows in model.PREFILL_BUCKETS else rows
    served = moe_decode.piece_router_split(tile)

    def sgemm():
        return moe_decode.route_decode(u, weight, K, logits=invariant.linear_rows(u.float(), weight, tile=tile))
    ref = sgemm().ids.sort(-1).values
    print(f"router: u's F32 copy + one cuBLAS SGEMM per {tile} rows + routing launch {graphed_us(sgemm):7.2f} us")
    for split in sorted({2, 4, 8, 16, 32, served}):
        def partials(split=split):
            return moe_decode.route_decode(u, weight, K, logits=moe_decode.router_partials(u, weight, tile, split))
        same = (partials().ids.sort(-1).values == ref).all(-1).float().mean()
        print(f"router: u's F32 copy + {split:2d} K-range partials (strided-batched cuBLAS) + routing launch "
              f"{graphed_us(partials):7.2f} us  rows with the SGEMM's experts {same.item():.4f}"
              f"{'  (served)' if split == served else ''}")
    for rb, be, bk, split, dot in [(8, 16, 32, 16, False), (32, 32, 32, 8, True), (64, 64, 16, 8, True),
                                   (32, 64, 32, 8, True), (64, 64, 32, 4, True)]:
        lay = dict(RB=rb, BE=be, BK=bk, SPLIT=split, DOT=dot, UNROLL=False)
        same = (moe_decode.route_decode(u, weight, K, layout=lay).ids.sort(-1).values == ref).all(-1).float().mean()
        print(f"router: Triton GEMV {lay}: {graphed_us(lambda: moe_decode.route_decode(u, weight, K, layout=lay)):7.2f} us"
              f"  rows with the SGEMM's experts {same.item():.4f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="rows of the piece")
    parser.add_argument("--parts", nargs="+", default=["states", "front", "gated_norm", "router"],
                        choices=["states", "front", "gated_norm", "router"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/prefill_parts.py times CUDA kernels: no CUDA device here")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.rows} rows")
    for part in args.parts:
        globals()[part](args.rows)


if __name__ == "__main__":
    main()

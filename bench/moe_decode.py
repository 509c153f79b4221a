"""Routed FP8 experts of a decode step, 40 layers: fp8_moe's block-table path against
moe_decode's expert-major split-K path, config by config, one table (issue #7 / #8).

    python3 bench/moe_decode.py                        full geometry (H 2048, I 512, E 256, k 8) on cuda
    python3 bench/moe_decode.py --rows 1 128 --quick   the default configs only (bf16 and FP8 MMA)
    python3 bench/moe_decode.py --prefill --rows 128 256 1024   tile configs for padded prefill pieces
    python3 bench/moe_decode.py --shared --rows 1 8 32 128     a decode step's whole MoE front and
                                                       experts: the shared expert as two GEMMs beside
                                                       the routed launches, against inside them

Each layer has its own random FP8 experts (32 GB for 40 layers, so L2 holds nothing between
layers) and its own random router logits; the 40 `moe_*_pairs` calls are captured as one CUDA graph
and replayed (median of triton.testing.do_bench). Floor = FP8 bytes + scales of the distinct
experts the routes select / the measured copy bandwidth. Before timing, each config's output is
checked against `naive_moe_fp8` on 3 rows of layer 0, and moe_decode's rows are checked to be
bit-identical alone and inside the largest batch (batch invariance); configs that share a K split
are compared bit for bit on that batch (does the tile shape change a row's bits? It does: a
prefill piece's config must follow its bucket, not its replay's size).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

H, I, E, K = 2048, 512, 256, 8


def do_bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / (do_bench(lambda: b.copy_(a)) * 1e-3)


def layer_weights(gen_seed: int):
    torch.manual_seed(gen_seed)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    s_gu = (torch.rand(E, 2 * I // 128, H // 128, device="cuda") + 0.5) / math.sqrt(H)
    w_d = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    s_d = (torch.rand(E, H // 128, I // 128, device="cuda") + 0.5) / math.sqrt(I)
    return w_gu, s_gu, w_d, s_d


def expert_bytes(unique: int) -> int:
    return unique * (3 * I * H + 4 * (2 * (I // 128) * (H // 128) + (H // 128) * (I // 128)))


def main(argv=None) -> dict:
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import fp8_moe, moe_decode

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="default configs only, no sweep")
    parser.add_argument("--prefill", action="store_true",
                        help="sweep configs for padded prefill pieces (many pairs per expert: BM 32/64, "
                             "SPLIT 1/2) instead of the decode sweep; run with --rows 128 256 512 1024")
    parser.add_argument("--shared", action="store_true",
                        help="route_decode + routed experts + shared expert per layer: the shared expert "
                             "as GEMMs (as served before) against inside the routed launches")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; building {args.layers} layers of experts ...", flush=True)
    layers = [layer_weights(i) for i in range(args.layers)]
    if args.shared:
        return shared_main(args, layers)
    variants = [("fp8_moe decode", dict(fp8_moe.DECODE_CONFIG), fp8_moe.moe_fp8_pairs),
                ("moe_decode", dict(moe_decode.DECODE_CONFIG), moe_decode.moe_decode_pairs),
                ("moe_decode fp8 dot", dict(moe_decode.DECODE_CONFIG, FP8_DOT=True), moe_decode.moe_decode_pairs)]
    if args.prefill:
        # FP8 operands only (bf16 lost at every size, session 9); the served piece configs first
        for cfg in (moe_decode.SMALL_PIECE_CONFIG, moe_decode.LARGE_PIECE_CONFIG, moe_decode.WIDE_PIECE_CONFIG):
            variants.append(("moe_decode piece", dict(cfg), moe_decode.moe_decode_pairs))
        # gate/up's and down's own warps and stages (DOWN_WARPS / DOWN_STAGES): down's K is only
        # I = 512, four 128-wide steps against gate/up's sixteen. Session 12 run 2 swept down alone
        # (2 warps, 3 stages best: 9.89 against 10.20 ms at 256 rows); earlier tile sweeps are in
        # docs/perf.md.
        small = moe_decode.SMALL_PIECE_CONFIG
        for bn1, warps, stages, bn2, down_warps, down_stages in [
                (64, 4, 3, 64, 2, 3), (64, 2, 3, 64, 2, 3), (64, 2, 4, 64, 2, 3), (64, 2, 5, 64, 2, 3),
                (128, 2, 3, 64, 2, 3), (128, 4, 4, 64, 2, 3), (32, 2, 3, 64, 2, 3), (64, 4, 3, 64, 2, 4),
                (64, 4, 3, 64, 1, 3), (64, 4, 3, 32, 1, 3), (64, 4, 3, 128, 2, 3)]:
            variants.append(("moe_decode gu/down", dict(small, BN_GU=bn1, num_warps=warps, num_stages=stages,
                                                        BN_DOWN=bn2, DOWN_WARPS=down_warps,
                                                        DOWN_STAGES=down_stages), moe_decode.moe_decode_pairs))
        # the grid's order (N_FAST: an expert's column blocks one after another) with gate/up's
        # column blocks, against the slots-first grid served before session 14
        for bn1, n_fast in [(64, False), (32, False), (64, True), (128, True)]:
            variants.append(("moe_decode grid", dict(small, BN_GU=bn1, N_FAST=n_fast), moe_decode.moe_decode_pairs))
        variants.append(("moe_decode grid", dict(moe_decode.LARGE_PIECE_CONFIG, N_FAST=False),
                         moe_decode.moe_decode_pairs))
        for cfg in (moe_decode.LARGE_PIECE_CONFIG, moe_decode.WIDE_PIECE_CONFIG):
            for down_warps, down_stages in [(2, 3), (2, 4), (8, 3)]:
                variants.append(("moe_decode down", dict(cfg, DOWN_WARPS=down_warps, DOWN_STAGES=down_stages),
                                 moe_decode.moe_decode_pairs))
    elif not args.quick:
        variants.append(("fp8_moe fast", dict(fp8_moe.FAST_DECODE_CONFIG), fp8_moe.moe_fp8_pairs))
        base = moe_decode.DECODE_CONFIG
        for split, bn1, bn2, stages in [(2, 64, 32, 3), (8, 64, 32, 3), (16, 64, 32, 3), (4, 128, 32, 3),
                                        (4, 32, 32, 3), (4, 64, 64, 3), (4, 64, 16, 3), (8, 32, 32, 2),
                                        (8, 64, 16, 2), (4, 64, 32, 2)]:
            variants.append(("moe_decode", dict(base, SPLIT=split, BN_GU=bn1, BN_DOWN=bn2, num_stages=stages),
                             moe_decode.moe_decode_pairs))
        for warps, down_warps in [(4, 2), (2, 2), (2, 4)]:
            variants.append(("moe_decode warps", dict(base, num_warps=warps, DOWN_WARPS=down_warps),
                             moe_decode.moe_decode_pairs))

    # correctness on layer 0, 3 rows
    x3 = torch.randn(3, H, device="cuda").bfloat16()
    ids3, w3 = fp8_moe.router_topk(torch.randn(3, E, device="cuda"), K)
    ref = fp8_moe.naive_moe_fp8(x3, ids3, w3, *layers[0])
    for name, cfg, fn in variants:
        got = fn(x3, ids3, w3, *layers[0], config=cfg).sum(1)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        cfg["rel_err_vs_naive"] = err
        if err > 1e-2:
            print(f"WARNING {name} {cfg}: rel err {err:.2e} against naive_moe_fp8")

    results = {"copy_tb_s": bw / 1e12, "rows": {}}
    big = max(args.rows)
    xb = torch.randn(big, H, device="cuda").bfloat16()
    idsb, wb = fp8_moe.router_topk(torch.randn(big, E, device="cuda"), K)
    print(f"{'T':>4} {'variant':<18} {'config':<84} {'ms/40 layers':>12} {'x floor':>8} {'TB/s':>6} {'rel err':>8}")
    for t in args.rows:
        x = torch.randn(t, H, device="cuda").bfloat16()
        routes = [fp8_moe.router_topk(torch.randn(t, E, device="cuda"), K) for _ in layers]
        unique = sum(int(ids.unique().numel()) for ids, _ in routes)
        floor_ms = expert_bytes(unique) / bw * 1e3
        rows = []
        for name, cfg, fn in variants:
            kernel_cfg = {k: v for k, v in cfg.items() if k != "rel_err_vs_naive"}

            def run(fn=fn, kernel_cfg=kernel_cfg):
                for weights, (ids, w) in zip(layers, routes):
                    fn(x, ids, w, *weights, config=kernel_cfg)
            try:
                graph = dg.GraphedStep(run)
                ms = do_bench(graph.replay)
            except Exception as exc:   # one failing config must not cost the run
                print(f"{t:>4} {name:<18} {str(kernel_cfg):<84} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            rows.append(dict(variant=name, config=kernel_cfg, ms=ms, x_floor=ms / floor_ms,
                             rel_err=cfg["rel_err_vs_naive"]))
            short = ",".join(f"{k}={v}" for k, v in kernel_cfg.items())
            print(f"{t:>4} {name:<18} {short:<84} {ms:>12.3f} {ms / floor_ms:>8.2f} "
                  f"{expert_bytes(unique) / (ms * 1e-3) / 1e12:>6.2f} {cfg['rel_err_vs_naive']:>8.1e}", flush=True)
        results["rows"][t] = dict(floor_ms=floor_ms, unique_per_layer=unique / len(layers), variants=rows)

    # Does a row's result depend on the tile shape? Configs with the same K split (the summation
    # order over H) and dot type are compared bit for bit on the big batch: if BM/BN/warps never
    # change a row's bits, a padded prefill replay may pick its tiles by its total pair count
    # without breaking batch invariance.
    groups: dict[tuple, list] = {}
    for name, cfg, fn in variants:
        if fn is not moe_decode.moe_decode_pairs:
            continue
        kernel_cfg = {k: v for k, v in cfg.items() if k != "rel_err_vs_naive"}
        key = (kernel_cfg.get("SPLIT"), bool(kernel_cfg.get("FP8_DOT", False)))
        try:
            groups.setdefault(key, []).append((kernel_cfg, fn(xb, idsb, wb, *layers[0], config=kernel_cfg)))
        except Exception as exc:
            print(f"tile check: {kernel_cfg} failed: {type(exc).__name__}: {exc}"[:200])
    results["same_bits_across_tiles"] = {}
    for (split, fp8), outs in sorted(groups.items(), key=str):
        same = all(torch.equal(outs[0][1], o) for _, o in outs[1:])
        results["same_bits_across_tiles"][f"SPLIT={split},FP8_DOT={fp8}"] = same
        print(f"SPLIT={split} FP8_DOT={fp8}: {len(outs)} tile configs give the same bits at {big} rows: {same}")
        for cfg, o in outs[1:]:    # which ones share the first's bits (a piece config may change within those)
            print(f"    same bits as {outs[0][0]}: {torch.equal(outs[0][1], o)}  {cfg}")

    # batch invariance of moe_decode at its default config: each row alone == inside the big batch
    inside = moe_decode.moe_decode_pairs(xb, idsb, wb, *layers[0])
    same = all(torch.equal(moe_decode.moe_decode_pairs(xb[r:r + 1], idsb[r:r + 1], wb[r:r + 1], *layers[0]),
                           inside[r:r + 1]) for r in range(0, big, max(1, big // 16)))
    results["moe_decode_batch_invariant"] = same
    print(f"moe_decode rows alone == inside a batch of {big}: {same}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def shared_main(args, layers) -> dict:
    """--shared: per layer, route_decode, the routed experts and the shared expert (I_s = 512, BF16),
    combined; the shared expert either as SparseMoE's two GEMMs + silu_mul (invariant.linear_rows,
    padded to 128 rows) or inside moe_decode_pairs' launches. Checks the fused path's rows alone
    against inside the largest batch, and its shared output against its torch reference."""
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import moe_decode
    from services.common.invariant import linear_rows

    shared = []
    for i in range(len(layers)):
        torch.manual_seed(1000 + i)
        gate_up = (torch.randn(2 * I + 64, H, device="cuda") / math.sqrt(H)).bfloat16()   # gate, up, scalar gate, pad
        gate_up[2 * I + 1:] = 0
        down = (torch.randn(H, I, device="cuda") / math.sqrt(I)).bfloat16()
        router = torch.randn(E, H, device="cuda") / math.sqrt(H)
        shared.append((gate_up, down, router))

    def layer_gemms(x, weights, sh):
        gate_up, down, router = sh
        route = moe_decode.route_decode(x, router, K)
        pairs = moe_decode.moe_decode_pairs(x, route.ids, route.weights, *weights, route=route)
        fused = linear_rows(x, gate_up)
        out = linear_rows(dg.silu_mul(fused[:, :I], fused[:, I:2 * I]), down)
        return dg.moe_combine(pairs, x, out, fused[:, 2 * I])

    def layer_fused(x, weights, sh, config=None):
        gate_up, down, router = sh
        route = moe_decode.route_decode(x, router, K, shared_gate=gate_up[2 * I])
        pairs, out = moe_decode.moe_decode_pairs(x, route.ids, route.weights, *weights, route=route,
                                                 shared=(gate_up[:2 * I], down), config=config)
        return dg.moe_combine(pairs, x, out, route.shared_gate_logit)

    # DECODE_CONFIG, then bit-neutral variants of it (warps and column blocks; the K split and BM stay)
    base = moe_decode.DECODE_CONFIG
    configs = {"served": base}
    # the split reduce inside gate/up at one row (LAST_REDUCES) against its own launch: the same bits
    configs[f"reduce {'launch' if base['LAST_REDUCES'] else 'in gate/up'}"] = dict(
        base, LAST_REDUCES=not base["LAST_REDUCES"])
    configs["served again"] = base
    for warps, down_warps, bn1, bn2 in [(4, 4, 64, 64), (2, 2, 64, 64), (4, 4, 32, 32), (2, 2, 32, 32), (2, 2, 64, 32),
                                        (2, 4, 64, 64), (2, 1, 32, 32), (4, 2, 64, 64)]:
        configs[f"w{warps}/{down_warps} bn{bn1}/{bn2}"] = dict(base, num_warps=warps, DOWN_WARPS=down_warps,
                                                             BN_GU=bn1, BN_DOWN=bn2)
    results = {"rows": {}}
    print(f"{'T':>4} {'shared expert':<28} {'ms/40 layers':>12} {'us/layer':>9}")
    for t in args.rows:
        x = torch.randn(t, H, device="cuda").bfloat16()
        cases = [("two GEMMs + silu_mul", layer_gemms, None)] + [
            (f"fused {name}", layer_fused, cfg) for name, cfg in configs.items()]
        for name, layer, cfg in cases:
            def run(layer=layer, cfg=cfg):
                for weights, sh in zip(layers, shared):
                    if cfg is None:
                        layer(x, weights, sh)
                    else:
                        layer(x, weights, sh, cfg)
            ms = do_bench(dg.GraphedStep(run).replay)
            results["rows"].setdefault(t, {})[name] = ms
            print(f"{t:>4} {name:<28} {ms:>12.3f} {ms * 1e3 / len(layers):>9.2f}", flush=True)
    big = max(args.rows)
    xb = torch.randn(big, H, device="cuda").bfloat16()
    inside = layer_fused(xb, layers[0], shared[0])
    same = all(torch.equal(layer_fused(xb[r:r + 1], layers[0], shared[0]), inside[r:r + 1])
               for r in range(0, big, max(1, big // 16)))
    for name, cfg in configs.items():   # bit-neutral: each config's rows equal DECODE_CONFIG's
        equal = torch.equal(layer_fused(xb, layers[0], shared[0], cfg), inside)
        results.setdefault("same_bits_as_decode_config", {})[name] = equal
        print(f"{name}: the same bits as DECODE_CONFIG at {big} rows: {equal}")
    gate_up, down, _ = shared[0]
    got = moe_decode.moe_decode_pairs(xb, *fp8_route(xb, shared[0][2]), *layers[0], shared=(gate_up[:2 * I], down))[1]
    ref = moe_decode.shared_expert_reference(xb, gate_up[:2 * I], down)
    err = float((got - ref).norm() / ref.norm())
    results.update(batch_invariant=same, shared_rel_err=err)
    print(f"fused: rows alone == inside a batch of {big}: {same}; shared expert vs reference: rel err {err:.2e}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def fp8_route(x, router):
    from services.backbone.kernels import fp8_moe
    return fp8_moe.router_topk(x.float() @ router.T, K)


if __name__ == "__main__":
    main()

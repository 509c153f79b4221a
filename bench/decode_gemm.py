"""The decode step's dense GEMMs: kernels/decode_gemm.decode_linear (Triton, batch-invariant by
construction) against invariant.linear_rows (cuBLAS padded to 128 rows), one table (issue #8).

    python3 bench/decode_gemm.py                       every real shape at M = 1, 8, 32, 128
    python3 bench/decode_gemm.py --sweep --shapes out_proj   also other configs (M = 1 and 128; a few
                                                       minutes per shape: compiles every config) and
                                                       other row partitions (1, 2, 4, 8 tiles per
                                                       program at M = 32 and 128)
    python3 bench/decode_gemm.py --backbone            the graphed decode step, cublas vs triton
                                                       (bench/backbone.py twice, DRAMA_DECODE_GEMM)
    python3 bench/decode_gemm.py --cublas-tiles 32 64 128   linear_rows (cuBLAS) with other padded
                                                       tiles: rows per GEMM call, M = 1 and 128
                                                       (at M = 128 a 32-row tile is 4 calls)

Per shape and M: `calls` GEMMs on distinct weights (the layers of one decode step, so L2 holds
no weight between calls) captured as one CUDA graph, replayed (median of
triton.testing.do_bench); µs per call and GB/s of weight bytes read. The router's cuBLAS column
includes its F32 copy of u, as serving does it (decode_linear reads bf16 u). Before timing:
`err` is decode_linear's max |diff| / max |ref| against the float64 reference on 4 rows, and
`inv` says whether rows alone (M = 1) and inside M = 8 and 32 equal their bits inside M = 128 at
positions 0, 1, 15, 16, 31, 63, 64, 127, and M = 128 equals the single-program partition (all
its tiles in one program, tiles=8) ("yes" or the first failure). The last column is the config and
the row partition (t tiles per program x g row groups).
What to look for: inv = yes everywhere; at M = 1 most shapes near 3 TB/s+; at M = 32 and 128
the Triton time at most cuBLAS's (the decode step needs both to take triton as its default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# (name, N, K, weight dtype, residual, calls per decode step at the full preset)
SHAPES = [("gdn_in_proj", 12352, 2048, torch.bfloat16, False, 30),
          ("out_proj", 2048, 4096, torch.bfloat16, True, 40),
          ("shared_fused", 1088, 2048, torch.bfloat16, False, 40),
          ("shared_down", 2048, 512, torch.bfloat16, False, 40),
          ("router", 256, 2048, torch.float32, False, 40),
          ("attn_qkv", 9216, 2048, torch.bfloat16, False, 10),
          # the tower's (per frame step: qkv as attn_qkv x 13, o_proj and fc as out_proj x 13 and 9)
          ("tower_gate_up", 24576, 2048, torch.bfloat16, False, 13),
          ("tower_down", 2048, 12288, torch.bfloat16, True, 13),
          ("tower_head", 1024, 2048, torch.bfloat16, False, 9)]
POSITIONS = (0, 1, 15, 16, 31, 63, 64, 127)


def do_bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def graphed(fn, calls: int):
    """fn(i) for i < calls, captured once; returns the replay. Warmed up on the capture stream
    first, as serving captures (services/common/cuda_graphs.capture): Triton compiles there, and
    decode_linear makes that stream's split-reduce tickets."""
    from services.common.cuda_graphs import capture

    graph, _ = capture(lambda: [fn(i) for i in range(calls)], warmup=1)
    return graph.replay


def invariance(decode_linear, w, dtype, residual: bool, config=None, tiles=None) -> str:
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(128, w.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
    r = torch.randn(128, w.shape[0], device="cuda", generator=gen).to(dtype) if residual else None
    cut = (lambda t, a, b: None if t is None else t[a:b])
    full = decode_linear(x, w, r, config=config, tiles=tiles)
    if not torch.equal(decode_linear(x, w, r, config=config, tiles=8), full):
        return "NO (tiles=8)"
    for m in (8, 32):
        if not torch.equal(decode_linear(x[:m], w, cut(r, 0, m), config=config, tiles=tiles), full[:m]):
            return f"NO (M={m})"
    for p in POSITIONS:
        if not torch.equal(decode_linear(x[p:p + 1], w, cut(r, p, p + 1), config=config)[0], full[p]):
            return f"NO (row {p})"
    return "yes"


def bench_shape(shape, rows, configs, args, tiles=(None,)) -> list[dict]:
    """Time decode_linear under each config (None: config_for's) and row partition (None:
    tiles_for's) and, for the defaults, linear_rows."""
    name, n, k, dtype, residual, calls = shape
    calls = min(calls, args.calls)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype) for _ in range(calls)]
    out = []
    for config in configs:
        for t in tiles:
            try:
                out += bench_config(name, config, rows, weights, residual, gen, t,
                                    check=config is None or not args.no_inv)
            except Exception as e:        # a sweep config may not fit (registers, shared memory)
                if config is None and t is None:
                    raise
                print(f"{name:<13} {_label(config)} tiles {t}: failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80]})", flush=True)
    del weights
    torch.cuda.empty_cache()
    return out


def _label(config: dict | None) -> str:
    return "default" if config is None else ",".join(f"{key}{v}" for key, v in config.items())


def random_rows(m: int, cols: int, dtype, gen) -> torch.Tensor:
    """[m, cols] random rows in padded storage (invariant.empty_rows), as serving hands a GEMM its
    input: linear_rows reads it in place."""
    from services.common import invariant

    rows = invariant.empty_rows(m, cols, dtype=dtype, device="cuda")
    return rows.copy_(torch.randn(m, cols, device="cuda", generator=gen))


def bench_config(name, config, rows, weights, residual, gen, tiles=None, check: bool = True) -> list[dict]:
    """Time one config at each row count; `check` False skips the invariance check (--no-inv:
    a sweep's configs, whose extra row partitions each cost a compile)."""
    from services.backbone.kernels import decode_gemm
    from services.common import invariant

    n, k = weights[0].shape
    dtype, calls = weights[0].dtype, len(weights)
    nbytes = n * k * weights[0].element_size()
    inv = invariance(decode_gemm.decode_linear, weights[0], dtype, residual, config, tiles) if check else "skipped"
    out = []
    for m in rows:
        x = random_rows(m, k, torch.bfloat16, gen)
        r = random_rows(m, n, dtype, gen) if residual else None
        few = min(m, 4)
        ref = invariant.linear_rows_reference(x[:few], weights[0], None if r is None else r[:few])
        got = decode_gemm.decode_linear(x[:few], weights[0], None if r is None else r[:few], config=config,
                                        tiles=tiles)
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        triton_ms = do_bench(graphed(lambda i: decode_gemm.decode_linear(x, weights[i], r, config=config,
                                                                         tiles=tiles), calls))
        plan = decode_gemm.launch_plan(m, n, k, dtype, config, tiles)
        label = _label(config) + ("" if tiles is None else f" tiles{tiles}")
        row = dict(shape=name, n=n, k=k, m=m, config=label, plan=plan, triton_us=triton_ms * 1e3 / calls,
                   triton_gbs=nbytes * calls / (triton_ms * 1e-3) / 1e9, err=err, inv=inv)
        if config is None and tiles is None:
            if dtype == torch.float32:         # serving's cuBLAS router: F32 copy of u, then the GEMM
                x32 = invariant.empty_rows(m, k, dtype=torch.float32, device="cuda")
                fn = lambda i: invariant.linear_rows(x32.copy_(x), weights[i])  # noqa: E731
            else:
                fn = lambda i: invariant.linear_rows(x, weights[i], r)  # noqa: E731
            cublas_ms = do_bench(graphed(fn, calls))
            row.update(cublas_us=cublas_ms * 1e3 / calls, cublas_gbs=nbytes * calls / (cublas_ms * 1e-3) / 1e9)
        out.append(row)
        print(_line(row), flush=True)
    return out


def _line(r: dict) -> str:
    cublas = (f"{r['cublas_us']:>9.1f} {r['cublas_gbs']:>8.0f} {r['triton_us'] / r['cublas_us']:>6.2f}"
              if "cublas_us" in r else f"{'':>9} {'':>8} {'':>6}")
    return (f"{r['shape']:<13} {r['m']:>4} {r['triton_us']:>9.1f} {r['triton_gbs']:>8.0f} {cublas} "
            f"{r['err']:>8.1e} {r['inv']:<14} {r['config']} (t{r['plan']['tiles']}xg{r['plan']['groups']})")


HEADER = (f"{'shape':<13} {'M':>4} {'triton us':>9} {'GB/s':>8} {'cublas us':>9} {'GB/s':>8} {'ratio':>6} "
          f"{'err':>8} {'inv':<14} config (tiles per program x row groups)")


def sweep_configs(n: int, k: int, dtype, stages=(3,), warps=(4,), bns=(32, 64, 128), bks=None) -> list[dict]:
    """Candidate configs for one weight shape: each one fixed for every M (issue #8). stages,
    warps, bns, bks: the pipeline depths, warp counts, column and reduction blocks to cross with
    every SPLIT (bks None: 32, 64 for F32 weights, 64, 128 for bf16)."""
    f32 = dtype == torch.float32
    out = []
    for bn in bns:
        for bk in bks or ((32, 64) if f32 else (64, 128)):
            for split in (1, 2, 4, 8, 16, 32):
                programs = -(-n // bn) * split
                if k // split < bk or programs < 64 or programs > 1024:
                    continue
                for num_stages in stages:
                    for num_warps in warps:
                        out.append(dict(BM=16 if f32 else 64, BN=bn, BK=bk, SPLIT=split, num_warps=num_warps,
                                        num_stages=num_stages))
    return out


def backbone(args) -> dict:
    """bench/backbone.py's graphed decode step with DRAMA_DECODE_GEMM=cublas, then =triton."""
    results = {}
    for backend in ("cublas", "triton"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [sys.executable, str(ROOT / "bench" / "backbone.py"), "--preset", "full", "--device", "cuda",
                   "--prefill", "256", "--batch", *map(str, args.rows), "--context", "64", "--steps", "5",
                   "--warmup", "2", "--decode-graphs", "--served-warm-up", "--out", str(out)]
            print(f"DRAMA_DECODE_GEMM={backend} {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True, env=dict(os.environ, DRAMA_DECODE_GEMM=backend))
            results[backend] = json.loads(out.read_text())
    print(f"\n{'batch':>5} {'cublas ms':>10} {'triton ms':>10} {'saved ms':>9}   (graphed decode step, median)")
    for batch in args.rows:
        t = {b: next(r["median_ms"] for r in results[b]["decode"] if r["batch"] == batch and r["graphs"])
             for b in results}
        print(f"{batch:>5} {t['cublas']:>10.2f} {t['triton']:>10.2f} {t['cublas'] - t['triton']:>9.2f}")
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], help="default: all")
    parser.add_argument("--calls", type=int, default=40, help="GEMMs per graph, on distinct weights (at most "
                        "the shape's count per decode step)")
    parser.add_argument("--sweep", action="store_true", help="also time other configs (M = 1 and 128)")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 128],
                        help="row counts the sweep times (default 1 128)")
    parser.add_argument("--sweep-stages", type=int, nargs="+", default=[3], help="pipeline depths to sweep")
    parser.add_argument("--sweep-warps", type=int, nargs="+", default=[4], help="warp counts to sweep")
    parser.add_argument("--sweep-bn", type=int, nargs="+", default=[32, 64, 128], help="column blocks to sweep")
    parser.add_argument("--sweep-bk", type=int, nargs="+", help="reduction blocks to sweep (default by dtype)")
    parser.add_argument("--no-partitions", action="store_true", help="skip the sweep's row partitions")
    parser.add_argument("--no-inv", action="store_true", help="swept configs skip the invariance check")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compile the swept configs first in this many processes (Triton's disk cache)")
    parser.add_argument("--try", dest="tries", nargs="+", metavar="SHAPE:KEY=V,..",
                        help="time config_for's config with these changes (e.g. tower_down:SPLIT=4,num_stages=4) "
                             "at --rows, invariance checked, beside the default")
    parser.add_argument("--backbone", action="store_true", help="time the whole graphed decode step instead")
    parser.add_argument("--cublas-tiles", type=int, nargs="+", metavar="ROWS",
                        help="time linear_rows with these padded tiles instead (M = --rows)")
    parser.add_argument("--variants", action="store_true",
                        help="time the default config with other MMA tiles (BM 16 / 64) and row partitions, "
                             "at --rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_gemm.py needs a CUDA GPU")
    if args.backbone:
        results = backbone(args)
    elif args.variants:
        results = variants(args)
    elif args.cublas_tiles:
        results = cublas_tiles(args)
    elif args.tries:
        results = tries(args)
    else:
        print(f"{torch.cuda.get_device_name()}; GB/s = weight bytes read per second")
        print(HEADER)
        results = {"default": [], "sweep": []}
        shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
        for shape in shapes:
            results["default"] += bench_shape(shape, args.rows, [None], args)
        if args.sweep:
            print(f"\nsweep (M = {args.sweep_rows}; ratio column empty: compare with the default rows above)")
            print(HEADER)
            per_shape = [(shape, sweep_configs(shape[1], shape[2], shape[3], args.sweep_stages, args.sweep_warps,
                                               args.sweep_bn, args.sweep_bk)) for shape in shapes]
            if args.jobs > 1:
                precompile([(shape, config, m) for shape, configs in per_shape for config in configs
                            for m in args.sweep_rows], args.jobs)
            for shape, configs in per_shape:
                rows = bench_shape(shape, args.sweep_rows, configs, args)
                results["sweep"] += rows
                cublas128 = next(r["cublas_us"] for r in results["default"] if r["shape"] == shape[0]
                                 and r["m"] == max(args.rows))
                best = _best(rows, cublas128)
                if best:
                    print(f"best for {shape[0]}: {best}   (least M = 1 time with M = 128 <= 1.3x cuBLAS)")
                fastest = sorted((r["triton_us"], r["config"]) for r in rows if r["m"] == 1)[:3]
                print(f"fastest at M = 1 for {shape[0]}: " + "; ".join(f"{us:.1f} us {c}" for us, c in fastest))
            if args.no_partitions:
                shapes = []
            print("\nrow partitions (default config; tiles per program forced; bits equal by design, inv checks)")
            print(HEADER)
            for shape in shapes:
                rows = bench_shape(shape, [32, 128], [None], args, tiles=(1, 2, 4, 8))
                results["sweep"] += rows
                for m in (32, 128):
                    t = min((r["triton_us"], r["plan"]["tiles"]) for r in rows if r["m"] == m)
                    print(f"best for {shape[0]} at M = {m}: {t[1]} tiles per program ({t[0]:.1f} us; "
                          f"default {decode_gemm_plan(shape, m)})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


def variants(args) -> list[dict]:
    """--variants: per shape, config_for's config with BM (rows per MMA tile: 16 is the per-warp
    mma.sync, 64 Hopper's warpgroup MMA) 16 or 64 and the row partitions each allows at 128 rows,
    then 64-row tiles with other BK / stages / BN, against cuBLAS; `inv` checks each variant's
    rows alone against themselves inside 128."""
    from services.backbone.kernels import decode_gemm

    print(f"{torch.cuda.get_device_name()}; GB/s = weight bytes read per second; PDL "
          f"{'on' if decode_gemm.pdl_args() else 'off'}")
    print(HEADER)
    out = []
    for shape in SHAPES:
        name, n, k, dtype = shape[:4]
        if (args.shapes and name not in args.shapes) or dtype == torch.float32:
            continue
        base = decode_gemm.config_for(n, k, dtype)
        out += bench_shape(shape, args.rows, [None], args)
        for bm, tiles in ((16, None), (16, 8), (64, 1), (64, 2)):
            out += bench_shape(shape, args.rows, [dict(base, BM=bm)], args, tiles=(tiles,))
        # 64-row tiles in other pipelines (BK and stages set how many programs an SM holds)
        for change in (dict(BK=64, num_stages=3), dict(BK=64, num_stages=4), dict(BK=64, num_stages=5),
                       dict(BK=128, num_stages=2), dict(BN=128, BK=64, num_stages=4)):
            out += bench_shape(shape, args.rows, [dict(base, BM=64, **change)], args)
    return out


def tries(args) -> list[dict]:
    """--try: per shape named, the default config and each given change of it, at --rows."""
    from services.backbone.kernels import decode_gemm

    changes: dict[str, list[dict]] = {}
    for entry in args.tries:
        name, _, spec = entry.partition(":")
        change = {key: int(v) for key, v in (kv.split("=") for kv in spec.split(",") if kv)}
        changes.setdefault(name, []).append(change)
    print(f"{torch.cuda.get_device_name()}; GB/s = weight bytes read per second")
    print(HEADER)
    out = []
    for shape in SHAPES:
        if shape[0] not in changes:
            continue
        base = decode_gemm.config_for(shape[1], shape[2], shape[3])
        out += bench_shape(shape, args.rows, [None] + [dict(base, **c) for c in changes[shape[0]]], args)
    return out


def cublas_tiles(args) -> list[dict]:
    """--cublas-tiles: us per GEMM (and GB/s of weight) of linear_rows with each padded tile at
    each M, every shape, `calls` distinct weights per graph as bench_shape."""
    from services.common import invariant

    print(f"{torch.cuda.get_device_name()}; linear_rows (cuBLAS) by padded tile, us per GEMM (GB/s)")
    print(f"{'shape':<13} {'M':>4} " + " ".join(f"{'tile ' + str(t):>16}" for t in args.cublas_tiles))
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, dtype, residual, calls in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        calls = min(calls, args.calls)
        weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype) for _ in range(calls)]
        nbytes = n * k * weights[0].element_size()
        for m in args.rows:
            x = random_rows(m, k, dtype, gen)
            r = random_rows(m, n, dtype, gen) if residual else None
            cells = []
            for tile in args.cublas_tiles:
                ms = do_bench(graphed(lambda i: invariant.linear_rows(x, weights[i], r, tile=tile), calls))
                us = ms * 1e3 / calls
                out.append(dict(shape=name, m=m, tile=tile, us=us, gbs=nbytes / (us * 1e-6) / 1e9))
                cells.append(f"{us:>8.1f} ({out[-1]['gbs']:>5.0f})")
            print(f"{name:<13} {m:>4} " + " ".join(cells), flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return out


def precompile(work: list, jobs: int) -> None:
    """Compile every (shape, config, rows) of a sweep in `jobs` processes sharing Triton's disk
    cache, so the timing loop only loads kernels (a config takes ~1-2 s to compile, one at a time
    in one process)."""
    import multiprocessing
    import time

    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for done, _ in enumerate(pool.imap_unordered(_compile_one, work), 1):
            if done % 20 == 0 or done == len(work):
                print(f"compiled {done}/{len(work)} configs in {time.perf_counter() - start:.0f} s", flush=True)


def _compile_one(item) -> None:
    (name, n, k, dtype, residual, _), config, m = item
    from services.backbone.kernels import decode_gemm

    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(n, k, dtype=dtype, device="cuda")
    r = torch.zeros(m, n, dtype=dtype, device="cuda") if residual else None
    try:
        decode_gemm.decode_linear(x, w, r, config=config)
        torch.cuda.synchronize()
    except Exception:          # a config that does not fit fails again, with its message, when timed
        pass


def decode_gemm_plan(shape, m: int) -> str:
    from services.backbone.kernels import decode_gemm
    plan = decode_gemm.launch_plan(m, shape[1], shape[2], shape[3])
    return f"{plan['tiles']} tiles x {plan['groups']} groups"


def _best(rows: list[dict], cublas128: float) -> str | None:
    by_config = {}
    for r in rows:
        by_config.setdefault(r["config"], {})[r["m"]] = r
    ok = [(c[1]["triton_us"], name) for name, c in by_config.items()
          if 1 in c and 128 in c and c[128]["triton_us"] <= 1.3 * cublas128 and c[1]["inv"] == "yes"]
    return min(ok)[1] if ok else None


if __name__ == "__main__":
    main()

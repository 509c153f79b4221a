"""The tower's draws alone (issue #7): what the ten draws of a frame step cost, one table.

    python3 bench/draws.py                      every case at 1, 8 and 128 rows
    python3 bench/draws.py --rows 1 --cases frame

Two parts, each captured as a CUDA graph of `--repeat` copies and timed by replaying it
(median of triton.testing.do_bench, µs per copy):

- `draw`: one kernels.draw launch over M candidates (4097: the semantic draw; 1024: a residual
  one) with the sampling settings that decide its work: greedy, top_p 1 (no cut), the API's
  default top_p 0.9, and RAS's top_p 0.95 + top_k 30 (two cuts).
- `semantic`: FusedFrameDraws.semantic alone at the API's defaults (the draw with its
  bookkeeping; against `draw` at 4097 and top_p 0.9, what the bookkeeping costs inside it).
- `frame`: the ten draws of a frame step with their bookkeeping (RAS switch, repetition
  penalty, EOS, code writes, RAS windows), the torch path (engine.torch_sampler + FrameDraws +
  advance_ras_windows) against kernels.FusedFrameDraws, at the API's defaults, half the rows on RAS.

Logits are random bf16 (std 3), as flat as the random-weight tower's: the cut then keeps many
candidates, which is the bisections' worst case. Each copy of a `draw` case in the graph has its
own draw index, so its own noise: with the race first (kernels.RACE_FIRST, `--race-first on off`
compares) some copies answer from the race and others bisect, as served draws do. The `semantic`
and `frame` copies repeat one noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SETTINGS = {"greedy": (0.0, 1.0, 0), "top_p 1": (0.8, 1.0, 0), "top_p 0.9": (0.8, 0.9, 0),
            "RAS 0.95/30": (1.5, 0.95, 30)}


def do_bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def graphed(fn, repeat: int):
    """fn(copy) captured for copy = 0 .. repeat-1 in one CUDA graph; returns the replay."""
    fn(0)                                                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy in range(repeat):
            fn(copy)
    return graph.replay


def draw_cases(rows: int, repeat: int) -> list[dict]:
    from services.tower import kernels

    out = []
    g = torch.Generator(device="cuda").manual_seed(rows)
    for m in (4097, 1024):
        logits = (torch.randn(rows, m, device="cuda", generator=g) * 3).bfloat16()
        seeds = torch.randint(0, 2 ** 62, (rows,), device="cuda", generator=g)
        takes = torch.zeros(rows, dtype=torch.int64, device="cuda")
        frames = torch.arange(rows, device="cuda")
        for name, (temperature, top_p, top_k) in SETTINGS.items():
            args = dict(temperature=torch.full((rows,), temperature, device="cuda"),
                        top_p=torch.full((rows,), top_p, device="cuda"),
                        top_k=torch.full((rows,), top_k, dtype=torch.int64, device="cuda"),
                        seeds=seeds, takes=takes, frames=frames)
            row = dict(part="draw", rows=rows, m=m, setting=name)
            # each copy its own draw index, so its own noise: the race first answers some and not others
            row["us"] = do_bench(graphed(lambda copy, args=args: kernels.draw(logits, draw_index=1 + copy, **args),
                                         repeat)) * 1000 / repeat
            out.append(row)
    return out


def frame_inputs(rows: int, ras_rows: bool) -> dict:
    """A frame step's draw inputs at the full preset and the API's defaults (penalty 1.1): RAS
    windows of random codes (`ras_rows`: every other row's last two codes equal, so it is on
    RAS), the staged ints / floats, the heads' bf16 logits, empty codes, every row drawing."""
    from services.common.config import DramaConfig
    from services.common.make_checkpoint import preset_raw
    from services.tower.graphs import FLOAT_FIELDS, INT_FIELDS

    cfg = DramaConfig.from_dict(preset_raw("full"))
    g = torch.Generator(device="cuda").manual_seed(rows)
    n, semantic = cfg.num_codebooks, cfg.semantic_codebook_size
    pool = torch.randint(0, semantic, (rows, cfg.sampling.ras_window), device="cuda", generator=g)
    if ras_rows:
        pool[::2, -1] = pool[::2, -2]
    ints = torch.zeros(len(INT_FIELDS), rows, dtype=torch.int64, device="cuda")
    floats = torch.zeros(len(FLOAT_FIELDS), rows, device="cuda")
    ints[INT_FIELDS.index("slot")] = torch.arange(rows, device="cuda")
    ints[INT_FIELDS.index("top_k")] = cfg.sampling.top_k
    ints[INT_FIELDS.index("seed")] = torch.randint(0, 2 ** 62, (rows,), device="cuda", generator=g)
    floats[FLOAT_FIELDS.index("temperature")] = cfg.sampling.temperature
    floats[FLOAT_FIELDS.index("top_p")] = cfg.sampling.top_p
    floats[FLOAT_FIELDS.index("penalty")] = 1.1
    logits = [(torch.randn(rows, semantic + 1, device="cuda", generator=g) * 3).bfloat16()]
    logits += [(torch.randn(rows, cfg.residual_codebook_size, device="cuda", generator=g) * 3).bfloat16()
               for _ in range(n - 1)]
    return dict(cfg=cfg, pool=pool, ints=ints, floats=floats, logits=logits,
                codes=torch.full((rows, n), -1, dtype=torch.int64, device="cuda"),
                draw_rows=torch.arange(rows, device="cuda"))


def semantic_cases(rows: int, repeat: int) -> list[dict]:
    """FusedFrameDraws.semantic alone (RAS switch, penalty, draw, EOS, writes, window advance)."""
    from services.tower.engine import fused_frame_draws

    f = frame_inputs(rows, ras_rows=False)

    def fn(copy):
        fused_frame_draws(f["cfg"], f["pool"], f["ints"], f["floats"]).semantic(f["logits"][0], f["codes"],
                                                                                f["draw_rows"])

    return [dict(part="semantic", rows=rows, m=f["cfg"].semantic_codebook_size + 1, setting="defaults",
                 us=do_bench(graphed(fn, repeat)) * 1000 / repeat)]


def frame_cases(rows: int, repeat: int) -> list[dict]:
    """The ten draws of a frame step, the torch bookkeeping against FusedFrameDraws."""
    from services.tower.engine import advance_ras_windows, fused_frame_draws, torch_sampler
    from services.tower.graphs import INT_FIELDS
    from services.tower.model import FrameDraws

    f = frame_inputs(rows, ras_rows=True)
    cfg, pool, ints, floats, logits = f["cfg"], f["pool"], f["ints"], f["floats"], f["logits"]
    slots = ints[INT_FIELDS.index("slot")]

    def frame(fused: bool):
        codes = f["codes"].clone()
        if fused:
            draws = fused_frame_draws(cfg, pool, ints, floats)
        else:
            history = pool[slots]
            draws = FrameDraws(torch_sampler(cfg, history, ints, floats), cfg.semantic_codebook_size)
        cast = (lambda x: x.float()) if draws.float32_logits else (lambda x: x)
        stopped = draws.semantic(cast(logits[0]), codes, f["draw_rows"])
        for column in range(1, cfg.num_codebooks):
            draws.residual(column, cast(logits[column]), codes, f["draw_rows"], stopped)
        if not fused:
            advance_ras_windows(pool, slots, history, codes[:, 0], stopped)

    row = dict(part="frame", rows=rows, setting="defaults",
               m=f"{cfg.semantic_codebook_size + 1}+{cfg.num_codebooks - 1}x{cfg.residual_codebook_size}")
    for fused in (False, True):
        replay = graphed(lambda copy, fused=fused: frame(fused), repeat)
        row["fused" if fused else "torch"] = do_bench(replay) * 1000 / repeat
    return [row]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--cases", nargs="+", choices=["draw", "semantic", "frame"],
                        default=["draw", "semantic", "frame"])
    parser.add_argument("--repeat", type=int, default=20, help="copies per graph")
    parser.add_argument("--warps", nargs="+", metavar="S[,R]",
                        help="the draws over 4096+ candidates with S warps and the smaller ones with R "
                        "(kernels._draw_warps: 16 and 4), each entry in turn, e.g. 16 16,8 8,2")
    parser.add_argument("--race-first", nargs="+", choices=["on", "off"], default=["on"],
                        help="kernels.RACE_FIRST for each pass in turn (on: the default, off: always bisect)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/draws.py needs CUDA")
    from services.tower import kernels

    rows_out = []
    default_warps = kernels._draw_warps
    default_race_first = kernels.RACE_FIRST
    passes = [(entry, race) for race in args.race_first for entry in args.warps or [None]]
    for entry, race in passes:
        kernels.RACE_FIRST = race == "on"
        if entry is not None:
            big, small = (int(w) for w in (entry.split(",") + [str(default_warps(1024))])[:2])
            kernels._draw_warps = lambda m, big=big, small=small: big if kernels._next_pow2(m) >= 4096 else small
        first = len(rows_out)
        for rows in args.rows:
            if "draw" in args.cases:
                rows_out += draw_cases(rows, args.repeat)
            if "semantic" in args.cases:
                rows_out += semantic_cases(rows, args.repeat)
            if "frame" in args.cases:
                rows_out += frame_cases(rows, args.repeat)
        for r in rows_out[first:]:
            r["warps"] = f"{kernels._draw_warps(4097)},{kernels._draw_warps(1024)}"
            r["race_first"] = race
        kernels._draw_warps = default_warps
    kernels.RACE_FIRST = default_race_first
    print(f"{'part':8} {'rows':>4} {'M':>14} {'setting':12} {'warps':>6} {'race':>4} {'µs':>8} {'µs, fused':>10}")
    for r in rows_out:
        if r["part"] == "frame":
            print(f"{'frame':8} {r['rows']:4d} {r['m']:>14} {r['setting']:12} {r['warps']:>6} {r['race_first']:>4} "
                  f"{r['torch']:8.1f} "
                  f"{r['fused']:10.1f}"
                  f"  torch | fused")
        else:
            print(f"{r['part']:8} {r['rows']:4d} {r['m']:>14} {r['setting']:12} {r['warps']:>6} {r['race_first']:>4} "
                  f"{r['us']:8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=2))
    return rows_out


if __name__ == "__main__":
    main()

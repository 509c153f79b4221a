"""Does a decode GEMM run faster when its weights were asked into L2 during the kernels before it?

    python3 bench/l2_prefetch.py                     every shape, every prefetch size, one table
    python3 bench/l2_prefetch.py --shapes gdn_in_proj --mb 0 24 48

A batch-1 decode step alternates latency-bound kernels (routing, the GDN recurrence, norms: HBM
mostly idle) with GEMMs bound by HBM. Each layer here is, in one CUDA graph of `--layers` layers
with distinct weights (so no weight stays in L2 from the layer before):

    prefetch launch (first MB of this layer's weight, or none) -> `--between` a kernel that streams
    `--between-mb` MB with few programs (the MoE's expert reads: slow, HBM far from busy) -> the GEMM

and the table gives µs per layer for the whole and, from a second graph without the GEMM, what the
GEMM adds. The prefetch is one TMA instruction per program (`cp.async.bulk.prefetch.L2` with an
`evict_last` hint, `prefetch`), or one `prefetch.global.L2` per 128-byte line (`--lines`), in a
launch of its own or (`--inside`) by the programs of the kernel between. Compare each size against 0 MB.

H200, session 25 (16 layers, 27 MB between by 128 programs, µs per layer, the whole layer / the
GEMM's share): the GEMM gains 1-3 µs with its weights asked for, but the kernel that asks (or the
launch before it) loses more, ~0.2 µs per MB: GDN in_proj 42.0 / 15.0 -> 44.8 / 14.3 (16 MB asked
by the kernel between), out_proj 34.4 / 6.9 -> 36.6 / 6.1; even all of out_proj from L2 (5.3 µs)
runs at ~3.2 TB/s, so a decode GEMM's few microseconds of start and drain stay. Not used in serving.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.backbone.kernels import HAS_TRITON  # noqa: E402

SHAPES = {"gdn_in_proj": (12352, 2048), "attn_qkv": (9216, 2048), "out_proj": (2048, 4096),
          "tower_gate_up": (24576, 2048), "tower_down": (2048, 12288)}

if HAS_TRITON:
    import triton
    import triton.language as tl

    # thread 0 of the program only: the other threads hold the same scalar operands
    _BULK = tl.constexpr("""{
    .reg .pred p; .reg .u32 t; .reg .b64 pol;
    mov.u32 t, %tid.x;
    setp.eq.u32 p, t, 0;
    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
    @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
    mov.u32 $0, 0;
    }""")
    _BULK_PLAIN = tl.constexpr("""{
    .reg .pred p; .reg .u32 t;
    mov.u32 t, %tid.x;
    setp.eq.u32 p, t, 0;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.u32 $0, 0;
    }""")

    @triton.jit
    def prefetch_l2(ptr, nbytes, HINT: tl.constexpr = True):
        """Ask for bytes [ptr, ptr + nbytes) in L2 (ptr 16-byte aligned, nbytes a multiple of 16),
        as `evict_last` lines when HINT. Returns at once."""
        if HINT:
            tl.inline_asm_elementwise(_BULK, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_BULK_PLAIN, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def prefetch_l2_lines(ptrs):
        """Ask for each element's line in L2 (`prefetch.global.L2::evict_last`), one per thread element."""
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LINES: tl.constexpr, HINT: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * CHUNK
        if start < nbytes:
            size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
            if LINES:
                offs = start + tl.arange(0, CHUNK // 128).to(tl.int64) * 128
                prefetch_l2_lines(tl.where(offs < nbytes, ptr + offs, ptr))
            else:
                prefetch_l2(ptr + start, size, HINT)

    @triton.jit
    def _stream_kernel(src_ptr, out_ptr, n_words, per_program, pf_ptr, pf_chunk, pf_bytes, BLOCK: tl.constexpr,
                       EVICT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):
        """Program p sums int32 words [p·per, (p+1)·per): a slow reader of many bytes. PREFETCH: it
        first asks for bytes [p·pf_chunk, (p+1)·pf_chunk) of pf (below pf_bytes) in L2."""
        p = tl.program_id(0)
        if PREFETCH:
            pf_start = p.to(tl.int64) * pf_chunk
            if pf_start < pf_bytes:
                prefetch_l2(pf_ptr + pf_start, tl.minimum(pf_bytes - pf_start, pf_chunk).to(tl.int32))
        start = p.to(tl.int64) * per_program
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, per_program, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            if EVICT_FIRST:
                acc += tl.load(src_ptr + idx, mask=idx < n_words, other=0, eviction_policy="evict_first")
            else:
                acc += tl.load(src_ptr + idx, mask=idx < n_words, other=0)
        tl.store(out_ptr + p, tl.sum(acc, axis=0))


def prefetch(weight: torch.Tensor, nbytes: int, chunk: int = 1 << 18, lines: bool = False,
             hint: bool = True) -> None:
    """One launch asking for the first `nbytes` of `weight` (contiguous, CUDA) in L2, `chunk`
    bytes per program (a multiple of 128)."""
    nbytes = min(nbytes, weight.numel() * weight.element_size())
    nbytes -= nbytes % 16
    if nbytes <= 0:
        return
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    _prefetch_kernel[(triton.cdiv(nbytes, chunk),)](raw, nbytes, CHUNK=chunk, LINES=lines, HINT=hint,
                                                    num_warps=1 if not lines else 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["gdn_in_proj", "attn_qkv", "out_proj"], choices=SHAPES)
    parser.add_argument("--mb", type=float, nargs="+", default=[0, 8, 16, 24, 32, 48])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--between-mb", type=float, default=27.0, help="bytes the kernel between streams")
    parser.add_argument("--between-programs", type=int, default=128)
    parser.add_argument("--between-block", type=int, default=2048, help="int32 words a program loads at once")
    parser.add_argument("--evict-first", action="store_true", help="the kernel between reads with evict_first")
    parser.add_argument("--lines", action="store_true", help="per-line prefetch instead of TMA bulk")
    parser.add_argument("--no-hint", action="store_true", help="bulk prefetch without the evict_last hint")
    parser.add_argument("--chunk-kb", type=int, default=256)
    parser.add_argument("--inside", action="store_true",
                        help="the kernel between asks for the bytes itself (its programs, at their start)")
    args = parser.parse_args()
    if not (HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        raise SystemExit("bench/l2_prefetch.py needs Triton and a Hopper (sm_90) or later GPU")

    from services.backbone.kernels import decode_gemm

    dev = torch.device("cuda")
    torch.manual_seed(0)
    n_words = int(args.between_mb * 2**20) // 4
    between = [torch.randint(0, 100, (n_words,), dtype=torch.int32, device=dev) for _ in range(args.layers)]
    sink = torch.empty(args.between_programs, dtype=torch.int32, device=dev)
    per_program = triton.cdiv(n_words, args.between_programs)
    per_program = triton.cdiv(per_program, args.between_block) * args.between_block

    def stream(i: int, prefetch: torch.Tensor | None = None, nbytes: int = 0) -> None:
        chunk = triton.cdiv(triton.cdiv(nbytes, args.between_programs), 128) * 128
        pf = sink if prefetch is None else prefetch.view(torch.uint8)
        _stream_kernel[(args.between_programs,)](between[i], sink, n_words, per_program, pf, chunk, nbytes,
                                                  BLOCK=args.between_block, EVICT_FIRST=args.evict_first,
                                                  PREFETCH=prefetch is not None and nbytes > 0, num_warps=4)

    print(f"layers {args.layers}, between: {args.between_mb:.0f} MB by {args.between_programs} programs"
          f"{' evict_first' if args.evict_first else ''}; prefetch "
          f"{'lines' if args.lines else 'bulk' + ('' if args.no_hint else ' evict_last')}, "
          + ("by the kernel between" if args.inside else f"{args.chunk_kb} KB a program"), flush=True)
    print(f"{'shape':<14}{'MB of W':>8}{'pref MB':>8}{'layer us':>10}{'GEMM us':>9}{'no-GEMM us':>11}", flush=True)
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w_mb = n * k * 2 / 2**20
        for mb in args.mb:
            nbytes = int(mb * 2**20)

            def layers(with_gemm: bool) -> None:
                for i in range(args.layers):
                    if nbytes and not args.inside:
                        prefetch(weights[i], nbytes, chunk=args.chunk_kb * 1024, lines=args.lines,
                                 hint=not args.no_hint)
                    stream(i, weights[i] if args.inside else None, nbytes)
                    if with_gemm:
                        decode_gemm.decode_linear(x, weights[i])

            times = []
            for with_gemm in (True, False):
                layers(with_gemm)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layers(with_gemm)
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                reps = []
                for _ in range(20):
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    reps.append(start.elapsed_time(end) * 1000 / args.layers)
                times.append(sorted(reps)[len(reps) // 2])
            print(f"{name:<14}{w_mb:>8.1f}{mb:>8.0f}{times[0]:>10.2f}{times[0] - times[1]:>9.2f}{times[1]:>11.2f}",
                  flush=True)
        weights.clear()


if __name__ == "__main__":
    main()

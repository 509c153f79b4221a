"""Registers, spills and shared memory of the decode step's Triton kernels on Hopper (sm_90),
compiled on this machine: no GPU needed, only Triton (`pip install triton`; its ptxas comes with it).

    python3 bench/kernel_resources.py                 every case below, one table
    python3 bench/kernel_resources.py --cases gate_up down

Why: a kernel's registers per thread decide how many of its programs an SM holds at once, and
so how many weight bytes are in flight in a bandwidth-bound decode step. Session 13 found this
way why a fused variant of gate/up was slower on the H200: its epilogue took the kernel from 96
to 168 registers (5 to 3 programs per SM). It also catches a kernel that does not compile
(e.g. a construct the device's Triton refuses) before a device call is spent on it.

Each case compiles one kernel with serving's constexprs (moe_decode.DECODE_CONFIG etc.) and the
16-divisibility Triton gives at runtime to aligned pointers and to int arguments that are
multiples of 16 (without it loads are not vectorised and a kernel reads as twice its registers).
Columns: REG per thread, LOCAL (spill bytes per thread), SHARED bytes per program, and programs
per SM as the register file (64 K) and shared memory (228 KB) allow. The device's Triton may
differ from the local one in the last registers; the table is for comparing variants.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024


def _ptr(dtype: str) -> str:
    return "*" + dtype


def cases() -> dict:
    """name -> (jit function, argument types (default i32), constexprs, num_warps, num_stages,
    int arguments that are multiples of 16 at the full preset)."""
    import triton.language as tl

    from services.backbone.kernels import decode_gemm, decode_graph, gdn, moe_decode
    from services.common import device_handoff
    from services.tower import kernels as tower

    cfg = moe_decode.DECODE_CONFIG
    dot = dict(DOT=tl.bfloat16, PREC="tf32")
    moe_ptrs = dict(counts_ptr=_ptr("i32"), lists_ptr=_ptr("i32"), active_ptr=_ptr("i32"),
                    num_active_ptr=_ptr("i32"))
    gemm_ptrs = dict(x_ptr=_ptr("bf16"), w_ptr=_ptr("bf16"), r_ptr=_ptr("bf16"), out_ptr=_ptr("bf16"),
                     final_ptr=_ptr("bf16"), tickets_ptr=_ptr("i32"))
    gemm_div16 = {"N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om", "stride_fm", "K_RANGE"}

    def gemm(bm, tiles, bn=64, tma=False):     # GDN in_proj's launch (BK 128, whole K), PDL on
        ptrs = dict(gemm_ptrs, w_desc=f"tensordesc<bf16[{bn},128]>" if tma else _ptr("bf16"))
        return (decode_gemm._decode_gemm_kernel, ptrs,
                dict(BM=bm, BN=bn, BK=128, TILES=tiles, FINAL=True, HAS_RESIDUAL=False, LAST_REDUCES=False,
                     TMA=tma, PDL=True, **dot), 4, 3, gemm_div16)

    def split_gemm(last_reduces=True):   # out_proj's launch (K in 4 ranges, 4 stages)
        return (decode_gemm._decode_gemm_kernel, dict(gemm_ptrs, out_ptr=_ptr("fp32"), w_desc=_ptr("bf16")),
                dict(BM=64, BN=64, BK=128, TILES=1, FINAL=False, HAS_RESIDUAL=True, LAST_REDUCES=last_reduces,
                     TMA=False, PDL=True, **dot), 4, 4, gemm_div16)

    def gate_up(reduce):     # REDUCE: the split reduce by each column group's last program (one row: 8 pairs)
        return (moe_decode._gate_up_kernel,
                dict(xq_ptr=_ptr("fp8e4nv"), xa_ptr=_ptr("fp32"), w_ptr=_ptr("fp8e4nv"), s_ptr=_ptr("fp32"),
                     ws_ptr=_ptr("fp32"), u_ptr=_ptr("bf16"), sw_ptr=_ptr("bf16"), wss_ptr=_ptr("fp32"),
                     tickets_ptr=_ptr("i32"), shared_tickets_ptr=_ptr("i32"), hq_ptr=_ptr("fp8e4nv"),
                     ha_ptr=_ptr("fp32"), hs_ptr=_ptr("bf16"), **moe_ptrs),
                dict(BM=cfg["BM"], BN=cfg["BN_GU"], SPLIT=cfg["SPLIT"], FP8_DOT=cfg["FP8_DOT"], SHARED=True,
                     KX=cfg["SHARED_KX"], REDUCE=reduce, PDL=True, **dot),
                cfg["num_warps"], cfg["num_stages"], {"H", "I", "stride_we", "stride_wn", "stride_u", "IS"})

    draw_ptrs = dict(temperature_ptr=_ptr("fp32"), top_p_ptr=_ptr("fp32"), top_k_ptr=_ptr("i64"),
                     seed_ptr=_ptr("i64"), take_ptr=_ptr("i64"), frame_ptr=_ptr("i64"))
    frame_ptrs = dict(codes_ptr=_ptr("i64"), draw_rows_ptr=_ptr("i64"), stopped_ptr=_ptr("u8"))

    def draw(kernel, m, ptrs, **constexprs):     # the tower's draws at the full preset's M (4097, 1024)
        launch = tower._draw_launch(m)
        return (kernel, dict(logits_ptr=_ptr("bf16"), **draw_ptrs, **ptrs),
                dict(BM=launch["BM"], PRECISE_LOG=True, RACE_FIRST=launch["RACE_FIRST"], PDL=True, **constexprs),
                launch["num_warps"], 3, set())

    served = {
        "semantic_draw": draw(tower._semantic_draw_kernel, 4097,
                              dict(slot_ptr=_ptr("i64"), history_ptr=_ptr("i64"), penalty_ptr=_ptr("fp32"),
                                   ras_temperature="fp32", ras_top_p="fp32", drawn_temperature_ptr=_ptr("fp32"),
                                   drawn_top_p_ptr=_ptr("fp32"), drawn_top_k_ptr=_ptr("i64"), **frame_ptrs),
                              W=16, BW=16, RECENT=4),
        "residual_draw": draw(tower._residual_draw_kernel, 1024, frame_ptrs),
        "draw_4097": draw(tower._draw_kernel, 4097, dict(out_ptr=_ptr("i64"))),
        "gate_up": gate_up(0),
        "gate_up_reduce": gate_up(8),
        "down": (moe_decode._down_kernel,
                 dict(hq_ptr=_ptr("fp8e4nv"), ha_ptr=_ptr("fp32"), w_ptr=_ptr("fp8e4nv"), s_ptr=_ptr("fp32"),
                      out_ptr=_ptr("fp32"), weights_ptr=_ptr("bf16"), hs_ptr=_ptr("bf16"), sw_ptr=_ptr("bf16"),
                      shared_out_ptr=_ptr("fp32"), **moe_ptrs),
                 dict(BM=cfg["BM"], BN=cfg["BN_DOWN"], FP8_DOT=cfg["FP8_DOT"], SHARED=True, PDL=True, **dot),
                 cfg.get("DOWN_WARPS", cfg["num_warps"]), cfg.get("DOWN_STAGES", cfg["num_stages"]),
                 {"H", "I", "stride_we", "stride_wn", "IS"}),
        "split_reduce": (moe_decode._split_reduce_shared_kernel,
                         dict(ws_ptr=_ptr("fp32"), hq_ptr=_ptr("fp8e4nv"), ha_ptr=_ptr("fp32"), wss_ptr=_ptr("fp32"),
                              hs_ptr=_ptr("bf16")),
                         dict(SPLIT=cfg["SPLIT"], SHARED_SPLIT=cfg["SPLIT"] * cfg["SHARED_KX"], BM=16, PDL=True),
                         4, 3, {"I", "IS"}),
        "route_quant": (moe_decode._route_quant_kernel,
                        dict(ws_ptr=_ptr("fp32"), u_ptr=_ptr("bf16"), ids_ptr=_ptr("i32"), w_ptr=_ptr("bf16"),
                             xq_ptr=_ptr("fp8e4nv"), xa_ptr=_ptr("fp32"), num_active_ptr=_ptr("i32"),
                             sg_ptr=_ptr("bf16"), gl_ptr=_ptr("bf16"), counts_ptr=_ptr("i32"), lists_ptr=_ptr("i32"),
                             active_ptr=_ptr("i32"), tickets_ptr=_ptr("i32")),
                        dict(S=16, KP=8, BE=256, GP=16, GATE=True, KEYED_TOPK=True, LISTS=True,
                             TICKETS=moe_decode.REDUCE_TICKETS, PDL=True),
                        moe_decode.ROUTE_CONFIG["num_warps"], 3, {"H", "E", "stride_u", "stride_ws"}),
        "router_partial": (moe_decode._router_partial_kernel,
                           dict(u_ptr=_ptr("bf16"), w_ptr=_ptr("fp32"), ws_ptr=_ptr("fp32")),
                           dict(KR=128, RB=moe_decode.ROUTER_LAYOUT["RB"], BE=moe_decode.ROUTER_LAYOUT["BE"],
                                BK=moe_decode.ROUTER_LAYOUT["BK"], DOT=False, UNROLL=True, PDL=True),
                           4, 3, {"H", "E", "stride_u"}),
        "gemm_bm64": gemm(64, 1),
        "gemm_bm64_t2": gemm(64, 2),
        "gemm_bm16_t4": gemm(16, 4),
        "gemm_in_proj": gemm(64, 1, bn=32),                 # as served (decode_gemm.TUNED: BN 32)
        "gemm_in_proj_tma": gemm(64, 1, bn=32, tma=True),   # its weight through TMA box loads
        "gemm_split_last_reduces": split_gemm(),
        "gemm_out_proj": split_gemm(last_reduces=False),       # as served: the reduce in its own launch
        "split_reduce_norm": (decode_gemm._split_reduce_norm_kernel,     # out_proj's reduce + the next norm
                              dict(part_ptr=_ptr("fp32"), r_ptr=_ptr("bf16"), out_ptr=_ptr("bf16"),
                                   w_ptr=_ptr("bf16"), u_ptr=_ptr("bf16"), eps="fp32"),
                              dict(SPLIT=4, HAS_RESIDUAL=True, BH=2048, PDL=True), 8, 3,
                              {"N", "stride_rm", "stride_om", "stride_um"}),
        "gdn_decode": (gdn._gdn_decode_kernel,
                       dict(q_ptr=_ptr("bf16"), k_ptr=_ptr("bf16"), v_ptr=_ptr("bf16"), a_ptr=_ptr("bf16"),
                            b_ptr=_ptr("bf16"), A_log_ptr=_ptr("fp32"), dt_bias_ptr=_ptr("fp32"), h_ptr=_ptr("fp32"),
                            o_ptr=_ptr("bf16"), slot_ptr=_ptr("i64"), scale="fp32"),
                       dict(HK=16, HV=32, K=128, V=128, BK=128, BV=64, HAS_SLOTS=True, PDL=True),
                       4, 3, {"stride_q", "stride_k", "stride_v"}),
        "handoff_fill": (device_handoff._fill_kernel,     # a chained step's inputs from the tower's frames
                         dict(flag_ptr=_ptr("i64"), seq="i64", frames_ptr=_ptr("i64"), ids_ptr=_ptr("i64"),
                              codes_ptr=_ptr("i64"), status_ptr=_ptr("i32"), timeout_ns="i64", abort_ptr=_ptr("i32")),
                         dict(N=10, BLOCK_R=1, BLOCK_N=16, TIMER=True), 1, 3, set()),
        "handoff_receive": (device_handoff._receive_kernel,     # the tower's wait for a step's rows
                            dict(flag_ptr=_ptr("i64"), seq="i64", src_ptr=_ptr("i32"), dst_ptr=_ptr("i32"),
                                 status_ptr=_ptr("i32"), timeout_ns="i64"),
                            dict(BLOCK=device_handoff.ROW_WORDS_PER_PROGRAM, TIMER=True), 4, 3, set()),
        "conv_update": (gdn._conv_update_kernel,
                        dict(x_ptr=_ptr("bf16"), w_ptr=_ptr("bf16"), state_ptr=_ptr("bf16"), out_ptr=_ptr("bf16"),
                             slot_ptr=_ptr("i64")),
                        dict(TAPS=4, BLOCK=1024, HAS_SLOTS=True, PDL=True), 4, 3, {"C", "stride_x", "stride_o"}),
    }
    # the same launches reading ahead of their PDL wait (kernels/__init__.PDL_PRELOAD); the down
    # launch's PRELOAD counts its K blocks (I 512: 4)
    preloads = {name: dict(PRELOAD=True) for name in ("router_partial", "route_quant", "split_reduce_norm",
                                                       "gdn_decode", "conv_update")}
    preloads["down"] = dict(PRELOAD=4)
    combine = (decode_graph._moe_combine_norm_kernel,
               dict(pairs_ptr=_ptr("fp32"), res_ptr=_ptr("bf16"), sh_ptr=_ptr("bf16"), shg_ptr=_ptr("bf16"),
                    out_ptr=_ptr("bf16"), w_ptr=_ptr("bf16"), normed_ptr=_ptr("bf16"), eps="fp32"),
               dict(K=8, HAS_SHARED=True, BH=2048, PDL=True), 8, 3, {"H", "stride_res", "stride_sh"})
    return served | {"combine_norm": combine, "combine_norm_preload": _variant(combine, PRELOAD=True)} | {
        f"{name}_preload": _variant(served[name], **change) for name, change in preloads.items()}


def _variant(case: tuple, **constexprs) -> tuple:
    """A case with some constexprs changed."""
    fn, types, given, num_warps, num_stages, div16 = case
    return fn, types, dict(given, **constexprs), num_warps, num_stages, div16


def compile_case(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, div16: set):
    """The kernel compiled for sm_90 (triton.compile: frontend, LLVM, ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(fn.fn).parameters
    names = list(params)
    # a constexpr left out takes its default, as at a launch that does not pass it
    constexprs = {n: p.default for n, p in params.items()
                  if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)} | constexprs
    unknown = set(types) | set(constexprs) | div16
    unknown -= set(names)
    if unknown:
        raise ValueError(f"{fn.fn.__name__} has no arguments {sorted(unknown)}")
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n in div16]
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def resources(kernel) -> dict:
    """REG / LOCAL / SHARED of a compiled kernel, from cuobjdump on its cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict((key, int(value)) for key, value in re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", text))
    found["SHARED"] = max(found.get("SHARED", 0), kernel.metadata.shared)
    return found


def programs_per_sm(regs: int, shared: int, num_warps: int) -> int:
    by_regs = REGISTERS_PER_SM // max(1, regs * 32 * num_warps)
    by_shared = SHARED_PER_SM // shared if shared else by_regs
    return min(by_regs, by_shared)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", help="default: all")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("bench/kernel_resources.py needs Triton (pip install triton); no GPU needed")
    table = cases()
    names = args.cases or list(table)
    missing = [n for n in names if n not in table]
    if missing:
        raise SystemExit(f"unknown cases {missing}; known: {list(table)}")
    print(f"{'kernel':<15} {'warps':>5} {'REG':>4} {'LOCAL':>5} {'SHARED':>7} {'per SM':>6}")
    rows = []
    for name in names:
        fn, types, constexprs, warps, stages, div16 = table[name]
        found = resources(compile_case(fn, types, constexprs, warps, stages, div16))
        row = dict(kernel=name, warps=warps, **found,
                   programs_per_sm=programs_per_sm(found["REG"], found["SHARED"], warps))
        rows.append(row)
        print(f"{name:<15} {warps:>5} {row['REG']:>4} {row.get('LOCAL', 0):>5} {row['SHARED']:>7} "
              f"{row['programs_per_sm']:>6}", flush=True)
    return rows


if __name__ == "__main__":
    main()

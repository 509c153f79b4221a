"""Routed FP8 experts for the decode step: expert-major, split-K (MODEL.md §4.5, §4.7).

Same contract as `fp8_moe.moe_fp8_pairs` (per-pair weighted outputs [T, k, H] F32 for
`decode_graph.moe_combine`), same §4.7 arithmetic and rounding points, same weight layout
(`fp8_moe.pack_gate_up`); `fp8_moe.naive_moe_fp8` is the reference. What differs is how the work
is laid out, because the decode step is bound by how many weight bytes are in flight at once:

1. Route by expert, in parallel. `_expert_lists_kernel` runs one program per expert: it compares
   the step's n = T·k expert ids with its own, writes the matching pair indices in ascending
   order (a cumsum gives each its rank) and its count, and, if it has any, claims a slot in the
   list of active experts with one atomic add. O(E·n) compares spread over E programs, where
   fp8_moe's one-program block table does O(n²) in one program: at T = 128 (n = 1024) that was
   ~0.3 ms per layer, most of a 128-row step's MoE time.
2. Programs are laid out by active expert, not by padded row block: program (slot, column
   stripe, K split) reads its expert's weights for BN columns over H/SPLIT of the reduction,
   once, and applies them to every pair of that expert (BM rows at a time). At T = 1 the 8
   experts give 8 · (2I/BN) · SPLIT programs with a few K steps each, so many loads are in flight
   at once; fp8_moe's K loop of 16 dependent steps per program left the decode step latency-bound
   (25 µs per layer for 16.8 MB of gate/up weights).
3. The K split is a fixed constant (4), not chosen by batch size, and partial sums are reduced in
   split order by `fp8_moe._split_reduce_quant_kernel` (which also §4.7-quantises h for the down
   GEMM): a pair's bits depend on its own row only, whatever the step's batch (issue #8; a
   config that changed with T would be a different summation order). Warps, pipeline stages and
   column blocks (BN) leave every sum alone: they only change which threads compute an element.

The active-slot order from the atomic add varies from run to run; nothing depends on it: a
program's results depend on which expert it holds, not on its slot.

The shared expert (BF16, MODEL.md §4.5) can ride along (`moe_decode_pairs(shared=)`): more slots
in the gate/up and down grids, one 16-row tile each, and more row blocks in the split reduce, so a
decode step spends no launch of its own on it (three before: bench/moe_decode.py --shared, H200
2026-11-30, us per layer with routing and combine: T = 1: 46.4 -> 36.5; 128: 299.5 -> 302.7).

In front of these, `route_decode` takes a decode step from u to the experts' inputs in two
launches: the F32 router GEMV (partial sums over 16 K ranges), then one program per row that adds
them, routes, quantises u (§4.7) and zeroes the active-expert counter. It replaced six launches
per layer (u's F32 copy, the cuBLAS router GEMM padded to 128 rows, top-k, a bf16 cast, the
quantiser, the counter's zeroing): `python3 bench/router_decode.py`, us per layer in a 40-layer
graph on the H200 (2026-11-30): T = 1: 23.1 -> 10.9; T = 128: 24.0 -> 29.9.
At T = 1 (one stream) the routing program is the only one, and it knows the step's whole
routing: it also writes what `expert_lists` would (each of the k distinct picks has the one pair),
so the single-stream step skips that launch (DecodeRoute.lists). It also zeroes tickets
(DecodeRoute.tickets) with which the split reduce folds into gate/up at one row: the last
program of each 128-column group and kind (routed, shared) reduces that group, the same code on
the same partials as the reduce launch, so the same bits (DECODE_CONFIG's LAST_REDUCES).

H200, 40 layers of distinct experts in one CUDA graph (`python3 bench/moe_decode.py`, 2026-11-29),
ms against fp8_moe's decode path: T = 1: 1.38 vs 1.86; 8: 4.74 vs 5.27; 32: 11.4 vs 13.5;
64: 15.2 vs 19.9; 128: 17.2 vs 31.2 (2.3x the byte floor of the selected experts, from 4.2x).
With FP8_DOT (2026-11-30): T = 1: 1.03, 128: 10.5 (1.41x the floor).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from services.common.grpcutil import env_switch

from . import HAS_TRITON, PDL_PRELOAD, bf16_dot_args, pdl_args, use_triton
from . import fp8_moe

if HAS_TRITON:
    import triton
    import triton.language as tl

    from . import pdl_prologue

# BM pairs per tl.dot (16 is tl.dot's smallest M), BN_GU / BN_DOWN output columns per program
# (gate_up covers gate and up columns n..n+BN together), SPLIT = K split of gate_up over H,
# FP8_DOT = tl.dot on the FP8 operands as stored (Hopper's FP8 MMA) rather than both converted to
# bf16 first. One config for every batch size: see the module docstring, item 3.
#
# FP8_DOT, H200, 40 layers of distinct experts in one graph (bench/moe_decode.py --quick, 2026-11-30):
# T = 1: 1.38 -> 1.03 ms; 8: 4.76 -> 3.08; 32: 11.5 -> 6.95; 128: 17.3 -> 10.5 (1.41x the byte
# floor). The conversion of every weight tile to bf16 in registers, not the bytes, was the limit.
# The products of two FP8 values are exact in F32 either way; the MMA sums each 128-wide K block
# before the F32 block scales apply (the §4.7 recipe), within 1e-3 of naive_moe_fp8 (tests).
# SHARED_KX: the shared expert's gate/up (moe_decode_pairs(shared=)) in SPLIT·SHARED_KX K ranges.
# DOWN_WARPS / DOWN_STAGES (optional): the down launch's own num_warps / num_stages (else the
# config's): its K is I = 512, four 128-wide steps against gate/up's sixteen. Neither changes a bit.
# BN 32 (was 64): the same tiles' sums and K split, so the same bits (tests/test_moe_decode.py),
# more programs in flight. H200, route + routed and shared experts + combine, 40 layers in one
# graph (bench/moe_decode.py --shared, session 12 run 5), ms at 1 / 8 / 32 / 64 / 128 rows:
# BN 64: 1.280 / 3.293 / 7.577 / 10.30 / 12.43; BN 32: 1.244 / 3.208 / 7.295 / 9.626 / 11.57.
# (2-warp programs won at 128 rows without the shared expert, 10.47 -> 9.34, but lost with it.)
# LAST_REDUCES: at one row (route_decode's lists and tickets), the last gate/up program of each
# 128-column group does the split reduce (_last_program_reduces): one launch fewer per layer, the
# same bits (the same reduce code on the same partials). DRAMA_MOE_LAST_REDUCES=0 turns it off.
# H200, route + experts (+ combine), 40 layers in one graph, one process (bench/moe_decode.py
# --shared --rows 1, session 18): 1.175 -> 1.142 ms (run 4); with the combine + norm launch
# timed too, 1.298 -> 1.228 (run 6). One ticket per group for both kinds (the last program
# reducing both tiles in turn) had measured 1.200 against the launch's 1.175 (run 3, two
# processes). The same trick for the combine + next norm inside down (its last programs per column
# block, then per row) gave the same bits but no time: 1.223 -> 1.228 (run 6); not kept.
DECODE_CONFIG = dict(BM=16, BN_GU=32, BN_DOWN=32, SPLIT=4, num_warps=4, num_stages=3, FP8_DOT=True, SHARED_KX=2,
                     LAST_REDUCES=env_switch("DRAMA_MOE_LAST_REDUCES") is not False)
REDUCE_TICKETS = 16     # tickets route_decode zeroes: a routed and a shared half of 128-column groups
# of gate/up each (I, I_s <= 1024)

# Padded prefill pieces (Backbone.prefill_graphs) have many pairs per expert. A row's bits depend
# on the tile shape (BM changes the MMA instruction: bench/moe_decode.py --prefill checks this and
# finds they differ), so the config is a function of the piece bucket alone, never of how many
# pieces a replay packs: a prompt gives the same bits alone or packed with others (issue #8).
# H200, ms per 40 layers at 256 / 512 / 768 / 1024 rows (--prefill, session 10 run 2): BM 16:
# 10.2 / 13.7 / 18.5 / 23.9; BM 32: 11.5 / 12.0 / 13.5 / 17.6; BM 64: 11.1 / 11.5 / 12.0 / 12.6.
# (Two BM-row tiles per weight read, one dot each, did not help: BM 16 x 2 17.5, BM 32 x 2 19.6
# at 1024 rows.)
#
# BM 64 runs on Hopper's warpgroup MMA (with FP8 operands Triton lowers a 64-row dot to wgmma),
# BM 16 and 32 on the per-warp MMA. The warpgroup MMA's FP8 sums are not exact F32: it keeps
# about 14 bits of the running sum (DeepSeek-V3 report, §3.3.2). Here every 128-wide K block is
# its own dot whose sum is promoted to F32 with the block's scales (the §4.7 recipe; the same
# promotion interval DeepSeek uses), so the error stays at one block's ~2^-14, below the bf16
# rounding of gate and up that follows. It shows in the output only where it flips one of the
# recipe's roundings (gate/up to bf16, h to FP8): 4.7e-3 of the largest output off
# naive_moe_fp8, 2.3e-7 for BM 16/32 (tests/test_moe_decode.py bounds each).
# So BM 64 serves only where it wins by milliseconds, the pieces of 768 and 1024 rows, and there
# batch invariance holds too: model.prefill_groups packs pieces only with pieces of the same MMA
# (`piece_mma`; these graphs hold one piece anyway). BM 16 and BM 32 pieces do share graphs, and
# give the same bits (tests/test_prefill_graphs.py).
# DOWN_WARPS 2 for 256-row pieces: down's short K (four steps) runs better in more, smaller
# programs; the same bits (session 12 run 2, bench/moe_decode.py --prefill --rows 256: 10.20 ->
# 9.89 ms per 40 layers).
# N_FAST (the column blocks of one expert launched one after another, so the programs in flight
# stream neighbouring rows of fewer experts) with BN_GU 32 for 256-row pieces, N_FAST for 512: the
# same bits (bench/moe_decode.py --prefill --rows 256 512, session 14 runs 2-3: 256 rows 9.87 ->
# 9.52 ms per 40 layers, 512 rows 11.47 -> 11.32; BN_GU 32 without N_FAST had lost in session
# 12). A plain read of gate/up in the kernel's access pattern reaches 3.8-4.2 TB/s, the kernel ~3.5.
SMALL_PIECE_CONFIG = dict(BM=16, BN_GU=32, BN_DOWN=64, SPLIT=1, num_warps=4, num_stages=3, FP8_DOT=True,
                          DOWN_WARPS=2, N_FAST=True)
# and for 512-row pieces (run 3): 11.92 -> 11.30 ms; BM 64 pieces keep 4 (2: 18.2 against 11.6)
LARGE_PIECE_CONFIG = dict(BM=32, BN_GU=64, BN_DOWN=64, SPLIT=1, num_warps=4, num_stages=3, FP8_DOT=True,
                          DOWN_WARPS=2, N_FAST=True)
WIDE_PIECE_CONFIG = dict(BM=64, BN_GU=64, BN_DOWN=64, SPLIT=1, num_warps=4, num_stages=3, FP8_DOT=True)
LARGE_PIECE_ROWS = 512       # pieces of this many rows and more: 16+ pairs per expert on average
WIDE_PIECE_ROWS = 768        # and from here on: 24+


def piece_config(bucket: int) -> dict:
    """The moe_decode config of a padded prefill piece of `bucket` rows (see above)."""
    if bucket >= WIDE_PIECE_ROWS:
        return WIDE_PIECE_CONFIG
    return LARGE_PIECE_CONFIG if bucket >= LARGE_PIECE_ROWS else SMALL_PIECE_CONFIG


def piece_mma(bucket: int) -> str:
    """The MMA a piece of `bucket` rows runs its routed experts on: "warpgroup" (BM 64 with FP8
    operands) or "warp" (BM 16, 32). Pieces of the same MMA give a row the same bits in each
    other's graphs (model.prefill_groups packs only those together); across the two they do not."""
    config = piece_config(bucket)
    return "warpgroup" if config["BM"] >= 64 and config.get("FP8_DOT", False) else "warp"


if HAS_TRITON:

    @triton.jit
    def _expert_lists_kernel(ids_ptr, counts_ptr, lists_ptr, active_ptr, num_active_ptr, n, T,
                             NP: tl.constexpr, PDL: tl.constexpr = False):
        """Program e: pair indices p (ascending) with ids[p] == e -> lists[e, :count], counts[e];
        a non-empty expert appends itself to `active` (num_active must be 0 before the launch)."""
        pdl_prologue(PDL)
        e = tl.program_id(0)
        p = tl.arange(0, NP)
        ids = tl.load(ids_ptr + p, mask=p < n, other=-1)
        hit = ids == e
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        count = tl.sum(hit.to(tl.int32), axis=0)
        tl.store(lists_ptr + e * T + rank, p, mask=hit)
        tl.store(counts_ptr + e, count)
        slot = tl.atomic_add(num_active_ptr, 1, mask=count > 0)
        tl.store(active_ptr + slot, e, mask=count > 0)

    @triton.jit
    def _slot_and_column_block(N_FAST: tl.constexpr):
        """(expert slot, column block) of this program. The grid is (slots, column blocks) or, with
        N_FAST, (column blocks, slots): the launch order only, never what a program computes."""
        if N_FAST:
            return tl.program_id(1), tl.program_id(0)
        return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def _shared_gate_up(u_ptr, stride_u, w_ptr, ws_ptr, T, H, IS, pid_n, r0, k_first, k_last,
                        BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        """The shared expert's share of _gate_up_kernel: partial gate and up sums of rows
        r0..r0+BM-1 (BN columns each, K blocks k_first..k_last-1) in BF16 -> ws[t, n] and
        ws[t, IS + n], F32 (ws: this K range's [T, 2·IS]). w: [2·IS, H] (gate rows, then up rows),
        unit stride along H."""
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < IS
        offs_k = tl.arange(0, 128)
        w_gate = w_ptr + offs_n.to(tl.int64)[:, None] * H
        w_up = w_gate + IS * H
        r = r0 + tl.arange(0, BM)
        r_ok = r < T
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(k_first, k_last):
            kk = kb * 128 + offs_k
            k_ok = kk < H
            x = tl.load(u_ptr + r.to(tl.int64)[:, None] * stride_u + kk[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            wm = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_gate + kk[None, :], mask=wm, other=0.0).to(DOT)
            wu = tl.load(w_up + kk[None, :], mask=wm, other=0.0).to(DOT)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PREC)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PREC)
        out = ws_ptr + r.to(tl.int64)[:, None] * (2 * IS) + offs_n[None, :]
        mask = r_ok[:, None] & n_ok[None, :]
        tl.store(out, acc_g, mask=mask)
        tl.store(out + IS, acc_u, mask=mask)

    @triton.jit
    def _gate_up_kernel(xq_ptr, xa_ptr, w_ptr, s_ptr, ws_ptr, counts_ptr, lists_ptr, active_ptr,
                        num_active_ptr, n_pairs, top_k, T, H, I, SG,
                        stride_we, stride_wn, stride_se, stride_sn,
                        u_ptr, stride_u, sw_ptr, wss_ptr, IS, shared_slot,
                        tickets_ptr, arrivals, shared_tickets_ptr, shared_arrivals, hq_ptr, ha_ptr, hs_ptr,
                        BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                        PREC: tl.constexpr, FP8_DOT: tl.constexpr, SHARED: tl.constexpr, KX: tl.constexpr,
                        REDUCE: tl.constexpr = 0, N_FAST: tl.constexpr = False, PDL: tl.constexpr = False):
        """Partial gate and up sums of one active expert, BN columns each, over H/SPLIT:
        ws[split, p, n] (gate) and ws[split, p, I + n] (up), F32, for every pair p of the expert.
        SHARED: the slots from `shared_slot` on (after every expert slot) do the same for the
        shared expert (BF16 weights sw, rows u) into wss [SPLIT·KX, T, 2·IS]: one BM-row tile and
        one of SPLIT·KX K ranges per program (_shared_gate_up; its bf16 weights are twice the
        bytes of an FP8 expert's, so KX = 2 evens the programs out).
        REDUCE (> 0: a power of two >= the pairs and the rows): the split reduce's work is done
        here too, by the last program of each kind (routed, shared) to finish each 128-column
        group (_last_program_reduces), in tiles of REDUCE rows, not by a launch of its own."""
        pdl_prologue(PDL)
        slot, pid_n = _slot_and_column_block(N_FAST)
        pid_k = tl.program_id(2)
        _gate_up_program(xq_ptr, xa_ptr, w_ptr, s_ptr, ws_ptr, counts_ptr, lists_ptr, active_ptr,
                         num_active_ptr, n_pairs, top_k, T, H, I, SG, stride_we, stride_wn, stride_se, stride_sn,
                         u_ptr, stride_u, sw_ptr, wss_ptr, IS, shared_slot, slot, pid_n, pid_k,
                         BM, BN, SPLIT, DOT, PREC, FP8_DOT, SHARED, KX)
        if REDUCE > 0:
            _last_program_reduces(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, tickets_ptr, arrivals,
                                  shared_tickets_ptr, shared_arrivals, (pid_n * BN) // 128,
                                  slot >= shared_slot, SPLIT, SPLIT * KX, SHARED, REDUCE)

    @triton.jit
    def _last_program_reduces(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, tickets_ptr, arrivals,
                              shared_tickets_ptr, shared_arrivals, g, is_shared, SPLIT: tl.constexpr,
                              SHARED_SPLIT: tl.constexpr, SHARED: tl.constexpr, BM: tl.constexpr):
        """Take a ticket for 128-column group g: the routed experts' programs from `tickets`, the
        shared expert's (is_shared) from `shared_tickets`. The program that draws the last of its
        group's `arrivals` (`shared_arrivals`: every program of that kind whose columns fall in g,
        whatever it computed) does _split_reduce_shared_kernel's tile for it: the pairs' (one:
        n_pairs <= BM) or the shared expert's (T <= BM). The same code on the same partials, so the
        same bits as the separate launch (a tile's height changes no sum: the reduce adds along
        splits, the quantiser's amax runs along a row). The step's routing launch zeroes the
        tickets (route_decode), and the last program zeroes its own again, so the route may serve
        another launch.

        Ordering: the barrier puts every thread's partial-sum stores before the ticket's release
        (acq_rel at GPU scope, as CUTLASS's split-K semaphore does); the last program's acquire
        then makes every other program's stores visible, and it reads them from L2 (".cg"),
        never from a line this SM's L1 may hold from an earlier layer's reduce."""
        tl.debug_barrier()
        if SHARED and is_shared:
            ticket = tl.atomic_add(shared_tickets_ptr + g, 1, sem="acq_rel", scope="gpu")
            if ticket == shared_arrivals - 1:
                tl.store(shared_tickets_ptr + g, 0)
                _reduce_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, 1, g, 1,
                             SPLIT, SHARED_SPLIT, BM, ".cg")
        else:
            ticket = tl.atomic_add(tickets_ptr + g, 1, sem="acq_rel", scope="gpu")
            if ticket == arrivals - 1:
                tl.store(tickets_ptr + g, 0)
                _reduce_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, 0, g, 1,
                             SPLIT, SHARED_SPLIT, BM, ".cg")

    @triton.jit
    def _gate_up_program(xq_ptr, xa_ptr, w_ptr, s_ptr, ws_ptr, counts_ptr, lists_ptr, active_ptr,
                         num_active_ptr, n_pairs, top_k, T, H, I, SG, stride_we, stride_wn, stride_se, stride_sn,
                         u_ptr, stride_u, sw_ptr, wss_ptr, IS, shared_slot, slot, pid_n, pid_k,
                         BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                         PREC: tl.constexpr, FP8_DOT: tl.constexpr, SHARED: tl.constexpr, KX: tl.constexpr):
        """_gate_up_kernel's sums for program (slot, pid_n, pid_k)."""
        G = tl.cdiv(H, 128)
        if SHARED:
            if slot >= shared_slot:
                if pid_n * BN < IS:
                    tile, sub = (slot - shared_slot) // KX, (slot - shared_slot) % KX
                    per_s = tl.cdiv(G, SPLIT * KX)
                    first = (pid_k * KX + sub) * per_s
                    _shared_gate_up(u_ptr, stride_u, sw_ptr, wss_ptr + (pid_k * KX + sub) * T * (2 * IS), T, H,
                                    IS, pid_n, tile * BM, first, tl.minimum(G, first + per_s), BM, BN, DOT, PREC)
                return
        per = tl.cdiv(G, SPLIT)
        k_first = pid_k * per
        k_last = tl.minimum(G, k_first + per)
        if slot >= tl.load(num_active_ptr) or pid_n * BN >= I:
            return
        expert = tl.load(active_ptr + slot)
        count = tl.load(counts_ptr + expert)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < I
        offs_k = tl.arange(0, 128)
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        w_up = w_gate + I * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
        for r0 in range(0, count, BM):
            r = r0 + tl.arange(0, BM)
            r_ok = r < count
            pairs = tl.load(lists_ptr + expert * T + r, mask=r_ok, other=0)
            tokens = (pairs // top_k).to(tl.int64)
            acc_g = tl.zeros([BM, BN], dtype=tl.float32)
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
            for kb in range(k_first, k_last):
                kk = kb * 128 + offs_k
                k_ok = kk < H
                xq = tl.load(xq_ptr + tokens[:, None] * H + kk[None, :],
                             mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(xa_ptr + tokens * G + kb, mask=r_ok, other=0.0)
                wm = n_ok[:, None] & k_ok[None, :]
                wg = tl.load(w_gate + kk[None, :], mask=wm, other=0.0)
                wu = tl.load(w_up + kk[None, :], mask=wm, other=0.0)
                if not FP8_DOT:
                    xq, wg, wu = xq.to(DOT), wg.to(DOT), wu.to(DOT)
                sg = tl.load(s_base + kb).to(tl.float32)
                su = tl.load(s_base + SG * stride_sn + kb).to(tl.float32)
                acc_g += tl.dot(xq, tl.trans(wg), input_precision=PREC) * a[:, None] * sg
                acc_u += tl.dot(xq, tl.trans(wu), input_precision=PREC) * a[:, None] * su
            out = ws_ptr + (pid_k * n_pairs + pairs.to(tl.int64)[:, None]) * (2 * I) + offs_n[None, :]
            mask = r_ok[:, None] & n_ok[None, :]
            tl.store(out, acc_g, mask=mask)
            tl.store(out + I, acc_u, mask=mask)

    @triton.jit
    def _shared_down(hs_ptr, w_ptr, out_ptr, T, H, IS, pid_n, r0,
                     BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        """The shared expert's share of _down_kernel: out[t, n] = Σ_i hs[t, i]·w[n, i] in F32
        (BF16 hs [T, IS] and w [H, IS], unweighted) for rows r0..r0+BM-1 and BN hidden columns."""
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < H
        offs_k = tl.arange(0, 128)
        w_base = w_ptr + offs_n.to(tl.int64)[:, None] * IS
        r = r0 + tl.arange(0, BM)
        r_ok = r < T
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, tl.cdiv(IS, 128)):
            kk = kb * 128 + offs_k
            k_ok = kk < IS
            x = tl.load(hs_ptr + r.to(tl.int64)[:, None] * IS + kk[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            w = tl.load(w_base + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * H + offs_n[None, :], acc,
                 mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(hq_ptr, ha_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, counts_ptr, lists_ptr, active_ptr,
                     num_active_ptr, T, H, I,
                     stride_we, stride_wn, stride_se, stride_sn,
                     hs_ptr, sw_ptr, shared_out_ptr, IS, shared_slot,
                     BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
                     PREC: tl.constexpr, FP8_DOT: tl.constexpr, SHARED: tl.constexpr,
                     N_FAST: tl.constexpr = False, PRELOAD: tl.constexpr = 0, PDL: tl.constexpr = False):
        """out[p, n] = w_p · fp8_linear(h[p], down_e)[n], F32, for every pair p of one active
        expert and BN hidden columns (h pre-quantised per 1x128 group). SHARED: the slots from
        `shared_slot` on apply the shared expert's down to hs, one BM-row tile each (_shared_down).
        PRELOAD (1-4: I's 128-wide K blocks, all of them): a routed program reads its expert and
        loads its weight tiles and scales before the PDL wait. The expert lists come from the
        routing (or expert_lists) launch, which has finished once this kernel runs: only gate/up
        or the split reduce, which write h, run between (kernels/__init__.PDL_PRELOAD). The same
        dots in the same order, so the same bits."""
        slot, pid_n = _slot_and_column_block(N_FAST)
        if PRELOAD > 0:
            routed = slot < tl.load(num_active_ptr, cache_modifier=".cg")
            if SHARED:
                routed = routed & (slot < shared_slot)
            expert = tl.load(active_ptr + slot, mask=routed, other=0, cache_modifier=".cg")   # .cg: L2's copy
            offs_n = pid_n * BN + tl.arange(0, BN)
            w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
            s_base = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
            # (the routed flag widened first: Triton's interpreter refuses the mask otherwise)
            w_ok = (tl.full([BN, 1], 1, tl.int1) & routed) & (offs_n < H)[:, None]
            w0 = _down_tile(w_base, w_ok, 0, I)
            s0 = tl.load(s_base, mask=routed, other=0.0).to(tl.float32)
            if PRELOAD > 1:
                w1 = _down_tile(w_base, w_ok, 1, I)
                s1 = tl.load(s_base + 1, mask=routed, other=0.0).to(tl.float32)
            if PRELOAD > 2:
                w2 = _down_tile(w_base, w_ok, 2, I)
                s2 = tl.load(s_base + 2, mask=routed, other=0.0).to(tl.float32)
            if PRELOAD > 3:
                w3 = _down_tile(w_base, w_ok, 3, I)
                s3 = tl.load(s_base + 3, mask=routed, other=0.0).to(tl.float32)
        pdl_prologue(PDL)
        if SHARED:
            if slot >= shared_slot:
                _shared_down(hs_ptr, sw_ptr, shared_out_ptr, T, H, IS, pid_n, (slot - shared_slot) * BM,
                             BM, BN, DOT, PREC)
                return
        if slot >= tl.load(num_active_ptr):
            return
        expert = tl.load(active_ptr + slot)
        count = tl.load(counts_ptr + expert)
        G = tl.cdiv(I, 128)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < H
        offs_k = tl.arange(0, 128)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BN) // 128) * stride_sn
        for r0 in range(0, count, BM):
            r = r0 + tl.arange(0, BM)
            r_ok = r < count
            pairs = tl.load(lists_ptr + expert * T + r, mask=r_ok, other=0).to(tl.int64)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            if PRELOAD > 0:        # every K block preloaded (the launch checks PRELOAD = G)
                acc = _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, 0, I, G, w0, s0, DOT, PREC, FP8_DOT)
                if PRELOAD > 1:
                    acc = _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, 1, I, G, w1, s1, DOT, PREC, FP8_DOT)
                if PRELOAD > 2:
                    acc = _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, 2, I, G, w2, s2, DOT, PREC, FP8_DOT)
                if PRELOAD > 3:
                    acc = _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, 3, I, G, w3, s3, DOT, PREC, FP8_DOT)
            else:
                for kb in range(0, G):
                    kk = kb * 128 + offs_k
                    w = tl.load(w_base + kk[None, :], mask=n_ok[:, None] & (kk < I)[None, :], other=0.0)
                    s = tl.load(s_base + kb).to(tl.float32)
                    acc = _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, kb, I, G, w, s, DOT, PREC, FP8_DOT)
            rw = tl.load(weights_ptr + pairs, mask=r_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + pairs[:, None] * H + offs_n[None, :], acc * rw[:, None],
                     mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_tile(w_base, w_ok, kb, I):
        """K block kb of a down program's weight rows [BN, 128] (past I zeros)."""
        kk = kb * 128 + tl.arange(0, 128)
        return tl.load(w_base + kk[None, :], mask=w_ok & (kk < I)[None, :], other=0.0)

    @triton.jit
    def _down_step(acc, hq_ptr, ha_ptr, pairs, r_ok, kb, I, G, w, s, DOT: tl.constexpr, PREC: tl.constexpr,
                   FP8_DOT: tl.constexpr):
        """acc + K block kb of the pairs' h (quantised, group scale a) times w (block scale s)."""
        kk = kb * 128 + tl.arange(0, 128)
        hq = tl.load(hq_ptr + pairs[:, None] * I + kk[None, :], mask=r_ok[:, None] & (kk < I)[None, :], other=0.0)
        a = tl.load(ha_ptr + pairs * G + kb, mask=r_ok, other=0.0)
        if not FP8_DOT:
            hq, w = hq.to(DOT), w.to(DOT)
        return acc + tl.dot(hq, tl.trans(w), input_precision=PREC) * a[:, None] * s

    @triton.jit
    def _split_reduce_shared_kernel(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, pair_blocks,
                                    SPLIT: tl.constexpr, SHARED_SPLIT: tl.constexpr, BM: tl.constexpr,
                                    PDL: tl.constexpr = False):
        """fp8_moe._split_reduce_quant_kernel for the routed pairs (row blocks < pair_blocks), and
        for the shared expert's rows (the blocks after them): the same split-order sum and
        bf16(silu(bf16 gate)·bf16 up), stored as BF16 hs [T, IS] (the shared down is BF16: no
        quantisation)."""
        pdl_prologue(PDL)
        _reduce_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, tl.program_id(0), tl.program_id(1),
                     pair_blocks, SPLIT, SHARED_SPLIT, BM, "")

    @triton.jit
    def _reduce_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, wss_ptr, hs_ptr, T, IS, pid_m, g, pair_blocks,
                     SPLIT: tl.constexpr, SHARED_SPLIT: tl.constexpr, BM: tl.constexpr, CACHE: tl.constexpr):
        """_split_reduce_shared_kernel's tile (pid_m, g); CACHE: the partials' loads' (fp8_moe._split_swiglu)."""
        if pid_m < pair_blocks:
            if g * 128 < I:
                fp8_moe._split_reduce_quant_tile(ws_ptr, hq_ptr, ha_ptr, n_pairs, I, pid_m, g, SPLIT, BM, CACHE)
        else:
            if g * 128 < IS:
                cols = g * 128 + tl.arange(0, 128)
                rows = (pid_m - pair_blocks) * BM + tl.arange(0, BM)
                act, ok = fp8_moe._split_swiglu(wss_ptr, rows, cols, T, IS, SHARED_SPLIT, BM, CACHE)
                tl.store(hs_ptr + rows.to(tl.int64)[:, None] * IS + cols[None, :], act.to(tl.bfloat16), mask=ok)


if HAS_TRITON:

    @triton.jit
    def _router_w(w_ptr, experts, e_ok, k0, H, BK: tl.constexpr):
        """W[experts, k0:k0+BK] (past H zeros): one BK step's router weights."""
        ks = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + experts[:, None] * H + ks[None, :], mask=e_ok[:, None] & (ks < H)[None, :], other=0.0)

    @triton.jit
    def _router_step(acc, u_ptr, w, rows, r_ok, k0, H, stride_u, BK: tl.constexpr, DOT: tl.constexpr):
        """One BK step of _router_partial_kernel at K offset k0: acc + u[rows, k0:k0+BK]·w (its _router_w)."""
        ks = k0 + tl.arange(0, BK)
        u = tl.load(u_ptr + rows.to(tl.int64)[:, None] * stride_u + ks[None, :],
                    mask=r_ok[:, None] & (ks < H)[None, :], other=0.0).to(tl.float32)
        if DOT:
            acc = tl.dot(u, tl.trans(w), acc, input_precision="ieee")
        else:
            acc += u[:, None, :] * w[None, :, :]
        return acc

    @triton.jit
    def _router_partial_kernel(u_ptr, w_ptr, ws_ptr, M, H, E, stride_u,
                               KR: tl.constexpr, RB: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                               DOT: tl.constexpr, UNROLL: tl.constexpr, PRELOAD: tl.constexpr = False,
                               PDL: tl.constexpr = False):
        """ws[s, m, e] = Σ_{h in K range s} u[m, h]·W[e, h] in F32 (IEEE products and sums, never
        TF32: §4.6), for RB rows and BE experts; u bf16 or F32 is widened in registers.
        Every shape here is a constexpr fixed by the weight, never by M: a row's partials are the
        same instructions on the same values whichever program and tile it lands in.
        UNROLL: the KR/BK steps written out (tl.static_range), so every step's loads can be in
        flight at once; the loop form may wait for each step's load in turn. The same products
        and sums in the same order either way.
        PRELOAD (KR <= 4·BK): the program's weights, all its steps', are loaded before it waits
        for the kernel before it (pdl_prologue): no kernel of a step writes them, and under PDL the
        program is resident while that kernel (the norm that makes u) still runs. The same steps
        after the wait, so the same bits."""
        rg, eb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = rg * RB + tl.arange(0, RB)
        r_ok = rows < M
        experts = eb * BE + tl.arange(0, BE)
        e_ok = experts < E
        # DOT: an IEEE F32 tl.dot (an FMA chain over k); else products accumulated lane by lane
        # over the K steps and summed across the BK lanes once
        acc = tl.zeros([RB, BE], dtype=tl.float32) if DOT else tl.zeros([RB, BE, BK], dtype=tl.float32)
        if PRELOAD:
            tl.static_assert(KR <= 4 * BK, "PRELOAD holds at most four K steps of weights")
            w0 = _router_w(w_ptr, experts, e_ok, s * KR, H, BK)
            if KR > BK:
                w1 = _router_w(w_ptr, experts, e_ok, s * KR + BK, H, BK)
            if KR > 2 * BK:
                w2 = _router_w(w_ptr, experts, e_ok, s * KR + 2 * BK, H, BK)
            if KR > 3 * BK:
                w3 = _router_w(w_ptr, experts, e_ok, s * KR + 3 * BK, H, BK)
            pdl_prologue(PDL)
            acc = _router_step(acc, u_ptr, w0, rows, r_ok, s * KR, H, stride_u, BK, DOT)
            if KR > BK:
                acc = _router_step(acc, u_ptr, w1, rows, r_ok, s * KR + BK, H, stride_u, BK, DOT)
            if KR > 2 * BK:
                acc = _router_step(acc, u_ptr, w2, rows, r_ok, s * KR + 2 * BK, H, stride_u, BK, DOT)
            if KR > 3 * BK:
                acc = _router_step(acc, u_ptr, w3, rows, r_ok, s * KR + 3 * BK, H, stride_u, BK, DOT)
        elif UNROLL:
            pdl_prologue(PDL)
            for i in tl.static_range(0, KR, BK):
                w = _router_w(w_ptr, experts, e_ok, s * KR + i, H, BK)
                acc = _router_step(acc, u_ptr, w, rows, r_ok, s * KR + i, H, stride_u, BK, DOT)
        else:
            pdl_prologue(PDL)
            for k0 in range(s * KR, s * KR + KR, BK):
                w = _router_w(w_ptr, experts, e_ok, k0, H, BK)
                acc = _router_step(acc, u_ptr, w, rows, r_ok, k0, H, stride_u, BK, DOT)
        logits = acc if DOT else tl.sum(acc, axis=2)
        tl.store(ws_ptr + (s * M + rows.to(tl.int64)[:, None]) * E + experts[None, :], logits,
                 mask=r_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _route_quant_kernel(ws_ptr, u_ptr, ids_ptr, w_ptr, xq_ptr, xa_ptr, num_active_ptr, M, H, E, K, stride_u,
                            stride_ws, sg_ptr, gl_ptr, counts_ptr, lists_ptr, active_ptr, tickets_ptr,
                            S: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                            GP: tl.constexpr, GATE: tl.constexpr, KEYED_TOPK: tl.constexpr, LISTS: tl.constexpr = False,
                            TICKETS: tl.constexpr = 16, PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
        """Row t: its logits = the S partials ws[s, t] (row stride stride_ws, S = 1: the logits
        themselves) added in order 0, 1, ..; fp8_moe._softmax_topk (KEYED_TOPK, else its two-reduction
        form _softmax_topk_argmax: the same bits) -> ids, bf16 weights; its §4.7
        quantisation for gate/up (fp8_moe._quant_tile, one 128-group per tile row) -> xq, xa.
        GATE: also the shared expert's gate logit u·sg (F32 products, a fixed sum tree, rounded to
        bf16 as the BF16 linear rounds its output) -> gl[t]. Program 0 also zeroes num_active
        for expert_lists; or, LISTS (M = 1, K <= E), writes what expert_lists would: the row's K
        picks are K distinct experts (a pick removes its expert from the next), pair j the one
        pair of expert ids[j], slot j in the active list; and zeroes the TICKETS tickets of the
        split reduce inside gate/up (_last_program_reduces).
        PRELOAD: u's quantisation and the shared gate's logit computed before the PDL wait: u
        comes from the norm before the router's GEMV, which has finished once this kernel runs
        (kernels/__init__.PDL_PRELOAD); the same arithmetic, so the same bits."""
        t = tl.program_id(0)
        groups = tl.arange(0, GP)
        cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
        if PRELOAD:
            xq, a, gate = _quant_and_gate(u_ptr, sg_ptr, t, H, stride_u, cols, GATE)
        pdl_prologue(PDL)
        if not LISTS:
            if t == 0:
                tl.store(num_active_ptr, 0)
        offs = tl.arange(0, BE)
        ok = offs < E
        logit = tl.load(ws_ptr + t * stride_ws + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, S):
            logit += tl.load(ws_ptr + (s * M + t) * stride_ws + offs, mask=ok, other=0.0)
        if KEYED_TOPK:
            ids, ws = fp8_moe._softmax_topk(logit, offs, ok, E, K, KP, BE)
        else:
            ids, ws = fp8_moe._softmax_topk_argmax(logit, offs, ok, E, K, KP, BE)
        slots = tl.arange(0, KP)
        tl.store(ids_ptr + t * K + slots, ids, mask=slots < K)
        tl.store(w_ptr + t * K + slots, ws.to(tl.bfloat16), mask=slots < K)
        if LISTS:
            tl.store(counts_ptr + ids, tl.full([KP], 1, tl.int32), mask=slots < K)
            tl.store(lists_ptr + ids, slots, mask=slots < K)          # lists[e, 0]: T = 1
            tl.store(active_ptr + slots, ids, mask=slots < K)
            tl.store(num_active_ptr, K)
            tl.store(tickets_ptr + tl.arange(0, TICKETS), tl.zeros([TICKETS], tl.int32))
        g_count = tl.cdiv(H, 128)
        if not PRELOAD:
            xq, a, gate = _quant_and_gate(u_ptr, sg_ptr, t, H, stride_u, cols, GATE)
        tl.store(xq_ptr + t.to(tl.int64) * H + cols, xq.to(tl.float8e4nv), mask=cols < H)
        tl.store(xa_ptr + t * g_count + groups, a, mask=groups < g_count)
        if GATE:
            tl.store(gl_ptr + t, gate.to(tl.bfloat16))

    @triton.jit
    def _quant_and_gate(u_ptr, sg_ptr, t, H, stride_u, cols, GATE: tl.constexpr):
        """Row t of u: its §4.7 quantisation (fp8_moe._quant_tile: values, group scales) and, with
        GATE, the shared expert's gate logit u·sg in F32 (a fixed sum tree; 0 without GATE)."""
        # .cg: u from L2 (before the wait, never a stale line of this SM's L1)
        x = tl.load(u_ptr + t.to(tl.int64) * stride_u + cols, mask=cols < H, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        xq, a = fp8_moe._quant_tile(x)
        gate = 0.0
        if GATE:
            sg = tl.load(sg_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            gate = tl.sum(tl.sum(x * sg, axis=1), axis=0)
        return xq, a, gate



# The decode router's GEMV layout: RB rows x BE experts per program over one of SPLIT K ranges
# (BK per step; UNROLL: the steps written out, see _router_partial_kernel). One layout for every
# row count (issue #8). UNROLL changes when loads are issued, not the arithmetic: the same logits
# bits as the loop form (bench/router_decode.py checks them against it on the GPU).
ROUTER_LAYOUT = dict(RB=8, BE=16, BK=32, SPLIT=16, UNROLL=True)
# The GEMV's weights loaded before its PDL wait (_router_partial_kernel's PRELOAD; DRAMA_PDL_PRELOAD,
# see kernels/__init__); a layout's PRELOAD key overrides it
ROUTER_PRELOAD = PDL_PRELOAD
# the routing launch's quantisation of u and shared gate logit before its PDL wait (_route_quant_kernel's
# PRELOAD; DRAMA_PDL_PRELOAD); a route_config's PRELOAD key overrides it
ROUTE_PRELOAD = PDL_PRELOAD
# the down launch's expert weights and scales loaded before its PDL wait (_down_kernel's PRELOAD;
# DRAMA_PDL_PRELOAD), for one row (the single-stream decode step: H200, session 28 run 4, the
# step 2.37 -> 2.33 ms with the combine's); a config's DOWN_PRELOAD key overrides it. Prefill
# pieces lost with it (256 rows 15.4 -> 18.9 ms: 5 programs per SM instead of 8).
DOWN_PRELOAD = PDL_PRELOAD

# The routing launch (_route_quant_kernel, one program per row). KEYED_TOPK: one block reduction
# per pick (fp8_moe._softmax_topk) instead of two (_softmax_topk_argmax); the same ids and weights
# bit for bit on every row that is not NaN. num_warps: fewer warps make each block reduction warp
# shuffles without shared memory and barriers, but may sum the softmax's denominator, the
# renormalisation and the shared gate's dot in another order (the last bit of weights and gate
# logit; ids only where two experts' p are within a rounding). One value for every row count
# (issue #8); bench/router_decode.py --route-warps 4 2 1 times them and prints which bits differ.
# H200 (session 8), router GEMV + routing launch, µs per layer at T = 1 / 128: 4 warps keyed
# 10.72 / 29.17 (argmax 11.26 / 29.47); 2 warps 11.26 / 29.68; 1 warp 12.43 / 30.89.
ROUTE_CONFIG = dict(num_warps=4, KEYED_TOPK=True)

# Padded prefill pieces' router logits as partial sums over K ranges (F32, cuBLAS): router_partials.
# One cuBLAS SGEMM of [256, 2048] x [2048, 256] has 16 output tiles, so cuBLAS splits K itself and
# reduces in a kernel of its own; as one strided-batched GEMM over `piece_router_split(tile)` ranges
# the partials go straight to the routing launch, which adds them in range order as it adds the
# decode GEMV's. H200 (session 15 run 2, timed as `bench/prefill_parts.py --parts router` does: u's
# F32 copy + GEMM + routing launch, µs per layer): 256-row tiles 23.9 -> 19.6 (split 16; 8: 23.0,
# 32: 20.0); 512 rows in 256-row tiles 44.0 -> 35.0; one 1024-row tile 49.9 -> 46.2 (split 8; 16: 48.6).
def piece_router_split(tile: int) -> int:
    """K ranges of a piece's router GEMM for `tile` rows per GEMM (a function of the piece's
    bucket only, so of nothing another session's rows decide: issue #8)."""
    return 16 if tile <= 512 else 8


class DecodeRoute(NamedTuple):
    """What route_decode hands to moe_decode_pairs: the step's routing and quantised rows."""
    ids: torch.Tensor            # int32 [T, k]
    weights: torch.Tensor        # bf16 [T, k], renormalised
    xq: torch.Tensor             # float8_e4m3fn [T, H]: §4.7 quantisation of u
    xa: torch.Tensor             # F32 [T, ⌈H/128⌉]
    num_active: torch.Tensor     # int32 [1], zeroed for expert_lists (or counted, with lists)
    shared_gate_logit: torch.Tensor | None = None   # bf16 [T]: u·shared_expert_gate, when asked
    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # expert_lists' (counts,
    # lists, active), written by the routing launch itself for one row (route_decode)
    tickets: torch.Tensor | None = None      # int32 [REDUCE_TICKETS], zeroed with `lists`: one per
    # 128-column group of gate/up and kind (routed, shared), for the split reduce inside gate/up


def route_decode_reference(u: torch.Tensor, router_weight: torch.Tensor, k: int,
                           shared_gate: torch.Tensor | None = None) -> DecodeRoute:
    """route_decode with torch ops: F32 logits, fp8_moe.router_topk_reference, quantize_rows_fp8,
    the shared expert's gate logit as an F32 product rounded to bf16."""
    ids, weights = fp8_moe.router_topk_reference(u.float() @ router_weight.float().T, k)
    xq, xa = fp8_moe.quantize_rows_fp8(u)
    gate = None if shared_gate is None else (u.float() @ shared_gate.float()).to(torch.bfloat16)
    return DecodeRoute(ids, weights, xq, xa, torch.zeros(1, dtype=torch.int32, device=u.device), gate)


def router_partials(u: torch.Tensor, router_weight: torch.Tensor, tile: int,
                    split: int | None = None) -> torch.Tensor:
    """F32 router logits of u [T, H] (bf16 or F32) as `split` partial sums [split, T, E] over
    consecutive K ranges of H/split (piece_router_split(tile) unless given; route_decode(logits=)
    adds them in range order): one strided-batched cuBLAS GEMM per `tile` rows, IEEE F32 products
    and sums (MODEL.md §4.6; torch leaves TF32 off for matmuls).

    Batch invariance (issue #8) as invariant.linear_rows: each GEMM holds `tile` rows (a piece's
    gemm_rows, model.piece_gemm_rows, so rows of one piece at their positions in it), and its
    shape, so cuBLAS's kernel and each element's summation order, depends on `tile`, `split` and
    the router's shape only (tests/test_moe_decode.py puts one row at every position). A split
    that does not divide H falls back to 1 range (the tiny test configs)."""
    t, h = u.shape
    e = router_weight.shape[0]
    split = piece_router_split(tile) if split is None else split
    if split < 1 or h % split:
        split = 1
    kr = h // split
    u32 = u.float()
    a = u32.view(t, split, kr).transpose(0, 1)                       # [split, T, kr], row stride H
    w = router_weight.view(e, split, kr).permute(1, 2, 0)            # [split, kr, E], column-major
    out = torch.empty(split, t, e, dtype=torch.float32, device=u.device)
    for i in range(0, t, tile):
        torch.bmm(a[:, i:i + tile], w, out=out[:, i:i + tile])
    return out


def route_decode(u: torch.Tensor, router_weight: torch.Tensor, k: int, logits: torch.Tensor | None = None,
                 layout: dict | None = None, shared_gate: torch.Tensor | None = None,
                 route_config: dict | None = None) -> DecodeRoute:
    """The front of a decode step's MoE in two launches, for u [T, H] (bf16, CUDA) and the F32
    router [E, H]: the router GEMV as ROUTER_SPLIT partial sums, then one program per row that
    adds them, routes (softmax, top-k, renormalise) and quantises the row for gate/up.

    It replaces six launches per layer (u's F32 copy, the router GEMM padded to 128 rows, top-k,
    the bf16 cast of the weights, the quantiser, the zeroing of num_active). Logits are F32 sums in a
    fixed order; they may differ from cuBLAS's in the last bits, which can flip a near-tie in the
    routing: decode rows and prefill rows take different router kernels, each batch-invariant.
    `logits` (F32 [T, E], or [S, T, E] partial sums over S K ranges, unit stride along E):
    computed by the caller; then one launch (padded prefill pieces pass `router_partials`:
    moe.SparseMoE.forward_kernels).
    `layout`: the GEMV's, ROUTER_LAYOUT unless given; `route_config`: the routing launch's, keys
    given override ROUTE_CONFIG's (bench/router_decode.py compares them).
    `shared_gate` ([H], the shared expert's scalar gate): its logit per row comes out of the
    routing launch too (DecodeRoute.shared_gate_logit), for moe_decode_pairs(shared=...).
    One row (the single-stream decode step): the routing launch also writes expert_lists'
    output (DecodeRoute.lists), so moe_decode_pairs skips that launch: one program knows the
    whole step's routing. The same lists as expert_lists' (the slot order aside, which nothing
    reads)."""
    if not use_triton(u, router_weight):
        return route_decode_reference(u, router_weight, k, shared_gate)
    t, h = u.shape
    e = router_weight.shape[0]
    if router_weight.dtype != torch.float32 or router_weight.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError("route_decode needs an F32 router [E, H] and u with unit stride along H")
    dev = u.device
    route = {**ROUTE_CONFIG, **(route_config or {})}
    if logits is None:
        lay = layout or ROUTER_LAYOUT
        k_range = triton.cdiv(triton.cdiv(h, lay["SPLIT"]), lay["BK"]) * lay["BK"]
        split = triton.cdiv(h, k_range)
        preload = bool(lay.get("PRELOAD", ROUTER_PRELOAD)) and k_range <= 4 * lay["BK"]
        partials = torch.empty(split, t, e, dtype=torch.float32, device=dev)
        _router_partial_kernel[(triton.cdiv(t, lay["RB"]), triton.cdiv(e, lay["BE"]), split)](
            u, router_weight, partials, t, h, e, u.stride(0), KR=k_range,
            RB=lay["RB"], BE=lay["BE"], BK=lay["BK"], DOT=lay.get("DOT", False), UNROLL=lay.get("UNROLL", False),
            PRELOAD=preload, num_warps=lay.get("num_warps", 4), **pdl_args())
    else:
        partials = logits if logits.dim() == 3 else logits.unsqueeze(0)
        if (partials.shape[1:] != (t, e) or partials.stride(-1) != 1 or partials.dtype != torch.float32
                or partials.stride(0) != t * partials.stride(1)):
            raise ValueError(f"logits must be F32 [{t}, {e}] or [S, {t}, {e}] (S K-range partials), "
                             f"unit stride along E; got {tuple(logits.shape)} {logits.dtype}")
        split = partials.shape[0]
    ids = torch.empty(t, k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, k, dtype=torch.bfloat16, device=dev)
    xq = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=dev)
    groups = math.ceil(h / fp8_moe.GROUP)
    xa = torch.empty(t, groups, dtype=torch.float32, device=dev)
    num_active = torch.empty(1, dtype=torch.int32, device=dev)
    gate = None
    if shared_gate is not None:
        if shared_gate.shape != (h,) or shared_gate.stride(0) != 1:
            raise ValueError(f"shared_gate must be [{h}] with unit stride")
        gate = torch.empty(t, dtype=torch.bfloat16, device=dev)
    lists = tickets = None
    if t == 1 and k <= e:
        lists = (torch.empty(e, dtype=torch.int32, device=dev), torch.empty(e, 1, dtype=torch.int32, device=dev),
                 torch.empty(k, dtype=torch.int32, device=dev))
        tickets = torch.empty(REDUCE_TICKETS, dtype=torch.int32, device=dev)
    _route_quant_kernel[(t,)](partials, u, ids, weights, xq, xa, num_active, t, h, e, k, u.stride(0),
                              partials.stride(-2), shared_gate if gate is not None else u,
                              gate if gate is not None else weights, *(lists or (ids, ids, ids)),
                              tickets if tickets is not None else ids,
                              S=split, KP=triton.next_power_of_2(k), BE=triton.next_power_of_2(e),
                              GP=triton.next_power_of_2(groups), GATE=gate is not None,
                              KEYED_TOPK=route["KEYED_TOPK"], LISTS=lists is not None, TICKETS=REDUCE_TICKETS,
                              # only after our GEMV: then the kernel before this one never writes u
                              PRELOAD=bool(route.get("PRELOAD", ROUTE_PRELOAD)) and logits is None,
                              num_warps=route["num_warps"], **pdl_args())
    return DecodeRoute(ids, weights, xq, xa, num_active, gate, lists, tickets)


def expert_lists(topk_ids: torch.Tensor, num_experts: int, num_active: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: (counts [E], lists [E, T] pair indices ascending, active [min(E, n)] expert ids
    in slot order, num_active [1]) for topk_ids [T, k] int32 on CUDA. Entries past an expert's count
    and slots past num_active are left unwritten. `num_active`: an int32 [1] already zeroed
    (route_decode's), else a zeroed one is allocated (one more launch)."""
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    lists = torch.empty(num_experts, t, dtype=torch.int32, device=dev)
    active = torch.empty(min(num_experts, n), dtype=torch.int32, device=dev)
    if num_active is None:
        num_active = torch.zeros(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    _expert_lists_kernel[(num_experts,)](ids, counts, lists, active, num_active, n, t,
                                         NP=max(16, triton.next_power_of_2(n)), num_warps=4, **pdl_args())
    return counts, lists, active, num_active


def _expert_grid(slots: int, column_blocks: int, n_fast: bool, *rest: int) -> tuple[int, ...]:
    """The expert kernels' grid: slots fastest, or with N_FAST the column blocks of one expert
    (programs launched one after another then stream neighbouring rows of one expert's weights)."""
    return (column_blocks, slots, *rest) if n_fast else (slots, column_blocks, *rest)


def moe_decode_pairs(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down,
                     config: dict | None = None, route: DecodeRoute | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None):
    """CUDA only: the weighted per-pair expert outputs w_j·E_{e_j}(x_t), [T, k, H] float32.
    Arguments as fp8_moe.moe_fp8_pairs; no host sync, so a decode step can be graph-captured.
    `route` (route_decode's, whose ids and weights are topk_ids and topk_weights): x is already
    quantised and num_active zeroed, two launches fewer.
    `shared` = (gate_up [2·I_s, H], down [H, I_s]), BF16, x BF16: the shared expert E_s(x) comes
    out of the same three launches (one more slot in the expert grids, more row blocks in the
    reduce), and the result is (pairs, E_s(x) [T, H] F32, unweighted). Its sums are F32 over the
    same fixed K ranges for every row count, and gate and up are rounded to bf16 before
    silu(gate)·up as the BF16 linears round theirs, so it stands in for
    down(silu(gate(x))·up(x)) of three BF16 GEMMs (shared_expert_reference)."""
    t, h, e, i = fp8_moe._check_moe_args(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down)
    cfg = config or DECODE_CONFIG
    k = topk_ids.shape[1]
    n = t * k
    bm, bn1, bn2, split = cfg["BM"], cfg["BN_GU"], cfg["BN_DOWN"], cfg["SPLIT"]
    # FP8_DOT: tl.dot on the FP8 operands as they are (Hopper's FP8 tensor-core MMA) instead of
    # converting both to bf16 first; the interpreter (float32 operands in bf16_dot_args) has no FP8
    # dot, so it keeps the converting path
    fp8_dot = bool(cfg.get("FP8_DOT", False)) and bf16_dot_args()["DOT"] == tl.bfloat16
    if fp8_moe.GROUP % bn1 or fp8_moe.GROUP % bn2:
        raise ValueError("BN must divide 128 so a program's columns share one scale block")
    if x.stride(1) != 1:
        x = x.contiguous()
    if shared is not None:   # checked before any launch (expert_lists consumes route.num_active)
        sw_gate_up, sw_down = shared
        i_s = sw_down.shape[1]
        if (x.dtype != torch.bfloat16 or sw_gate_up.dtype != torch.bfloat16 or sw_down.dtype != torch.bfloat16
                or sw_gate_up.shape != (2 * i_s, h) or sw_down.shape != (h, i_s)
                or not sw_gate_up.is_contiguous() or not sw_down.is_contiguous()):
            raise ValueError(f"shared expert: bf16 x, contiguous bf16 gate_up [2·I_s, {h}] and down [{h}, I_s], "
                             f"got {x.dtype} {tuple(sw_gate_up.shape)} {sw_gate_up.dtype} {tuple(sw_down.shape)}")
    if route is not None and route.lists is not None:      # one row: the routing launch wrote them
        (counts, lists, active), num_active = route.lists, route.num_active
    else:
        counts, lists, active, num_active = expert_lists(topk_ids, e, route.num_active if route else None)
    slots = active.numel()
    xq, xa = (route.xq, route.xa) if route else fp8_moe.quantize_rows_fp8_triton(x)
    dev = x.device
    kx = cfg.get("SHARED_KX", 2)      # the shared expert's gate/up: SPLIT·KX K ranges
    if shared is not None:
        wss = torch.empty(split * kx, t, 2 * i_s, dtype=torch.float32, device=dev)
        hs = torch.empty(t, i_s, dtype=torch.bfloat16, device=dev)
        shared_out = torch.empty(t, h, dtype=torch.float32, device=dev)
    else:   # placeholders the kernels never touch (SHARED=False)
        i_s, sw_gate_up, sw_down, wss, hs, shared_out = 0, w_gate_up, w_down, xa, xa, xa
    has_shared = shared is not None
    ws = torch.empty(split, n, 2 * i, dtype=torch.float32, device=dev)
    shared_tiles = triton.cdiv(t, bm) if has_shared else 0       # the shared expert's row tiles
    n_fast = bool(cfg.get("N_FAST", False))
    hq = torch.empty(n, i, dtype=torch.float8_e4m3fn, device=dev)
    ha = torch.empty(n, math.ceil(i / fp8_moe.GROUP), dtype=torch.float32, device=dev)
    # the split reduce by gate/up's last program per 128-column group and kind (routed, shared): one
    # reduce tile of pairs or of shared rows (at most 16 rows: 8 for a row's 8 pairs), groups whole
    columns = max(i, i_s)
    reduce_rows = triton.next_power_of_2(max(n, t))
    last_reduces = (bool(cfg.get("LAST_REDUCES", False)) and route is not None and route.tickets is not None
                    and reduce_rows <= 16 and columns % fp8_moe.GROUP == 0
                    and columns // fp8_moe.GROUP <= REDUCE_TICKETS // 2)
    grid_slots = slots + shared_tiles * kx
    _gate_up_kernel[_expert_grid(grid_slots, triton.cdiv(columns, bn1), n_fast, split)](
        xq, xa, w_gate_up, s_gate_up, ws, counts, lists, active, num_active, n, k, t, h, i,
        s_gate_up.shape[1] // 2,
        w_gate_up.stride(0), w_gate_up.stride(1), s_gate_up.stride(0), s_gate_up.stride(1),
        x, x.stride(0), sw_gate_up, wss, i_s, slots,
        *((route.tickets[:REDUCE_TICKETS // 2], slots * (fp8_moe.GROUP // bn1) * split,
           route.tickets[REDUCE_TICKETS // 2:], shared_tiles * kx * (fp8_moe.GROUP // bn1) * split) if last_reduces
          else (num_active, 0, num_active, 0)), hq, ha, hs,
        BM=bm, BN=bn1, SPLIT=split, **bf16_dot_args(), FP8_DOT=fp8_dot, SHARED=has_shared, KX=kx,
        REDUCE=reduce_rows if last_reduces else 0, N_FAST=n_fast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args())
    if not last_reduces:
        if has_shared:
            pair_blocks = triton.cdiv(n, 16)
            _split_reduce_shared_kernel[(pair_blocks + triton.cdiv(t, 16), triton.cdiv(max(i, i_s), fp8_moe.GROUP))](
                ws, hq, ha, n, i, wss, hs, t, i_s, pair_blocks, SPLIT=split, SHARED_SPLIT=split * kx, BM=16,
                num_warps=4, **pdl_args())
        else:
            fp8_moe._split_reduce_quant_kernel[(triton.cdiv(n, 16), triton.cdiv(i, fp8_moe.GROUP))](
                ws, hq, ha, n, i, SPLIT=split, BM=16, num_warps=4, **pdl_args())
    out = torch.empty(n, h, dtype=torch.float32, device=dev)
    weights = topk_weights.reshape(-1)
    blocks = triton.cdiv(i, 128)
    _down_kernel[_expert_grid(slots + shared_tiles, triton.cdiv(h, bn2), n_fast)](
        hq, ha, w_down, s_down, out, weights, counts, lists, active, num_active, t, h, i,
        w_down.stride(0), w_down.stride(1), s_down.stride(0), s_down.stride(1),
        hs, sw_down, shared_out, i_s, slots,
        BM=bm, BN=bn2, **bf16_dot_args(), FP8_DOT=fp8_dot, SHARED=has_shared, N_FAST=n_fast,
        PRELOAD=blocks if cfg.get("DOWN_PRELOAD", DOWN_PRELOAD and t == 1) and blocks <= 4 else 0,
        num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]), num_stages=cfg.get("DOWN_STAGES", cfg["num_stages"]),
        **pdl_args())
    pairs = out.view(t, k, h)
    return (pairs, shared_out) if has_shared else pairs


def shared_expert_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """What moe_decode_pairs(shared=...) computes, with torch ops: gate and up as F32 sums rounded
    to bf16, h = bf16(silu(gate)·up), the down product in F32 (not rounded). [T, H] F32."""
    i_s = down.shape[1]
    gu = (x.float() @ gate_up.float().T).to(torch.bfloat16).float()
    g, up = gu[:, :i_s], gu[:, i_s:]
    hs = (g * torch.sigmoid(g) * up).to(torch.bfloat16).float()
    return hs @ down.float().T

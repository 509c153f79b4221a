"""Backbone GPU fast paths at the real Drama 3 geometry (MODEL.md §11), one script, one table.

    python bench/kernels.py [--out DIR] [--quick]       our kernels and a full-geometry layer stack
    python bench/kernels.py --peer [--tag NAME]         transformers' Qwen3_5MoeForCausalLM decode step
    python bench/kernels.py --report DIR                merge DIR/*.json into one table + kernels-latest.json

What is timed (medians of CUDA-event timings, triton.testing.do_bench or graph replays):
  copy bandwidth     a 2 GiB device-to-device copy, bytes read + written: the ceiling for floors
  moe decode         routed FP8 experts of 40 layers (distinct weights, so L2 holds nothing), one
                     CUDA graph, T = 1/8/32/64 rows; floor = selected experts' FP8 bytes + scales / bw
  gdn                fla fused_recurrent and our in-place kernel per layer (decode), fla chunk (prefill)
  decode step        our own compact 40-layer stack (30 GDN + 10 gated attention, FP8 MoE + BF16
                     shared expert, norms, KV cache of 1000 rows), random weights made on the GPU,
                     captured as one CUDA graph, batch 1/8/32/64; floor = bytes / bw
  prefill            the same stack over 256 / 1024 rows of one sequence, eager
  peer               transformers' model built on meta, to_empty on cuda, random BF16 weights,
                     vocab 4096 (the LM head is not part of our step), decode at batch 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

H, I_E, E, K_E, I_S = 2048, 512, 256, 8, 512
N_Q, N_KV, D_H, ROT, THETA = 16, 2, 256, 64, 1e7
HK, HV, DK, DV, KC = 16, 32, 128, 128, 4
C_CONV = 2 * HK * DK + HV * DV          # 8192
LAYERS, INTERVAL = 40, 4
CTX = 1000                               # KV rows already in the cache at the decode step


def do_bench(fn, warmup=25, rep=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (the METHOD.md ceiling)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=10, rep=100)
    return 2 * a.numel() * 2 / (ms * 1e-3)


def fp8_randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)


def scales(e, n, k, fan_in):
    return (torch.rand(e, math.ceil(n / 128), math.ceil(k / 128), device="cuda") + 0.5) / math.sqrt(fan_in)


def lin(n, k):
    return (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# the compact layer stack
# --------------------------------------------------------------------------------------------

class Stack:
    """Full-geometry weights for LAYERS layers; projections fused per layer as a loader would:
    GDN in_proj = [qkv | z | b | a], attention qkv = [q_proj | k_proj | v_proj], MoE input GEMM =
    [router | shared gate | shared up | shared_expert_gate]."""

    def __init__(self, layers=LAYERS):
        self.layers = []
        for i in range(layers):
            attn = (i + 1) % INTERVAL == 0
            L = dict(attn=attn, ln1=(torch.randn(H, device="cuda") * 0.1).bfloat16(),
                     ln2=(torch.randn(H, device="cuda") * 0.1).bfloat16())
            if attn:
                L.update(w_qkv=lin(2 * N_Q * D_H + 2 * N_KV * D_H, H), w_o=lin(H, N_Q * D_H),
                         q_norm=(torch.randn(D_H, device="cuda") * 0.1).bfloat16(),
                         k_norm=(torch.randn(D_H, device="cuda") * 0.1).bfloat16())
            else:
                L.update(w_in=lin(C_CONV + HV * DV + 2 * HV, H), w_out=lin(H, HV * DV),
                         conv_w=(torch.randn(C_CONV, KC, device="cuda") * 0.5).bfloat16(),
                         A_log=torch.rand(HV, device="cuda") * 2.0, dt_bias=torch.randn(HV, device="cuda"),
                         norm_w=(torch.rand(DV, device="cuda") + 0.5).bfloat16())
            L.update(w_rs=lin(E + 2 * I_S + 1, H), w_sd=lin(H, I_S),
                     w_gu=fp8_randn(E, 2 * I_E, H), s_gu=scales(E, 2 * I_E, H, H),
                     w_d=fp8_randn(E, H, I_E), s_d=scales(E, H, I_E, I_E))
            self.layers.append(L)

    def bf16_bytes(self):
        n = 0
        for L in self.layers:
            for k, v in L.items():
                if isinstance(v, torch.Tensor) and k not in ("w_gu", "s_gu", "w_d", "s_d"):
                    n += v.numel() * v.element_size()
        return n

    def states(self, b, max_len=1024):
        st = []
        for L in self.layers:
            if L["attn"]:
                st.append(dict(k=torch.randn(b, N_KV, max_len, D_H, device="cuda").bfloat16(),
                               v=torch.randn(b, N_KV, max_len, D_H, device="cuda").bfloat16()))
            else:
                st.append(dict(conv=torch.randn(b, C_CONV, KC - 1, device="cuda").bfloat16(),
                               S=torch.randn(b, HV, DK, DV, device="cuda") * 0.01))
        return st


BEST = {}   # T -> fastest MoE decode config of the sweep; the decode step uses it for its batch size


def moe_block(L, x, grouped=False):
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import fp8_moe as moe
    u = dg.rms_norm_plus(x, L["ln2"])
    r = u @ L["w_rs"].T                                              # [T, E + 2 I_s + 1]
    ids, w = moe.router_topk(r[:, :E], K_E)
    shared = dg.silu_mul(r[:, E:E + I_S], r[:, E + I_S:E + 2 * I_S]) @ L["w_sd"].T
    cfg = None if grouped else BEST.get(x.shape[0])
    pairs = moe.moe_fp8_pairs(u, ids, w, L["w_gu"], L["s_gu"], L["w_d"], L["s_d"], grouped=grouped, config=cfg)
    return dg.moe_combine(pairs, x, shared, r[:, E + 2 * I_S])


def decode_step(stack, st, x, seq, pos, ctx=CTX):
    """One decode row for each of x's B sequences, every sequence at position `pos` (static)."""
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import gdn
    b = x.shape[0]
    for L, S in zip(stack.layers, st):
        u = dg.rms_norm_plus(x, L["ln1"])
        if L["attn"]:
            qkv = u @ L["w_qkv"].T
            q = dg.attention_prologue(qkv, L["q_norm"], L["k_norm"], S["k"], S["v"], seq, pos,
                                      n_q=N_Q, n_kv=N_KV, d_h=D_H, rotary_dim=ROT, theta=THETA)
            # GQA decode as one query block per KV head: [B, n_kv, n_q/n_kv, d_h] against [B, n_kv, L, d_h]
            o = F.scaled_dot_product_attention(q.view(b, N_KV, N_Q // N_KV, D_H),
                                               S["k"][:, :, :ctx + 1], S["v"][:, :, :ctx + 1])
            gate = qkv[:, :2 * N_Q * D_H].view(b, N_Q, 2 * D_H)[..., D_H:]
            o = o.reshape(b, N_Q, D_H) * torch.sigmoid(gate)
            x = torch.addmm(x, o.reshape(b, N_Q * D_H), L["w_o"].T)
        else:
            proj = u @ L["w_in"].T                                   # [B, c + Hv·V + 2 Hv]
            mixed = gdn.causal_conv1d_update(proj[:, :C_CONV], L["conv_w"], S["conv"])
            q = mixed[:, :HK * DK].view(b, HK, DK)
            k = mixed[:, HK * DK:2 * HK * DK].view(b, HK, DK)
            v = mixed[:, 2 * HK * DK:].view(b, HV, DV)
            z = proj[:, C_CONV:C_CONV + HV * DV].view(b, HV, DV)
            bb = proj[:, C_CONV + HV * DV:C_CONV + HV * DV + HV]
            a = proj[:, C_CONV + HV * DV + HV:]
            o = gdn.gdn_decode_inplace(q, k, v, a, bb, L["A_log"], L["dt_bias"], S["S"])
            y = gdn.gated_rms_norm(o, z, L["norm_w"])
            x = torch.addmm(x, y.view(b, HV * DV), L["w_out"].T)
        x = moe_block(L, x)
    return x


def prefill(stack, st, x):
    """All rows of one sequence from position 0 (x [T, H]); fla chunk for GDN, causal SDPA."""
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import gdn
    t = x.shape[0]
    seq = torch.zeros(t, dtype=torch.long, device="cuda")
    pos = torch.arange(t, device="cuda")
    for L, S in zip(stack.layers, st):
        u = dg.rms_norm_plus(x, L["ln1"])
        if L["attn"]:
            qkv = u @ L["w_qkv"].T
            q = dg.attention_prologue(qkv, L["q_norm"], L["k_norm"], S["k"], S["v"], seq, pos,
                                      n_q=N_Q, n_kv=N_KV, d_h=D_H, rotary_dim=ROT, theta=THETA)
            kk = S["k"][:1, :, :t].repeat_interleave(N_Q // N_KV, dim=1)
            vv = S["v"][:1, :, :t].repeat_interleave(N_Q // N_KV, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True)[0].transpose(0, 1)
            gate = qkv[:, :2 * N_Q * D_H].view(t, N_Q, 2 * D_H)[..., D_H:]
            x = torch.addmm(x, (o * torch.sigmoid(gate)).reshape(t, N_Q * D_H), L["w_o"].T)
        else:
            proj = u @ L["w_in"].T
            mixed, conv_state = gdn.causal_conv1d(proj[None, :, :C_CONV], L["conv_w"])
            S["conv"][:1].copy_(conv_state)
            mixed = mixed[0]
            q = mixed[:, :HK * DK].view(1, t, HK, DK)
            k = mixed[:, HK * DK:2 * HK * DK].view(1, t, HK, DK)
            v = mixed[:, 2 * HK * DK:].view(1, t, HV, DV)
            g, beta = gdn.gdn_gates(proj[:, -HV:], proj[:, -2 * HV:-HV], L["A_log"], L["dt_bias"])
            o, s_new = gdn.chunk_gated_delta_rule(q, k, v, g[None], beta[None].bfloat16())
            S["S"][:1].copy_(s_new)
            y = gdn.gated_rms_norm(o[0], proj[:, C_CONV:C_CONV + HV * DV].view(t, HV, DV), L["norm_w"])
            x = torch.addmm(x, y.view(t, HV * DV), L["w_out"].T)
        x = moe_block(L, x, grouped=t * K_E > 1024)
    return x


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------

def section(results, name, fn, save_to=None):
    """Run one measurement; a failure is recorded, not raised. With save_to, the results so far are
    written after every section, so a command stopped by its time limit keeps what it measured."""
    t0 = time.time()
    try:
        results[name] = fn()
    except Exception as exc:  # keep going: one failed section must not cost the whole device call
        import traceback
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[{name}] {time.time() - t0:.1f}s {json.dumps(results[name])[:600]}", flush=True)
    if save_to is not None:
        Path(save_to).mkdir(parents=True, exist_ok=True)
        (Path(save_to) / "ours.json").write_text(json.dumps(results, indent=1))


def expert_bytes(unique):
    return unique * (2 * I_E * H + H * I_E + 4 * (2 * (I_E // 128) * (H // 128) + (H // 128) * (I_E // 128)))


def bench_moe(stack, bw, quick):
    from services.backbone.kernels import decode_graph as dg
    from services.backbone.kernels import fp8_moe as moe
    out = {}
    configs = [dict(moe.DECODE_CONFIG)]
    if not quick:
        for bm, bn1, bn2, nw, ns, sp in [(16, 64, 64, 4, 4, 1), (16, 32, 64, 4, 4, 4), (16, 32, 64, 4, 3, 8),
                                         (16, 64, 64, 4, 4, 4), (16, 32, 32, 4, 4, 4), (16, 16, 64, 4, 4, 4)]:
            configs.append(dict(BM=bm, BN_GU=bn1, BN_DOWN=bn2, num_warps=nw, num_stages=ns, SPLIT=sp))
    for t in (1, 8, 32, 64):
        x = torch.randn(t, H, device="cuda").bfloat16()
        routes = [moe.router_topk(torch.randn(t, E, device="cuda"), K_E) for _ in stack.layers]
        unique = sum(int(ids.unique().numel()) for ids, _ in routes)
        floor_ms = expert_bytes(unique) / bw * 1e3
        rows = []
        for cfg in (configs if t in (1, 64) else configs[:1] + [BEST.get(1, configs[0])]):
            def run(cfg=cfg):
                for L, (ids, w) in zip(stack.layers, routes):
                    moe.moe_fp8_pairs(x, ids, w, L["w_gu"], L["s_gu"], L["w_d"], L["s_d"], config=cfg)
            g = dg.GraphedStep(run)
            ms = do_bench(g.replay)
            rows.append(dict(config=cfg, ms_40_layers=ms))
        best = min(rows, key=lambda r: r["ms_40_layers"])
        BEST[t] = best["config"]
        out[f"T={t}"] = dict(ms_40_layers=best["ms_40_layers"], ms_per_layer=best["ms_40_layers"] / len(stack.layers),
                             floor_ms_40_layers=floor_ms, unique_experts_per_layer=unique / len(stack.layers),
                             gbytes_40_layers=expert_bytes(unique) / 1e9,
                             achieved_tb_s=expert_bytes(unique) / (best["ms_40_layers"] * 1e-3) / 1e12,
                             best_config=best["config"], sweep=rows)
    return out


def bench_gdn():
    from services.backbone.kernels import gdn
    out = {}
    for b in (1, 8, 32, 64):
        q, k = torch.randn(b, 1, HK, DK, device="cuda").bfloat16(), torch.randn(b, 1, HK, DK, device="cuda").bfloat16()
        v = torch.randn(b, 1, HV, DV, device="cuda").bfloat16()
        g, beta = gdn.gdn_gates(torch.randn(b, 1, HV, device="cuda"), torch.randn(b, 1, HV, device="cuda"),
                                torch.rand(HV, device="cuda"), torch.randn(HV, device="cuda"))
        S = torch.randn(b, HV, DK, DV, device="cuda") * 0.01
        beta = beta.bfloat16()
        fla_ms = do_bench(lambda: gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S))
        a, bb = torch.randn(b, HV, device="cuda").bfloat16(), torch.randn(b, HV, device="cuda").bfloat16()
        A_log, dt = torch.rand(HV, device="cuda"), torch.randn(HV, device="cuda")
        own_ms = do_bench(lambda: gdn.gdn_decode_inplace(q[:, 0], k[:, 0], v[:, 0], a, bb, A_log, dt, S))
        state_mb = b * HV * DK * DV * 4 / 1e6
        out[f"decode B={b}"] = dict(fla_fused_recurrent_ms=fla_ms, own_inplace_ms=own_ms, state_mb=state_mb)
    for t in (256, 1024):
        q, k = torch.randn(1, t, HK, DK, device="cuda").bfloat16(), torch.randn(1, t, HK, DK, device="cuda").bfloat16()
        v = torch.randn(1, t, HV, DV, device="cuda").bfloat16()
        g, beta = gdn.gdn_gates(torch.randn(1, t, HV, device="cuda"), torch.randn(1, t, HV, device="cuda"),
                                torch.rand(HV, device="cuda"), torch.randn(HV, device="cuda"))
        beta = beta.bfloat16()
        out[f"chunk T={t}"] = dict(fla_chunk_ms=do_bench(lambda: gdn.chunk_gated_delta_rule(q, k, v, g, beta)))
    return out


def bench_step(stack, bw):
    from services.backbone.kernels import decode_graph as dg
    out = {}
    bf16 = stack.bf16_bytes()
    for b in (1, 8, 32, 64):
        st = stack.states(b)
        x = torch.randn(b, H, device="cuda").bfloat16()
        seq = torch.arange(b, device="cuda")
        pos = torch.full((b,), CTX, device="cuda")
        y = decode_step(stack, st, x, seq, pos)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all(), "decode step produced non-finite values"
        g = dg.GraphedStep(decode_step, stack, st, x, seq, pos)
        graph_ms = do_bench(g.replay, warmup=10, rep=300)
        eager_ms = do_bench(lambda: decode_step(stack, st, x, seq, pos), warmup=3, rep=100) if b in (1, 64) else None
        unique = E * (1 - (1 - K_E / E) ** b)                  # expected distinct experts per layer
        n_gdn = sum(not L["attn"] for L in stack.layers)
        n_attn = len(stack.layers) - n_gdn
        state_bytes = b * (n_gdn * (2 * HV * DK * DV * 4 + 2 * C_CONV * (KC - 1) * 2) + n_attn * 2 * N_KV * (CTX + 1) * D_H * 2)
        total = bf16 + expert_bytes(unique) * len(stack.layers) + state_bytes
        out[f"B={b}"] = dict(graph_ms=graph_ms, eager_ms=eager_ms, floor_ms=total / bw * 1e3, gbytes=total / 1e9,
                             bf16_weight_gb=bf16 / 1e9, expert_gb=expert_bytes(unique) * len(stack.layers) / 1e9,
                             state_gb=state_bytes / 1e9, rows_per_s=b / (graph_ms * 1e-3))
        del g, st
        torch.cuda.empty_cache()
    return out


def bench_prefill(stack):
    out = {}
    st = stack.states(1, max_len=1024)
    for t in (256, 1024):
        x = torch.randn(t, H, device="cuda").bfloat16()
        y = prefill(stack, st, x)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all(), "prefill produced non-finite values"
        out[f"T={t}"] = dict(ms=do_bench(lambda: prefill(stack, st, x), warmup=3, rep=60))
    return out


def bench_prefill_graph(stack):
    """The same prefill captured as one CUDA graph per row count (removes the host launch cost)."""
    from services.backbone.kernels import decode_graph as dg
    out = {}
    st = stack.states(1, max_len=1024)
    for t in (256, 1024):
        x = torch.randn(t, H, device="cuda").bfloat16()
        g = dg.GraphedStep(prefill, stack, st, x)
        out[f"T={t}"] = dict(ms=do_bench(g.replay, warmup=3, rep=100))
        del g
    return out


def main_ours(args):
    from services.backbone.kernels import HAS_TRITON
    assert HAS_TRITON and torch.cuda.is_available()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        import fla
        res["fla"] = getattr(fla, "__version__", "?")
    except Exception as exc:
        res["fla"] = f"unavailable: {exc}"
    import triton
    res["triton"] = triton.__version__
    section(res, "copy_bw_tb_s", lambda: copy_bandwidth() / 1e12)
    bw = res["copy_bw_tb_s"] * 1e12 if isinstance(res["copy_bw_tb_s"], float) else 4.2e12
    t0 = time.time()
    stack = Stack()
    torch.cuda.synchronize()
    res["stack_build_s"] = time.time() - t0
    res["stack_gb"] = torch.cuda.memory_allocated() / 1e9
    section(res, "moe_decode", lambda: bench_moe(stack, bw, args.quick), args.out)
    section(res, "decode_step", lambda: bench_step(stack, bw), args.out)
    section(res, "prefill", lambda: bench_prefill(stack), args.out)
    section(res, "prefill_graph", lambda: bench_prefill_graph(stack), args.out)
    section(res, "gdn", bench_gdn, args.out)       # last: fla's autotuning alone takes about a minute
    print(report(res, {}))


# --------------------------------------------------------------------------------------------
# the transformers peer
# --------------------------------------------------------------------------------------------

def main_peer(args):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    import transformers
    cfg = Qwen3_5MoeTextConfig(vocab_size=4096, max_position_embeddings=4096)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg)
    model = model.to(torch.bfloat16).to_empty(device="cuda").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.7)
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
        for m in model.modules():
            if hasattr(m, "inv_freq") and hasattr(m, "compute_default_rope_parameters"):
                inv, _ = m.compute_default_rope_parameters(m.config, "cuda")
                m.inv_freq.copy_(inv)
                m.original_inv_freq.copy_(inv)
    import importlib.util
    # transformers picks fla's kernels for the GDN core when `fla` imports (hub_kernels fallback chain)
    res = dict(transformers=transformers.__version__, tag=args.tag,
               gdn_decode_impl="fla" if importlib.util.find_spec("fla") else "torch",
               experts_impl=str(getattr(cfg, "_experts_implementation", None)),
               gb=torch.cuda.memory_allocated() / 1e9)
    ids = torch.randint(0, 4096, (1, 64), device="cuda")
    times = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(3 + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times.sort()
    res.update(decode_ms_median=times[len(times) // 2], decode_ms_all=times)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"peer-{args.tag}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def fmt(v, nd=3):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def report(res: dict, peers: dict) -> str:
    lines = [f"device {res.get('device')}  torch {res.get('torch')}  triton {res.get('triton')}  fla {res.get('fla')}  "
             f"date {res.get('date')}",
             f"copy bandwidth (read+write): {fmt(res.get('copy_bw_tb_s'))} TB/s", ""]
    moe_r = res.get("moe_decode", {})
    if "error" not in moe_r:
        lines += ["MoE decode, routed FP8 experts, 40 layers (distinct weights), CUDA graph",
                  "| T | ms / 40 layers | ms / layer | floor ms / 40 | x floor | TB/s | experts/layer | config |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, r in moe_r.items():
            c = r["best_config"]
            lines.append(f"| {k[2:]} | {fmt(r['ms_40_layers'])} | {fmt(r['ms_per_layer'], 4)} | {fmt(r['floor_ms_40_layers'])} | "
                         f"{fmt(r['ms_40_layers'] / r['floor_ms_40_layers'], 2)} | {fmt(r['achieved_tb_s'], 2)} | "
                         f"{fmt(r['unique_experts_per_layer'], 1)} | BM{c['BM']} BN{c['BN_GU']}/{c['BN_DOWN']} w{c['num_warps']} s{c['num_stages']} split{c.get('SPLIT', 1)} |")
        lines.append("")
    gd = res.get("gdn", {})
    if "error" not in gd:
        lines += ["GDN core per layer (eager, one launch each)", "| case | fla ms | own in-place ms |", "|---|---|---|"]
        for k, r in gd.items():
            lines.append(f"| {k} | {fmt(r.get('fla_fused_recurrent_ms', r.get('fla_chunk_ms')), 4)} | "
                         f"{fmt(r.get('own_inplace_ms'), 4)} |")
        lines.append("")
    st = res.get("decode_step", {})
    if "error" not in st:
        lines += ["Full decode step, 40 layers (30 GDN + 10 attention, KV 1000 rows), BF16 + FP8 experts",
                  "| batch | graph ms | eager ms | floor ms | x floor | GB moved | rows/s |", "|---|---|---|---|---|---|---|"]
        for k, r in st.items():
            lines.append(f"| {k[2:]} | {fmt(r['graph_ms'])} | {fmt(r['eager_ms'])} | {fmt(r['floor_ms'])} | "
                         f"{fmt(r['graph_ms'] / r['floor_ms'], 2)} | {fmt(r['gbytes'], 2)} | {fmt(r['rows_per_s'], 0)} |")
        lines.append("")
    pf = res.get("prefill", {})
    if "error" not in pf:
        pg = res.get("prefill_graph", {})
        lines += ["Prefill, one sequence, 40 layers", "| rows | eager ms | CUDA graph ms |", "|---|---|---|"]
        lines += [f"| {k[2:]} | {fmt(r['ms'], 2)} | {fmt(pg.get(k, {}).get('ms'), 2)} |" for k, r in pf.items()]
        lines.append("")
    for tag, p in peers.items():
        if "decode_ms_median" in p:
            ours = st.get("B=1", {}).get("graph_ms") if "error" not in st else None
            speed = f", ours {fmt(ours)} ms -> {p['decode_ms_median'] / ours:.0f}x" if ours else ""
            lines.append(f"transformers {p['transformers']} [{tag}] decode step batch 1: {fmt(p['decode_ms_median'], 1)} ms "
                         f"(GDN decode via {p['gdn_decode_impl']}){speed}")
    for name in ("moe_decode", "gdn", "decode_step", "prefill", "prefill_graph"):
        if "error" in res.get(name, {}):
            lines.append(f"{name}: ERROR {res[name]['error']}")
    return "\n".join(lines)


def main_report(args):
    d = Path(args.report)
    res = json.loads((d / "ours.json").read_text()) if (d / "ours.json").exists() else {}
    peers = {p.stem[5:]: json.loads(p.read_text()) for p in sorted(d.glob("peer-*.json"))}
    res["peers"] = peers
    (d / "kernels-latest.json").write_text(json.dumps(res, indent=1))
    print(report(res, peers))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--quick", action="store_true", help="no config sweep")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--report", default=None)
    a = ap.parse_args()
    if a.report:
        main_report(a)
    elif a.peer:
        main_peer(a)
    else:
        main_ours(a)

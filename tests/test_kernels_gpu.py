"""GPU fast paths of the backbone (services/backbone/kernels) against their references.

The references and the pure-torch pieces (activation quantiser, block tables, conv, GDN
recurrence, norms) run on CPU in CI; every Triton/fla comparison is marked `cuda` and skips
without a GPU. Errors are judged by the relative L2 error ‖out − ref‖ / ‖ref‖, reported with
the max absolute difference.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from services.backbone.kernels import decode_graph as dg
from services.backbone.kernels import fp8_moe as moe
from services.backbone.kernels import gdn
from services.common import fp8 as common_fp8

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out, ref, tol, what=""):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}, max abs {float((out.double() - ref.double()).abs().max()):.3e}"


def random_experts(e: int, h: int, i: int, device="cpu", seed=0):
    """Random FP8 experts in our stacked layout, quantised per 128x128 block like the tiny generator."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ws = []
    for shape in ((e, i, h), (e, i, h), (e, h, i)):
        w = torch.randn(*shape, generator=g) / math.sqrt(shape[2])
        q, s = zip(*(common_fp8.quantize_block_fp8(w[j]) for j in range(e)))
        ws.append((torch.stack(q), torch.stack(s)))
    (wg, sg), (wu, su), (wd, sd) = ws
    w_gate_up, s_gate_up = moe.pack_gate_up(wg, sg, wu, su)
    return [t.to(device) for t in (w_gate_up, s_gate_up, wd, sd.float())]


def random_routing(t: int, e: int, k: int, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    ids, w = moe.router_topk_reference(logits, k)
    return ids.to(device), w.to(device)


# --------------------------------------------------------------------------------------------
# CPU: references and pure-torch pieces
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 64), (5, 200), (2, 2, 384)])
def test_quantize_rows_matches_common_fp8(shape):
    """The device-agnostic §4.7 quantiser is bit-identical to services.common.fp8's."""
    x = torch.randn(*shape) * torch.logspace(-3, 2, shape[-1])
    xq, a = moe.quantize_rows_fp8(x)
    ref_q, ref_a = common_fp8.quantize_activation_fp8(x)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(a, ref_a)


def test_fp8_linear_dequant_matches_reference_linear():
    """(x_q·a)(W_q·S)ᵀ in float32 equals §4.7's per-group sum within float32 rounding."""
    torch.manual_seed(1)
    w = torch.randn(160, 200) / 14
    w_q, s = common_fp8.quantize_block_fp8(w)
    x = torch.randn(4, 200)
    ref = common_fp8.fp8_linear_reference(x, w_q, s, out_dtype=torch.float32)
    assert_close(moe.fp8_linear_dequant(x, w_q, s), ref, 1e-6, "fp8 linear")


def test_naive_moe_matches_fp8_linear_composition():
    """naive_moe_fp8 = Σ_j w_j down(bf16(silu(bf16 gate)·bf16 up)) with common.fp8's linear, partial blocks."""
    h, i, e, k, t = 64, 160, 8, 2, 3
    w_gate_up, s_gate_up, w_down, s_down = random_experts(e, h, i)
    ids, w = random_routing(t, e, k)
    x = torch.randn(t, h).to(torch.bfloat16)
    out = moe.naive_moe_fp8(x, ids, w, w_gate_up, s_gate_up, w_down, s_down)
    ref = torch.zeros(t, h)
    for r in range(t):
        for j in range(k):
            ex = int(ids[r, j])
            gate = common_fp8.fp8_linear_reference(x[r], w_gate_up[ex, :i], s_gate_up[ex, :2])
            up = common_fp8.fp8_linear_reference(x[r], w_gate_up[ex, i:], s_gate_up[ex, 2:])
            act = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
            ref[r] += w[r, j].float() * common_fp8.fp8_linear_reference(act, w_down[ex], s_down[ex],
                                                                         out_dtype=torch.float32)
    assert_close(out, ref, 1e-5, "naive moe")


def test_moe_fp8_cpu_falls_back_to_naive():
    h, i, e, k, t = 64, 160, 8, 2, 2
    experts = random_experts(e, h, i, seed=3)
    ids, w = random_routing(t, e, k, seed=3)
    x = torch.randn(t, h).to(torch.bfloat16)
    y = moe.moe_fp8(x, ids, w, *experts)
    assert y.dtype == torch.bfloat16 and y.shape == (t, h)
    assert_close(y, moe.naive_moe_fp8(x, ids, w, *experts), 1e-2, "cpu moe")


@pytest.mark.parametrize("t,e,k,bm", [(1, 8, 2, 16), (7, 8, 2, 16), (40, 16, 4, 16), (300, 64, 8, 64)])
def test_align_blocks_torch_table(t, e, k, bm):
    """Every pair sits in exactly one block, each block holds one expert, blocks ordered by expert id."""
    ids, _ = random_routing(t, e, k, seed=t)
    block_expert, block_rows, max_blocks = moe.align_blocks_torch(ids, e, bm)
    n, flat = t * k, ids.reshape(-1).long()
    rows = block_rows.view(max_blocks, bm)
    seen = []
    for b in range(max_blocks):
        valid = rows[b][rows[b] < n].long()
        if block_expert[b] < 0:
            assert valid.numel() == 0
            continue
        assert valid.numel() > 0 and (flat[valid] == block_expert[b]).all()
        seen.append(valid)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(n))
    used = block_expert[block_expert >= 0]
    assert (used[1:] >= used[:-1]).all()


def test_router_reference_ties_take_lower_index():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -2.0]])
    ids, w = moe.router_topk_reference(logits, 2)
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(w.float(), torch.full((1, 2), 0.5))


def test_causal_conv1d_matches_naive_and_splits():
    """The conv equals the loop reference, and two calls with the carried state equal one."""
    torch.manual_seed(2)
    x, w = torch.randn(2, 11, 24), torch.randn(24, 4)
    state0 = torch.randn(2, 24, 3)
    y, s = gdn.causal_conv1d(x, w, state0)
    y_ref, s_ref = gdn.naive_causal_conv1d(x, w, state0)
    assert_close(y, y_ref, 1e-6, "conv")
    assert torch.equal(s, s_ref)
    y1, s1 = gdn.causal_conv1d(x[:, :5], w, state0)
    y2, s2 = gdn.causal_conv1d(x[:, 5:], w, s1)
    # silu's vector tail may round the last ulp differently by length: close, not bit-equal
    assert torch.allclose(torch.cat([y1, y2], 1), y, rtol=1e-6, atol=1e-7) and torch.equal(s2, s)


def test_conv_update_cpu_matches_conv():
    torch.manual_seed(3)
    x, w, state = torch.randn(3, 40), torch.randn(40, 4), torch.randn(3, 40, 3)
    y_ref, s_ref = gdn.causal_conv1d(x[:, None], w, state)
    y = gdn.causal_conv1d_update(x, w, state)
    assert torch.equal(y, y_ref[:, 0]) and torch.equal(state, s_ref)


def test_naive_recurrence_split_and_float64():
    """The float32 recurrence agrees with float64, and splitting the rows carries the state exactly."""
    torch.manual_seed(4)
    b, t, hk, hv, dk, dv = 2, 9, 2, 4, 16, 8
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v = torch.randn(b, t, hv, dv)
    g, beta = gdn.gdn_gates(torch.randn(b, t, hv), torch.randn(b, t, hv), torch.randn(hv), torch.randn(hv))
    s0 = torch.randn(b, hv, dk, dv)
    o, s = gdn.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o64, s64 = gdn.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, dtype=torch.float64)
    assert_close(o, o64, 1e-5, "o f32 vs f64")
    assert_close(s, s64, 1e-5, "S f32 vs f64")
    o1, s1 = gdn.naive_recurrent_gated_delta_rule(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], initial_state=s0)
    o2, s2 = gdn.naive_recurrent_gated_delta_rule(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:], initial_state=s1)
    assert torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-6) and torch.allclose(s2, s, atol=1e-6)


def test_gdn_decode_cpu_fallback_updates_state_in_place():
    torch.manual_seed(5)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 8
    q, k, v = torch.randn(b, hk, dk), torch.randn(b, hk, dk), torch.randn(b, hv, dv)
    a, bb, A_log, dt_bias = torch.randn(b, hv), torch.randn(b, hv), torch.randn(hv), torch.randn(hv)
    state = torch.randn(b, hv, dk, dv)
    g, beta = gdn.gdn_gates(a, bb, A_log, dt_bias)
    o_ref, s_ref = gdn.naive_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                        beta[:, None], initial_state=state)
    o = gdn.gdn_decode_inplace(q, k, v, a, bb, A_log, dt_bias, state)
    assert torch.allclose(o, o_ref[:, 0]) and torch.equal(state, s_ref)


def test_attention_prologue_reference_at_position_zero_is_norm_only():
    """RoPE at position 0 is the identity, so q is RMSNorm⁺(q); k/v land in the caches at (seq, pos)."""
    torch.manual_seed(6)
    n_q, n_kv, d_h = 4, 2, 16
    qkv = torch.randn(2, 2 * n_q * d_h + 2 * n_kv * d_h).to(torch.bfloat16)
    qn, kn = torch.randn(d_h) * 0.1, torch.randn(d_h) * 0.1
    kc, vc = torch.zeros(3, n_kv, 8, d_h, dtype=torch.bfloat16), torch.zeros(3, n_kv, 8, d_h, dtype=torch.bfloat16)
    seq, pos = torch.tensor([2, 0]), torch.tensor([0, 5])
    q = dg.naive_attention_prologue(qkv, qn, kn, kc, vc, seq, pos, n_q=n_q, n_kv=n_kv, d_h=d_h,
                                    rotary_dim=4, theta=1e4)
    q0 = qkv[0, :2 * n_q * d_h].view(n_q, 2 * d_h)[:, :d_h]
    assert torch.equal(q[0], dg.naive_rms_norm_plus(q0, qn))
    v1 = qkv[1, 2 * n_q * d_h + n_kv * d_h:].view(n_kv, d_h)
    assert torch.equal(vc[0, :, 5], v1) and kc[2, :, 0].abs().sum() > 0 and kc[1].abs().sum() == 0


# --------------------------------------------------------------------------------------------
# CUDA: Triton / fla against the references
# --------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("m,k", [(1, 64), (17, 200), (64, 2048)])
def test_triton_activation_quant_bit_exact(m, k):
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-4, 3, k, device="cuda")).to(torch.bfloat16)
    xq, a = moe.quantize_rows_fp8_triton(x)
    ref_q, ref_a = moe.quantize_rows_fp8(x)
    assert torch.equal(a, ref_a)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))


@cuda
@pytest.mark.parametrize("t,e,k,bm", [(1, 8, 2, 16), (3, 256, 8, 16), (64, 256, 8, 16), (17, 8, 2, 16), (100, 32, 8, 16)])
def test_route_kernel_equals_torch_tables(t, e, k, bm):
    ids, _ = random_routing(t, e, k, device="cuda", seed=t)
    got = moe.route_blocks(ids, e, bm)
    ref = moe.align_blocks_torch(ids, e, bm)
    assert got[2] == ref[2]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@cuda
@pytest.mark.parametrize("t,e,k", [(1, 256, 8), (5, 64, 8), (64, 128, 8)])
def test_router_topk_kernel(t, e, k):
    logits = torch.randn(t, e + 3, device="cuda")[:, :e]          # strided rows, like a fused projection
    ids, w = moe.router_topk(logits, k)
    ref_ids, ref_w = moe.router_topk_reference(logits, k)
    assert torch.equal(ids, ref_ids)
    assert_close(w, ref_w, 1e-2, "router weights")


MOE_SHAPES = [  # (H, I, E, k, T): tiny (partial blocks), mid, real H/I with fewer experts
    (64, 160, 8, 2, 1), (64, 160, 8, 2, 13), (256, 384, 16, 4, 33), (2048, 512, 32, 8, 1), (2048, 512, 32, 8, 64),
]


@cuda
@pytest.mark.parametrize("h,i,e,k,t", MOE_SHAPES)
@pytest.mark.parametrize("grouped", [False, True])
def test_moe_fp8_matches_naive(h, i, e, k, t, grouped):
    experts = random_experts(e, h, i, device="cuda", seed=h + t)
    ids, w = random_routing(t, e, k, device="cuda", seed=t)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    y = moe.moe_fp8(x, ids, w, *experts, grouped=grouped)
    ref = moe.naive_moe_fp8(x, ids, w, *experts)
    assert_close(y, ref, 1e-2, f"moe grouped={grouped}")


@cuda
@pytest.mark.parametrize("h,i,e,k,t", [(64, 160, 8, 2, 5), (2048, 512, 32, 8, 1), (2048, 512, 32, 8, 64)])
@pytest.mark.parametrize("cfg", [dict(moe.DECODE_CONFIG, SPLIT=4), dict(moe.DECODE_CONFIG, SPLIT=8),
                                 moe.FAST_DECODE_CONFIG], ids=["split4", "split8", "fast"])
def test_moe_fp8_split_k_matches_naive(h, i, e, k, t, cfg):
    """gate_up split over K (partials reduced, silu'd and quantised by a second kernel); empty splits when K is short."""
    split = cfg["SPLIT"]
    experts = random_experts(e, h, i, device="cuda", seed=h + t + split)
    ids, w = random_routing(t, e, k, device="cuda", seed=t + split)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    y = moe.moe_fp8(x, ids, w, *experts, config=cfg, grouped=False)
    assert_close(y, moe.naive_moe_fp8(x, ids, w, *experts), 1e-2, f"moe {cfg}")


@cuda
def test_moe_fp8_prefill_many_rows():
    h, i, e, k, t = 256, 384, 16, 4, 300                        # T·k = 1200 > DECODE_MAX_PAIRS
    experts = random_experts(e, h, i, device="cuda", seed=9)
    ids, w = random_routing(t, e, k, device="cuda", seed=9)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    assert_close(moe.moe_fp8(x, ids, w, *experts), moe.naive_moe_fp8(x, ids, w, *experts), 1e-2, "prefill moe")


def _gdn_inputs(b, t, hk, hv, dk, dv, device="cuda", seed=0):
    g_ = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g_)  # noqa: E731
    q, k, v = r(b, t, hk, dk), r(b, t, hk, dk), r(b, t, hv, dv)
    g, beta = gdn.gdn_gates(r(b, t, hv), r(b, t, hv), r(hv) * 0.5, r(hv))
    s0 = r(b, hv, dk, dv) * 0.1
    return [x.to(device) for x in (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), s0)]


@cuda
@pytest.mark.parametrize("b,t,hk,hv", [(1, 63, 2, 4), (2, 200, 4, 8), (1, 256, 16, 32)])
def test_fla_chunk_matches_reference(b, t, hk, hv):
    pytest.importorskip("fla")
    q, k, v, g, beta, s0 = _gdn_inputs(b, t, hk, hv, 128, 128, seed=t)
    o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = gdn.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert_close(o, o_ref, 1e-2, "fla chunk o")
    assert_close(s, s_ref, 1e-2, "fla chunk S")


@cuda
@pytest.mark.parametrize("b,t", [(1, 1), (4, 1), (2, 3)])
def test_fla_recurrent_matches_reference(b, t):
    pytest.importorskip("fla")
    q, k, v, g, beta, s0 = _gdn_inputs(b, t, 16, 32, 128, 128, seed=b)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = gdn.naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert_close(o, o_ref, 1e-2, "fla recurrent o")
    assert_close(s, s_ref, 1e-4, "fla recurrent S")


@cuda
@pytest.mark.parametrize("b", [1, 5])
def test_gdn_decode_inplace_matches_reference(b):
    """Strided views of one projection row, gates fused, state updated in place."""
    hk, hv, dk, dv = 16, 32, 128, 128
    proj = torch.randn(b, 2 * hk * dk + hv * dv + 2 * hv + 7, device="cuda").to(torch.bfloat16)
    q = proj[:, :hk * dk].view(b, hk, dk)
    k = proj[:, hk * dk:2 * hk * dk].view(b, hk, dk)
    v = proj[:, 2 * hk * dk:2 * hk * dk + hv * dv].view(b, hv, dv)
    a = proj[:, -2 * hv - 7:-hv - 7]
    bb = proj[:, -hv - 7:-7]
    A_log, dt_bias = torch.randn(hv, device="cuda") * 0.5, torch.randn(hv, device="cuda")
    state = torch.randn(b, hv, dk, dv, device="cuda") * 0.1
    g, beta = gdn.gdn_gates(a, bb, A_log, dt_bias)
    o_ref, s_ref = gdn.naive_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                        beta[:, None], initial_state=state)
    o = gdn.gdn_decode_inplace(q, k, v, a, bb, A_log, dt_bias, state)
    assert_close(o, o_ref[:, 0], 1e-2, "decode o")
    assert_close(state, s_ref, 1e-5, "decode S")


@cuda
@pytest.mark.parametrize("b", [1, 3])
def test_gdn_decode_state_loaded_before_the_wait_gives_the_same_bits(b):
    """The state stripe (and the slot) read before the kernel's PDL wait (STATE_PRELOAD,
    DRAMA_PDL_PRELOAD): the output and the new state bit for bit as without, slots too."""
    hk, hv, dk, dv = 16, 32, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(b)
    q, k = (torch.randn(b, hk, dk, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(b, hv, dv, device="cuda", generator=gen).to(torch.bfloat16)
    a, bb = (torch.randn(b, hv, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(hv, device="cuda", generator=gen) * 0.5, torch.randn(hv, device="cuda", generator=gen)
    pool = torch.randn(b + 2, hv, dk, dv, device="cuda", generator=gen) * 0.1
    slots = torch.arange(b, device="cuda", dtype=torch.int64).flip(0) + 1
    outs = []
    for preload in (False, True):
        state = pool.clone()
        o = gdn.gdn_decode_inplace(q, k, v, a, bb, A_log, dt_bias, state, slots=slots, preload=preload)
        outs.append((o, state))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[1][1], pool)


@cuda
def test_conv_update_kernel_matches_torch():
    b, c = 3, 8192
    proj = torch.randn(b, c + 100, device="cuda").to(torch.bfloat16)
    x = proj[:, :c]
    w = torch.randn(c, 4, device="cuda").to(torch.bfloat16)
    state = torch.randn(b, c, 3, device="cuda").to(torch.bfloat16)
    y_ref, s_ref = gdn.causal_conv1d(x[:, None], w, state)
    y = gdn.causal_conv1d_update(x, w, state)
    assert_close(y, y_ref[:, 0], 1e-2, "conv update")
    assert torch.equal(state, s_ref)


@cuda
@pytest.mark.parametrize("slotted", [False, True])
def test_conv_update_with_its_state_read_before_the_wait_gives_the_same_bits(slotted, monkeypatch):
    """The conv update's state, weights and slot read before its PDL wait (CONV_PRELOAD,
    DRAMA_PDL_PRELOAD): the same output and new state bit for bit."""
    b, c = 3, 8192
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(b, c + 100, device="cuda", generator=gen).to(torch.bfloat16)[:, :c]
    w = torch.randn(c, 4, device="cuda", generator=gen).to(torch.bfloat16)
    pool = torch.randn(b + 2, c, 3, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.tensor([4, 0, 2], device="cuda") if slotted else None
    outs = []
    for preload in (False, True):
        monkeypatch.setattr(gdn, "CONV_PRELOAD", preload)
        state = pool.clone() if slotted else pool[:b].clone()
        outs.append((gdn.causal_conv1d_update(x, w, state, slots=slots), state))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


@cuda
def test_norm_kernels_match_references():
    x = torch.randn(5, 2048 + 64, device="cuda").to(torch.bfloat16)[:, :2048]
    w = torch.randn(2048, device="cuda").to(torch.bfloat16) * 0.1
    assert_close(dg.rms_norm_plus(x, w), dg.naive_rms_norm_plus(x, w), 1e-2, "rms_norm_plus")
    # the widened form (the MoE norm on prefill steps): the same bf16 bits, and their exact F32
    u, u32 = dg.rms_norm_plus(x, w, widened=True)
    assert torch.equal(u, dg.rms_norm_plus(x, w)) and u32.dtype == torch.float32 and torch.equal(u32, u.float())
    o = torch.randn(3, 32, 128, device="cuda").to(torch.bfloat16)
    z = torch.randn(3, 32 * 128 + 40, device="cuda").to(torch.bfloat16)[:, :4096].view(3, 32, 128)
    nw = torch.randn(128, device="cuda").to(torch.bfloat16)
    assert_close(gdn.gated_rms_norm(o, z, nw), gdn.naive_gated_rms_norm(o, z, nw), 1e-2, "gated norm")
    g, u = torch.randn(2, 1100, device="cuda").bfloat16()[:, :512], torch.randn(2, 512, device="cuda").bfloat16()
    assert_close(dg.silu_mul(g, u), dg.naive_silu_mul(g, u), 1e-2, "silu_mul")
    # wider than one column block (the tower's gate|up output, as two column views of one tensor)
    gu = torch.randn(3, 6000, device="cuda").bfloat16()
    assert_close(dg.silu_mul(gu[:, :3000], gu[:, 3000:]), dg.naive_silu_mul(gu[:, :3000], gu[:, 3000:]),
                 1e-2, "silu_mul wide")


@cuda
def test_gated_norm_heads_per_program_change_no_bit(monkeypatch):
    """gdn.GATED_NORM_HEADS heads per program, one warp each, give the bits of one head per
    program (a head's squares are summed by one warp in the same order either way), also for a
    head count it does not divide (the gcd is taken)."""
    for hv in (32, 6):
        o = torch.randn(5, hv, 128, device="cuda").to(torch.bfloat16)
        z = torch.randn(5, hv * 128 + 40, device="cuda").to(torch.bfloat16)[:, :hv * 128].view(5, hv, 128)
        nw = torch.randn(128, device="cuda").to(torch.bfloat16)
        monkeypatch.setattr(gdn, "GATED_NORM_HEADS", 1)
        one = gdn.gated_rms_norm(o, z, nw)
        monkeypatch.undo()
        assert torch.equal(gdn.gated_rms_norm(o, z, nw), one), f"{hv} heads"


@cuda
def test_attention_prologue_kernel_matches_reference():
    n_q, n_kv, d_h = 16, 2, 256
    qkv = torch.randn(4, 2 * n_q * d_h + 2 * n_kv * d_h, device="cuda").to(torch.bfloat16)
    qn, kn = (torch.randn(d_h, device="cuda") * 0.1).bfloat16(), (torch.randn(d_h, device="cuda") * 0.1).bfloat16()
    seq, pos = torch.tensor([0, 1, 2, 3], device="cuda"), torch.tensor([0, 7, 999, 3], device="cuda")
    caches = [torch.zeros(4, n_kv, 1024, d_h, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    kw = dict(n_q=n_q, n_kv=n_kv, d_h=d_h, rotary_dim=64, theta=1e7)
    q = dg.attention_prologue(qkv, qn, kn, caches[0], caches[1], seq, pos, **kw)
    q_ref = dg.naive_attention_prologue(qkv, qn, kn, caches[2], caches[3], seq, pos, **kw)
    assert_close(q, q_ref, 1e-2, "prologue q")
    assert_close(caches[0], caches[2], 1e-2, "prologue k cache")
    assert torch.equal(caches[1], caches[3])


@cuda
def test_moe_combine_kernel():
    pairs = torch.randn(3, 8, 2048, device="cuda")
    res = torch.randn(3, 2048, device="cuda").bfloat16()
    sh = torch.randn(3, 2048, device="cuda").bfloat16()
    gl = torch.randn(3, 9, device="cuda").bfloat16()[:, 4]
    assert_close(dg.moe_combine(pairs, res, sh, gl), dg.naive_moe_combine(pairs, res, sh, gl), 1e-2, "combine")


@cuda
def test_moe_combine_with_norm_kernel():
    """The combine with the next norm fused: the residual as moe_combine's, bit for bit; the
    normed rows as RMSNorm⁺ of it; each row alone as inside the batch."""
    pairs = torch.randn(5, 8, 2048, device="cuda")
    res = torch.randn(5, 2048, device="cuda").bfloat16()
    sh = torch.randn(5, 2048, device="cuda").bfloat16()
    gl = torch.randn(5, 9, device="cuda").bfloat16()[:, 4]
    w = (torch.randn(2048, device="cuda") * 0.1).bfloat16()
    out, normed = dg.moe_combine(pairs, res, sh, gl, norm_weight=w, eps=1e-6)
    assert torch.equal(out, dg.moe_combine(pairs, res, sh, gl))
    assert_close(normed, dg.naive_rms_norm_plus(out, w, 1e-6), 1e-2, "combine norm")
    for r in (0, 4):
        alone = dg.moe_combine(pairs[r:r + 1], res[r:r + 1], sh[r:r + 1], gl[r:r + 1], norm_weight=w, eps=1e-6)
        assert torch.equal(alone[0], out[r:r + 1]) and torch.equal(alone[1], normed[r:r + 1])


@cuda
@pytest.mark.parametrize("shared", [True, False])
def test_moe_combine_inputs_read_before_the_wait_give_the_same_bits(shared, monkeypatch):
    """The combine + norm's residual, shared gate logit and gain read before its PDL wait
    (COMBINE_PRELOAD, DRAMA_PDL_PRELOAD): the same rows bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    pairs = torch.randn(2, 8, 2048, device="cuda", generator=gen)
    res = torch.randn(2, 2048, device="cuda", generator=gen).bfloat16()
    sh = torch.randn(2, 2048, device="cuda", generator=gen).bfloat16() if shared else None
    gl = torch.randn(2, 9, device="cuda", generator=gen).bfloat16()[:, 4] if shared else None
    w = (torch.randn(2048, device="cuda", generator=gen) * 0.1).bfloat16()
    runs = []
    for preload in (False, True):
        monkeypatch.setattr(dg, "COMBINE_PRELOAD", preload)
        runs.append(dg.moe_combine(pairs, res, sh, gl, norm_weight=w, eps=1e-6))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@cuda
def test_embed_kernel_equals_the_torch_embed():
    """Backbone.embed's one-launch kernel path against its torch code, bit for bit, on the GPU."""
    from types import SimpleNamespace

    from services.backbone.model import AudioSpec, Backbone

    spec = AudioSpec(semantic_start_token_id=100, num_codebooks=10, codebook_vocab_size=64,
                     semantic_codebook_size=64, residual_codebook_size=64)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(200, 2048, generator=g).bfloat16().cuda()
    cb = torch.randn(10 * 64, 2048, generator=g).bfloat16().cuda()
    frames = torch.randint(0, 64, (6, 10), generator=g)
    frames[[0, 3]] = -1
    ids = torch.where(frames[:, 0] >= 0, 100 + frames[:, 0], torch.tensor([7, 0, 0, 150, 0, 0]))
    outs = {}
    for kernels in (False, True):
        model = SimpleNamespace(kernels=kernels, dtype=torch.bfloat16, audio=spec,
                                embed_tokens=SimpleNamespace(weight=table), codebook_embeddings=SimpleNamespace(weight=cb))
        model._embed_torch = functools.partial(Backbone._embed_torch, model)     # embed's torch path calls it
        outs[kernels] = Backbone.embed(model, ids.cuda(), frames.cuda())
        outs[kernels, "text"] = Backbone.embed(model, ids[[0, 3]].cuda(), None)
    assert torch.equal(outs[True], outs[False])
    assert torch.equal(outs[True, "text"], outs[False, "text"])


def test_route_decode_off_cuda_routes_and_quantises():
    """Off CUDA route_decode runs its torch reference; held here to the math in float64: the k
    experts of largest softmax probability, their renormalised weights (bf16), u's §4.7 groups
    (x_q·a within e4m3's rounding of u, the group's largest |u| mapped to 448), a zeroed counter."""
    from services.backbone.kernels import moe_decode

    g = torch.Generator().manual_seed(5)
    u = torch.randn(6, 256, generator=g).bfloat16()
    u[2, 128:] *= 30.0
    router = torch.randn(16, 256, generator=g) / 16
    got = moe_decode.route_decode(u, router, 4)
    probs = torch.softmax(u.double() @ router.double().T, dim=-1)
    top = probs.topk(4, dim=-1)
    assert torch.equal(got.ids.long(), top.indices)
    torch.testing.assert_close(got.weights.double(), top.values / top.values.sum(-1, keepdim=True),
                               rtol=2 ** -8, atol=0)
    groups = u.double().view(6, 2, 128)
    torch.testing.assert_close(got.xa.double(), groups.abs().amax(-1) / 448, rtol=1e-6, atol=0)
    deq = got.xq.double().view(6, 2, 128) * got.xa.double()[..., None]
    assert ((deq - groups).abs() <= groups.abs() * 2 ** -4 + got.xa.double()[..., None] * 2 ** -9).all()
    assert got.num_active.tolist() == [0]

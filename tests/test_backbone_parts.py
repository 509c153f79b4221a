"""The backbone's math, part by part, against float64 references (MODEL.md §4.3-§4.5).

Errors are judged by relative RMS error; messages carry the max abs difference (fla's style).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services.backbone.attention import attend_row, attend_rows, naive_attention
from services.backbone.gated_deltanet import (
    CHUNK,
    GDNCache,
    causal_conv_taps,
    chunk_gated_delta_rule,
    gdn_chunk,
    gdn_gates,
    l2_normalize,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from services.backbone.layers import RowBatch, Segment
from services.backbone.moe import naive_moe, route
from services.backbone.rope import RotaryTable, apply_rope, naive_apply_rope
from services.backbone.weights import load_backbone


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def assert_close(got, ref, tol, what=""):
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e}, max abs {float((got - ref).abs().max()):.2e}"


def gdn_inputs(length: int, heads: int, kdim: int, vdim: int, seed: int):
    """Random q̂ (scaled), k̂ (unit), v, g ≤ 0, β ∈ (0, 1), state, in the layout [T, H, ·]."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, heads, kdim, generator=gen)) * kdim ** -0.5
    k = l2_normalize(torch.randn(length, heads, kdim, generator=gen))
    v = torch.randn(length, heads, vdim, generator=gen)
    g, beta = gdn_gates(torch.randn(length, heads, generator=gen), torch.randn(length, heads, generator=gen),
                        torch.rand(heads, generator=gen) * 2 - 1, torch.randn(heads, generator=gen) * 0.5)
    state = torch.randn(heads, kdim, vdim, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length,heads,kdim,vdim", [(1, 2, 16, 16), (63, 3, 10, 6), (64, 2, 16, 8),
                                                    (65, 4, 12, 20), (150, 2, 32, 16)],
                         ids=lambda v: str(v))
def test_chunked_delta_rule_equals_recurrence(length, heads, kdim, vdim):
    """The 64-row chunk form and the token-by-token recurrence agree (outputs and final state),
    and each agrees with its float64 reference."""
    q, k, v, g, beta, state = gdn_inputs(length, heads, kdim, vdim, seed=length)
    ref_o, ref_s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, state)
    naive_o, naive_s = naive_chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert_close(naive_o, ref_o, 1e-10, "naive chunk vs naive recurrence, o")
    assert_close(naive_s, ref_s, 1e-10, "naive chunk vs naive recurrence, S")
    for name, fn in (("chunk", chunk_gated_delta_rule), ("recurrent", recurrent_gated_delta_rule)):
        o, s = fn(q, k, v, g, beta, state)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        assert_close(o, ref_o, 2e-5, f"{name} o")
        assert_close(s, ref_s, 2e-5, f"{name} S")


def test_gdn_chunk_rows_depend_only_on_earlier_rows():
    """Row i of a chunk is bit-identical whether later rows are real or zero padding, and when
    the solved rows of earlier rows are handed in instead of recomputed."""
    heads, kdim, vdim = 3, 16, 8
    q, k, v, g, beta, state = gdn_inputs(CHUNK, heads, kdim, vdim, seed=7)
    q, k, v, g, beta = (x.movedim(0, 1).contiguous() for x in (q, k, v, g, beta))   # head-major
    full_o, full_s, full_solved = gdn_chunk(q, k, v, g, beta, state)
    for rows in (1, 20, 63):
        pad = lambda x: torch.cat([x[:, :rows], torch.zeros_like(x[:, rows:])], dim=1)  # noqa: E731
        o, _, solved = gdn_chunk(pad(q), pad(k), pad(v), pad(g), pad(beta), state,
                                 known=full_solved[:, :rows // 2], rows=rows)
        assert torch.equal(o[:, :rows], full_o[:, :rows])
        assert torch.equal(solved[:, :rows], full_solved[:, :rows])
    # A complete chunk's end state agrees with the recurrence.
    _, ref_s = naive_recurrent_gated_delta_rule(q.movedim(1, 0), k.movedim(1, 0), v.movedim(1, 0), g.T, beta.T, state)
    assert_close(full_s, ref_s, 2e-5, "chunk end state")


def test_causal_conv_taps_equal_conv1d():
    gen = torch.Generator().manual_seed(0)
    channels, taps, n = 12, 4, 37
    x = torch.randn(n, channels, generator=gen)
    w = torch.randn(channels, taps, generator=gen)
    window = torch.cat([torch.zeros(taps - 1, channels), x])
    ref = F.conv1d(x.T[None], w[:, None, :], padding=taps - 1, groups=channels)[0, :, :n].T
    assert_close(causal_conv_taps(window, w), ref, 1e-6, "conv")


def test_gdn_layer_against_float64_layer_reference(tiny_checkpoint):
    """The module's cached path (conv state, chunk state, partial rows) against a float64
    reference of the whole layer computed by loops: outputs, conv state and recurrent state."""
    model = load_backbone(tiny_checkpoint, lm_head=False)
    layer = model.layers[0].linear_attn
    cfg = model.config
    length = 2 * CHUNK
    u = torch.randn(length, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cache = GDNCache.allocate(cfg, 2, torch.float32, "cpu")
    outs, start = [], 0
    for n in (50, 1, 77):                                 # chunk boundaries fall inside the calls
        segment = Segment(slot=1, start=start, count=n, offset=0)
        outs.append(layer(u[start:start + n], RowBatch((segment,), torch.arange(start, start + n), True), cache))
        start += n
    got = torch.cat(outs)

    ud = u.double()
    m = ud @ layer.in_proj_qkv.weight.double().T
    w = layer.conv1d.weight.double()[:, 0]
    taps = w.shape[1]
    padded = torch.cat([torch.zeros(taps - 1, m.shape[1], dtype=torch.float64), m])
    conv = torch.stack([sum(w[:, j] * padded[t + j] for j in range(taps)) for t in range(length)])
    act = conv * torch.sigmoid(conv)
    kd, hk, hv, vd = cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    q, k, v = act.split([hk * kd, hk * kd, hv * vd], dim=-1)
    q = q.reshape(length, hk, kd)
    k = k.reshape(length, hk, kd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * kd ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    a = ud @ layer.in_proj_a.weight.double().T
    b = ud @ layer.in_proj_b.weight.double().T
    g = -torch.exp(layer.A_log.double()) * F.softplus(a + layer.dt_bias.double())
    o, state = naive_recurrent_gated_delta_rule(q, k, v.reshape(length, hv, vd), g, torch.sigmoid(b))
    z = (ud @ layer.in_proj_z.weight.double().T).reshape(length, hv, vd)
    y = o / torch.sqrt((o * o).mean(-1, keepdim=True) + cfg.rms_norm_eps) * layer.norm.weight.double()
    y = (y * z * torch.sigmoid(z)).reshape(length, -1) @ layer.out_proj.weight.double().T
    assert_close(got, y, 1e-5, "layer output")
    assert_close(cache.state[1], state, 1e-5, "recurrent state after two chunks")
    assert torch.allclose(cache.conv[1].double(), m[-(taps - 1):], atol=1e-6)
    assert not cache.state[0].any() and not cache.conv[0].any()   # other slots untouched


def test_attention_row_and_batched_forms_match_reference():
    gen = torch.Generator().manual_seed(0)
    length, n_q, n_kv, d = 29, 6, 2, 12
    q = torch.randn(length, n_q, d, generator=gen)
    k = torch.randn(length, n_kv, d, generator=gen)
    v = torch.randn(length, n_kv, d, generator=gen)
    scale = d ** -0.5
    ref = naive_attention(q, k, v, scale)
    keys, values = k.transpose(0, 1), v.transpose(0, 1)
    rows = torch.stack([attend_row(q[t], keys[:, :t + 1], values[:, :t + 1], scale) for t in range(length)])
    assert_close(rows, ref, 1e-6, "attend_row")
    # Batched: the last 10 rows against all keys, positions 19..28.
    assert_close(attend_rows(q[19:], keys, values, 19, scale), ref[19:], 1e-6, "attend_rows")


def test_rope_matches_float64_reference_and_table_is_position_exact():
    rotary_dim, theta = 8, 10_000_000.0
    table = RotaryTable(rotary_dim, theta)
    positions = torch.tensor([0, 1, 5, 1023, 1024, 3000])
    cos, sin = table.lookup(positions)
    x = torch.randn(len(positions), 3, 32, generator=torch.Generator().manual_seed(0))
    got = apply_rope(x, cos, sin)
    assert_close(got, naive_apply_rope(x, positions, rotary_dim, theta), 1e-6, "rope")
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])     # the rest passes through
    again = table.lookup(torch.tensor([3000, 5]))
    assert torch.equal(again[0], cos[[5, 2]]) and torch.equal(again[1], sin[[5, 2]])


def test_route_ties_pick_the_lower_expert_and_renormalise():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))


def test_moe_layer_matches_float64_reference(tiny_checkpoint):
    """FP8 experts dequantised on the fly, top-k routing and the gated shared expert."""
    model = load_backbone(tiny_checkpoint, lm_head=False)
    moe = model.layers[1].mlp
    x = torch.randn(13, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    experts = [moe.experts.weights(e) for e in range(model.config.num_experts)]
    shared = (moe.shared_expert.gate_proj.weight, moe.shared_expert.up_proj.weight, moe.shared_expert.down_proj.weight)
    ref = naive_moe(x, moe.gate.weight, experts, shared, moe.shared_expert_gate.weight, moe.top_k)
    for exact in (True, False):
        assert_close(moe(x, exact), ref, 1e-6, f"moe exact={exact}")


def test_audio_row_embedding(tiny_checkpoint):
    """(embed_tokens[semantic_start + c_0] + Σ_k codebook_embeddings[k·B + c_k]) / √(N+1)."""
    model = load_backbone(tiny_checkpoint, lm_head=False)
    spec = model.audio
    frame = torch.tensor([[5] + list(range(1, spec.num_codebooks))])
    text_and_audio = model.embed(torch.tensor([7, spec.semantic_start_token_id + 5]),
                                 torch.cat([torch.full((1, spec.num_codebooks), -1), frame]))
    table, cb = model.embed_tokens.weight.double(), model.codebook_embeddings.weight.double()
    expected = table[spec.semantic_start_token_id + 5] + sum(
        cb[k * spec.codebook_vocab_size + int(frame[0, k])] for k in range(spec.num_codebooks))
    assert torch.equal(text_and_audio[0], model.embed_tokens.weight[7])
    assert_close(text_and_audio[1], expected / math.sqrt(spec.num_codebooks + 1), 1e-7, "audio row")

"""kernels/gdn.gdn_decode_step: a decode row's GDN core in one launch (conv + silu, l2 norms,
gates, the delta-rule update, the gated RMSNorm) against the three functions it replaces.

The reference runs everywhere (it is the CPU path); the Triton kernel runs on CUDA, or in
Triton's interpreter on the CPU: TRITON_INTERPRET=1 python -m pytest tests/test_gdn_decode_step.py
"""

from __future__ import annotations

import os

import pytest
import torch

from services.backbone.kernels import HAS_TRITON, gdn

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
CUDA = torch.cuda.is_available() and HAS_TRITON
DEVICE = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(not (CUDA or INTERPRET),
                             reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")

TAPS = 4


def inputs(bsz, heads, pool, dtype, seed=0, device=DEVICE):
    """Random inputs of one decode step: proj [B, c + Hv·V + 2·Hv], a conv state pool and a
    recurrent state pool of `pool` slots, the layer's parameters."""
    gen = torch.Generator().manual_seed(seed)
    hk, dk, hv, dv = heads
    channels = 2 * hk * dk + hv * dv
    t = dict(proj=torch.randn(bsz, channels + hv * dv + 2 * hv, generator=gen) * 2,
             conv_weight=torch.randn(channels, TAPS, generator=gen) / 2,
             conv_state=torch.randn(pool, channels, TAPS - 1, generator=gen),
             A_log=torch.randn(hv, generator=gen) / 2, dt_bias=torch.randn(hv, generator=gen) / 2,
             state=torch.randn(pool, hv, dk, dv, generator=gen) / dk,
             norm_weight=1 + torch.randn(dv, generator=gen) / 4)
    for name in ("proj", "conv_weight", "conv_state", "norm_weight"):
        t[name] = t[name].to(dtype)
    return {name: v.to(device) for name, v in t.items()}


def reference(args, heads, slots):
    """The three functions gdn_decode_step replaces, on copies of the states, on the CPU in F32
    math: y [B, Hv·V] bf16 and the new conv and recurrent states."""
    hk, dk, hv, dv = heads
    a = {name: v.cpu().clone() for name, v in args.items()}
    channels = a["conv_weight"].shape[0]
    bsz = a["proj"].shape[0]
    cpu_slots = None if slots is None else slots.cpu()
    mixed = gdn.causal_conv1d_update(a["proj"][:, :channels], a["conv_weight"], a["conv_state"], slots=cpu_slots)
    key = hk * dk
    gates = a["proj"][:, channels + hv * dv:]                 # b | a
    o = gdn.gdn_decode_inplace(mixed[:, :key].view(bsz, hk, dk), mixed[:, key:2 * key].view(bsz, hk, dk),
                               mixed[:, 2 * key:].view(bsz, hv, dv), gates[:, hv:], gates[:, :hv],
                               a["A_log"], a["dt_bias"], a["state"], slots=cpu_slots)
    z = a["proj"][:, channels:channels + hv * dv].view(bsz, hv, dv)
    y = gdn.naive_gated_rms_norm(o, z, a["norm_weight"], 1e-6).view(bsz, hv * dv)
    return y, a["conv_state"], a["state"]


CASES = [((2, 16, 4, 16), 3, torch.float32, None, 64),
         ((2, 16, 4, 16), 3, torch.float32, [4, 0, 2], 8),     # each value head in two column stripes
         ((2, 16, 4, 16), 3, torch.bfloat16, [4, 0, 2], 64),
         ((1, 8, 3, 12), 2, torch.float32, [1, 3], 8)]          # V not a power of two, 3 value heads a key head


@kernels
@pytest.mark.parametrize("heads,bsz,dtype,slots,block_v", CASES,
                         ids=["f32", "f32-two-stripes", "bf16-slots", "odd-dims-slots-two-stripes"])
def test_fused_step_matches_the_three_functions(heads, bsz, dtype, slots, block_v):
    if INTERPRET and not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates F32 -> bf16 where the GPU rounds to nearest")
    pool = bsz if slots is None else 5          # without slots, row b is slot b
    args = inputs(bsz, heads, pool=pool, dtype=dtype)
    slots = None if slots is None else torch.tensor(slots, device=DEVICE)
    want_y, want_conv, want_state = reference(args, heads, slots)
    y = gdn.gdn_decode_step(args["proj"], args["conv_weight"], args["conv_state"], args["A_log"], args["dt_bias"],
                            args["state"], args["norm_weight"], 1e-6, heads, slots=slots, block_v=block_v)
    assert y.dtype == torch.bfloat16 and y.shape == want_y.shape
    # the conv state is a copy: exact; the recurrent state and y: the same F32 math, sums in
    # another order, y rounded to bf16
    assert torch.equal(args["conv_state"].cpu(), want_conv)
    torch.testing.assert_close(args["state"].cpu(), want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.cpu().float(), want_y.float(), rtol=2e-2, atol=2e-2)
    # untouched slots stay as they were
    if slots is not None:
        others = [s for s in range(pool) if s not in slots.tolist()]
        fresh = inputs(bsz, heads, pool=pool, dtype=dtype)
        assert torch.equal(args["state"].cpu()[others], fresh["state"].cpu()[others])


@kernels
def test_row_alone_equals_row_in_batch():
    """A row's outputs do not depend on the other rows of the step."""
    heads = (2, 16, 4, 16)
    args = inputs(4, heads, pool=4, dtype=torch.bfloat16, seed=3)
    alone = {name: v.clone() for name, v in args.items()}
    y = gdn.gdn_decode_step(args["proj"], args["conv_weight"], args["conv_state"], args["A_log"], args["dt_bias"],
                            args["state"], args["norm_weight"], 1e-6, heads)
    y2 = gdn.gdn_decode_step(alone["proj"][2:3], alone["conv_weight"], alone["conv_state"], alone["A_log"],
                             alone["dt_bias"], alone["state"], alone["norm_weight"], 1e-6, heads,
                             slots=torch.tensor([2], device=DEVICE))
    assert torch.equal(y[2:3], y2)
    assert torch.equal(args["state"][2], alone["state"][2])


def test_cpu_path_is_the_three_functions():
    """Off CUDA (no interpreter) gdn_decode_step is the three functions in turn, states in place."""
    if INTERPRET:
        pytest.skip("the interpreter runs the kernel")
    heads = (2, 16, 4, 16)
    args = inputs(3, heads, pool=3, dtype=torch.float32, device="cpu")
    want_y, want_conv, want_state = reference(args, heads, None)
    y = gdn.gdn_decode_step(args["proj"], args["conv_weight"], args["conv_state"], args["A_log"], args["dt_bias"],
                            args["state"], args["norm_weight"], 1e-6, heads)
    assert torch.equal(y, want_y) and torch.equal(args["conv_state"], want_conv)
    assert torch.equal(args["state"], want_state)


def test_rejects_a_projection_of_the_wrong_width():
    heads = (2, 16, 4, 16)
    args = inputs(2, heads, pool=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="does not hold"):
        gdn.gdn_decode_step(args["proj"][:, 1:], args["conv_weight"], args["conv_state"], args["A_log"],
                            args["dt_bias"], args["state"], args["norm_weight"], 1e-6, heads)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with Triton")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_backbone_decode_steps_with_the_fused_core(monkeypatch, graphs):
    """DRAMA_GDN_FUSED_DECODE's path through the backbone (gated_deltanet.forward_kernels): decode
    steps of 3 sessions give the rows of the three-launch path (cosine >= 0.9999: last-bit sum
    orders, then bf16 and FP8 rounding downstream), eager and from CUDA graphs."""
    from services.backbone.engine import BackboneEngine
    from services.backbone.weights import random_backbone
    from tests.test_backbone_gpu import MID, copy_to, cosine

    ref = random_backbone(MID, device="cpu", seed=11)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, MID.vocab_size, (n,), generator=gen) for n in (5, 40, 90)]
    steps = torch.randint(0, MID.vocab_size, (10, 3), generator=gen)
    out = {}
    for fused in (False, True):
        monkeypatch.setattr(gdn, "FUSED_DECODE", fused)
        engine = BackboneEngine(copy_to(ref, "cuda", kernels=True, decode_graphs=graphs), max_sessions=4,
                                max_context=200)
        slots = [engine.open() for _ in prompts]
        engine.step([(s, p, None) for s, p in zip(slots, prompts)])
        rows = []
        for t in steps:
            rows += engine.step([(s, t[j:j + 1], None) for j, s in enumerate(slots)])
        out[fused] = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    cos = cosine(out[True], out[False])
    print(f"fused vs three launches ({'graphed' if graphs else 'eager'}): min cosine {float(cos.min()):.7f}")
    assert cos.min() >= 0.9999, f"min cosine {float(cos.min()):.7f}"

"""kernels/gdn.prefill_front: the GDN front of a prefill step (conv + silu + gates of all packed
rows, each segment's new conv state) against the per-sequence references.

The reference runs everywhere (it is the CPU kernel path); the Triton kernels run on CUDA, or in
Triton's interpreter on the CPU: TRITON_INTERPRET=1 python -m pytest tests/test_gdn_prefill_front.py
"""

from __future__ import annotations

import os

import pytest
import torch

from services.backbone.kernels import HAS_TRITON, gdn

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON) and not INTERPRET,
                             reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")

HEADS = (2, 8, 4, 6)               # Hk, K, Hv, V: c = 2·2·8 + 4·6 = 56 channels
CHANNELS = 2 * HEADS[0] * HEADS[1] + HEADS[2] * HEADS[3]
TAPS = 4


def step(counts, seed=0, dtype=torch.float32, device="cpu", pad_to=None, slots=None):
    """Random inputs of one step: segments of `counts` real rows (each padded to `pad_to` rows
    when given, as the prefill graphs' pieces are)."""
    gen = torch.Generator().manual_seed(seed)
    hk, dk, hv, dv = HEADS
    n = len(counts)
    extent = [pad_to or c for c in counts]
    rows = sum(extent)
    proj = torch.randn(rows, CHANNELS + hv * dv + 2 * hv, generator=gen) * 2
    weight = torch.randn(CHANNELS, TAPS, generator=gen)
    pool = torch.randn(n + 3, CHANNELS, TAPS - 1, generator=gen)
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    slots = torch.tensor(slots if slots is not None else [2 * i % (n + 3) for i in range(n)][:n])
    first = torch.tensor([0] + extent[:-1]).cumsum(0)
    row_seg = torch.arange(n).repeat_interleave(torch.tensor(extent))
    mask = None
    if pad_to:
        mask = (torch.arange(pad_to)[None, :] < torch.tensor(counts)[:, None]).flatten().float()
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(proj=to(proj.to(dtype)), weight=to(weight.to(dtype)), conv_state=to(pool.to(dtype)),
                A_log=to(A_log), dt_bias=to(dt_bias), seg_slots=to(slots), seg_first=to(first),
                seg_rows=to(torch.tensor(counts)), row_seg=to(row_seg), heads=HEADS, row_mask=to(mask))


def per_sequence(args):
    """Each segment alone through gdn.causal_conv1d (the batch conv reference) and gdn_gates."""
    hk, dk, hv, dv = HEADS
    proj, state = args["proj"].cpu().float(), args["conv_state"].cpu().float().clone()
    outs, new_states = [], []
    for s, (slot, first, n) in enumerate(zip(args["seg_slots"].tolist(), args["seg_first"].tolist(),
                                             args["seg_rows"].tolist())):
        m = proj[first:first + n, :CHANNELS]
        y, new = gdn.causal_conv1d(m[None], args["weight"].cpu().float(), state[slot:slot + 1])
        outs.append(y[0])
        new_states.append((slot, new[0]))
    for slot, new in new_states:
        state[slot] = new
    b = proj[:, CHANNELS + hv * dv:CHANNELS + hv * dv + hv]
    a = proj[:, CHANNELS + hv * dv + hv:]
    g, beta = gdn.gdn_gates(a, b, args["A_log"].cpu(), args["dt_bias"].cpu())
    return outs, state, g, beta


def real_rows(args):
    return [torch.arange(f, f + n) for f, n in zip(args["seg_first"].tolist(), args["seg_rows"].tolist())]


@pytest.mark.parametrize("counts,pad_to", [([5, 1, 9], None), ([2, 3], None), ([3, 1], 8), ([7], 16)])
def test_reference_matches_each_sequence_alone(counts, pad_to):
    """Segments shorter than the conv's taps read the old state; padding rows are not real rows."""
    args = step(counts, pad_to=pad_to)
    before = args["conv_state"].clone()
    front = gdn.prefill_front_reference(**args)
    outs, state, g, beta = per_sequence(dict(args, conv_state=before))
    y = torch.cat([front.q.flatten(1), front.k.flatten(1), front.v.flatten(1)], 1)
    for rows, want in zip(real_rows(args), outs):
        assert torch.allclose(y[rows], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(args["conv_state"], state)
    mask = torch.ones(y.shape[0]) if pad_to is None else args["row_mask"]
    assert torch.allclose(front.g, g * mask[:, None]) and torch.allclose(front.beta, beta * mask[:, None])
    if pad_to:
        assert (front.beta[mask == 0] == 0).all() and (front.g[mask == 0] == 0).all()


@kernels
@pytest.mark.parametrize("counts,pad_to", [([5, 1, 9], None), ([1, 2, 70], None), ([3, 1], 8), ([40, 64], 64)])
def test_kernels_match_the_reference(counts, pad_to):
    """Conv rows to rounding, the new conv states bit for bit (they are copies), the gates to
    rounding (log(1 + e^x) in the kernel, torch's softplus in the reference)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    args = step(counts, pad_to=pad_to, dtype=dtype, device=DEVICE)
    ref_args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    got = gdn.prefill_front(**args)
    want = gdn.prefill_front_reference(**ref_args)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name in ("q", "k", "v", "beta"):
        a, b = getattr(got, name).float(), getattr(want, name).float()
        for rows in real_rows(args):
            assert torch.allclose(a[rows], b[rows], **tol), name
    assert torch.allclose(got.g, want.g, rtol=1e-5, atol=1e-6)
    assert torch.equal(args["conv_state"], ref_args["conv_state"])
    for t in got:
        assert t.is_contiguous()


@kernels
def test_kernel_rows_do_not_depend_on_the_other_segments():
    """A segment's rows and new conv state are the same bits alone or packed with others."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    together = step([6, 2, 11], seed=3, dtype=dtype, device=DEVICE, slots=[4, 0, 2])
    got = gdn.prefill_front(**together)
    first, n = 6, 2                                   # the middle segment alone, slot 0
    alone = dict(together, proj=together["proj"][first:first + n].clone(),
                 conv_state=step([6, 2, 11], seed=3, dtype=dtype, device=DEVICE)["conv_state"],
                 seg_slots=together["seg_slots"][1:2], seg_first=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                 seg_rows=together["seg_rows"][1:2], row_seg=torch.zeros(n, dtype=torch.int64, device=DEVICE))
    one = gdn.prefill_front(**alone)
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(getattr(got, name)[first:first + n], getattr(one, name)), name
    assert torch.equal(together["conv_state"][0], alone["conv_state"][0])

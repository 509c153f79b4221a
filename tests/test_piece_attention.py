"""kernels/attention.piece_attention: padded prefill pieces' attention, a block of rows sharing its
keys, against naive_piece_attention (each real row through naive_decode_attention).

Runs on CUDA, or in Triton's interpreter on the CPU:
TRITON_INTERPRET=1 python -m pytest tests/test_piece_attention.py
Off both, the reference path is checked against itself only through the dispatch test.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.backbone.kernels import HAS_TRITON
from services.backbone.kernels import attention as kattn

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
CUDA = torch.cuda.is_available() and HAS_TRITON
DEVICE = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(not (CUDA or INTERPRET),
                             reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def case(pieces, bucket, n_q=4, n_kv=2, d=32, slots=6, max_context=160, seed=0):
    """pieces: [(slot, start, real rows)]; returns the arguments of piece_attention (and a gate)."""
    gen = torch.Generator().manual_seed(seed)
    total = len(pieces) * bucket
    q = torch.randn(total, n_q, d, generator=gen)
    k_pool = torch.randn(slots, n_kv, max_context, d, generator=gen)
    v_pool = torch.randn(slots, n_kv, max_context, d, generator=gen)
    gate = torch.randn(total, n_q, d, generator=gen)
    positions = torch.cat([torch.arange(bucket) + start for _, start, _ in pieces])
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return dict(q=to(q.to(DTYPE)), k_pool=to(k_pool.to(DTYPE)), v_pool=to(v_pool.to(DTYPE)),
                piece_slots=to(torch.tensor([s for s, _, _ in pieces])), positions=to(positions),
                piece_rows=to(torch.tensor([n for _, _, n in pieces])), bucket=bucket, scale=d ** -0.5), to(gate.to(DTYPE))


@kernels
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (2, 2)], ids=["G2", "G8", "G1"])
def test_matches_the_reference(gated, heads):
    args, gate = case([(3, 0, 40), (1, 57, 9), (5, 100, 0), (0, 3, 48)], bucket=48, n_q=heads[0], n_kv=heads[1])
    got = kattn.piece_attention(**args, gate=gate if gated else None)
    ref = kattn.naive_piece_attention(**{k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                                         for k, v in args.items()}, gate=gate.float() if gated else None)
    assert got.shape == args["q"].shape
    real = (torch.arange(got.shape[0], device=got.device) % args["bucket"]) < args["piece_rows"].repeat_interleave(args["bucket"])
    assert torch.equal(got[~real].float(), torch.zeros_like(got[~real].float())), "padding rows must be zero"
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@kernels
def test_rows_do_not_depend_on_the_bucket_or_the_other_pieces():
    """The same piece padded to 32 or 64 rows, alone or behind another piece: the same bits."""
    args, _ = case([(2, 10, 27)], bucket=32, seed=1)
    other, _ = case([(4, 0, 30)], bucket=32, seed=2)
    rows = args["q"][:27]
    outs = []
    for bucket, before in [(32, False), (64, False), (32, True)]:
        q = torch.zeros(bucket * (1 + before), *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        q[bucket * before:][:27] = rows
        if before:
            q[:30] = other["q"][:30]
        slots = torch.tensor([4, 2] if before else [2], device=rows.device)
        starts = [0, 10] if before else [10]
        positions = torch.cat([torch.arange(bucket) + s for s in starts]).to(rows.device)
        real = torch.tensor([30, 27] if before else [27], device=rows.device)
        got = kattn.piece_attention(q, args["k_pool"], args["v_pool"], slots, positions, real, bucket, args["scale"])
        outs.append(got[bucket * before:][:27])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_dispatch_falls_back_to_the_reference_off_the_kernel():
    """Where the kernel cannot run (CPU without the interpreter, or G not a power of two), the
    reference answers, with zeros on padding rows and the output written into `out`."""
    args, gate = case([(1, 5, 7)], bucket=16, n_q=6, n_kv=2)       # G = 3
    args = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in args.items()}
    out = torch.empty_like(args["q"])
    got = kattn.piece_attention(**args, gate=gate.cpu(), out=out)
    assert got is out
    ref = kattn.naive_piece_attention(**args, gate=gate.cpu())
    assert torch.equal(got, ref) and torch.equal(got[7:], torch.zeros_like(got[7:]))

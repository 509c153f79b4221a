"""The backbone's decode attention kernel (kernels/attention.py) against its reference.

CUDA only (the kernel runs on bf16 CUDA tensors; elsewhere decode_attention is the reference
itself); skipped without a GPU. Each test first asserts the kernel path is the one taken.
"""

import pytest
import torch

from services.backbone.kernels import HAS_TRITON
from services.backbone.kernels import attention as kattn

DEVICE, DTYPE = "cuda", torch.bfloat16
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA GPU with Triton")


def _pool(slots: int, n_kv: int, length: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, n_kv, length, d, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(slots, n_kv, length, d, generator=gen).to(DTYPE).to(DEVICE)
    return k, v


@pytest.mark.parametrize("positions,context", [([0], 1), ([0, 63, 64, 200], 201), ([5, 1000, 129], 1030)])
@pytest.mark.parametrize("n_q,n_kv", [(16, 2), (4, 4)])
def test_kernel_matches_the_reference(positions, context, n_q, n_kv):
    d, b = 64, len(positions)
    k, v = _pool(b + 2, n_kv, context + 7, d, seed=1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(b, n_q, d, generator=gen).to(DTYPE).to(DEVICE)
    slots = torch.randperm(b + 2, generator=gen)[:b].to(DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    assert kattn.supported(q, k)
    got = kattn.decode_attention(q, k, v, slots, pos, context, d ** -0.5)
    ref = kattn.naive_decode_attention(q.float(), k.float(), v.float(), slots, pos, context, d ** -0.5)
    assert got.shape == (b, n_q, d)
    assert (got.float() - ref).abs().max() < 2e-2         # bf16 output of an F32 softmax


def test_a_row_does_not_depend_on_the_batch():
    """Splits follow `context` and each row's own length, so a row alone equals the same row in a batch."""
    d, n_q, n_kv, context = 64, 8, 2, 600
    k, v = _pool(6, n_kv, context, d, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, n_q, d, generator=gen).to(DTYPE).to(DEVICE)
    slots = torch.tensor([4, 0, 2, 5, 1], device=DEVICE)
    pos = torch.tensor([599, 3, 300, 64, 128], device=DEVICE)
    assert kattn.supported(q, k)
    together = kattn.decode_attention(q, k, v, slots, pos, context, d ** -0.5)
    for r in range(5):
        alone = kattn.decode_attention(q[r:r + 1], k, v, slots[r:r + 1], pos[r:r + 1], context, d ** -0.5)
        assert torch.equal(alone[0], together[r])


def test_the_output_gate_in_the_combine_launch():
    """gate=, out=: the gated output o ⊙ σ(gate) written where asked, from a strided gate (the
    attention's q|gate projection), as gate_output of the ungated kernel output."""
    n_q, n_kv, d, b = 16, 2, 64, 3
    k, v = _pool(b, n_kv, 300, d, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(b, n_q, d, generator=gen).to(DTYPE).to(DEVICE)
    q_and_gate = torch.randn(b, n_q, 2 * d, generator=gen).to(DTYPE).to(DEVICE)
    gate = q_and_gate[..., d:]
    slots, pos = torch.arange(b, device=DEVICE), torch.tensor([0, 100, 299], device=DEVICE)
    out = torch.full((b, n_q, d), float("nan"), dtype=DTYPE, device=DEVICE)
    got = kattn.decode_attention(q, k, v, slots, pos, 300, d ** -0.5, gate=gate, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = kattn.gate_output(kattn.decode_attention(q, k, v, slots, pos, 300, d ** -0.5), gate)
    assert torch.equal(got, ref)      # σ computed as torch does (libdevice expf, IEEE division)

"""The tower's decode attention read ahead of its PDL wait (kernels.decode_attention(preload=),
on in the tower's layer with DRAMA_PDL_PRELOAD): every block but the one holding the row's own
position is attended before the wait, the rest after, in the same order through the same
arithmetic. So the same bits as without, whether the row's position opens, ends or sits inside a
block, with one piece or several, with the output gate or not.

Runs on CUDA (bf16, the served shapes), or on the CPU in Triton's interpreter (TRITON_INTERPRET=1
with a Triton install; float32, whose dots the interpreter computes exactly as written); skipped
where neither is available (CI's CPU torch has no Triton). PDL itself is off in the interpreter:
there the test checks the arithmetic of the split loop, on the GPU the read-ahead as served.
"""

from __future__ import annotations

import os

import pytest
import torch

from services.tower import kernels
from services.tower.model import RowBatch, attend_rowwise

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runnable = pytest.mark.skipif(not kernels.HAS_TRITON or not (torch.cuda.is_available() or INTERPRET),
                              reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")


@runnable
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_attention_read_ahead_gives_the_same_bits(splits):
    cuda = DEVICE == "cuda"
    heads, kv_heads, head_dim = (16, 2, 256) if cuda else (4, 2, 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    block = 32 if head_dim >= 256 else 64                       # decode_attention's BN
    g = torch.Generator(device=DEVICE).manual_seed(7 + (splits or 0))
    slots_n, length = 4, 5 * block + 9
    k_cache = torch.randn(slots_n, kv_heads, length, head_dim, device=DEVICE, generator=g).to(dtype)
    v_cache = torch.randn(slots_n, kv_heads, length, head_dim, device=DEVICE, generator=g).to(dtype)
    # own positions first in a block, last in one, inside one; one row alone in its first block
    positions = torch.tensor([0, 1, block - 1, block, block + 1, 2 * block - 1, 3 * block + 5, length - 1],
                             device=DEVICE)
    slots = torch.tensor([1, 0, 3, 2, 1, 0, 3, 2], device=DEVICE)
    q_and_gate = (torch.randn(len(slots), heads, 2 * head_dim, device=DEVICE, generator=g) * 2).to(dtype)
    q, gate = q_and_gate.split(head_dim, dim=-1)                 # the layer's strided views
    outputs = {}
    for gated in (False, True):
        for preload in (False, True):
            outputs[gated, preload] = kernels.decode_attention(q, k_cache, v_cache, slots, positions, splits=splits,
                                                               gate=gate if gated else None, preload=preload)
        assert torch.equal(outputs[gated, True], outputs[gated, False])
    plain = outputs[False, False]
    rows = RowBatch.from_segments([(s, p, 1) for s, p in zip(slots.tolist(), positions.tolist())], DEVICE)
    reference = attend_rowwise(q.double(), k_cache.double(), v_cache.double(), rows)
    error = (plain.double() - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1)
    assert error.max() < (1e-2 if cuda else 1e-5), error

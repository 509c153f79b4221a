"""The decode GEMM settings the benches compare inside one process (issue #7).

    with applied("session20"): ...       build or capture the engine's steps under that setting

Separate processes on one lent machine differ by up to ~0.3 ms per backbone step and ±0.1 ms per
tower step (docs/perf.md), more than a launch config changes; decode_linear reads
`decode_gemm.TUNED` and `decode_gemm.LAST_REDUCES` at each call, so graphs captured under a
setting keep it. Settings:

    tuned           the module's TUNED (session 21), the split reduce in its own launch (the default)
    last-reduces    the module's TUNED, the split reduce in the GEMM launch (LAST_REDUCES)
    session20       session 20's TUNED (the tower's down projection only), the reduce launch
"""

from __future__ import annotations

import contextlib

import torch

from services.backbone.kernels import decode_gemm

SESSION20_TUNED = {(2048, 12288, torch.bfloat16): dict(BN=64, BK=128, SPLIT=4)}
GEMM_CONFIGS = {"tuned": (None, False), "last-reduces": (None, True), "session20": (SESSION20_TUNED, False)}


@contextlib.contextmanager
def applied(name: str | None):
    """decode_gemm.TUNED and LAST_REDUCES as `name` has them (None: unchanged), restored after."""
    saved = decode_gemm.TUNED, decode_gemm.LAST_REDUCES
    if name is not None:
        table, last_reduces = GEMM_CONFIGS[name]
        decode_gemm.TUNED = saved[0] if table is None else table
        decode_gemm.LAST_REDUCES = last_reduces
    try:
        yield
    finally:
        decode_gemm.TUNED, decode_gemm.LAST_REDUCES = saved

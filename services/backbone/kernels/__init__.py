"""GPU fast paths for the backbone (issue #7), each beside a plain-torch reference.

    fp8_moe.py       routed FP8 experts (MODEL.md §4.5, §4.7): Triton decode step + grouped prefill,
                     a one-launch router/top-k, and `naive_moe_fp8` (loops, float32)
    moe_decode.py    the decode step's routed experts: its router GEMV + top-k + quantisation in
                     two launches, routed by expert in parallel, laid out by active expert,
                     split-K gate/up (same contract and arithmetic as fp8_moe)
    gdn.py           Gated DeltaNet core (§4.3): fla kernels on CUDA (chunked prefill, recurrent
                     decode), an in-place Triton decode step, the causal depthwise conv with its
                     state, the gated RMSNorm, and float32 references
    decode_graph.py  small fused kernels of the decode step (RMSNorm⁺, attention q/k norm + RoPE +
                     KV write, the MoE combine with the next norm, the embed) and a CUDA-graph
                     wrapper for a fixed-shape step

Every module imports on a machine without Triton or CUDA: the Triton kernels are defined only
when `triton` imports, and each public function falls back to its torch reference on CPU.
`HAS_TRITON` says which side a call takes; tests force either side.
"""

from __future__ import annotations

import functools
import os

try:  # Triton ships with CUDA builds of torch only; CPU CI has none.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


# Triton's CPU interpreter (TRITON_INTERPRET=1): kernels there avoid what it lacks (libdevice,
# bf16 dots), read once at import
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def bf16_dot_args() -> dict:
    """(read once per process) `DOT` / `PREC` for tl.dot on bf16 operands: bf16 with the default
    precision on a GPU. Triton's CPU interpreter (TRITON_INTERPRET=1, for checking the kernels
    without a GPU) multiplies bf16 as raw bits, so there the operands are float32 with IEEE
    products: the same values (bf16 and FP8 values are exact in float32)."""
    if INTERPRET:
        return dict(DOT=tl.float32, PREC="ieee")
    return dict(DOT=tl.bfloat16, PREC=None)


def use_triton(*tensors) -> bool:
    """True when every tensor is on CUDA and Triton is importable: the one dispatch rule."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)

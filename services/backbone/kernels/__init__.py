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

from services.common.grpcutil import env_switch

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


# Programmatic dependent launch (Hopper). A decode step is ~570 short kernels back to back, and a
# kernel launched with `launch_pdl` may start while the one before it drains: its programs become
# resident and wait in `griddepcontrol.wait` (pdl_prologue) until the previous kernel has finished
# and its writes are visible, instead of the next launch starting only then. Each such kernel
# calls pdl_prologue first thing, in every program: it waits before it reads anything (a program
# that skipped the wait could finish before its predecessor, and its successor, which waits only
# for it, would read too early), then lets its own successor launch. Off in Triton's interpreter
# and off CUDA; DRAMA_PDL=0 turns it off (read once at import). H200 (session 9, bench/backbone.py,
# graphed decode step): batch 1 3.41 -> 3.20 ms, batch 128 20.44 -> 20.28, bit for bit the same.
PDL = HAS_TRITON and not INTERPRET and env_switch("DRAMA_PDL") is not False
# Under PDL a kernel's programs are resident while the kernel before them still runs. Whatever that
# kernel does not write they may read before they wait: weights, and state written by earlier
# kernels (when a program passes its wait, every kernel before its predecessor has finished, since
# each program of the predecessor waited before it let this kernel launch). DRAMA_PDL_PRELOAD (on
# unless 0; read once at import) has the MoE router's GEMV (its weights) and routing launch (u's
# quantisation), GDN's conv update and recurrence (their state) and the decode GEMM's split reduce
# (its residual) do so; the same bits. H200 (session 28 run 2, bench/backbone.py --settings, one
# process), graphed batch-1 decode step 2.68 / 2.69 / 2.55 -> 2.50 / 2.53 / 2.37 ms. A decode GEMM's
# own first weight tiles in registers lost (in_proj 14.9 -> 20.0 µs: the peeled steps' dots and
# shared memory); asking L2 for them, or for the shared expert's weights from the router's GEMV,
# before the wait changed nothing (run 3).
PDL_PRELOAD = env_switch("DRAMA_PDL_PRELOAD") is not False

if HAS_TRITON:
    if hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"):

        @triton.jit
        def pdl_prologue(ENABLED: tl.constexpr):
            if ENABLED:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
    else:  # pragma: no cover - a Triton without the intrinsics
        PDL = False

        @triton.jit
        def pdl_prologue(ENABLED: tl.constexpr):
            pass


def pdl_args() -> dict:
    """Launch arguments of a kernel that calls pdl_prologue(PDL): {PDL, launch_pdl} on a CUDA
    device of compute capability 9 or more when PDL is on, else {} (the kernel's PDL defaults to
    False, and nothing waits)."""
    if not PDL or not _pdl_device():
        return {}
    return dict(PDL=True, launch_pdl=True)


@functools.cache
def _pdl_device() -> bool:
    """Does this process's CUDA device launch with PDL (Hopper or later)? Read once."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

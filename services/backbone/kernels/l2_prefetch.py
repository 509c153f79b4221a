"""Weight bytes into L2 ahead of the kernel that reads them (issue #7).

At batch 1 a decode step spends most of its time in short, latency-bound kernels (routing, the
GDN recurrence, norms) while HBM idles, then in GEMMs bound by HBM. A program of an earlier kernel
can ask the copy engine (TMA) to bring a later kernel's weights into L2 with one instruction
(`cp.async.bulk.prefetch.L2`): nothing waits for it, nothing is written, no result depends on it,
only when the bytes arrive. The hint `evict_last` asks L2 to keep those lines over lines read
normally (the streamed expert weights in between).

    prefetch_l2(ptr, nbytes)              (inside a Triton kernel) thread 0 asks for [ptr, ptr+nbytes)
    prefetch_l2_lines(ptrs)               (inside a Triton kernel) every element's 128-byte line, per thread
    prefetch(tensor, nbytes, programs)    a launch of its own that asks for a tensor's first bytes

Hopper (sm_90) and later; the interpreter and CPUs never call these (callers pass PREFETCH=False).
"""

from __future__ import annotations

import torch

from . import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    # thread 0 of the program only: the other threads hold the same scalar operands
    _BULK = tl.constexpr("""{
    .reg .pred p; .reg .u32 t; .reg .b64 pol;
    mov.u32 t, %tid.x;
    setp.eq.u32 p, t, 0;
    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
    @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
    mov.u32 $0, 0;
    }""")
    _BULK_PLAIN = tl.constexpr("""{
    .reg .pred p; .reg .u32 t;
    mov.u32 t, %tid.x;
    setp.eq.u32 p, t, 0;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.u32 $0, 0;
    }""")

    @triton.jit
    def prefetch_l2(ptr, nbytes, HINT: tl.constexpr = True):
        """Ask for bytes [ptr, ptr + nbytes) in L2 (ptr 16-byte aligned, nbytes a multiple of 16),
        as `evict_last` lines when HINT. Returns at once."""
        if HINT:
            tl.inline_asm_elementwise(_BULK, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_BULK_PLAIN, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def prefetch_l2_lines(ptrs):
        """Ask for each element's line in L2 (`prefetch.global.L2::evict_last`), one per thread element."""
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LINES: tl.constexpr, HINT: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * CHUNK
        if start < nbytes:
            size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
            if LINES:
                offs = start + tl.arange(0, CHUNK // 128).to(tl.int64) * 128
                prefetch_l2_lines(tl.where(offs < nbytes, ptr + offs, ptr))
            else:
                prefetch_l2(ptr + start, size, HINT)


def prefetch(weight: torch.Tensor, nbytes: int, chunk: int = 1 << 18, lines: bool = False,
             hint: bool = True) -> None:
    """One launch asking for the first `nbytes` of `weight` (contiguous, CUDA) in L2, `chunk`
    bytes per program (a multiple of 128)."""
    nbytes = min(nbytes, weight.numel() * weight.element_size())
    nbytes -= nbytes % 16
    if nbytes <= 0:
        return
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    _prefetch_kernel[(triton.cdiv(nbytes, chunk),)](raw, nbytes, CHUNK=chunk, LINES=lines, HINT=hint,
                                                    num_warps=1 if not lines else 4)

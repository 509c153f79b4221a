"""Name every Triton kernel specialisation a stage makes after it reports SERVING.

The GPU stages warm up before SERVING so that no request pays for a kernel compilation. A
backbone prefill shape the warm-up missed costs about a second the first time it is seen. A
specialisation after SERVING therefore means the warm-up missed a shape (or a kernel argument
takes values it never took there).

`watch_after_serving()` installs Triton's `jit_cache_hook`, which Triton calls whenever a kernel
has no compiled binary in this process for the arguments' specialisation (a real compile or a
load from the on-disk cache). The hook logs the kernel and its signature at WARNING and counts
it in `late_specialisations`. It returns False, so compilation goes on as usual.
`grpcutil.set_serving` installs it when a stage turns SERVING. Without Triton (CPU-only torch)
it is a no-op.
"""

from __future__ import annotations

import logging

log = logging.getLogger("services.kernels")

late_specialisations = 0          # kernel specialisations made after SERVING, this process
_installed = False


def on_specialise(*, key=None, repr: str = "", fn=None, compile=None, is_manual_warmup: bool = False,
                  already_compiled: bool = False) -> bool:
    """The hook body (Triton's keyword arguments); False: let Triton compile."""
    global late_specialisations
    if is_manual_warmup or already_compiled:
        return False
    late_specialisations += 1
    log.warning("Triton kernel specialised after SERVING (the warm-up missed this shape; the "
                "request that caused it waited for the compile): %s", repr or key)
    return False


def watch_after_serving() -> bool:
    """Install the hook once per process, after any hook already there; False without Triton."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:           # CPU-only torch: no Triton, nothing compiles
        return False
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        on_specialise(**kwargs)
        return previous(**kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    _installed = True
    return True

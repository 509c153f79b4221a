"""Kernels beside the main stream: a fork and a join for work whose inputs are ready and whose
result is read only a few kernels later (issue #7).

    job = overlap.beside(fn, *args, device=...)   # fn(*args) on the side stream of the current stream
    ...                                           # main-stream kernels that do not read the result
    result = job.join()                           # the current stream waits for the side stream

Why: at small batches most of a layer's kernels are latency-bound and leave most SMs and most of
the memory bandwidth idle (a GDN decode layer's conv update and recurrence run ~7 µs on a few
dozen programs). A GEMM whose result is read only after them (GDN's z projection, read by the
gated norm) runs there for nearly free instead of in series. The results are the same kernels on
the same values; only the order on the GPU changes.

Where it is off: off CUDA (fn runs in place, join returns its result), and with
DRAMA_OVERLAP=0 (the callers then take their fused, single-stream form). Under CUDA-graph
capture the fork and the join become graph edges: the side stream waits on an event of the
capturing stream, so it joins the capture, and the join brings it back before the capture ends.

Why no record_stream is needed, given the caller's one rule (keep fn's inputs referenced until
join returns, which a layer does by holding them in locals):
- fn's inputs were made on the main stream and stay allocated while the side stream reads them;
- fn's outputs are allocated on the side stream. When freed, their blocks go back to the side
  stream's pool, and the next side-stream kernel that may reuse one runs after the next fork,
  which waits for everything the main stream had queued, including every read of the old result.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from services.common.grpcutil import env_switch

ENABLED = env_switch("DRAMA_OVERLAP") is not False      # default on (only CUDA has streams)

# one side stream per main stream (keyed by its handle): the decode graphs' capture stream, the
# prefill lane's, an eager caller's; a side stream never serves two main streams, so a fork
# waits only on its own main stream
_SIDE: dict[int, torch.cuda.Stream] = {}


def active(device: torch.device) -> bool:
    """True when `beside` runs its work on a side stream for tensors on `device`."""
    return ENABLED and torch.device(device).type == "cuda"


class Job:
    """A forked piece of work: join() makes the current stream wait for it and returns its result."""

    def __init__(self, result: Any, stream: torch.cuda.Stream | None):
        self._result, self._stream = result, stream

    def join(self) -> Any:
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._stream = None
        return self._result


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of the current stream on `device` (made on first use)."""
    main = torch.cuda.current_stream(device)
    side = _SIDE.get(main.cuda_stream)
    if side is None:
        side = _SIDE[main.cuda_stream] = torch.cuda.Stream(device)
    return side


def beside(fn: Callable[..., Any], *args: Any, device: torch.device) -> Job:
    """fn(*args) on the side stream after the work queued so far on the current stream (see the
    module docstring for the rule on inputs); in place where `active(device)` is False."""
    if not active(device):
        return Job(fn(*args), None)
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        result = fn(*args)
    return Job(result, side)

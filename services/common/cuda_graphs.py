"""Capturing a CUDA graph the way every stage does it (backbone decode/prefill steps, tower steps).

    capture(run, pool=None, stream=None, warmup=2) -> (graph, output)

`run()` is warmed up first on the capture stream, as torch's docs require (Triton compiles its
specialisations and cuBLAS creates its workspace for that stream), then captured on the same
stream. Why the stream matters: cuBLAS keeps one workspace per stream and a graph keeps the one of
its capture stream, and torch's default capture stream is one for the whole process, so two graph
families that may replay at the same time (the backbone's prefill pieces on the lane's stream and
its decode steps on the main loop's) must be captured on different streams. `pool` (a
torch.cuda.graph_pool_handle()) lets graphs that never replay concurrently share memory.
"""

from __future__ import annotations

from typing import Callable

import torch


def capture(run: Callable[[], object], *, pool=None, stream: torch.cuda.Stream | None = None,
            warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, output of the captured call): replaying the graph reruns `run` on whatever its
    static inputs hold then and refreshes that output in place. stream=None: a new stream."""
    stream = torch.cuda.Stream() if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads may go on using the GPU meanwhile (the backbone's checkpoint
    # readers copy experts while the warm-up captures, weights.start_backbone_load); torch's
    # default ("global") would refuse their allocations and syncs. This thread stays strict.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        output = run()
    return graph, output

"""Waiting for a CUDA stream with the host thread awake (issue #7), off by default.

A stage's step ends in one wait for the GPU (the backbone's rows, the tower's codes go to the host
next). CUDA's own wait blocks the thread in the driver: the py-spy profile of the single-stream
stack on the H200 (docs/perf.md, session 23) finds neither stage's thread on the CPU while its
step runs. A thread that slept pays on waking: in bench/tower.py a graphed tower step ran 1.95 ms
after its thread slept 5 ms against 1.60 ms after it spun 5 ms, with the GPU idle 5 ms in both
and its SM clock unchanged (1980 MHz). So a stage can poll instead: `synchronize(stream, spin=True)`
records an event and queries it until it has passed, letting the GIL go on each turn
(time.sleep(0)), so the thread never sleeps and other threads (the backbone's prefill lane) still
run.

Measured on the H200 (session 23): the tower's step in a loop 1.70 -> 1.51 ms with it; the
single-stream stack under MPS did not move (ms per frame at 20 words over four stacks each,
alternating: 5.58 / 5.28 / 5.71 / 5.27 polling, 5.16 / 5.62 / 5.53 / 5.31 blocking), and it costs
a CPU core per stage while its GPU works. So it is off unless `DRAMA_GPU_WAIT_SPIN=1`.
"""

from __future__ import annotations

import time

import torch

from services.common.grpcutil import env_switch


def spin_default(device: torch.device | str) -> bool:
    """Poll GPU waits? On a CUDA device with DRAMA_GPU_WAIT_SPIN=1; never elsewhere."""
    return torch.device(device).type == "cuda" and env_switch("DRAMA_GPU_WAIT_SPIN") is True


def synchronize(stream: torch.cuda.Stream, spin: bool) -> None:
    """Return once all work queued on `stream` so far has run."""
    if not spin:
        stream.synchronize()
        return
    done = torch.cuda.Event()
    done.record(stream)
    while not done.query():
        time.sleep(0)                         # the GIL goes to any thread that wants it

"""services/common/gpu_wait.py: a stage's wait for its GPU step, polled with the thread awake."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.common import gpu_wait


def test_spin_is_for_cuda_devices_when_turned_on(monkeypatch):
    monkeypatch.delenv("DRAMA_GPU_WAIT_SPIN", raising=False)
    assert not gpu_wait.spin_default("cuda:0") and not gpu_wait.spin_default("cpu")
    monkeypatch.setenv("DRAMA_GPU_WAIT_SPIN", "1")
    assert gpu_wait.spin_default("cuda:0") and gpu_wait.spin_default(torch.device("cuda"))
    assert not gpu_wait.spin_default("cpu")
    monkeypatch.setenv("DRAMA_GPU_WAIT_SPIN", "0")
    assert not gpu_wait.spin_default("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spin", [True, False])
def test_synchronize_returns_after_the_streams_work_and_lets_other_threads_run(spin):
    stream = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    ticks = []
    stop = threading.Event()

    def other():                              # a Python thread that needs the GIL meanwhile
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    host = torch.zeros(x.shape, pin_memory=True)
    # every kernel once before the timed part: a kernel's first launch loads its module, and
    # with lazy loading that launch waits for the running kernels (the sleep below)
    torch.cuda._sleep(1000)
    x.add_(1)
    host.copy_(x, non_blocking=True)
    x.zero_()
    torch.cuda.synchronize()
    thread = threading.Thread(target=other)
    thread.start()
    try:
        torch.cuda._sleep(200_000_000)        # ~0.1 s of GPU time at ~2 GHz
        x.add_(1)
        host.copy_(x, non_blocking=True)
        started = time.perf_counter()
        gpu_wait.synchronize(stream, spin)
        waited = time.perf_counter() - started
        # the work queued before the wait has run: the copy behind it is in host memory, read
        # with no other wait
        assert host[0].item() == 1.0 and host[-1].item() == 1.0
        assert waited > 0.02
        assert sum(started <= t <= started + waited for t in ticks) >= 5, "the other thread starved"
    finally:
        stop.set()
        thread.join()

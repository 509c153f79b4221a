"""Kernel specialisations after SERVING are named (services/common/kernel_watch.py)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from services.common import kernel_watch


def test_a_late_specialisation_is_logged_and_counted(caplog):
    before = kernel_watch.late_specialisations
    with caplog.at_level(logging.WARNING, logger="services.kernels"):
        go_on = kernel_watch.on_specialise(key=("k",), repr="_route_kernel[num_warps=4](n: i32, NP: 2048)",
                                           is_manual_warmup=False, already_compiled=False)
    assert go_on is False                                   # Triton compiles as usual
    assert kernel_watch.late_specialisations == before + 1
    assert "_route_kernel" in caplog.text and "after SERVING" in caplog.text


def test_warmups_and_cached_kernels_are_not_counted(caplog):
    before = kernel_watch.late_specialisations
    with caplog.at_level(logging.WARNING, logger="services.kernels"):
        kernel_watch.on_specialise(repr="a", is_manual_warmup=True)
        kernel_watch.on_specialise(repr="b", already_compiled=True)
    assert kernel_watch.late_specialisations == before and not caplog.text


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton is installed here")
def test_without_triton_watching_is_a_no_op():
    assert kernel_watch.watch_after_serving() is False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_hook_chains_to_one_already_installed():
    from triton import knobs

    seen = []
    saved, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, (lambda **kw: seen.append(kw) or False)
    saved_installed, kernel_watch._installed = kernel_watch._installed, False
    try:
        assert kernel_watch.watch_after_serving() is True
        before = kernel_watch.late_specialisations
        assert knobs.runtime.jit_cache_hook(key=1, repr="k", fn=None, compile={}, is_manual_warmup=False,
                                            already_compiled=False) is False
        assert seen and kernel_watch.late_specialisations == before + 1
    finally:
        knobs.runtime.jit_cache_hook, kernel_watch._installed = saved, saved_installed

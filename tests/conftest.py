"""Shared fixtures: the tiny random-weight checkpoint, made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Two CI cores: keep torch from oversubscribing them when servers and tests share the process.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The MODEL.md §10 tiny checkpoint (seed 0), written once for the whole session."""
    from services.common.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_checkpoint(out, preset="tiny", seed=0, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_config(tiny_checkpoint):
    from services.common.config import load_config

    return load_config(tiny_checkpoint)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module's direct model calls, as the stages' model workers use:
    the CPU paths are many tiny ops, and OpenMP fork/joins dominate them on a busy 2-core box.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

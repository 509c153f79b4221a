"""bench/kernel_resources.py: the occupancy arithmetic (always), and every case compiled for
sm_90 with its registers read back (where Triton is installed; no GPU needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_resources  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_programs_per_sm_follow_registers_and_shared_memory():
    # 96 registers x 128 threads: 5 programs in the 64 K register file; 168: 3 (session 13's case)
    assert kernel_resources.programs_per_sm(96, 12288, 4) == 5
    assert kernel_resources.programs_per_sm(168, 12288, 4) == 3
    # shared memory the tighter limit: 100 KB per program, 2 fit in 228 KB
    assert kernel_resources.programs_per_sm(32, 100 * 1024, 4) == 2
    assert kernel_resources.programs_per_sm(255, 0, 8) == 1


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (compiles for sm_90 on the CPU, no GPU)")
def test_every_case_compiles_for_hopper_without_spills():
    rows = kernel_resources.main([])
    assert [r["kernel"] for r in rows] == list(kernel_resources.cases())
    for r in rows:
        assert 0 < r["REG"] <= 255 and r["programs_per_sm"] >= 1, r
        assert r.get("LOCAL", 0) == 0, f"{r['kernel']} spills {r['LOCAL']} bytes per thread"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_unknown_arguments_are_named():
    fn = kernel_resources.cases()["down"][0]
    with pytest.raises(ValueError, match="no_such_arg"):
        kernel_resources.compile_case(fn, {"no_such_arg": "i32"}, {}, 4, 3, set())

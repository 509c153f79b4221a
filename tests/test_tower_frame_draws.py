"""The tower's fused frame draws (kernels.FusedFrameDraws) against the torch bookkeeping around
kernels.draw (engine.torch_sampler + model.FrameDraws + engine.advance_ras_windows).

Both paths draw with the same kernel code (kernels._draw_row), so every difference would come
from the bookkeeping the fused kernels take over: the RAS switch (§6.2), the repetition penalty,
EOS, the code writes at the draw rows, the RAS windows' advance. So the codes, stop flags and
windows must be equal, bit for bit, on rows made to hit each case.

Runs on CUDA, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1 with a Triton install);
skipped where neither is available (CI's CPU torch has no Triton).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
import torch

from services.common.config import DramaConfig
from services.tower import sampling
from services.tower.engine import advance_ras_windows, fused_frame_draws, torch_sampler
from services.tower.graphs import FLOAT_FIELDS, INT_FIELDS
from services.tower.model import FrameDraws
from tests.test_tower_kernels_draw import DEVICE, runnable


def _preset(name: str) -> DramaConfig:
    return DramaConfig.from_dict(json.loads(resources.files("services.common").joinpath(
        f"presets/{name}.json").read_text()))


def _windows(g: torch.Generator, slots: int, window: int, semantic: int) -> torch.Tensor:
    """RAS windows [slots, W], right-aligned, covering: empty, one code, a repeat among the last
    ras_recent (RAS on), a repeat only further back (RAS off), full windows of few values."""
    pool = torch.full((slots, window), -1, dtype=torch.int64)
    for s in range(slots):
        kind = s % 5
        if kind == 0:
            continue
        length = {1: 1, 2: 5, 3: window, 4: window}[kind]
        values = torch.randint(0, semantic, (length,), generator=g)
        if kind == 2:
            values[-1] = values[-3]                     # a repeat in the last four
        if kind == 3:
            values[-4:] = torch.arange(4)               # the last four distinct, a repeat before
            values[0] = values[-1]
        if kind == 4:
            values = torch.randint(0, 3, (length,), generator=g)
        pool[s, window - length:] = values
    return pool


def _parameters(g: torch.Generator, rows: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ints [6, R] / floats [3, R] in INT_FIELDS / FLOAT_FIELDS order, varied per row."""
    ints = torch.zeros(len(INT_FIELDS), rows, dtype=torch.int64)
    floats = torch.zeros(len(FLOAT_FIELDS), rows, dtype=torch.float32)
    ints[INT_FIELDS.index("slot")] = torch.tensor(slots)
    ints[INT_FIELDS.index("top_k")] = torch.tensor([[0, 5, 0, 2][r % 4] for r in range(rows)])
    ints[INT_FIELDS.index("seed")] = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g)
    ints[INT_FIELDS.index("take")] = torch.arange(rows) % 3
    ints[INT_FIELDS.index("frame")] = torch.randint(0, 500, (rows,), generator=g)
    floats[FLOAT_FIELDS.index("temperature")] = torch.tensor([[0.0, 0.7, 0.0, 1.3][r % 4] for r in range(rows)])
    floats[FLOAT_FIELDS.index("top_p")] = torch.tensor([[1.0, 0.8, 0.95][r % 3] for r in range(rows)])
    floats[FLOAT_FIELDS.index("penalty")] = torch.tensor([[2.0, 1.3, 1.0][r % 3] for r in range(rows)])
    return ints, floats


@runnable
@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_fused_frame_draws_equal_the_torch_bookkeeping(preset):
    cfg = _preset(preset)
    g = torch.Generator().manual_seed(3)
    window, semantic, residual = cfg.sampling.ras_window, cfg.semantic_codebook_size, cfg.residual_codebook_size
    slots_n, rows, extra = 13, 10, 4
    pool = _windows(g, slots_n, window, semantic)
    # rows 0 and 6: greedy, penalised 2x, one code in the window; 2 and 8 on RAS; 1 and 5 draw EOS
    slots = [(3 * r + 1) % slots_n for r in range(rows)]
    ints, floats = _parameters(g, rows, slots)
    # draw rows among T = rows + extra rows, out of the way of the teacher-forced ones
    draw_rows = torch.sort(torch.randperm(rows + extra, generator=g)[:rows]).values
    targets = torch.randint(0, residual, (rows + extra, cfg.num_codebooks), generator=g)
    targets[draw_rows] = -1
    semantic_logits = (torch.randn(rows, semantic + 1, generator=g) * 1.5).bfloat16()
    semantic_logits[[1, 5], semantic] = 40.0
    # the window's codes among the likeliest, so the penalty changes draws
    for r, s in enumerate(slots):
        seen = pool[s][pool[s] >= 0]
        semantic_logits[r, seen] = 6.0
    residual_logits = [(torch.randn(rows, residual, generator=g) * 3).bfloat16() for _ in range(cfg.num_codebooks - 1)]

    history = pool[torch.tensor(slots)]
    ras = sampling.ras_active(history, recent=cfg.sampling.ras_recent)
    assert ras.any() and not ras.all()

    def run(fused: bool, cfg=cfg, floats=floats):
        device_pool = pool.to(DEVICE, copy=True)
        i, f = ints.to(DEVICE), floats.to(DEVICE)
        codes, rows_ = targets.to(DEVICE, copy=True), draw_rows.to(DEVICE)
        if fused:
            draws = fused_frame_draws(cfg, device_pool, i, f)
        else:
            window_rows = device_pool[i[INT_FIELDS.index("slot")]]
            draws = FrameDraws(torch_sampler(cfg, window_rows, i, f), semantic)
        cast = (lambda x: x.to(DEVICE)) if not draws.float32_logits else (lambda x: x.to(DEVICE).float())
        stopped = draws.semantic(cast(semantic_logits), codes, rows_)
        for column, logits in enumerate(residual_logits, start=1):
            draws.residual(column, cast(logits), codes, rows_, stopped)
        if not fused:
            advance_ras_windows(device_pool, i[INT_FIELDS.index("slot")], window_rows, codes[rows_, 0], stopped)
        return codes.cpu(), stopped.cpu(), device_pool.cpu()

    fused_codes, fused_stopped, fused_pool = run(True)
    codes, stopped, advanced = run(False)
    assert stopped.any() and not stopped.all()
    assert torch.equal(fused_stopped, stopped)
    assert torch.equal(fused_codes, codes), (fused_codes - codes).abs().amax(dim=1)
    assert torch.equal(fused_pool, advanced)
    # the data exercise the penalty and the RAS switch: without either, other semantic codes
    unpenalised = floats.clone()
    unpenalised[FLOAT_FIELDS.index("penalty")] = 1.0
    assert not torch.equal(run(False, floats=unpenalised)[0][:, 0], codes[:, 0])
    no_ras = dataclasses.replace(cfg, sampling_defaults=dataclasses.replace(cfg.sampling, ras_temperature=0.0))
    assert not torch.equal(run(False, cfg=no_ras)[0][:, 0], codes[:, 0])
    assert torch.equal(run(True, cfg=no_ras)[0], run(False, cfg=no_ras)[0])
    # the teacher-forced rows kept their targets; stopped rows hold -1 in every codebook
    kept = torch.ones(rows + extra, dtype=torch.bool)
    kept[draw_rows] = False
    assert torch.equal(codes[kept], targets[kept])
    assert codes[draw_rows[stopped]].eq(-1).all()
    assert not torch.equal(advanced, pool)          # windows of drawing rows advanced


@runnable
def test_the_fused_semantic_draw_penalises_and_advances_its_window():
    """The fused semantic draw reads its row's window: with every other candidate far below, a
    greedy draw takes the window's code unless the penalty pushes it under the runner-up."""
    cfg = _preset("tiny")
    semantic = cfg.semantic_codebook_size
    pool = torch.full((2, cfg.sampling.ras_window), -1, dtype=torch.int64)
    pool[0, -1] = 7                                     # slot 0 has drawn 7 before; slot 1 nothing
    ints, floats = _parameters(torch.Generator().manual_seed(0), 2, [0, 1])
    floats[FLOAT_FIELDS.index("temperature")] = 0.0
    floats[FLOAT_FIELDS.index("penalty")] = 2.0
    logits = torch.full((2, semantic + 1), -5.0)
    logits[:, 7], logits[:, 9] = 4.0, 3.0               # 7 / 2 = 2 < 3: slot 0 draws 9, slot 1 draws 7
    codes = torch.full((2, cfg.num_codebooks), -1, dtype=torch.int64, device=DEVICE)
    draws = fused_frame_draws(cfg, pool.to(DEVICE), ints.to(DEVICE), floats.to(DEVICE))
    draws.semantic(logits.bfloat16().to(DEVICE), codes, torch.arange(2, device=DEVICE))
    assert codes[:, 0].tolist() == [9, 7]
    assert draws.history[:, -2:].tolist() == [[7, 9], [-1, 7]]

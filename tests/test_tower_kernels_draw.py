"""The tower's fused draw (kernels.draw: one Triton kernel per draw, no sort) against references.

The kernel finds the top-p/top-k cut by bisection and sums probabilities in float64, where
`sampling.draw` sorts and takes torch's float32 cumsum; both compute the softmax in float32 in
their own order. So the two may disagree only on a row whose outcome sits within rounding of a
boundary: a cumulative sum next to top_p, two probabilities next to each other at the cut, or two
race scores next to each other. `_float64_draw` repeats the draw in float64 and flags those rows;
every other row must give exactly the same candidate from the kernel, from sampling.draw and from
the float64 draw, and the flagged rows must stay rare (they are a few per thousand here).

Runs on CUDA, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1 with a Triton install);
skipped where neither is available (CI's CPU torch has no Triton).
"""

from __future__ import annotations

import os

import pytest
import torch

from services.tower import kernels, sampling

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runnable = pytest.mark.skipif(not kernels.HAS_TRITON or not (torch.cuda.is_available() or INTERPRET),
                              reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")
TOLERANCE = 1e-5        # relative closeness that marks a boundary row as ambiguous


def _float64_draw(logits, temperature, top_p, top_k, keys):
    """(answer int64 [R], ambiguous bool [R]): §6.1 in float64 on the float32-scaled logits."""
    logits = logits.double().cpu()
    rows, m = logits.shape
    temperature, top_p, top_k = temperature.double().cpu(), top_p.double().cpu(), top_k.cpu()
    greedy = temperature <= 0
    scaled = (logits.float() / torch.where(greedy, 1.0, temperature).float()[:, None]).double()
    probs = torch.softmax(scaled, dim=-1)
    kept = sampling.kept_candidates(probs, top_p, top_k)          # §6.1's rule, here in float64
    sorted_probs = torch.sort(probs, dim=-1, descending=True, stable=True).values
    cumulative = sorted_probs.cumsum(dim=-1)
    rank = torch.arange(m)[None, :]
    # ambiguous: a cumulative sum within rounding of top_p (ranks >= 2, top_p < 1), or the last
    # kept and the first dropped probabilities close but not equal (float32 may tie or swap them)
    near_p = ((cumulative - top_p[:, None]).abs() <= TOLERANCE * top_p.clamp(min=1e-3)[:, None]) & (rank >= 1)
    ambiguous = (near_p & (top_p[:, None] < 1)).any(dim=-1)
    count = kept.sum(dim=-1)
    has_next = count < m
    last = sorted_probs.gather(1, (count - 1)[:, None])[:, 0]
    following = sorted_probs.gather(1, count.clamp(max=m - 1)[:, None])[:, 0]
    ambiguous |= has_next & (last != following) & ((last - following).abs() <= TOLERANCE * last)
    q = sampling.exponential_noise(keys.cpu(), m).double()
    score = torch.where(probs > 0, probs / q, torch.zeros_like(probs))
    score = torch.where(kept, score, torch.full_like(score, -1.0))
    top2 = score.topk(2, dim=-1).values if m > 1 else torch.cat([score, score - 1], dim=-1)
    ambiguous |= (top2[:, 0] > 0) & ((top2[:, 0] - top2[:, 1]).abs() <= TOLERANCE * top2[:, 0])
    answer = torch.where(greedy, logits.argmax(dim=-1), score.argmax(dim=-1))
    return answer, ambiguous & ~greedy


def _inputs(rows: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # bf16-valued logits, as the heads give them: many exact ties among candidates
    logits = (torch.randn(rows, m, generator=g) * 4).bfloat16().float()
    logits[:4] = 0.0                                                   # all tied
    logits[4:24] = (logits[4:24] / 4).round()                          # a few values: big tie groups at the cut
    temperature = torch.rand(rows, generator=g) * 1.6
    temperature[::7] = 0.0                                             # greedy rows
    temperature[3::11] = 1e-3                                          # most probabilities underflow to 0
    top_p = torch.rand(rows, generator=g)
    top_p[::5] = 1.0
    top_p[1::9] = 0.0                                                  # first rank only
    top_p[2::13] = 0.95
    top_k = torch.randint(-2, 60, (rows,), generator=g)
    top_k[::4] = 4097
    top_k[1::6] = 1
    seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g)
    takes = torch.randint(0, 4, (rows,), generator=g)
    frames = torch.randint(0, 3000, (rows,), generator=g)
    return [t.to(DEVICE) for t in (logits, temperature, top_p, top_k, seeds, takes, frames)]


@runnable
@pytest.mark.parametrize("m", [4097, 1024, 33, 7, 1])
def test_fused_draw_equals_the_references_away_from_boundaries(m):
    rows = 256 if DEVICE == "cuda" else 48
    logits, temperature, top_p, top_k, seeds, takes, frames = _inputs(rows, m, seed=m)
    flagged = 0
    for draw_index in (0, 1, 9):
        fused = kernels.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds,
                             takes=takes, frames=frames, draw_index=draw_index).cpu()
        keys = sampling.noise_key(seeds, takes, frames, draw_index)
        torch_draw = sampling.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, keys=keys).cpu()
        reference, ambiguous = _float64_draw(logits, temperature, top_p, top_k, keys)
        clear = ~ambiguous
        bad = (clear & (fused != reference)).nonzero()[:, 0]
        assert bad.numel() == 0, f"draw {draw_index}: rows {bad[:8].tolist()} fused {fused[bad[:8]].tolist()} " \
                                 f"float64 {reference[bad[:8]].tolist()}"
        assert torch.equal(fused[clear], torch_draw[clear])
        flagged += int(ambiguous.sum())
    assert flagged <= 0.03 * 3 * rows, f"{flagged} of {3 * rows} rows flagged as boundary cases"


@runnable
@pytest.mark.parametrize("m", [4097, 1024, 33])
def test_the_race_first_gives_the_bisections_codes(m, monkeypatch):
    """kernels.RACE_FIRST answers a draw whose race winner lies inside the cut without bisecting:
    the same codes as the bisection on every row, in rows where it answers and rows where it
    bisects (both kinds must be there, or the test proves nothing)."""
    rows = 256 if DEVICE == "cuda" else 40
    logits, temperature, top_p, top_k, seeds, takes, frames = _inputs(rows, m, seed=100 + m)
    temperature[rows // 2:] = 0.8                  # the served default on the flat half: wide cuts
    logits[rows // 2:] = logits[rows // 2:] / 8
    codes, inside = {}, []
    for race_first in (False, True):
        monkeypatch.setattr(kernels, "RACE_FIRST", race_first)
        codes[race_first] = torch.stack([
            kernels.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds, takes=takes,
                         frames=frames, draw_index=draw_index).cpu() for draw_index in (0, 5)])
    assert torch.equal(codes[True], codes[False])
    for draw_index in (0, 5):
        keys = sampling.noise_key(seeds, takes, frames, draw_index).cpu()
        probs = torch.softmax(logits.cpu().double() / temperature.cpu().double().clamp(min=1e-30)[:, None], dim=-1)
        kept = sampling.kept_candidates(probs, top_p.cpu().double(), top_k.cpu())
        score = torch.where(probs > 0, probs / sampling.exponential_noise(keys, m).double(), 0.0)
        winner = score.argmax(dim=-1)
        inside.append(kept.gather(1, winner[:, None])[:, 0] & (temperature.cpu() > 0))
    share = torch.cat(inside).float().mean()
    assert 0.2 < share < 0.9, f"the race first would answer {share:.0%} of the draws"


@runnable
def test_fused_draw_corners():
    """Hand-made rows with known answers: ties, greedy, rank 1 only, a zero-probability field."""
    m = 9
    logits = torch.tensor([
        [0.0] * m,                                      # all tied: top_k 3 keeps indices 0, 1, 2
        [1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0],  # greedy: first of the tied maxima
        [1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0],  # top_p 0: rank 1 only (index 1)
        [1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0],  # top_k 2: indices 1 and 2
        [0.0, 0.0, 80.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # temperature 0.01: only index 2 is > 0
    ], device=DEVICE)
    rows = logits.shape[0]
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.01], device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], device=DEVICE)
    top_k = torch.tensor([3, 0, 0, 2, 0], device=DEVICE)
    for frame in range(40):
        args = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                    seeds=torch.arange(rows, device=DEVICE) + 17, takes=torch.zeros(rows, dtype=torch.int64, device=DEVICE),
                    frames=torch.full((rows,), frame, device=DEVICE))
        codes = kernels.draw(logits, draw_index=0, **args).tolist()
        assert codes[0] in (0, 1, 2) and codes[1] == 1 and codes[2] == 1 and codes[3] in (1, 2) and codes[4] == 2
        keys = sampling.noise_key(args["seeds"], args["takes"], args["frames"], 0)
        reference = sampling.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, keys=keys).tolist()
        assert codes == reference


@runnable
def test_fused_draw_is_batch_invariant():
    """A row's draw is the same alone, inside a batch, and at any place in it."""
    rows, m = 24, 1024
    logits, temperature, top_p, top_k, seeds, takes, frames = _inputs(rows, m, seed=3)
    together = kernels.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds, takes=takes,
                            frames=frames, draw_index=2)
    flipped = kernels.draw(logits.flip(0), temperature=temperature.flip(0), top_p=top_p.flip(0), top_k=top_k.flip(0),
                           seeds=seeds.flip(0), takes=takes.flip(0), frames=frames.flip(0), draw_index=2)
    assert torch.equal(together, flipped.flip(0))
    for r in (0, 5, rows - 1):
        alone = kernels.draw(logits[r:r + 1], temperature=temperature[r:r + 1], top_p=top_p[r:r + 1],
                             top_k=top_k[r:r + 1], seeds=seeds[r:r + 1], takes=takes[r:r + 1],
                             frames=frames[r:r + 1], draw_index=2)
        assert int(alone) == int(together[r])


@runnable
def test_fused_draw_ends_on_nan_and_infinite_logits():
    """Broken logits (NaN, all -inf, +inf) still give an index in range: the kernel's searches
    always end (a GPU kernel that loops forever would hang the stage)."""
    m = 257
    logits = torch.randn(4, m, device=DEVICE)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, 7] = float("inf")
    logits[3] = float("nan")
    n = logits.shape[0]
    codes = kernels.draw(logits, temperature=torch.full((n,), 0.8, device=DEVICE), top_p=torch.full((n,), 0.9, device=DEVICE),
                         top_k=torch.full((n,), 30, device=DEVICE), seeds=torch.arange(n, device=DEVICE),
                         takes=torch.zeros(n, dtype=torch.int64, device=DEVICE), frames=torch.zeros(n, dtype=torch.int64, device=DEVICE),
                         draw_index=1)
    assert codes.shape == (n,) and bool(((codes >= 0) & (codes < m)).all())


def test_too_many_candidates_take_the_torch_path():
    """Above FUSED_DRAW_MAX_CANDIDATES (and without Triton) the draw is sampling.draw itself."""
    m = kernels.FUSED_DRAW_MAX_CANDIDATES + 1
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, m, generator=g)
    args = dict(temperature=torch.tensor([0.8, 0.0]), top_p=torch.tensor([0.9, 1.0]), top_k=torch.tensor([0, 0]))
    seeds, takes, frames = torch.tensor([5, 6]), torch.tensor([0, 0]), torch.tensor([3, 4])
    got = kernels.draw(logits, seeds=seeds, takes=takes, frames=frames, draw_index=1, **args)
    keys = sampling.noise_key(seeds, takes, frames, 1)
    assert torch.equal(got, sampling.draw(logits, keys=keys, **args))

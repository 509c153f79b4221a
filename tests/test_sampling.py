"""The tower sampler (MODEL.md §6): distribution, determinism, the naive reference, RAS."""

from __future__ import annotations

import random

import pytest
import torch

from services.tower import sampling as S


def _critical_chi2(df: int, alpha: float = 1e-4) -> float:
    """Upper-tail chi-square critical value by the Wilson-Hilferty cube approximation.

    scipy is not installed; for df >= 2 the approximation is within a fraction of a percent of the
    exact value at this alpha, far below what a wrong sampler produces.
    """
    z = torch.special.ndtri(torch.tensor(1 - alpha, dtype=torch.float64)).item()
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3


def _expected_kept(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The renormalised kept distribution of one row, in float64, straight from §6.1."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    kept, cumulative = [], 0.0
    for rank, i in enumerate(order):
        cumulative += probs[i].item()
        if rank == 0 or cumulative <= top_p or top_p >= 1:
            kept.append(i)
    if 0 < top_k < len(kept):
        kept = kept[:top_k]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def _keys(n: int, seed: int = 1234, draw_index: int = 0) -> torch.Tensor:
    return S.noise_key(seed, 0, torch.arange(n), draw_index)


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.8, 3), (1.0, 1.0, 5), (1.5, 0.95, 30), (0.8, 0.5, 4097),
], ids=lambda v: str(v))
def test_empirical_distribution_matches_kept_set(temperature, top_p, top_k):
    """Over many keys, draws follow the renormalised kept set; dropped candidates never appear."""
    torch.manual_seed(0)
    m, n = 40, 40000
    logits = torch.randn(m) * 1.5
    expected = _expected_kept(logits, temperature, top_p, top_k)
    codes = S.draw(logits.expand(n, m), temperature=temperature, top_p=top_p, top_k=top_k,
                   keys=_keys(n))
    counts = torch.bincount(codes, minlength=m).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a dropped candidate was drawn"
    df = int(kept.sum()) - 1
    if df == 0:
        assert counts[kept].sum() == n
        return
    statistic = ((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum().item()
    assert statistic < _critical_chi2(df), f"chi2 {statistic:.1f} with df {df}"


def test_rows_are_independent():
    """Two rows of one step with different draw indices: their joint counts factorise."""
    logits = torch.tensor([0.0, 0.3, -0.2])
    n = 30000
    frames = torch.arange(n)
    keys = torch.stack([S.noise_key(7, 0, frames, 1), S.noise_key(7, 0, frames, 2)], dim=1).flatten()
    codes = S.draw(logits.expand(2 * n, 3), temperature=1.0, top_p=1.0, top_k=0, keys=keys).view(n, 2)
    joint = torch.zeros(3, 3, dtype=torch.float64)
    joint.index_put_((codes[:, 0], codes[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    expected = joint.sum(1, keepdim=True) * joint.sum(0, keepdim=True) / n
    statistic = ((joint - expected) ** 2 / expected).sum().item()
    assert statistic < _critical_chi2(4)


@pytest.mark.parametrize("top_k", [0, -3, 4097, 10000])
def test_top_k_zero_or_large_keeps_all(top_k):
    probs = torch.softmax(torch.randn(2, 4097), dim=-1)
    kept = S.kept_candidates(probs, torch.ones(2), torch.full((2,), top_k))
    assert kept.all()


def test_top_p_keeps_first_rank_and_cuts_by_inclusive_cumsum():
    probs = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.05, 0.9, 0.03, 0.02]])
    kept = S.kept_candidates(probs, torch.tensor([0.7, 0.5]), torch.zeros(2, dtype=torch.int64))
    # Row 0: ranks 1(0.5) 2(0.2, index 2 before index 3 on the tie) -> cumsum 0.7 <= 0.7 kept.
    assert kept.tolist() == [[False, True, True, False], [False, True, False, False]]


def test_top_k_applies_after_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    kept = S.kept_candidates(probs, torch.tensor([0.95]), torch.tensor([2]))
    assert kept.tolist() == [[True, True, False, False]]


def test_temperature_zero_is_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    codes = S.draw(logits, temperature=0.0, top_p=0.1, top_k=1, keys=_keys(2))
    assert codes.tolist() == [1, 0]
    codes = S.draw(logits, temperature=torch.tensor([-1.0, 0.0]), top_p=0.9, top_k=0, keys=_keys(2))
    assert codes.tolist() == [1, 0]


def test_same_key_same_draw_different_key_different_stream():
    torch.manual_seed(1)
    logits = torch.randn(1, 4097).expand(64, 4097)
    same = S.draw(logits, temperature=1.0, top_p=1.0, top_k=0, keys=_keys(1).expand(64))
    assert (same == same[0]).all()
    varied = S.draw(logits, temperature=1.0, top_p=1.0, top_k=0, keys=_keys(64))
    assert len(set(varied.tolist())) > 32


def test_draw_is_batch_invariant():
    """A row's draw does not depend on which other rows share the call."""
    torch.manual_seed(2)
    logits = torch.randn(9, 300)
    keys = _keys(9)
    temperature = torch.linspace(0.3, 1.5, 9)
    batched = S.draw(logits, temperature=temperature, top_p=0.9, top_k=50, keys=keys)
    for r in range(9):
        alone = S.draw(logits[r:r + 1], temperature=temperature[r:r + 1], top_p=0.9, top_k=50,
                       keys=keys[r:r + 1])
        assert alone.item() == batched[r].item()


def test_splitmix_and_keys_match_python_integers():
    rng = random.Random(0)
    values = [rng.getrandbits(64) for _ in range(500)] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    tensor = torch.tensor([S.as_int64(v) for v in values])
    got = [v & (2**64 - 1) for v in S.splitmix64(tensor).tolist()]
    assert got == [S.naive_splitmix64(v) for v in values]
    for seed, take, frame, draw_index in [(0, 0, 0, 0), (2**64 - 1, 3, 2047, 9), (12345, 1, 7, 0)]:
        key = S.noise_key(seed, take, frame, draw_index).item() & (2**64 - 1)
        assert key == S.naive_noise_key(seed, take, frame, draw_index)


def test_noise_matches_naive_stream():
    """Same q as the per-candidate loop, up to the last bit of the float32 logarithm."""
    keys = _keys(3, seed=99)
    q = S.exponential_noise(keys, 4097)
    for r in range(3):
        naive = torch.tensor(S.naive_exponential_noise(keys[r].item(), 4097))
        ulp = torch.finfo(torch.float32).eps * naive.abs().clamp(min=2.0 ** -20)
        assert ((q[r] - naive).abs() <= ulp).all()
    assert (q > 0).all() and abs(q.mean().item() - 1.0) < 0.05


@pytest.mark.parametrize("m", [7, 33, 4097])
def test_batched_draw_equals_naive(m):
    torch.manual_seed(m)
    rows = 12
    logits = torch.randn(rows, m) * 2
    logits[3, 1] = logits[3, 0]                                   # a tie
    temperature = torch.tensor([0.8, 0.0, 1.0, 1.5, 0.5, -1.0, 0.8, 1.2, 0.9, 2.0, 0.3, 1.0])
    top_p = torch.tensor([0.9, 0.9, 1.0, 0.95, 0.5, 0.9, 0.99, 0.7, 1.0, 0.2, 0.9, 0.0])
    top_k = torch.tensor([0, 0, 4097, 30, 3, 1, 0, 10, 1, 0, 2, 0])
    keys = _keys(rows, seed=5)
    batched = S.draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, keys=keys)
    naive = S.naive_draw(logits, temperature=temperature, top_p=top_p, top_k=top_k, keys=keys)
    assert batched.tolist() == naive.tolist()


def _history(codes_per_row: list[list[int]], window: int = 16) -> torch.Tensor:
    out = torch.full((len(codes_per_row), window), -1, dtype=torch.int64)
    for r, codes in enumerate(codes_per_row):
        codes = codes[-window:]
        if codes:
            out[r, window - len(codes):] = torch.tensor(codes)
    return out


def test_ras_trigger():
    cases = [
        ([], False), ([5], False), ([5, 5], True), ([5, 6], False), ([1, 2, 3, 4], False),
        ([1, 2, 1, 4], True), ([9, 9, 1, 2, 3, 4], False),   # the repeat is older than the last 4
        ([7, 1, 2, 3, 7], False), ([1, 2, 3, 3], True), (list(range(20)) + [0, 19], True),
    ]
    history = _history([codes for codes, _ in cases])
    got = S.ras_active(history, recent=4).tolist()
    assert got == [expected for _, expected in cases]
    assert got == [S.naive_ras_active(codes[-16:], recent=4) for codes, _ in cases]


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5, 4.0, -3.0], [2.0, -1.0, 0.5, 4.0, -3.0]])
    history = _history([[0, 1, 1, 4], []], window=6)
    out = S.apply_repetition_penalty(logits, history, torch.tensor([2.0, 2.0]))
    assert out[0].tolist() == [1.0, -2.0, 0.5, 4.0, -6.0]      # each distinct code once
    assert out[1].tolist() == logits[1].tolist()                  # empty history: unchanged
    assert out[0].tolist() == S.naive_repetition_penalty(logits[0].tolist(), [0, 1, 1, 4], 2.0)
    off = S.apply_repetition_penalty(logits, history, 1.0)
    assert torch.equal(off, logits)

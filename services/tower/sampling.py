"""The tower's sampler (MODEL.md §6): one batched draw, its noise, RAS and the repetition penalty.

Everything here is a pure function of tensors, batched over rows `R` with `M` candidates per row,
and never synchronises with the host, so a whole step's draws are a handful of kernels.

    draw(logits [R, M], temperature=, top_p=, top_k=, keys [R]) -> int64 [R]
    noise_key(seed, take_index, frame_index, draw_index) -> int64 key (§6.3)
    exponential_noise(keys [R], M) -> float32 [R, M]
    ras_active(history [R, W], recent=) -> bool [R]                        (§6.2)
    apply_repetition_penalty(logits [R, M], history [R, W], penalty) -> [R, M]

`history` holds the last `ras_window` semantic codes of each row's take, right-aligned, with -1
where the take has fewer codes so far.

The `naive_*` functions are the readable references: one row at a time, Python integers for
splitmix64, float64 for the softmax and the cumulative sums. Tests require `draw` and
`naive_draw` to agree.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------------
# splitmix64 on int64 tensors
# --------------------------------------------------------------------------------------------
# torch has no full uint64 arithmetic, so the uint64 values live in int64 tensors with the same
# bits. Addition and multiplication wrap mod 2^64 in two's complement exactly as unsigned ones do;
# only the right shift differs (torch's is arithmetic), so `_shr` masks off the copied sign bits.

_MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned (or any) Python integer `value`."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = as_int64(0x9E3779B97F4A7C15)
_MIX1 = as_int64(0xBF58476D1CE4E5B9)
_MIX2 = as_int64(0x94D049BB133111EB)


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """The splitmix64 step (§6.3) on int64 tensors holding uint64 bits, elementwise."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def noise_key(seed, take_index, frame_index, draw_index) -> Tensor:
    """The key of one draw's noise stream (§6.3), as int64 bits; arguments broadcast.

    Each argument is a Python int or an int64 tensor. `seed` may be a full uint64 Python int.
    """
    def as_tensor(v):
        return v.to(torch.int64) if isinstance(v, Tensor) else torch.tensor(as_int64(int(v)))

    h = splitmix64(as_tensor(seed))
    for v in (take_index, frame_index, draw_index):
        h = splitmix64(h ^ as_tensor(v))
    return h


def exponential_noise(keys: Tensor, num_candidates: int) -> Tensor:
    """q [R, M] float32: the Exp(1) variate of each candidate in each row's stream (§6.3).

    Counter-based: candidate `i` of the stream with key `h` is `-ln(u)` with `w = sm(h ^ i)` and
    `u = ((w >> 11) + 0.5) * 2^-53`. The 53-bit integer and `u` are exact in float64; `u` is then
    rounded once to float32 and the logarithm taken in float32. (That rounding can make `u = 1`
    and so `q = 0` for about one candidate in 2^25; `draw` handles the resulting infinities.)
    """
    counters = torch.arange(num_candidates, dtype=torch.int64, device=keys.device)
    w = splitmix64(keys.to(torch.int64)[:, None] ^ counters[None, :])
    u = (_shr(w, 11).to(torch.float64) + 0.5) * 2.0 ** -53
    return -torch.log(u.to(torch.float32))


# --------------------------------------------------------------------------------------------
# one batched draw (§6.1)
# --------------------------------------------------------------------------------------------

def _per_row(value, rows: int, dtype: torch.dtype, device) -> Tensor:
    """A float/int or an [R] tensor as an [R] tensor of `dtype`."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype).expand(rows)
    return torch.full((rows,), value, dtype=dtype, device=device)


def kept_candidates(probs: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """bool [R, M]: the candidates that survive top-p then top-k (§6.1 steps 3-4).

    Rank by probability descending, ties to the lower index (a stable descending sort). Top-p keeps
    rank r (1-based) iff r = 1 or the inclusive cumulative sum at r is <= top_p; top_p >= 1 keeps
    all. The top-p survivors are a prefix of the ranking, so top-k keeps ranks <= top_k of it;
    top_k <= 0 keeps all.
    """
    rows, m = probs.shape
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(m, device=probs.device)[None, :]                      # 0-based
    cumulative = sorted_probs.cumsum(dim=-1)
    keep_sorted = (rank == 0) | (cumulative <= top_p[:, None]) | (top_p[:, None] >= 1)
    k = torch.where(top_k <= 0, torch.full_like(top_k, m), top_k)
    keep_sorted &= rank < k[:, None]
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def draw(logits: Tensor, *, temperature, top_p, top_k, keys: Tensor) -> Tensor:
    """One draw per row (§6.1): int64 [R] candidate indices.

    logits [R, M] (any float dtype, used in float32); temperature, top_p, top_k: a number for
    every row or an [R] tensor; keys int64 [R] from `noise_key`. Temperature <= 0 is argmax
    (lowest index on ties). Otherwise softmax(logits / temperature), top-p, top-k, and the
    exponential race `argmax over kept of probs / q`: the same as sampling the renormalised kept
    distribution, but with no host sync and always M noise values per row.
    """
    logits = logits.to(torch.float32)
    rows, m = logits.shape
    device = logits.device
    temperature = _per_row(temperature, rows, torch.float32, device)
    top_p = _per_row(top_p, rows, torch.float32, device)
    top_k = _per_row(top_k, rows, torch.int64, device)

    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    kept = kept_candidates(probs, top_p, top_k)
    q = exponential_noise(keys, m)
    # A kept zero-probability candidate scores 0 (never nan from 0/0); a dropped one scores -1,
    # below every kept one. q = 0 gives +inf, and argmax takes the first (lowest) index on ties.
    race = torch.where(probs > 0, probs / q, torch.zeros_like(probs))
    race = torch.where(kept, race, torch.full_like(race, -1.0))
    return torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))


# --------------------------------------------------------------------------------------------
# repetition-aware sampling and the repetition penalty (§6.2)
# --------------------------------------------------------------------------------------------

def ras_active(history: Tensor, *, recent: int) -> Tensor:
    """bool [R]: is this a RAS frame? history int64 [R, W], right-aligned, -1 = empty.

    True iff the take has >= 2 codes and its last `recent` codes contain a repeated value.
    """
    last = history[:, -recent:]
    valid = last >= 0
    same = (last[:, :, None] == last[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    distinct_pairs = ~torch.eye(last.shape[1], dtype=torch.bool, device=history.device)
    repeated = (same & distinct_pairs).flatten(1).any(dim=-1)
    return repeated & ((history >= 0).sum(dim=-1) >= 2)


def apply_repetition_penalty(logits: Tensor, history: Tensor, penalty) -> Tensor:
    """logits [R, M] with each distinct code of `history` [R, W] penalised by rho (§6.2).

    A penalised logit is divided by rho if positive, multiplied by rho otherwise; rho = 1 changes
    nothing. Empty slots (-1) penalise nothing. The caller passes the semantic logits only; the EOS
    index never appears in the history.
    """
    rows, m = logits.shape
    penalty = _per_row(penalty, rows, logits.dtype, logits.device)[:, None]
    # Empty slots write into a spare column M, dropped afterwards, so one scatter of `True` does it
    # (duplicate indices are harmless when every write is the same value).
    index = torch.where(history >= 0, history, torch.full_like(history, m))
    seen = torch.zeros(rows, m + 1, dtype=torch.bool, device=logits.device)
    seen = seen.scatter_(1, index, True)[:, :m]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


# --------------------------------------------------------------------------------------------
# naive references
# --------------------------------------------------------------------------------------------

def _float32(x: float) -> float:
    """`x` rounded to the nearest float32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def naive_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def naive_noise_key(seed: int, take_index: int, frame_index: int, draw_index: int) -> int:
    """§6.3 key as an unsigned Python int."""
    h = naive_splitmix64(seed & _MASK64)
    for v in (take_index, frame_index, draw_index):
        h = naive_splitmix64(h ^ (v & _MASK64))
    return h


def naive_exponential_noise(key: int, num_candidates: int) -> list[float]:
    """One stream's q values, a candidate at a time (ln in float64 of the float32 u, rounded)."""
    out = []
    for i in range(num_candidates):
        w = naive_splitmix64((key & _MASK64) ^ i)
        u = ((w >> 11) + 0.5) * 2.0 ** -53
        out.append(_float32(-math.log(_float32(u))))
    return out


def naive_draw(logits: Tensor, *, temperature, top_p, top_k, keys: Tensor) -> Tensor:
    """`draw`, one row at a time with plain loops; same signature and answers."""
    rows, m = logits.shape
    temperature = _per_row(temperature, rows, torch.float32, "cpu").tolist()
    top_p = _per_row(top_p, rows, torch.float32, "cpu").tolist()
    top_k = _per_row(top_k, rows, torch.int64, "cpu").tolist()
    out = []
    for r in range(rows):
        row = logits[r].to(torch.float32).tolist()
        if temperature[r] <= 0:
            out.append(max(range(m), key=lambda i: (row[i], -i)))
            continue
        scaled = [_float32(x / temperature[r]) for x in row]
        peak = max(scaled)
        weights = [math.exp(x - peak) for x in scaled]
        total = sum(weights)
        probs = [w / total for w in weights]

        ranking = sorted(range(m), key=lambda i: (-probs[i], i))
        kept, cumulative = [], 0.0
        for r_index, i in enumerate(ranking):
            cumulative += probs[i]
            if r_index == 0 or cumulative <= top_p[r] or top_p[r] >= 1:
                kept.append(i)
            else:
                break
        if 0 < top_k[r] < len(kept):
            kept = kept[:top_k[r]]

        q = naive_exponential_noise(int(keys[r]), m)
        best, best_score = None, -1.0
        for i in sorted(kept):
            score = probs[i] / q[i] if probs[i] > 0 and q[i] > 0 else (math.inf if probs[i] > 0 else 0.0)
            if score > best_score:
                best, best_score = i, score
        out.append(best)
    return torch.tensor(out, dtype=torch.int64)


def naive_ras_active(codes: list[int], *, recent: int) -> bool:
    """§6.2 trigger for one take's semantic codes so far (oldest first, window already applied)."""
    last = codes[-recent:]
    return len(codes) >= 2 and len(set(last)) < len(last)


def naive_repetition_penalty(logits: list[float], codes: list[int], penalty: float) -> list[float]:
    out = list(logits)
    for c in set(codes):
        out[c] = out[c] / penalty if out[c] > 0 else out[c] * penalty
    return out

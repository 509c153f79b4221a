"""Band-limited sinc resampling, the same filter as torchaudio's default (MODEL.md §7.6 step 1).

torchaudio.functional.resample defaults: windowed sinc, Hann window, lowpass_filter_width 6,
rolloff 0.99. With g = gcd(orig, new), o = orig/g and n = new/g, output phase j ∈ [0, n) of
every block of o input samples is one polyphase filter, so the whole resampler is a strided
conv1d with n output channels. (torchaudio is not installed here; this is written from the math.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
# o·n·(2·width + o) filter taps above this would take gigabytes (e.g. 44099 -> 44100 Hz).
MAX_KERNEL_ELEMENTS = 1 << 25


def reduced_rates(orig_freq: int, new_freq: int) -> tuple[int, int]:
    g = math.gcd(int(orig_freq), int(new_freq))
    return int(orig_freq) // g, int(new_freq) // g


def sinc_resample_kernel(orig: int, new: int, dtype: torch.dtype = torch.float32,
                         lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
                         rolloff: float = ROLLOFF) -> tuple[Tensor, int]:
    """Polyphase filters [new, 1, 2·width + orig] and the half width, for reduced rates orig/new.

    The cutoff is rolloff·min(orig, new) (in units of the reduced rates); tap times are clamped to
    ±lowpass_filter_width zero crossings and weighted by a Hann window cos²(πt / 2w).
    """
    cutoff = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig     # input times
    phases = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new          # output offsets
    t = (phases + taps) * cutoff
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.tensor(1.0, dtype=dtype), t.sin() / t)
    # torchaudio multiplies by (window · scale) as one factor; keep that association.
    return sinc * (window * (cutoff / orig)), width


def resample(waveform: Tensor, orig_freq: int, new_freq: int) -> Tensor:
    """Resample the last dim of waveform [..., S] -> [..., ceil(S·new/orig)] (float input)."""
    if int(orig_freq) == int(new_freq):
        return waveform
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_freq} -> {new_freq}")
    orig, new = reduced_rates(orig_freq, new_freq)
    if new * (2 * orig + 14) > MAX_KERNEL_ELEMENTS:
        raise ValueError(f"cannot resample {orig_freq} Hz -> {new_freq} Hz: the rates share no "
                         f"useful common factor (filter would have {new} x {orig} phases)")
    kernel, width = sinc_resample_kernel(orig, new, dtype=waveform.dtype)
    kernel = kernel.to(waveform.device)
    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    length = shape[-1]
    padded = F.pad(flat, (width, width + orig))
    phases = F.conv1d(padded[:, None], kernel, stride=orig)         # [M, new, blocks]
    out = phases.transpose(1, 2).reshape(flat.shape[0], -1)
    target = math.ceil(new * length / orig)
    return out[..., :target].reshape(*shape[:-1], -1)

"""Convolutional building blocks of the modded DAC (MODEL.md §7.2), offline and streaming.

Every module here has `forward(x)` (the whole sequence, causal zero padding) and, where the
decoder needs it, `step(x, state)` (the next block of a stream, carrying its input tail in
`state`). Shapes are channels-first: x is [B, C, L].

GPU layout: with `channels_last` set (Codec.prepare on CUDA) the decoder's streaming convs run
on 4-D [B, C, 1, L] tensors in torch's channels_last memory format (physically [B, L, C]) with
weights in the same format, so cuDNN's F16 NHWC kernels take them as they are instead of
transposing input and weight on every call; their stream tails are kept in that layout too.
The decoder's last conv (w_4 -> 1 channel) has no good cuDNN kernel in either layout; with
`set_narrow` it runs as one GEMM and a shifted sum instead (`taps_conv1d`). With
`set_shifted_gemm` (or `set_method("gemm")`, per conv) the wide stride-1 convs (the first conv
and the residual units' k 7 convs) run the same way (`shifted_gemm_conv1d`): in F16 cuDNN runs a
few dilated shapes on a generic kernel 10-1000x slower than its tensor-core ones. With
`set_method("triton")` (default layout only) a wide conv runs as one implicit-GEMM Triton kernel
(conv_triton.implicit_conv1d): channels-first in and out, so none of cuDNN's NCHW <-> NHWC
transposes and none of the shifted GEMM's partial sums. The method is measured per conv at
Codec.prepare: Decoder.choose_conv_methods.

Streaming identity: a stride-1 causal conv with effective kernel k_e sees inputs n-k_e+1 … n.
Offline, the first k_e-1 of those are zeros (left padding); in a stream they are the previous
call's last k_e-1 inputs. A stream starts with a zero tail, so both read the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.codec import conv_triton
from services.codec.state import StreamState


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------

def snake(x: Tensor, alpha: Tensor) -> Tensor:
    """Snake activation x + sin²(αx)/(α + 1e-9); x [B, C, L], alpha [1, C, 1]."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def effective_kernel(kernel_size: int, dilation: int) -> int:
    return (kernel_size - 1) * dilation + 1


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int = 1,
                  dilation: int = 1, groups: int = 1) -> Tensor:
    """Offline causal conv (§7.2): x [B, C_in, L] -> [B, C_out, ceil(L/stride)].

    Left padding k_e - stride zeros; right padding the minimum that completes the last window.
    """
    k_e = effective_kernel(weight.shape[-1], dilation)
    length = x.shape[-1]
    n_out = math.ceil(length / stride)
    right = n_out * stride - length
    x = F.pad(x, (k_e - stride, right))
    return F.conv1d(x, weight, bias, stride=stride, dilation=dilation, groups=groups)


def taps_conv1d(window: Tensor, taps: Tensor, bias: Tensor | None, out_channels: int, kernel: int,
                dilation: int = 1) -> Tensor:
    """A valid (unpadded) stride-1 conv with few output channels: one GEMM and a shifted sum.

    window [B, C_in, W] (any strides: a channels_last window is just a transposed GEMM operand);
    taps from `conv_taps` -> [B, C_out, W - (k-1)·d] in the window's dtype.

    Why: for the decoder's last conv (w_4 -> 1 channel, k 7, at the audio rate) cuDNN has no
    tensor-core kernel (C_out = 1) and falls back to a generic one, measured on the H200 at
    ~2.7 ms per call for 10 s of F16 audio in the default layout and far worse in channels_last,
    for what is one ~85 MB read. Here P = taps @ window holds every tap's partial sum at every
    position (cuBLAS, reads the window once), and output n is Σ_j P[o·k + j, n + j·d]: one
    as_strided view of P (no copy), summed in float32; only P is rounded to the window's dtype.
    """
    batch, _, width = window.shape
    length = width - (kernel - 1) * dilation
    if taps.shape[0] < out_channels * kernel or length < 0:
        raise ValueError(f"taps {list(taps.shape)} for {out_channels} x {kernel} taps (dilation "
                         f"{dilation}) do not fit a window of {width}")
    partial = torch.matmul(taps, window)                        # [B, rows of taps, W]
    # element (b, o, n, j) = partial[b, o·k + j, n + j·d], whatever strides matmul gave P
    sb, sr, sw = partial.stride()
    shifted = partial.as_strided((batch, out_channels, length, kernel),
                                 (sb, kernel * sr, sw, sr + dilation * sw), partial.storage_offset())
    y = shifted.sum(-1, dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()[:, None]
    return y.to(window.dtype)


def conv_taps(weight: Tensor) -> Tensor:
    """weight [C_out, C_in, k] -> taps [R, C_in], row o·k + j = weight[o, :, j], R = C_out·k
    rounded up to 8 with zero rows (P's rows then stay 16-byte aligned in F16 for cuBLAS)."""
    c_out, c_in, kernel = weight.shape
    rows = c_out * kernel
    taps = weight.new_zeros(-(-rows // 8) * 8, c_in)
    taps[:rows] = weight.permute(0, 2, 1).reshape(rows, c_in)
    return taps


def stacked_taps(weight: Tensor) -> Tensor:
    """weight [C_out, C_in, k] -> taps [R, C_in] for shifted_gemm_conv1d: row j·C_out + o =
    weight[o, :, j] (tap-major, so tap j's outputs are one block of C_out rows of the GEMM's
    result), R = k·C_out rounded up to 8 with zero rows (16-byte aligned F16 rows for cuBLAS)."""
    c_out, c_in, kernel = weight.shape
    rows = kernel * c_out
    taps = weight.new_zeros(-(-rows // 8) * 8, c_in)
    taps[:rows] = weight.permute(2, 0, 1).reshape(rows, c_in)
    return taps


def shifted_gemm_conv1d(window: Tensor, taps: Tensor, bias: Tensor | None, out_channels: int,
                        kernel: int, dilation: int = 1, start: int = 0) -> Tensor:
    """A valid (unpadded) stride-1 conv of window[..., start:] as one GEMM and a shifted sum.

    window [B, C_in, W] (time contiguous) -> [B, C_out, L], contiguous; or 4-D [B, C_in, 1, W]
    in channels_last (physically [B, W, C_in], the channels_last decoder) -> [B, C_out, 1, L] in
    channels_last. L = W - start - (k-1)·d; taps from `stacked_taps`; the result is in the
    window's dtype:
        y[b, o, t] = bias[o] + Σ_j Σ_c taps[j·C_out + o, c] · window[b, c, start + t + j·d]
    `start` skips inputs a stream keeps only for alignment (CausalConv1d.tail_length).

    Why: in an H200 profile of the graphed F16 10 s decode, cuDNN spent a quarter of the time in
    its generic non-tensor-core kernel (implicit_convolve_sgemm, 5 calls at 1.1 ms; k 7 conv
    shapes, the decoder's long few-channel convs the likely ones) and another 13% transposing
    NCHW <-> NHWC around its other F16 convs; bench/codec.py --conv-table times each shape. Here
    P = taps · window holds every tap's partial sum at every position (one cuBLAS GEMM, K = C_in,
    reads the window once, writes k outputs' worth), and y is Σ_j of k shifted views of P (one
    as_strided view, no copy; one reduction that accumulates in float32 on CUDA and rounds once).
    Nothing is transposed: channels-first in, channels-first out; rows in, rows out. The cost is
    P's traffic (k times the output, written and read once) instead of an implicit GEMM's.
    """
    four_d = window.dim() == 4
    batch, c_in, width = window.shape[0], window.shape[1], window.shape[-1]
    length = width - start - (kernel - 1) * dilation
    if taps.shape[0] < kernel * out_channels or taps.shape[1] != c_in or length < 0 or start < 0:
        raise ValueError(f"taps {list(taps.shape)} for {out_channels} x {kernel} taps (dilation "
                         f"{dilation}) do not fit a window of {c_in} x {width} from {start}")
    if four_d:
        rows = as_channels_last(window).permute(0, 2, 3, 1).reshape(batch * width, c_in)  # a view
        partial = torch.mm(rows, taps.t())                          # [B·W, R]
        # element (b, t, o, j) = partial[b·W + start + t + j·d, j·C_out + o]; rows never cross
        # from one batch row into the next, since start + t + j·d < W
        sw, sr = partial.stride()
        shifted = partial.as_strided((batch, length, out_channels, kernel),
                                     (width * sw, sw, sr, dilation * sw + out_channels * sr),
                                     partial.storage_offset() + start * sw)
        y = shifted.sum(-1)                                         # [B, L, C_out]
        if bias is not None:
            y.add_(bias)
        return y.permute(0, 2, 1).unsqueeze(2)                      # channels_last, no copy
    if window.stride(-1) != 1:
        window = window.contiguous()
    partial = torch.bmm(taps.expand(batch, -1, -1), window)         # [B, R, W]
    # element (b, o, t, j) = partial[b, j·C_out + o, start + t + j·d]
    sb, sr, sw = partial.stride()
    shifted = partial.as_strided((batch, out_channels, length, kernel),
                                 (sb, sr, sw, out_channels * sr + dilation * sw),
                                 partial.storage_offset() + start * sw)
    y = shifted.sum(-1)                                             # [B, C_out, L]
    if bias is not None:
        y.add_(bias[:, None])
    return y


def causal_conv_transpose1d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """Offline causal transposed conv: x [B, C_in, L] -> [B, C_out, L·stride].

    weight [C_in, C_out, k]; the ordinary transposed conv yields (L-1)·s + k samples, of which
    the last k - s are dropped (they belong to inputs that have not arrived yet).
    """
    y = F.conv_transpose1d(x, weight, bias, stride=stride)
    return y[..., : x.shape[-1] * stride]


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------

# A conv with at most this many output taps (C_out · k) may run as taps_conv1d: the decoder's last
# conv (1 x 7) is the one that needs it; every other decoder conv has hundreds of output channels.
NARROW_MAX_TAPS = 16

# How a wide conv may run (CausalConv1d.set_method): cuDNN, one GEMM and a shifted sum, or the
# implicit-GEMM Triton kernel (default layout, where Triton runs).
CONV_METHODS = ("cudnn", "gemm", "triton")


class Streaming(nn.Module):
    """A module that keeps a tensor in the stream state under `state_key` (set by the model)."""

    state_key: str = ""

    def initial_state(self, batch: int, device, dtype) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def as_channels_last(x: Tensor) -> Tensor:
    """x [B, C, 1, L] in channels_last memory format (no copy when it already is)."""
    return x.contiguous(memory_format=torch.channels_last)


def snake_window(x: Tensor, alpha: Tensor, bias: Tensor | None = None,
                 tail: Tensor | None = None) -> Tensor:
    """[tail | snake(x + bias)] along time: the torch reference of snake_triton.snake_window.

    x [B, C, L] with alpha [1, C, 1], or 4-D [B, C, 1, L] (the channels_last decoder) with the
    same alpha; bias [C] (a conv's bias left to this op) or None; tail the next conv's stream
    tail in x's layout, or None. Without bias and tail this is exactly `snake`.
    """
    four_d = x.dim() == 4
    if bias is not None:
        x = x + (bias[:, None, None] if four_d else bias[:, None])
    y = snake(x, alpha[..., None] if four_d else alpha)
    if tail is None:
        return y
    window = torch.cat([tail, y], dim=-1)
    return as_channels_last(window) if four_d else window


class Snake(nn.Module):
    fused = False       # GPU: the one-kernel Triton snake (snake_triton.py), set by Codec.prepare

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)

    def step(self, x: Tensor, state: StreamState | None = None, *, bias: Tensor | None = None,
             tail: Tensor | None = None) -> Tensor:
        """snake(x), or with `bias` snake(x + bias) and with `tail` the next conv's window
        [tail | snake(...)] (see snake_window; fused, one kernel writes it all but the tail)."""
        if self.fused:
            from services.codec.snake_triton import fused_snake_window

            return fused_snake_window(x, self.alpha, bias, tail)
        return snake_window(x, self.alpha, bias, tail)


class CausalConv1d(Streaming):
    """Causal conv; `.conv` holds the (folded) weight so checkpoint names map one to one.

    `weight_normed` marks a conv stored as g/V in the checkpoint (the loader folds it).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, weight_normed: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride,
                              dilation=dilation, groups=groups)
        self.conv.weight_normed = weight_normed
        self.stride, self.dilation, self.groups = stride, dilation, groups
        # inputs before the first new one that an output reads (k_e - s)
        self.causal_span = effective_kernel(kernel_size, dilation) - stride
        self.weight_4d: Tensor | None = None     # channels_last [C_out, C_in, 1, k] (set_channels_last)
        self.taps: Tensor | None = None          # [C_out·k, C_in] for taps_conv1d (set_narrow)
        self.gemm_taps: Tensor | None = None     # [k·C_out, C_in] for shifted_gemm_conv1d (set_shifted_gemm)
        self.triton_weight: Tensor | None = None  # [k, C_out, C_in] for conv_triton (set_method)

    @property
    def tail_length(self) -> int:
        """Inputs a stream keeps: the causal span k_e - s, rounded up to a multiple of 8 for the
        shifted GEMM in the default layout, whose GEMM reads the window [tail | t inputs] with
        the window's length as leading dimension: cuBLAS's fast F16 kernels want it 16-byte
        aligned (t is a multiple of 8 in every decoder block). The extra inputs are skipped
        (`start`). channels_last windows are rows of C_in channels, aligned whatever the tail.
        The Triton kernel reads at any offset: its tail is the causal span."""
        if self.gemm_taps is not None and self.weight_4d is None:
            return -(-self.causal_span // 8) * 8
        return self.causal_span

    def forward(self, x: Tensor) -> Tensor:
        if self.triton_weight is not None:
            return conv_triton.implicit_conv1d(F.pad(x, (self.causal_span, 0)), self.triton_weight,
                                               self.conv.bias, self.conv.out_channels,
                                               self.conv.kernel_size[0], self.dilation)
        if self.gemm_taps is not None:
            window = F.pad(x, (self.tail_length, 0))
            return shifted_gemm_conv1d(window, self.gemm_taps, self.conv.bias, self.conv.out_channels,
                                       self.conv.kernel_size[0], self.dilation,
                                       start=self.tail_length - self.causal_span)
        return causal_conv1d(x, self.conv.weight, self.conv.bias, self.stride, self.dilation,
                             self.groups)

    def set_channels_last(self, on: bool) -> None:
        """Switch layout; channels_last drops the Triton method (default layout only) for cuDNN."""
        self.weight_4d = as_channels_last(self.conv.weight.unsqueeze(2)) if on else None
        if on:
            self.triton_weight = None

    @property
    def narrow(self) -> bool:
        """Few output taps (the decoder's last conv, 1 x 7): `step` may run it as taps_conv1d."""
        return (self.conv.out_channels * self.conv.kernel_size[0] <= NARROW_MAX_TAPS
                and self.stride == 1 and self.groups == 1)

    def set_narrow(self, on: bool) -> None:
        """Streaming steps through taps_conv1d (only where `narrow`; otherwise a no-op)."""
        self.taps = conv_taps(self.conv.weight) if on and self.narrow else None

    @property
    def wide(self) -> bool:
        """A stride-1 conv with a kernel of more than one tap and more output taps than `narrow`
        (the decoder's first conv and its residual units' k 7 convs): `step` and `forward` may
        run it as shifted_gemm_conv1d."""
        return (self.conv.kernel_size[0] > 1 and self.stride == 1 and self.groups == 1
                and not self.narrow)

    def set_shifted_gemm(self, on: bool) -> None:
        """Steps (and forward) through shifted_gemm_conv1d (only where `wide`; otherwise a
        no-op). In the default layout this lengthens the stream tail (`tail_length`): states made
        before the switch no longer fit. Either way the Triton method is off."""
        self.gemm_taps = stacked_taps(self.conv.weight) if on and self.wide else None
        self.triton_weight = None

    @property
    def method(self) -> str:
        """How a wide conv runs: "triton" (conv_triton.implicit_conv1d), "gemm"
        (shifted_gemm_conv1d) or "cudnn" (F.conv1d / F.conv2d)."""
        if self.triton_weight is not None:
            return "triton"
        return "gemm" if self.gemm_taps is not None else "cudnn"

    def set_method(self, method: str) -> None:
        """One of CONV_METHODS, for a wide conv only (Decoder.set_conv_methods: the choice is per
        conv, measured at Codec.prepare on CUDA). "triton" packs the weight as it is now (set the
        method after any dtype or device move) and is refused, leaving the method as it was, in
        channels_last (ValueError: the kernel is channels-first) and where Triton cannot run on
        the weight's device (RuntimeError: no Triton, or the CPU without TRITON_INTERPRET=1), so
        a conv never holds a method that fails at its first step."""
        if method not in CONV_METHODS:
            raise ValueError(f"conv method {method!r}: expected one of {CONV_METHODS}")
        if not self.wide:
            raise ValueError(f"only a wide conv has a choice of method (C_out {self.conv.out_channels}, "
                             f"k {self.conv.kernel_size[0]}, stride {self.stride}, groups {self.groups})")
        if method != "triton":
            self.set_shifted_gemm(method == "gemm")
            return
        if self.weight_4d is not None:
            raise ValueError("the triton conv method runs in the default layout only, not channels_last")
        device = self.conv.weight.device
        if not conv_triton.can_run(device):
            raise RuntimeError(f"the triton conv method cannot run on {device}: it needs Triton "
                               f"and CUDA (or Triton's interpreter, TRITON_INTERPRET=1, on the CPU)")
        self.gemm_taps = None
        self.triton_weight = conv_triton.pack_weight(self.conv.weight)

    def initial_state(self, batch: int, device, dtype) -> Tensor:
        if self.weight_4d is not None:
            return as_channels_last(torch.zeros(batch, self.conv.in_channels, 1, self.tail_length,
                                                device=device, dtype=dtype))
        return torch.zeros(batch, self.conv.in_channels, self.tail_length, device=device, dtype=dtype)

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        """x [B, C_in, t] (the next t inputs) -> [B, C_out, t]; stride 1 only.

        In channels_last mode x is [B, C_in, 1, t] and so is the result."""
        if self.tail_length > 0:
            x = torch.cat([state.tails[self.state_key], x], dim=-1)
        return self.step_window(x, state)

    def step_window(self, window: Tensor, state: StreamState, bias: bool = True) -> Tensor:
        """The step on its window [stream tail | next t inputs] (`step` makes it with a cat; a
        fused Snake writes it directly, Snake.step(tail=...)): keeps the window's last inputs as
        the new tail and convolves. bias=False leaves the bias to the caller (a fused Snake next
        adds it on the way, Snake.step(bias=...)). The tail is `tail_length` inputs long: more
        than the conv reads with the default-layout shifted GEMM, which skips the extra ones."""
        if self.tail_length > 0:
            if self.weight_4d is not None:
                state.tails[self.state_key] = as_channels_last(window[..., -self.tail_length:])
            else:
                # clone: a view would keep the whole window alive between calls
                state.tails[self.state_key] = window[..., -self.tail_length:].clone()
        return self.convolve_window(window, self.conv.bias if bias else None)

    def convolve_window(self, window: Tensor, bias_tensor: Tensor | None) -> Tensor:
        """The conv of a step's window [stream tail | t inputs] -> its t outputs, by whichever
        path is set (narrow taps, Triton, shifted GEMM, cuDNN); no state
        (Decoder.choose_conv_methods times this)."""
        if self.weight_4d is not None:
            # as_channels_last: a no-op unless an op upstream (a gather) handed over another layout
            window = as_channels_last(window)
            if self.taps is not None:
                # [B, C_out, 1, t]: with C_out = 1 contiguous and channels_last are the same bytes
                return taps_conv1d(window.squeeze(2), self.taps, bias_tensor, self.conv.out_channels,
                                   self.conv.kernel_size[0], self.dilation).unsqueeze(2)
            if self.gemm_taps is not None:
                return shifted_gemm_conv1d(window, self.gemm_taps, bias_tensor, self.conv.out_channels,
                                           self.conv.kernel_size[0], self.dilation)
            return F.conv2d(window, self.weight_4d, bias_tensor, dilation=(1, self.dilation),
                            groups=self.groups)
        if self.taps is not None:
            return taps_conv1d(window, self.taps, bias_tensor, self.conv.out_channels,
                               self.conv.kernel_size[0], self.dilation)
        if self.triton_weight is not None:
            # the window is exactly what the conv reads (tail_length is the causal span)
            return conv_triton.implicit_conv1d(window, self.triton_weight, bias_tensor,
                                               self.conv.out_channels, self.conv.kernel_size[0],
                                               self.dilation)
        if self.gemm_taps is not None:
            return shifted_gemm_conv1d(window, self.gemm_taps, bias_tensor, self.conv.out_channels,
                                       self.conv.kernel_size[0], self.dilation,
                                       start=self.tail_length - self.causal_span)
        return F.conv1d(window, self.conv.weight, bias_tensor, dilation=self.dilation, groups=self.groups)


class CausalConvTranspose1d(Streaming):
    """Causal transposed conv (kernel k, stride s); `.conv` is the nn.ConvTranspose1d."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 weight_normed: bool = True):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.conv.weight_normed = weight_normed
        self.stride = stride
        # Output block t depends on inputs t-p … t; a stream keeps those p previous inputs.
        self.history = math.ceil(kernel_size / stride) - 1
        self.weight_4d: Tensor | None = None     # channels_last [C_in, C_out, 1, k] (set_channels_last)
        self.dense_crop = False                  # default layout: crop by padding (Codec.prepare)

    def forward(self, x: Tensor) -> Tensor:
        return causal_conv_transpose1d(x, self.conv.weight, self.conv.bias, self.stride)

    def set_channels_last(self, on: bool) -> None:
        self.weight_4d = as_channels_last(self.conv.weight.unsqueeze(2)) if on else None

    def initial_state(self, batch: int, device, dtype) -> Tensor:
        if self.weight_4d is not None:
            return as_channels_last(torch.zeros(batch, self.conv.in_channels, 1, self.history,
                                                device=device, dtype=dtype))
        return torch.zeros(batch, self.conv.in_channels, self.history, device=device, dtype=dtype)

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        """x [B, C_in, t] -> [B, C_out, t·s]. A zero previous input adds nothing, as offline.

        In channels_last mode x is [B, C_in, 1, t] and so is the result."""
        if self.history > 0:
            x = torch.cat([state.tails[self.state_key], x], dim=-1)
        return self.step_window(x, state)

    def step_window(self, window: Tensor, state: StreamState) -> Tensor:
        """The step on its window [previous `history` inputs | next t inputs] (see
        CausalConv1d.step_window): keeps the new history and upsamples the t new inputs."""
        length = (window.shape[-1] - self.history) * self.stride
        crop = self.history * self.stride
        if self.weight_4d is not None:
            return self._step_4d(window, state, length, crop)
        if self.history == 0:
            return causal_conv_transpose1d(window, self.conv.weight, self.conv.bias, self.stride)
        state.tails[self.state_key] = window[..., -self.history:].clone()
        if self.dense_crop:
            # the crop inside the conv, as _step_4d: a dense result, no strided slice downstream
            y = F.conv_transpose1d(window, self.conv.weight, self.conv.bias, stride=self.stride,
                                   padding=crop)
            return y if y.shape[-1] == length else y[..., :length]
        y = F.conv_transpose1d(window, self.conv.weight, self.conv.bias, stride=self.stride)
        return y[..., crop: crop + length]

    def _step_4d(self, window: Tensor, state: StreamState, length: int, crop: int) -> Tensor:
        """window [B, C_in, 1, h + t] -> [B, C_out, 1, t·s], channels_last.

        padding = history·s crops the first history·s outputs (they belong to the previous call)
        and as many at the end (inputs that have not arrived), so the result is the kept block
        itself, dense, with no slice to copy.
        """
        if self.history > 0:
            state.tails[self.state_key] = as_channels_last(window[..., -self.history:])
        y = F.conv_transpose2d(as_channels_last(window), self.weight_4d, self.conv.bias,
                               stride=(1, self.stride), padding=(0, crop))
        return y if y.shape[-1] == length else y[..., :length]   # k = 2s (the decoder's): equal


def pointwise_residual_(x: Tensor, s: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x += W·s + b in place: a residual unit's 1x1 conv and its skip add as one GEMM.

    x, s [B, C, L] (x may be a strided view), or both 4-D [B, C, 1, L] in channels_last (the
    GEMM then runs on the physical [B·L, C] rows); weight [C, C] (the conv's [C, C, 1]); returns
    x. Why: cuBLAS adds the product onto x as it writes it (beta = 1), so the conv output never
    exists as a tensor of its own, the skip add is not a pass of its own, and in torch's default
    layout cuDNN's F16 NCHW <-> NHWC transposes around the conv are gone. Only the bias is a
    second (in-place) pass. The caller must own x: here it is the unit's input, which nothing
    reads after the unit (conv stream tails are copies, never views of it).
    """
    if x.dim() == 4:
        x = as_channels_last(x)                         # no copy when it already is
        channels = x.shape[1]
        rows = x.permute(0, 2, 3, 1).view(-1, channels)             # [B·L, C], x's own memory
        s_rows = as_channels_last(s).permute(0, 2, 3, 1).reshape(-1, channels)
        rows.addmm_(s_rows, weight.t())
        if bias is not None:
            rows.add_(bias)
        return x
    x.baddbmm_(weight.expand(x.shape[0], -1, -1), s)
    if bias is not None:
        x.add_(bias[:, None])
    return x


class ResidualUnit(nn.Module):
    """x + conv1(snake(conv7_d(snake(x)))) (§7.2); `block` indices match the checkpoint."""

    pointwise_gemm = False   # GPU: conv1 and the skip add as one in-place GEMM (Codec.prepare)
    fused_windows = False    # GPU: snake1 writes conv7's window, snake2 adds conv7's bias

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            CausalConv1d(dim, dim, kernel_size=7, dilation=dilation),
            Snake(dim),
            CausalConv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        snake1, conv7, snake2, conv1 = self.block
        if self.fused_windows:
            window = snake1.step(x, state, tail=state.tails[conv7.state_key])
            s = snake2.step(conv7.step_window(window, state, bias=False), state, bias=conv7.conv.bias)
        else:
            s = snake2.step(conv7.step(snake1.step(x, state), state), state)
        if self.pointwise_gemm:
            return pointwise_residual_(x, s, conv1.conv.weight[..., 0], conv1.conv.bias)
        return x + conv1.step(s, state)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 → LayerNorm over channels → Linear 4× → GELU → Linear → ⊙γ, + x."""

    def __init__(self, dim: int, mlp_ratio: int = 4, kernel_size: int = 7):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=kernel_size, groups=dim, weight_normed=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, mlp_ratio * dim)
        self.pwconv2 = nn.Linear(mlp_ratio * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def _pointwise(self, y: Tensor) -> Tensor:
        """The per-step part: y [B, C, L] -> [B, C, L]."""
        y = self.norm(y.transpose(1, 2))
        y = self.pwconv2(F.gelu(self.pwconv1(y)))
        return (self.gamma * y).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        return x + self._pointwise(self.dwconv(x))

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        return x + self._pointwise(self.dwconv.step(x, state))


def step_sequence(modules: nn.Sequential, x: Tensor, state: StreamState) -> Tensor:
    """Run a Sequential in streaming mode (modules without state, like Tanh, run as is)."""
    for module in modules:
        x = module.step(x, state) if hasattr(module, "step") else module(x)
    return x

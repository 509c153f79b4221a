"""The DAC decoder of the modded DAC (MODEL.md §7.4 step 5), streaming.

`model.0` causal conv C -> w_0 (k 7); for b = 1…4 a DecoderBlock: Snake(w_{b-1}) -> causal
transposed conv w_{b-1} -> w_b (k 2r_b, stride r_b) -> ResidualUnits(w_b) with dilations 1, 3, 9;
then Snake(w_4) -> causal conv w_4 -> 1 (k 7) -> tanh. Module indices match the checkpoint
(`decoder.model.{b}.block.{i}…`).

GPU paths (set by Codec.prepare): `set_channels_last(True)` gives every conv a 4-D channels_last
weight, and `step` moves the latents to [B, C, 1, L] channels_last on entry and the audio back to
[B, 1, L] at the end; `set_narrow` runs the last conv as one GEMM (conv.taps_conv1d);
`set_conv_methods` runs each wide conv (the first conv and the residual units' k 7 convs) on
cuDNN, as one GEMM and a shifted sum (conv.shifted_gemm_conv1d) or, in the default layout, as one
implicit-GEMM Triton kernel (conv_triton.implicit_conv1d), as `choose_conv_methods` measured
(`set_shifted_gemm`: all of them cuDNN or GEMM); `set_fused_windows` lets each Snake write the
next causal conv's input window (snake_triton.fused_snake_window).

Why a per-conv choice: on the H200 in F16 (bench/codec.py --conv-table, 10 s) cuDNN is the
fastest for most wide conv shapes, in channels_last most of all, but runs a few dilated ones on a
generic kernel: 2 ms (default layout) or 118-232 ms (channels_last) per call for what the GEMM
path does in 0.12-0.33 ms; and in the default F16 layout cuDNN transposes NCHW <-> NHWC around
every conv (~13% of the graphed 10 s decode), which the Triton kernel does not (it is timed only
with DRAMA_CODEC_TRITON_CONV=1: on the H200 it never won, see triton_in_choice). Which shapes go
which way depends on the cuDNN version, Triton and the GPU, so it is measured, once per shape,
instead of listed.

Only the streaming `step` is provided: offline decode is the stream over all frames (§7.5).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
from torch import Tensor, nn

from services.codec import conv_triton
from services.codec.conv import (CausalConv1d, CausalConvTranspose1d, ResidualUnit, Snake,
                                 as_channels_last)
from services.codec.state import StreamState
from services.common.grpcutil import env_switch

log = logging.getLogger(__name__)

DILATIONS = (1, 3, 9)

# choose_conv_methods: another method (the GEMM path, the Triton kernel) must beat cuDNN by this
# fraction to be taken (a shape where they are close stays on cuDNN: the library kernel, no P
# buffer, and timing noise cannot flip it) ...
GEMM_MARGIN = 0.10
# ... and cuDNN's timing stops after its first timed call once that call is this many times the
# fastest other method's (its slow kernels take 0.1-0.25 s a call: a median of three would add
# seconds).
CUDNN_GIVE_UP = 3.0


def triton_in_choice() -> bool:
    """Whether Codec.prepare times the Triton conv kernel too: only with DRAMA_CODEC_TRITON_CONV=1.
    Why off by default: on the H200 (2026-11-30, at 128 frames) it never beat cuDNN or the GEMM
    path by the margin (96 channels: 0.213-0.389 ms against cuDNN's 0.218-0.396; 192: 0.41
    against 0.30; 768: 0.15 against the GEMM's 0.09), while autotuning it at prepare added ~13 s
    to the codec's start (39.0 s against 25.6)."""
    return env_switch("DRAMA_CODEC_TRITON_CONV") is True


# time_conv(conv, method, length, give_up_ms) -> ms per call of `conv` by `method` on a window of
# `length` new inputs; give_up_ms (None for the first method timed) allows stopping early.
ConvTimer = Callable[[CausalConv1d, str, int, "float | None"], float]


def choose_conv_method(cudnn_ms: float, gemm_ms: float, margin: float = GEMM_MARGIN,
                       triton_ms: float | None = None) -> str:
    """cuDNN unless the fastest other method (the GEMM path, and the Triton kernel where it was
    timed) is faster by more than `margin` (a fraction of cuDNN's time); between the GEMM path
    and the Triton kernel the faster one (the GEMM on a tie: no autotuned kernel to trust)."""
    others = {"gemm": gemm_ms} if triton_ms is None else {"gemm": gemm_ms, "triton": triton_ms}
    best = min(others, key=others.get)
    return best if others[best] < (1.0 - margin) * cudnn_ms else "cudnn"


def cuda_conv_ms(conv: CausalConv1d, method: str, length: int, give_up_ms: float | None = None,
                 samples: int = 3, inner: int = 10) -> float:
    """ConvTimer on CUDA: ms per call of `conv.convolve_window` by `method` on a random batch-1
    window [tail | length inputs] in the conv's layout and dtype, no bias (the fused windows leave
    the k 7 convs' biases to the Snakes). The conv's method is restored.

    One eager warm-up call (cuDNN's algorithm choice, cuBLAS handles), then the call captured as a
    CUDA graph, as the server runs the decoder (eager if capture fails). One replay is timed
    alone: past give_up_ms that is the answer (a slow cuDNN kernel: 0.1-0.25 s a call). Otherwise
    the median of `samples` runs of `inner` back-to-back replays, so that the GPU never waits
    for the host between calls and launch gaps stay out of the number.
    """
    saved = conv.method
    conv.set_method(method)
    try:
        weight = conv.conv.weight
        device = weight.device
        window = torch.randn(1, conv.conv.in_channels, conv.tail_length + length, device=device,
                             dtype=weight.dtype)
        if conv.weight_4d is not None:
            window = as_channels_last(window.unsqueeze(2))

        def run():
            return conv.convolve_window(window, None)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                run()
            replay = graph.replay
        except RuntimeError:
            replay = run
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed(calls: int) -> float:
            start.record()
            for _ in range(calls):
                replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls

        first = timed(1)
        if give_up_ms is not None and first > give_up_ms:
            return first
        return statistics.median([timed(inner) for _ in range(samples)])
    finally:
        conv.set_method(saved)


class DecoderBlock(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, rate: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(input_dim),
            CausalConvTranspose1d(input_dim, output_dim, kernel_size=2 * rate, stride=rate),
            *[ResidualUnit(output_dim, dilation) for dilation in DILATIONS],
        )

    fused_windows = False    # GPU: the Snake writes the transposed conv's window (Codec.prepare)

    def step(self, x: Tensor, state: StreamState) -> Tensor:
        """x [B, w_{b-1}, L] -> [B, w_b, L·r_b]."""
        snake, up, *units = self.block
        if self.fused_windows:
            tail = state.tails[up.state_key] if up.history > 0 else None
            x = up.step_window(snake.step(x, state, tail=tail), state)
        else:
            x = up.step(snake.step(x, state), state)
        for unit in units:
            x = unit.step(x, state)
        return x


class Decoder(nn.Module):
    def __init__(self, latent_dim: int, channels: int, rates: list[int]):
        super().__init__()
        widths = [channels // 2 ** i for i in range(len(rates) + 1)]
        self.model = nn.Sequential(
            CausalConv1d(latent_dim, widths[0], kernel_size=7),
            *[DecoderBlock(widths[i], widths[i + 1], rate) for i, rate in enumerate(rates)],
            Snake(widths[-1]),
            CausalConv1d(widths[-1], 1, kernel_size=7),
            nn.Tanh(),
        )
        self.channels_last = False
        self.fused_windows = False

    def set_channels_last(self, on: bool) -> None:
        """Switch the streaming layout (states made before the switch no longer fit)."""
        self.channels_last = on
        for module in self.modules():
            if isinstance(module, (CausalConv1d, CausalConvTranspose1d)):
                module.set_channels_last(on)

    def set_narrow(self, on: bool) -> None:
        """The last conv (w_4 -> 1) through conv.taps_conv1d instead of cuDNN (Codec.prepare)."""
        for module in self.modules():
            if isinstance(module, CausalConv1d):
                module.set_narrow(on)

    def set_shifted_gemm(self, on: bool) -> None:
        """Every wide stride-1 conv (model.0, C -> w_0, and the residual units' k 7 convs) through
        conv.shifted_gemm_conv1d (on) or cuDNN (off); the last conv is narrow_conv's. In the
        default layout a GEMM conv's stream tail grows to a multiple of 8 inputs (alignment)."""
        for module in self.modules():
            if isinstance(module, CausalConv1d):
                module.set_shifted_gemm(on)

    def wide_convs(self, latent_length: int = 1) -> dict[str, tuple[CausalConv1d, int]]:
        """name -> (conv, the new inputs per step it sees when the decoder steps `latent_length`
        latents) for every wide conv, in decode order (names as in the checkpoint, no prefix)."""
        convs: dict[str, tuple[CausalConv1d, int]] = {}
        length = latent_length
        for name, module in self.model.named_modules(prefix="model"):
            if isinstance(module, CausalConvTranspose1d):
                length *= module.stride
            elif isinstance(module, CausalConv1d) and module.wide:
                convs[name] = (module, length)
        return convs

    def conv_methods(self) -> dict[str, str]:
        """name -> "cudnn", "gemm" or "triton" for every wide conv."""
        return {name: conv.method for name, (conv, _) in self.wide_convs().items()}

    def set_conv_methods(self, methods: dict[str, str]) -> None:
        """Each wide conv by its own method (names as `wide_convs`; a conv not named: cuDNN).
        A name that is not a wide conv is a ValueError; a method a conv refuses
        (CausalConv1d.set_method) raises with every conv back on the methods it had."""
        convs = self.wide_convs()
        unknown = set(methods) - set(convs)
        if unknown:
            raise ValueError(f"not wide decoder convs: {sorted(unknown)} (wide: {list(convs)})")
        previous = self.conv_methods()
        try:
            for name, (conv, _) in convs.items():
                conv.set_method(methods.get(name, "cudnn"))
        except (ValueError, RuntimeError):
            for name, (conv, _) in convs.items():
                conv.set_method(previous[name])
            raise

    def choose_conv_methods(self, time_conv: ConvTimer, latent_length: int,
                            margin: float = GEMM_MARGIN, triton: bool | None = None) -> dict[str, dict]:
        """Time each distinct wide conv shape (C_in, C_out, k, dilation, step length, layout)
        once at the step lengths of `latent_length` latents: the GEMM path first, then the
        Triton kernel (where `triton`, default: triton_in_choice() and conv_triton.available(),
        Triton and CUDA; and only in the default layout), then cuDNN (allowed to give up past
        CUDNN_GIVE_UP x the fastest other's time), and pick per choose_conv_method. Sets nothing; returns name -> {"method",
        "cudnn_ms", "gemm_ms", "length"}, plus "triton_ms" where timed (or "triton_error" where
        the kernel raised: logged, left out of the choice), for every wide conv
        (Decoder.set_conv_methods takes the methods). Timing the Triton kernel first at these
        lengths is also where it autotunes (conv_triton: once per shape, never per length)."""
        if triton is None:
            triton = conv_triton.available() and triton_in_choice()
        measured: dict[tuple, dict] = {}
        choices: dict[str, dict] = {}
        for name, (conv, length) in self.wide_convs(latent_length).items():
            key = (conv.conv.in_channels, conv.conv.out_channels, conv.conv.kernel_size[0],
                   conv.dilation, length, conv.weight_4d is not None)
            if key not in measured:
                timing = {"gemm_ms": time_conv(conv, "gemm", length, None)}
                if triton and conv.weight_4d is None:
                    try:
                        timing["triton_ms"] = time_conv(conv, "triton", length, None)
                    except Exception as error:  # noqa: BLE001 - an optional kernel; see below
                        # A Triton that cannot compile or tune this shape must not stop the
                        # codec from starting: the shape stays on cuDNN or the GEMM path, and
                        # the error is logged (and kept: the CUDA tests check triton_ms).
                        log.warning("codec: Triton conv kernel failed for %s (C_in %d, C_out %d, "
                                    "dilation %d): %s", name, conv.conv.in_channels,
                                    conv.conv.out_channels, conv.dilation, error)
                        timing["triton_error"] = f"{type(error).__name__}: {error}"
                fastest = min(ms for field, ms in timing.items() if field.endswith("_ms"))
                cudnn_ms = time_conv(conv, "cudnn", length, CUDNN_GIVE_UP * fastest)
                method = choose_conv_method(cudnn_ms, timing["gemm_ms"], margin, timing.get("triton_ms"))
                measured[key] = {"method": method, "cudnn_ms": cudnn_ms, **timing, "length": length}
            choices[name] = dict(measured[key])
        return choices

    def tune_triton(self, latent_length: int) -> None:
        """One eager call of each wide conv on the Triton method at its step length for
        `latent_length` latents (batch 1, random window): the kernel autotunes on the first call
        of each shape (conv_triton), which should be at the lengths that matter, not a 1-frame
        warm-up, and never inside a CUDA graph capture. After a measured choice it is a cache hit."""
        for conv, length in self.wide_convs(latent_length).values():
            if conv.method == "triton":
                weight = conv.conv.weight
                window = torch.randn(1, conv.conv.in_channels, conv.tail_length + length,
                                     device=weight.device, dtype=weight.dtype)
                conv.convolve_window(window, None)

    def set_fused_windows(self, on: bool) -> None:
        """Each Snake that feeds a causal conv writes that conv's input window itself, and a
        conv followed only by a Snake leaves its bias to it (snake_triton.fused_snake_window; the
        torch fallback makes the same numbers with a cat). Codec.prepare sets it with fused_snake."""
        self.fused_windows = on
        for module in self.modules():
            if isinstance(module, (DecoderBlock, ResidualUnit)):
                module.fused_windows = on
            elif isinstance(module, CausalConvTranspose1d):
                module.dense_crop = on     # the fused Snake after it wants a dense input

    def step(self, z: Tensor, state: StreamState) -> Tensor:
        """z [B, C, L] (upsampled latents) -> audio [B, 1, L·Π rates]."""
        x = as_channels_last(z.unsqueeze(2)) if self.channels_last else z
        first, *blocks, snake, last, tanh = self.model
        x = first.step(x, state)
        for block in blocks:
            x = block.step(x, state)
        if self.fused_windows:
            x = last.step_window(snake.step(x, state, tail=state.tails[last.state_key]), state)
        else:
            x = last.step(snake.step(x, state), state)
        audio = tanh(x)
        return audio.squeeze(2) if self.channels_last else audio

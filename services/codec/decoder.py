"""The DAC decoder of the modded DAC (MODEL.md §7.4 step 5), streaming.

`model.0` causal conv C -> w_0 (k 7); for b = 1…4 a DecoderBlock: Snake(w_{b-1}) -> causal
transposed conv w_{b-1} -> w_b (k 2r_b, stride r_b) -> ResidualUnits(w_b) with dilations 1, 3, 9;
then Snake(w_4) -> causal conv w_4 -> 1 (k 7) -> tanh. Module indices match the checkpoint
(`decoder.model.{b}.block.{i}…`).

GPU paths (set by Codec.prepare): `set_channels_last(True)` gives every conv a 4-D channels_last
weight, and `step` moves the latents to [B, C, 1, L] channels_last on entry and the audio back to
[B, 1, L] at the end (float32; F16 keeps torch's default layout, see Codec.prepare);
`set_narrow` runs the last conv as one GEMM (conv.taps_conv1d); `set_shifted_gemm` runs the
first conv and the residual units' k 7 convs as one GEMM and a shifted sum each
(conv.shifted_gemm_conv1d) instead of cuDNN; `set_fused_windows` lets each Snake write the next
causal conv's input window (snake_triton.fused_snake_window).

Only the streaming `step` is provided: offline decode is the stream over all frames (§7.5).
"""

from __future__ import annotations

from torch import Tensor, nn

from services.codec.conv import (CausalConv1d, CausalConvTranspose1d, ResidualUnit, Snake,
                                 as_channels_last)
from services.codec.state import StreamState

DILATIONS = (1, 3, 9)


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
        """The wide stride-1 convs (model.0, C -> w_0, and the residual units' k 7 convs) through
        conv.shifted_gemm_conv1d instead of cuDNN (Codec.prepare); the last conv is narrow_conv's.
        In the default layout their stream tails grow to a multiple of 8 inputs (alignment)."""
        for module in self.modules():
            if isinstance(module, CausalConv1d):
                module.set_shifted_gemm(on)

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

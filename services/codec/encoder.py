"""The DAC encoder of the modded DAC (MODEL.md §7.6 step 3), offline only.

`block.0` causal conv 1 -> e_0 (k 7); for b = 1…4 an EncoderBlock(e_b, stride s_b):
ResidualUnits(e_b/2) with dilations 1, 3, 9 -> Snake -> causal conv e_b/2 -> e_b (k 2s_b,
stride s_b) -> windowed transformer where configured; then Snake(e_4) -> causal conv e_4 -> C
(k 3). Module indices match the checkpoint (`encoder.block.{b}.block.{i}…`).
"""

from __future__ import annotations

from torch import Tensor, nn

from services.codec.conv import CausalConv1d, ResidualUnit, Snake
from services.codec.transformer import WindowedTransformer
from services.common.config import CodecConfig

DILATIONS = (1, 3, 9)


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, transformer: nn.Module):
        super().__init__()
        self.block = nn.Sequential(
            *[ResidualUnit(dim // 2, dilation) for dilation in DILATIONS],
            Snake(dim // 2),
            CausalConv1d(dim // 2, dim, kernel_size=2 * stride, stride=stride),
            transformer,
        )

    def forward(self, x: Tensor) -> Tensor:
        """x [B, dim/2, L] -> [B, dim, ceil(L/stride)]."""
        return self.block(x)


def block_transformer(cfg: CodecConfig, dim: int, n_layer: int) -> nn.Module:
    """The encoder-block transformer: n_head = dim // 64 and 3·dim feed-forward (reference
    formulas), head_dim/rope_base/norm_eps from transformer_general_config, explicit window."""
    if n_layer == 0:
        return nn.Identity()
    general = cfg.transformer_general_config
    n_head = dim // 64
    if n_head < 1:
        raise ValueError(f"encoder transformer at width {dim}: n_head = {dim} // 64 = 0")
    return WindowedTransformer(dim, n_layer, n_head, int(general.get("head_dim", 64)), 3 * dim,
                               cfg.encoder_transformer_window, float(general.get("rope_base", 10000)),
                               float(general.get("norm_eps", 1e-5)))


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.encoder_dim
        blocks: list[nn.Module] = [CausalConv1d(1, dim, kernel_size=7)]
        for stride, n_layer in zip(cfg.encoder_rates, cfg.encoder_transformer_layers):
            dim *= 2
            blocks.append(EncoderBlock(dim, stride, block_transformer(cfg, dim, n_layer)))
        blocks += [Snake(dim), CausalConv1d(dim, cfg.latent_dim, kernel_size=3)]
        self.block = nn.Sequential(*blocks)

    def forward(self, audio: Tensor) -> Tensor:
        """audio [B, 1, S] -> latents [B, C, S / hop]."""
        return self.block(audio)

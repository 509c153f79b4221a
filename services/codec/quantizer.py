"""Residual vector quantizer with down/upsampling and the pre/post modules (MODEL.md §7.4-7.6).

Codebook 0 is the semantic quantizer (`semantic_quantizer.quantizers.0`, Q_s entries), codebooks
1…N-1 the residual ones (`quantizer.quantizers.{q-1}`, Q_r entries); all have codebook_dim d.

Decode (dequant), per frame:  z = O_0 cb_0[c_0] + o_0 + Σ_{q≥1} (O_q cb_q[c_q] + o_q).
Encode: the nearest entry by cosine (lowest index on ties), then subtract what it explains.
The projections are kept in float32 whatever the decode dtype: encode runs in F32 (§7.3) and the
dequant is a handful of small matmuls whose result is cast to the decode dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.codec.conv import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock
from services.codec.transformer import WindowedTransformer
from services.common.config import CodecConfig, WindowedTransformerConfig


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------

def project(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """A kernel-1 conv as a linear map on the last dim: x [..., C_in], weight [C_out, C_in, 1]."""
    return F.linear(x, weight[..., 0], bias)


def nearest_by_cosine(latents: Tensor, codebook: Tensor) -> Tensor:
    """argmax_c cos(latents, codebook[c]); latents [..., d], codebook [Q, d] -> int64 [...].

    torch.argmax returns the first maximal index, which is the "lowest index on ties" rule.
    """
    similarity = F.normalize(latents, dim=-1) @ F.normalize(codebook, dim=-1).T
    return similarity.argmax(dim=-1)


def check_codes(codes: Tensor, semantic_size: int, residual_size: int, num_codebooks: int) -> None:
    """Raise ValueError unless codes [B, N, T] are integers with row 0 in [0, Q_s), others [0, Q_r)."""
    if codes.dim() != 3 or codes.shape[1] != num_codebooks:
        raise ValueError(f"codes must be [B, {num_codebooks}, T], got {list(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    if codes.numel() == 0:
        return
    for row, (low, high) in enumerate([(0, semantic_size)] + [(0, residual_size)] * (num_codebooks - 1)):
        values = codes[:, row]
        bad = (values < low) | (values >= high)
        if bool(bad.any()):
            first = int(values[bad][0])
            raise ValueError(f"codebook {row}: code {first} outside [0, {high})")


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------

class VectorQuantizer(nn.Module):
    """One codebook with its in/out projections (weight-normed kernel-1 convs in the checkpoint)."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(input_dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, input_dim, 1)
        self.in_proj.weight_normed = self.out_proj.weight_normed = True
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def dequantize(self, codes: Tensor) -> Tensor:
        """codes [B, T] -> [B, T, C] float32: O cb[c] + o."""
        return project(self.codebook.weight[codes], self.out_proj.weight, self.out_proj.bias)

    def quantize(self, z: Tensor) -> Tensor:
        """z [B, T, C] float32 -> codes [B, T]."""
        latents = project(z, self.in_proj.weight, self.in_proj.bias)
        return nearest_by_cosine(latents, self.codebook.weight)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, n_codebooks: int, input_dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(input_dim, codebook_size, codebook_dim)
                                        for _ in range(n_codebooks))


def _windowed_transformer(cfg: WindowedTransformerConfig) -> WindowedTransformer:
    return WindowedTransformer(cfg.dim, cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.intermediate_size,
                               cfg.window_size, cfg.rope_base, cfg.norm_eps)


class DownsampleResidualVectorQuantize(nn.Module):
    """`quantizer.*` of codec.pth: RVQs, down/upsample stages, pre/post module."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        q = cfg.quantizer
        dim = q.input_dim
        self.semantic_quantizer = ResidualVectorQuantizer(1, dim, q.semantic_codebook_size, q.codebook_dim)
        self.quantizer = ResidualVectorQuantizer(q.n_codebooks, dim, q.codebook_size, q.codebook_dim)
        self.downsample = nn.Sequential(*[
            nn.Sequential(CausalConv1d(dim, dim, factor, stride=factor, weight_normed=False),
                          ConvNeXtBlock(dim))
            for factor in q.downsample_factor])
        # The reference builds the upsample stages in reversed factor order; all are C -> C.
        self.upsample = nn.Sequential(*[
            nn.Sequential(CausalConvTranspose1d(dim, dim, factor, stride=factor, weight_normed=False),
                          ConvNeXtBlock(dim))
            for factor in reversed(q.downsample_factor)])
        self.pre_module = _windowed_transformer(q.pre_module)
        self.post_module = _windowed_transformer(q.post_module)
        # GPU decode: every codebook's projected rows O_q cb_q + o_q, stacked (set_dequant_table)
        self.dequant_table: Tensor | None = None
        self.dequant_offsets: Tensor | None = None

    @property
    def codebooks(self) -> list[VectorQuantizer]:
        return [self.semantic_quantizer.quantizers[0], *self.quantizer.quantizers]

    @torch.no_grad()
    def set_dequant_table(self, on: bool) -> None:
        """Precompute O_q cb_q[c] + o_q for every codebook and code (float32, Σ Q_q rows of C).

        Dequant is then one gather and one sum instead of ~40 small kernels per decode step; the
        sum's order differs from the reference's, so it is for the GPU path only (F32 rounding,
        far below F16). About 54 MB at the real geometry.
        """
        if not on:
            self.dequant_table = self.dequant_offsets = None
            return
        rows = [vq.dequantize(torch.arange(vq.codebook.num_embeddings,
                                           device=vq.codebook.weight.device)[None])[0]
                for vq in self.codebooks]
        self.dequant_table = torch.cat(rows)
        sizes = torch.tensor([0] + [len(r) for r in rows[:-1]])
        self.dequant_offsets = torch.cumsum(sizes, 0).to(self.dequant_table.device)

    def dequantize(self, codes: Tensor) -> Tensor:
        """codes [B, N, t] int64 -> z [B, C, t] float32 (§7.4 step 2).

        The residual sum is accumulated first and then added to the semantic part, the
        reference's order of additions.
        """
        if self.dequant_table is not None:
            rows = self.dequant_table[codes + self.dequant_offsets[:, None]]      # [B, N, t, C]
            return rows.sum(dim=1).transpose(1, 2)
        codebooks = self.codebooks
        residual = torch.zeros(())
        for q in range(1, len(codebooks)):
            residual = residual + codebooks[q].dequantize(codes[:, q])
        return (codebooks[0].dequantize(codes[:, 0]) + residual).transpose(1, 2)

    def quantize(self, z: Tensor) -> Tensor:
        """z [B, C, T] float32 (after pre_module) -> codes [B, N, T] (§7.6 steps 6-7)."""
        residual = z.transpose(1, 2)
        codes = []
        for vq in self.codebooks:
            code = vq.quantize(residual)
            codes.append(code)
            residual = residual - vq.dequantize(code)
        return torch.stack(codes, dim=1)

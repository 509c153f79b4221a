"""The Drama 3 backbone: a Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention, MoE in every
layer) over text and audio rows (MODEL.md §4). Outer to inner:

    Backbone                 embed_tokens, layers, final norm, optional lm_head (parity only)
      .embed(token_ids [R], frames [R, N] | None) -> input rows [R, H]              (§4.1)
      .forward_rows(x [R, H], segments, caches)    -> final-norm hidden [R, H], caches advanced
      .forward_tokens(token_ids [T])               -> (hidden [T, H], logits [T, V]) of a fresh sequence
      .allocate_caches(slots, max_context)         -> BackboneCaches (one entry per layer)
    DecoderLayer             h = x + Mixer(RMSNorm⁺(x)); x' = h + MoE(RMSNorm⁺(h))    (§4.2)
    GatedDeltaNet / GatedAttention / SparseMoE    in gated_deltanet.py, attention.py, moe.py

Rows of several sessions run in one call as `Segment`s of a `RowBatch`; row-wise work goes
through `per_row`, which on the exact (CPU) path gives every row the same arithmetic however the
rows were grouped (see layers.py). The choice is made once, in __init__ (`exact`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import TextConfig

from .attention import GatedAttention, KVCache
from .gated_deltanet import GatedDeltaNet, GDNCache
from .layers import Linear, RowBatch, Segment, Weight, per_row, rms_norm_plus
from .moe import SparseMoE
from .rope import RotaryTable


@dataclass(frozen=True)
class AudioSpec:
    """What the backbone needs to embed audio rows (top-level keys of our config.json)."""
    semantic_start_token_id: int
    num_codebooks: int              # N
    codebook_vocab_size: int        # B, rows per codebook in codebook_embeddings
    semantic_codebook_size: int     # Q_s
    residual_codebook_size: int     # Q_r


@dataclass
class BackboneCaches:
    """One cache per layer (GDNCache or KVCache), all preallocated for `slots` sessions."""
    layers: list
    slots: int
    max_context: int

    def reset(self, slot: int) -> None:
        for cache in self.layers:
            cache.reset(slot)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers for t in c.tensors())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, dtype, device):
        super().__init__()
        self.layer_type = layer_type
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = Weight(cfg.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm = Weight(cfg.hidden_size, dtype=dtype, device=device)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype, device)
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype, device)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = SparseMoE(cfg, dtype, device)

    def forward(self, x, batch: RowBatch, cache, cos, sin):
        u = per_row(lambda r: rms_norm_plus(r, self.input_layernorm.weight, self.eps), x, exact=batch.exact)
        if self.layer_type == "linear_attention":
            h = x + self.linear_attn(u, batch, cache)
        else:
            h = x + self.self_attn(u, batch, cache, cos, sin)
        u = per_row(lambda r: rms_norm_plus(r, self.post_attention_layernorm.weight, self.eps), h,
                    exact=batch.exact)
        return h + self.mlp(u, batch.exact)


class Backbone(nn.Module):
    """The backbone stage. `exact=None` picks the exact per-row path on CPU, batched elsewhere."""

    def __init__(self, cfg: TextConfig, audio: AudioSpec | None = None, *, dtype=torch.float32,
                 device="cpu", lm_head: bool = True, exact: bool | None = None):
        super().__init__()
        self.config, self.audio, self.dtype = cfg, audio, dtype
        self.exact = (torch.device(device).type == "cpu") if exact is None else exact
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, dtype, device) for t in cfg.layer_types)
        self.norm = Weight(cfg.hidden_size, **kw)
        # Parity entry point only: the service never computes logits (§4.8).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, **kw) if lm_head else None
        self.codebook_embeddings = (Weight(audio.num_codebooks * audio.codebook_vocab_size, cfg.hidden_size, **kw)
                                    if audio is not None else None)
        self._rotary = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rotary(self) -> RotaryTable:
        if self._rotary is None:   # built lazily: the module may have been created on meta
            self._rotary = RotaryTable(self.config.rotary_dim, self.config.rope_theta, self.device)
        return self._rotary

    # ----------------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """Input rows (§4.1). token_ids int64 [R]; frames int64 [R, N], a row all −1 is a text row.

        Audio row: (embed_tokens[semantic_start + c_0] + Σ_k codebook_embeddings[k·B + c_k]) / √(N+1),
        summed in F32 in that order (elementwise, so each row's bits are its own).
        Ids and codes are assumed valid (the engine checks them first).
        """
        table = self.embed_tokens.weight
        x = table[token_ids].float()
        if frames is None or frames.numel() == 0:
            return x.to(self.dtype)
        audio_rows = (frames[:, 0] >= 0).nonzero(as_tuple=True)[0]
        if audio_rows.numel():
            spec, codes = self.audio, frames[audio_rows]
            acc = table[spec.semantic_start_token_id + codes[:, 0]].float()
            cb = self.codebook_embeddings.weight
            for k in range(spec.num_codebooks):
                acc = acc + cb[k * spec.codebook_vocab_size + codes[:, k]].float()
            x[audio_rows] = acc / math.sqrt(spec.num_codebooks + 1)
        return x.to(self.dtype)

    def allocate_caches(self, slots: int, max_context: int) -> BackboneCaches:
        cfg, device = self.config, self.device
        layers = [GDNCache.allocate(cfg, slots, self.dtype, device, self.exact) if t == "linear_attention"
                  else KVCache.allocate(cfg, slots, max_context, self.dtype, device)
                  for t in cfg.layer_types]
        return BackboneCaches(layers, slots, max_context)

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        """x [R, H] input rows of all segments (in segment order) -> final-norm hidden [R, H].

        Each segment's rows must continue its slot's sequence (segment.start = rows held).
        """
        positions = torch.cat([torch.arange(s.start, s.start + s.count) for s in segments]).to(self.device)
        batch = RowBatch(tuple(segments), positions, self.exact)
        cos, sin = self.rotary().lookup(positions)
        for layer, cache in zip(self.layers, caches.layers):
            x = layer(x, batch, cache, cos, sin)
        return per_row(lambda r: rms_norm_plus(r, self.norm.weight, self.config.rms_norm_eps), x,
                       exact=batch.exact)

    @torch.inference_mode()
    def forward_tokens(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Parity entry point: token_ids int64 [T] of a fresh sequence -> (hidden [T, H], logits [T, V])."""
        if self.lm_head is None:
            raise RuntimeError("this Backbone was loaded without lm_head")
        token_ids = token_ids.to(self.device)
        caches = self.allocate_caches(1, max(1, token_ids.shape[0]))
        hidden = self.forward_rows(self.embed(token_ids), [Segment(0, 0, token_ids.shape[0], 0)], caches)
        return hidden, F.linear(hidden, self.lm_head.dense_weight())

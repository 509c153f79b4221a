"""The tensors our checkpoint format holds: name -> TensorSpec(shape, dtypes) (MODEL.md §2.3, §2.4).

Each stage's loader and `dramaturg checkpoint inspect` check a checkpoint against these tables,
and the tiny generator writes exactly these names, so the three can never drift apart.

Choices where MODEL.md leaves room (the codec model loads exactly these keys):
- Every weight-normed codec conv ("WN") also has a `.bias` of its output channels: dim 0 of V for
  a conv, dim 1 of V for a transposed conv (`decoder.model.{b}.block.1`). g is `[dim0(V), 1, 1]`.
- Encoder block b (1..4) works at e_b/2 channels in its residual units and its Snake (index 3)
  and outputs e_b; its stride is encoder_rates[b-1]. Decoder block b takes w_{b-1} to w_b with
  rate decoder_rates[b-1].
- The encoder block transformer (`encoder.block.{b}.block.5`) has dim e_b, n_head = e_b // 64
  (the reference formula; "64" is the literal, not transformer_general_config.head_dim),
  head_dim = transformer_general_config.head_dim, feed-forward 3 * e_b; same keys as the
  quantizer's pre/post module, including `norm.weight`.
- Downsample stage u is `quantizer.downsample.{u}.0.conv` (plain Conv1d, kernel = stride =
  downsample_factor[u]) then the ConvNeXt at `.1`; upsample mirrors it with a
  plain ConvTranspose1d at `quantizer.upsample.{u}.0.conv` (stage u undoes downsample
  stage len-1-u). Both convs are `[C, C, factor]`.
- Codec tensors may be F32, BF16 or F16 (§2.4); the tiny generator writes F32.
- The tower's optional `audio_decoder.semantic_head.weight` is not in `tower_inventory`; it is
  returned by `tower_optional_inventory` (checked only when present).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from services.common.config import CodecConfig, DramaConfig, TextConfig, WindowedTransformerConfig

IGNORED_PREFIXES = ("model.visual.", "model.vision_tower.", "mtp.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # non-persistent RoPE tables some writers leave in

BACKBONE_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."
TOWER_PREFIX = "audio_decoder."

BF16 = (torch.bfloat16,)
FP8 = (torch.float8_e4m3fn,)
F32_OR_BF16 = (torch.float32, torch.bfloat16)
CODEC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

WEIGHT_NORM_STYLES = ("new", "old", "folded")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]

    def __str__(self) -> str:
        names = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
        return f"{list(self.shape)} {names}"


def is_ignored(name: str, ignore_prefixes: Iterable[str] = IGNORED_PREFIXES) -> bool:
    """Tensors we skip on purpose (MODEL.md §2.5 rule 5): vision tower, MTP head, RoPE tables."""
    return name.startswith(tuple(ignore_prefixes)) or name.endswith(IGNORED_SUFFIXES)


# --------------------------------------------------------------------------------------------
# backbone (safetensors)
# --------------------------------------------------------------------------------------------

def _text(cfg: DramaConfig | TextConfig) -> TextConfig:
    return cfg.text_config if isinstance(cfg, DramaConfig) else cfg


def _block_size(cfg: DramaConfig | TextConfig) -> tuple[int, int]:
    if isinstance(cfg, DramaConfig) and cfg.quantization_config is not None:
        return tuple(cfg.quantization_config.weight_block_size)
    return (128, 128)


def fp8_linear_specs(name: str, out_features: int, in_features: int,
                     block_size: tuple[int, int] = (128, 128)) -> dict[str, TensorSpec]:
    """`name.weight` F8_E4M3 [out, in] and `name.weight_scale_inv` [ceil(out/b0), ceil(in/b1)]."""
    b0, b1 = block_size
    return {f"{name}.weight": TensorSpec((out_features, in_features), FP8),
            f"{name}.weight_scale_inv": TensorSpec((math.ceil(out_features / b0),
                                                    math.ceil(in_features / b1)), F32_OR_BF16)}


def _moe_layer(p: str, t: TextConfig, fp8_experts: bool, fused_experts: bool,
               block_size: tuple[int, int]) -> dict[str, TensorSpec]:
    h, i_e, i_s = t.hidden_size, t.moe_intermediate_size, t.shared_expert_intermediate_size
    specs = {f"{p}mlp.gate.weight": TensorSpec((t.num_experts, h), BF16)}
    if fused_experts:   # BF16 Qwen layout (§2.5 rule 3): gate rows then up rows
        specs[f"{p}mlp.experts.gate_up_proj"] = TensorSpec((t.num_experts, 2 * i_e, h), BF16)
        specs[f"{p}mlp.experts.down_proj"] = TensorSpec((t.num_experts, h, i_e), BF16)
    else:
        for e in range(t.num_experts):
            for proj, out_f, in_f in (("gate_proj", i_e, h), ("up_proj", i_e, h), ("down_proj", h, i_e)):
                name = f"{p}mlp.experts.{e}.{proj}"
                if fp8_experts:
                    specs.update(fp8_linear_specs(name, out_f, in_f, block_size))
                else:
                    specs[f"{name}.weight"] = TensorSpec((out_f, in_f), BF16)
    specs[f"{p}mlp.shared_expert.gate_proj.weight"] = TensorSpec((i_s, h), BF16)
    specs[f"{p}mlp.shared_expert.up_proj.weight"] = TensorSpec((i_s, h), BF16)
    specs[f"{p}mlp.shared_expert.down_proj.weight"] = TensorSpec((h, i_s), BF16)
    specs[f"{p}mlp.shared_expert_gate.weight"] = TensorSpec((1, h), BF16)
    return specs


def _gdn_mixer(p: str, t: TextConfig) -> dict[str, TensorSpec]:
    h, n_v, d_v = t.hidden_size, t.linear_num_value_heads, t.linear_value_head_dim
    a = f"{p}linear_attn."
    return {
        f"{a}in_proj_qkv.weight": TensorSpec((t.conv_dim, h), BF16),
        f"{a}in_proj_z.weight": TensorSpec((t.linear_value_dim, h), BF16),
        f"{a}in_proj_b.weight": TensorSpec((n_v, h), BF16),
        f"{a}in_proj_a.weight": TensorSpec((n_v, h), BF16),
        f"{a}conv1d.weight": TensorSpec((t.conv_dim, 1, t.linear_conv_kernel_dim), BF16),
        f"{a}A_log": TensorSpec((n_v,), F32_OR_BF16),
        f"{a}dt_bias": TensorSpec((n_v,), F32_OR_BF16),
        f"{a}norm.weight": TensorSpec((d_v,), BF16),
        f"{a}out_proj.weight": TensorSpec((h, t.linear_value_dim), BF16),
    }


def gated_attention_specs(p: str, hidden: int, n_q: int, n_kv: int, d_h: int) -> dict[str, TensorSpec]:
    """Qwen3.5 gated attention (`{p}self_attn.*`): q_proj holds query and gate rows per head."""
    a = f"{p}self_attn."
    return {
        f"{a}q_proj.weight": TensorSpec((2 * n_q * d_h, hidden), BF16),
        f"{a}k_proj.weight": TensorSpec((n_kv * d_h, hidden), BF16),
        f"{a}v_proj.weight": TensorSpec((n_kv * d_h, hidden), BF16),
        f"{a}o_proj.weight": TensorSpec((hidden, n_q * d_h), BF16),
        f"{a}q_norm.weight": TensorSpec((d_h,), BF16),
        f"{a}k_norm.weight": TensorSpec((d_h,), BF16),
    }


def backbone_inventory(cfg: DramaConfig | TextConfig, prefix: str = BACKBONE_PREFIX,
                       fp8_experts: bool = True, include_lm_head: bool = True,
                       fused_experts: bool = False) -> dict[str, TensorSpec]:
    """Every backbone tensor of §2.3, in checkpoint order (embedding, layers, final norm, head).

    `prefix` is `model.language_model.` (ours, VL-style) or `model.` (text-only checkpoints);
    `lm_head.weight` never carries it. `fp8_experts=False` expects BF16 per-expert weights without
    scales; `fused_experts=True` the fused BF16 `experts.gate_up_proj` / `experts.down_proj`.
    """
    t = _text(cfg)
    block_size = _block_size(cfg)
    h = t.hidden_size
    specs = {f"{prefix}embed_tokens.weight": TensorSpec((t.vocab_size, h), BF16)}
    for i, kind in enumerate(t.layer_types):
        p = f"{prefix}layers.{i}."
        specs[f"{p}input_layernorm.weight"] = TensorSpec((h,), BF16)
        if kind == "linear_attention":
            specs.update(_gdn_mixer(p, t))
        else:
            specs.update(gated_attention_specs(p, h, t.num_attention_heads, t.num_key_value_heads,
                                               t.head_dim))
        specs[f"{p}post_attention_layernorm.weight"] = TensorSpec((h,), BF16)
        specs.update(_moe_layer(p, t, fp8_experts, fused_experts, block_size))
    specs[f"{prefix}norm.weight"] = TensorSpec((h,), BF16)
    if include_lm_head and not t.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((t.vocab_size, h), BF16)
    return specs


# --------------------------------------------------------------------------------------------
# tower (safetensors, `audio_decoder.*`)
# --------------------------------------------------------------------------------------------

def _tower_layer(p: str, cfg: DramaConfig) -> dict[str, TensorSpec]:
    tw = cfg.audio_decoder_config
    d, i_t = tw.hidden_size, tw.intermediate_size
    specs = {f"{p}input_layernorm.weight": TensorSpec((d,), BF16)}
    specs.update(gated_attention_specs(p, d, tw.num_attention_heads, tw.num_key_value_heads, tw.head_dim))
    specs[f"{p}post_attention_layernorm.weight"] = TensorSpec((d,), BF16)
    specs[f"{p}mlp.gate_proj.weight"] = TensorSpec((i_t, d), BF16)
    specs[f"{p}mlp.up_proj.weight"] = TensorSpec((i_t, d), BF16)
    specs[f"{p}mlp.down_proj.weight"] = TensorSpec((d, i_t), BF16)
    return specs


def tower_inventory(cfg: DramaConfig) -> dict[str, TensorSpec]:
    """Every required `audio_decoder.*` tensor of §2.3 (the semantic head is optional, see below)."""
    tw = cfg.audio_decoder_config
    d = tw.hidden_size
    a = TOWER_PREFIX
    specs = {f"{a}codebook_embeddings.weight":
             TensorSpec((cfg.num_codebooks * cfg.codebook_vocab_size, cfg.text_config.hidden_size), BF16)}
    for s in range(tw.num_shared_layers):
        specs.update(_tower_layer(f"{a}shared_layers.{s}.", cfg))
    for j in range(tw.num_residual_layers):
        p = f"{a}residual_layers.{j}."
        specs.update(_tower_layer(p, cfg))
        specs[f"{p}pre_fc_norm_embedding.weight"] = TensorSpec((d,), BF16)
        specs[f"{p}pre_fc_norm_hidden.weight"] = TensorSpec((d,), BF16)
        specs[f"{p}fc.weight"] = TensorSpec((d, 2 * d), BF16)
        specs[f"{p}norm.weight"] = TensorSpec((d,), BF16)
        specs[f"{p}head.weight"] = TensorSpec((cfg.residual_codebook_size, d), BF16)
    return specs


def tower_optional_inventory(cfg: DramaConfig) -> dict[str, TensorSpec]:
    """Tower tensors that may be absent but must match when present (§2.3, §4.8)."""
    return {f"{TOWER_PREFIX}semantic_head.weight":
            TensorSpec((cfg.semantic_codebook_size + 1, cfg.text_config.hidden_size), BF16)}


# --------------------------------------------------------------------------------------------
# codec (codec.pth)
# --------------------------------------------------------------------------------------------

def _f(shape) -> TensorSpec:
    return TensorSpec(tuple(shape), CODEC_DTYPES)


def _windowed_transformer(p: str, dim: int, n_layer: int, n_head: int, head_dim: int,
                          ffn: int) -> dict[str, TensorSpec]:
    """Keys of the quantizer pre/post module and the encoder block transformer."""
    specs = {}
    for l in range(n_layer):
        q = f"{p}layers.{l}."
        specs[f"{q}attention.wqkv.weight"] = _f((3 * n_head * head_dim, dim))
        specs[f"{q}attention.wo.weight"] = _f((dim, n_head * head_dim))
        specs[f"{q}feed_forward.w1.weight"] = _f((ffn, dim))
        specs[f"{q}feed_forward.w3.weight"] = _f((ffn, dim))
        specs[f"{q}feed_forward.w2.weight"] = _f((dim, ffn))
        specs[f"{q}attention_norm.weight"] = _f((dim,))
        specs[f"{q}ffn_norm.weight"] = _f((dim,))
        specs[f"{q}attention_layer_scale.gamma"] = _f((dim,))
        specs[f"{q}ffn_layer_scale.gamma"] = _f((dim,))
    specs[f"{p}norm.weight"] = _f((dim,))
    return specs


def _module_transformer(p: str, m: WindowedTransformerConfig) -> dict[str, TensorSpec]:
    return _windowed_transformer(p, m.dim, m.n_layer, m.n_head, m.head_dim, m.intermediate_size)


def _convnext(p: str, c: int) -> dict[str, TensorSpec]:
    return {f"{p}dwconv.conv.weight": _f((c, 1, 7)), f"{p}dwconv.conv.bias": _f((c,)),
            f"{p}norm.weight": _f((c,)), f"{p}norm.bias": _f((c,)),
            f"{p}pwconv1.weight": _f((4 * c, c)), f"{p}pwconv1.bias": _f((4 * c,)),
            f"{p}pwconv2.weight": _f((c, 4 * c)), f"{p}pwconv2.bias": _f((c,)),
            f"{p}gamma": _f((c,))}


def _snake(name: str, channels: int) -> dict[str, TensorSpec]:
    return {name: _f((1, channels, 1))}


@dataclass(frozen=True)
class WeightNormConv:
    """One weight-normed conv: V's shape, whether it is transposed, its default (real) style."""
    v_shape: tuple[int, int, int]
    transposed: bool
    real_style: str          # "new" (parametrizations) or "old" (weight_g / weight_v)

    @property
    def bias_channels(self) -> int:
        return self.v_shape[1] if self.transposed else self.v_shape[0]


def codec_weight_norm_convs(codec: CodecConfig) -> dict[str, WeightNormConv]:
    """Every weight-normed conv of §2.4 by its key prefix (60 + 20 in the real codec)."""
    q = codec.quantizer
    c, d_cb = codec.latent_dim, q.codebook_dim
    convs: dict[str, WeightNormConv] = {}

    def add(prefix, shape, transposed=False, style="new"):
        convs[prefix] = WeightNormConv(tuple(shape), transposed, style)

    e = [codec.encoder_dim * 2 ** b for b in range(len(codec.encoder_rates) + 1)]
    add("encoder.block.0.conv", (e[0], 1, 7))
    for b, stride in enumerate(codec.encoder_rates, start=1):
        half = e[b] // 2
        for u in range(3):
            add(f"encoder.block.{b}.block.{u}.block.1.conv", (half, half, 7))
            add(f"encoder.block.{b}.block.{u}.block.3.conv", (half, half, 1))
        add(f"encoder.block.{b}.block.4.conv", (e[b], half, 2 * stride))
    add(f"encoder.block.{len(codec.encoder_rates) + 2}.conv", (c, e[-1], 3))

    w = [codec.decoder_dim // 2 ** b for b in range(len(codec.decoder_rates) + 1)]
    add("decoder.model.0.conv", (w[0], c, 7))
    for b, rate in enumerate(codec.decoder_rates, start=1):
        add(f"decoder.model.{b}.block.1.conv", (w[b - 1], w[b], 2 * rate), transposed=True)
        for u in range(3):
            add(f"decoder.model.{b}.block.{u + 2}.block.1.conv", (w[b], w[b], 7))
            add(f"decoder.model.{b}.block.{u + 2}.block.3.conv", (w[b], w[b], 1))
    add(f"decoder.model.{len(codec.decoder_rates) + 2}.conv", (1, w[-1], 7))

    rvq = ["quantizer.semantic_quantizer.quantizers.0"] + [
        f"quantizer.quantizer.quantizers.{i}" for i in range(q.n_codebooks)]
    for p in rvq:
        add(f"{p}.in_proj", (d_cb, c, 1), style="old")
        add(f"{p}.out_proj", (c, d_cb, 1), style="old")
    return convs


def weight_norm_specs(prefix: str, conv: WeightNormConv, style: str) -> dict[str, TensorSpec]:
    """The tensors one WN conv stores in `style` ("new", "old" or "folded"), bias included."""
    g = _f((conv.v_shape[0], 1, 1))
    v = _f(conv.v_shape)
    if style == "new":
        specs = {f"{prefix}.parametrizations.weight.original0": g,
                 f"{prefix}.parametrizations.weight.original1": v}
    elif style == "old":
        specs = {f"{prefix}.weight_g": g, f"{prefix}.weight_v": v}
    elif style == "folded":
        specs = {f"{prefix}.weight": v}
    else:
        raise ValueError(f"unknown weight-norm style {style!r}; expected one of {WEIGHT_NORM_STYLES}")
    specs[f"{prefix}.bias"] = _f((conv.bias_channels,))
    return specs


def detect_weight_norm_styles(names: Iterable[str], codec: CodecConfig) -> dict[str, str]:
    """For each WN conv, the style its keys in `names` use (its real style when none is present)."""
    names = set(names)
    styles = {}
    for prefix, conv in codec_weight_norm_convs(codec).items():
        found = [s for s in WEIGHT_NORM_STYLES
                 if set(weight_norm_specs(prefix, conv, s)) - {f"{prefix}.bias"} <= names]
        styles[prefix] = found[0] if found else conv.real_style
    return styles


def codec_inventory(codec: CodecConfig | DramaConfig,
                    style: str | Mapping[str, str] = "real") -> dict[str, TensorSpec]:
    """Every codec.pth tensor of §2.4.

    style: "real" (parametrizations in encoder/decoder, weight_g/weight_v in the RVQ projections,
    as Fish's file), "new", "old" or "folded" for every WN conv, or a map conv prefix -> style
    (what detect_weight_norm_styles returns).
    """
    if isinstance(codec, DramaConfig):
        codec = codec.codec_config
    q = codec.quantizer
    c, d_cb = codec.latent_dim, q.codebook_dim
    convs = codec_weight_norm_convs(codec)

    def conv_style(prefix: str) -> str:
        if isinstance(style, Mapping):
            return style.get(prefix, convs[prefix].real_style)
        return convs[prefix].real_style if style == "real" else style

    def wn(prefix: str) -> dict[str, TensorSpec]:
        return weight_norm_specs(prefix, convs[prefix], conv_style(prefix))

    # Module order of the reference DAC: encoder, quantizer, decoder.
    specs: dict[str, TensorSpec] = {}
    general = codec.transformer_general_config
    e = [codec.encoder_dim * 2 ** b for b in range(len(codec.encoder_rates) + 1)]
    specs.update(wn("encoder.block.0.conv"))
    for b in range(1, len(codec.encoder_rates) + 1):
        half, p = e[b] // 2, f"encoder.block.{b}.block."
        for u in range(3):
            specs.update(_snake(f"{p}{u}.block.0.alpha", half))
            specs.update(wn(f"{p}{u}.block.1.conv"))
            specs.update(_snake(f"{p}{u}.block.2.alpha", half))
            specs.update(wn(f"{p}{u}.block.3.conv"))
        specs.update(_snake(f"{p}3.alpha", half))
        specs.update(wn(f"{p}4.conv"))
        n_layer = codec.encoder_transformer_layers[b - 1]
        if n_layer > 0:
            specs.update(_windowed_transformer(f"{p}5.", e[b], n_layer, e[b] // 64,
                                               int(general.get("head_dim", 64)), 3 * e[b]))
    tail = len(codec.encoder_rates) + 1
    specs.update(_snake(f"encoder.block.{tail}.alpha", e[-1]))
    specs.update(wn(f"encoder.block.{tail + 1}.conv"))

    # Residual vector quantizer: semantic codebook first, then the residual ones.
    rvq = [("quantizer.semantic_quantizer.quantizers.0", q.semantic_codebook_size)] + [
        (f"quantizer.quantizer.quantizers.{i}", q.codebook_size) for i in range(q.n_codebooks)]
    for p, size in rvq:
        specs.update(wn(f"{p}.in_proj"))
        specs.update(wn(f"{p}.out_proj"))
        specs[f"{p}.codebook.weight"] = _f((size, d_cb))
    for name in ("pre_module", "post_module"):
        specs.update(_module_transformer(f"quantizer.{name}.", getattr(q, name)))
    # The upsample stages undo the downsample ones in reverse order (kernel = that stage's factor).
    for y, factors in (("downsample", q.downsample_factor), ("upsample", q.downsample_factor[::-1])):
        for u, factor in enumerate(factors):
            specs[f"quantizer.{y}.{u}.0.conv.weight"] = _f((c, c, factor))
            specs[f"quantizer.{y}.{u}.0.conv.bias"] = _f((c,))
            specs.update(_convnext(f"quantizer.{y}.{u}.1.", c))

    w = [codec.decoder_dim // 2 ** b for b in range(len(codec.decoder_rates) + 1)]
    specs.update(wn("decoder.model.0.conv"))
    for b in range(1, len(codec.decoder_rates) + 1):
        p = f"decoder.model.{b}.block."
        specs.update(_snake(f"{p}0.alpha", w[b - 1]))
        specs.update(wn(f"{p}1.conv"))
        for u in range(3):
            specs.update(_snake(f"{p}{u + 2}.block.0.alpha", w[b]))
            specs.update(wn(f"{p}{u + 2}.block.1.conv"))
            specs.update(_snake(f"{p}{u + 2}.block.2.alpha", w[b]))
            specs.update(wn(f"{p}{u + 2}.block.3.conv"))
    tail = len(codec.decoder_rates) + 1
    specs.update(_snake(f"decoder.model.{tail}.alpha", w[-1]))
    specs.update(wn(f"decoder.model.{tail + 1}.conv"))
    return specs

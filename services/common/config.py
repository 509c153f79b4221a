"""config.json, one dataclass per section (MODEL.md §2.2).

Field names equal the JSON keys so the mapping needs no table. Every section refuses unknown keys
and unsupported values with a `ConfigError` naming the key; derived sizes are computed once in
`__post_init__` (gpt-fast's ModelArgs pattern).

Entry points:
    load_config(checkpoint_dir)         -> DramaConfig (our speech checkpoints)
    load_text_config(checkpoint_dir)    -> TextConfig  (also accepts a flat HF Qwen3.5-MoE text config)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json problem; the message names the section and key."""


def _object(raw, section: str) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _build(cls, raw: dict, section: str, *, extra_allowed: dict[str, Any] | None = None):
    """Instantiate dataclass `cls` from `raw`, refusing unknown keys.

    `extra_allowed` maps keys that are accepted but not stored to a check: None (any value) or a
    required value (compared with ==) or a callable returning True when the value is supported.
    """
    _object(raw, section)
    names = {f.name for f in fields(cls) if f.init}
    kwargs, extra_allowed = {}, extra_allowed or {}
    for key, value in raw.items():
        if key in names:
            kwargs[key] = value
        elif key in extra_allowed:
            check = extra_allowed[key]
            ok = check is None or (check(value) if callable(check) else value == check)
            if not ok:
                raise ConfigError(f"{section}.{key}: unsupported value {value!r}")
        else:
            raise ConfigError(f"{section}: unknown key {key!r}")
    missing = [f.name for f in fields(cls) if f.init and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and f.name not in kwargs]
    if missing:
        raise ConfigError(f"{section}: missing key(s) {', '.join(repr(m) for m in missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{section}.{exc}") from None


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def _positive_ints(**values: Any) -> None:
    for key, value in values.items():
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, key,
                 f"expected a positive integer, got {value!r}")


# --------------------------------------------------------------------------------------------
# text_config: the backbone (HF Qwen3_5MoeTextConfig field names)
# --------------------------------------------------------------------------------------------

# Keys seen in published Qwen3.5 configs that we accept without storing; a value means "must equal".
_TEXT_ACCEPTED = {
    "attn_output_gate": True,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": lambda v: v in ([], None),
    "use_sliding_window": False,
    "sliding_window": lambda v: v is None,
    "rope_scaling": lambda v: v is None,
    "mamba_ssm_dtype": None, "dtype": None, "torch_dtype": None, "transformers_version": None,
    "architectures": None, "initializer_range": None, "use_cache": None,
    "output_router_logits": None, "router_aux_loss_coef": None, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None, "attention_dropout": lambda v: v in (0, 0.0),
    "model_type": lambda v: v in ("qwen3_5_moe_text", "qwen3_5_moe"),
}


@dataclass
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: list[str] | None = None
    full_attention_interval: int | None = None  # constructor arg of HF config; layer_types wins
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rope_parameters: dict | None = None
    rope_theta: float | None = None              # legacy top-level spelling
    partial_rotary_factor: float | None = None   # legacy top-level spelling
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        _positive_ints(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                       num_hidden_layers=self.num_hidden_layers,
                       num_attention_heads=self.num_attention_heads,
                       num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                       linear_num_key_heads=self.linear_num_key_heads,
                       linear_num_value_heads=self.linear_num_value_heads,
                       linear_key_head_dim=self.linear_key_head_dim,
                       linear_value_head_dim=self.linear_value_head_dim,
                       linear_conv_kernel_dim=self.linear_conv_kernel_dim,
                       num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        _require(self.hidden_act == "silu", "hidden_act", f"only 'silu' is implemented, got {self.hidden_act!r}")
        _require(not self.attention_bias, "attention_bias", "attention biases are not implemented")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 "must divide num_attention_heads")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_key_heads",
                 "must divide linear_num_value_heads")
        _require(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 "must not exceed num_experts")
        if self.layer_types is None:
            interval = self.full_attention_interval or 4
            self.layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for i, kind in enumerate(self.layer_types):
            _require(kind in ("linear_attention", "full_attention"), f"layer_types[{i}]",
                     f"unknown layer type {kind!r}")
        rope = dict(self.rope_parameters or {})
        for key in rope:
            _require(key in ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section",
                             "mrope_interleaved"), f"rope_parameters.{key}", "unknown key")
        _require(rope.get("rope_type", "default") == "default", "rope_parameters.rope_type",
                 f"only 'default' is implemented, got {rope.get('rope_type')!r}")
        # Legacy top-level values apply only when rope_parameters lacks them (MODEL.md §2.2).
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta if self.rope_theta is not None else 10000.0))
        self.partial_rotary_factor = float(rope.get(
            "partial_rotary_factor", self.partial_rotary_factor if self.partial_rotary_factor is not None else 0.25))
        rot = self.head_dim * self.partial_rotary_factor
        _require(rot == int(rot) and int(rot) % 2 == 0 and rot > 0, "partial_rotary_factor",
                 f"head_dim * factor = {rot} must be a positive even integer")

    # Derived sizes (MODEL.md §0).
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:          # n_k * d_k
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:        # n_v * d_v
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:                # c = 2 n_k d_k + n_v d_v
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_dict(cls, raw: dict, section: str = "text_config") -> "TextConfig":
        mtp_keys = {k: None for k in raw if isinstance(k, str) and k.startswith("mtp_")} \
            if isinstance(raw, dict) else {}
        return _build(cls, raw, section, extra_allowed=_TEXT_ACCEPTED | mtp_keys)


# --------------------------------------------------------------------------------------------
# audio_decoder_config: the tower (MODEL.md §5.1)
# --------------------------------------------------------------------------------------------

@dataclass
class AudioDecoderConfig:
    hidden_size: int
    num_shared_layers: int
    num_residual_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    attn_output_gate: bool = True
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000000.0,
                                                             "partial_rotary_factor": 0.25})

    def __post_init__(self):
        _positive_ints(hidden_size=self.hidden_size, num_residual_layers=self.num_residual_layers,
                       num_attention_heads=self.num_attention_heads,
                       num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                       intermediate_size=self.intermediate_size)
        _require(isinstance(self.num_shared_layers, int) and self.num_shared_layers >= 0,
                 "num_shared_layers", "expected a non-negative integer")
        _require(self.hidden_act == "silu", "hidden_act", "only 'silu' is implemented")
        _require(self.attn_output_gate is True, "attn_output_gate", "only true is implemented")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 "must divide num_attention_heads")
        for key in self.rope_parameters:
            _require(key in ("rope_theta", "partial_rotary_factor", "rope_type"),
                     f"rope_parameters.{key}", "unknown key")
        _require(self.rope_parameters.get("rope_type", "default") == "default", "rope_parameters.rope_type",
                 f"only 'default' is implemented, got {self.rope_parameters.get('rope_type')!r}")
        rot = self.head_dim * self.partial_rotary_factor
        _require(rot == int(rot) and int(rot) % 2 == 0 and rot > 0, "rope_parameters.partial_rotary_factor",
                 f"head_dim * factor = {rot} must be a positive even integer")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000000.0))

    @property
    def partial_rotary_factor(self) -> float:
        return float(self.rope_parameters.get("partial_rotary_factor", 0.25))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_layers(self) -> int:
        return self.num_shared_layers + self.num_residual_layers


# --------------------------------------------------------------------------------------------
# codec_config: Fish modded DAC (MODEL.md §7.1)
# --------------------------------------------------------------------------------------------

@dataclass
class WindowedTransformerConfig:
    """The quantizer's pre/post module (windowed causal transformer)."""
    window_size: int
    n_layer: int
    n_head: int
    head_dim: int
    dim: int
    intermediate_size: int
    causal: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        _positive_ints(window_size=self.window_size, n_head=self.n_head, head_dim=self.head_dim,
                       dim=self.dim, intermediate_size=self.intermediate_size)
        _require(isinstance(self.n_layer, int) and self.n_layer >= 0, "n_layer", "expected >= 0")
        _require(self.causal is True, "causal", "only causal modules are implemented")


@dataclass
class QuantizerConfig:
    input_dim: int
    n_codebooks: int              # residual codebooks (N - 1)
    codebook_size: int            # Q_r
    codebook_dim: int
    semantic_codebook_size: int   # Q_s
    downsample_factor: list[int]
    post_module: WindowedTransformerConfig
    pre_module: WindowedTransformerConfig

    @classmethod
    def from_dict(cls, raw: dict, section: str) -> "QuantizerConfig":
        raw = dict(_object(raw, section))
        for key in ("post_module", "pre_module"):
            if key in raw:
                raw[key] = _build(WindowedTransformerConfig, raw[key], f"{section}.{key}")
        return _build(cls, raw, section)

    def __post_init__(self):
        _positive_ints(input_dim=self.input_dim, n_codebooks=self.n_codebooks,
                       codebook_size=self.codebook_size, codebook_dim=self.codebook_dim,
                       semantic_codebook_size=self.semantic_codebook_size)
        _require(all(f == 2 for f in self.downsample_factor), "downsample_factor",
                 f"only stride-2 stages are implemented, got {self.downsample_factor}")
        for key in ("post_module", "pre_module"):
            _require(getattr(self, key).dim == self.input_dim, f"{key}.dim",
                     "must equal quantizer.input_dim (projections are not implemented)")


@dataclass
class CodecConfig:
    sample_rate: int
    encoder_dim: int
    encoder_rates: list[int]
    decoder_dim: int
    decoder_rates: list[int]
    quantizer: QuantizerConfig
    latent_dim: int | None = None
    encoder_transformer_layers: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    encoder_transformer_window: int = 512
    decoder_transformer_layers: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # inert
    transformer_general_config: dict = field(default_factory=lambda: {
        "head_dim": 64, "rope_base": 10000, "norm_eps": 1e-5})

    @classmethod
    def from_dict(cls, raw: dict, section: str = "codec_config") -> "CodecConfig":
        raw = dict(_object(raw, section))
        if "quantizer" in raw:
            raw["quantizer"] = QuantizerConfig.from_dict(raw["quantizer"], f"{section}.quantizer")
        return _build(cls, raw, section)

    def __post_init__(self):
        _positive_ints(sample_rate=self.sample_rate, encoder_dim=self.encoder_dim,
                       decoder_dim=self.decoder_dim)
        _require(len(self.encoder_transformer_layers) == len(self.encoder_rates),
                 "encoder_transformer_layers", "needs one entry per encoder rate")
        if self.latent_dim is None:
            self.latent_dim = self.encoder_dim * 2 ** len(self.encoder_rates)
        _require(self.quantizer.input_dim == self.latent_dim, "quantizer.input_dim",
                 f"must equal latent_dim {self.latent_dim}")
        for key in self.transformer_general_config:
            _require(key in ("head_dim", "rope_base", "norm_eps"),
                     f"transformer_general_config.{key}", "unknown key")
        _require(self.frame_samples == math.prod(self.decoder_rates) * math.prod(self.quantizer.downsample_factor),
                 "decoder_rates", "encoder and decoder hop lengths disagree")
        # Decoder widths halve per block (w_b = decoder_dim / 2^b) and must stay whole.
        _require(self.decoder_dim % 2 ** len(self.decoder_rates) == 0, "decoder_dim",
                 f"must be divisible by 2^{len(self.decoder_rates)}")
        # The encoder block transformer has dim // 64 heads (MODEL.md §7.1): it needs dim >= 64.
        for b, n_layer in enumerate(self.encoder_transformer_layers):
            _require(n_layer == 0 or self.encoder_dim * 2 ** (b + 1) >= 64, f"encoder_transformer_layers[{b}]",
                     f"block width {self.encoder_dim * 2 ** (b + 1)} is below 64 (no attention head)")

    @property
    def hop_length(self) -> int:          # encoder hop, 512 for the real codec
        return math.prod(self.encoder_rates)

    @property
    def frame_samples(self) -> int:       # samples per frame, 2048
        return self.hop_length * math.prod(self.quantizer.downsample_factor)

    @property
    def num_codebooks(self) -> int:       # N
        return self.quantizer.n_codebooks + 1

    @property
    def frame_rate_hz(self) -> float:
        return self.sample_rate / self.frame_samples


# --------------------------------------------------------------------------------------------
# small sections
# --------------------------------------------------------------------------------------------

@dataclass
class QuantizationConfig:
    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: list[int] = field(default_factory=lambda: [128, 128])
    modules_to_not_convert: list[str] = field(default_factory=list)

    def __post_init__(self):
        _require(self.quant_method == "fp8", "quant_method", f"only 'fp8', got {self.quant_method!r}")
        _require(self.fmt == "e4m3", "fmt", f"only 'e4m3', got {self.fmt!r}")
        _require(self.activation_scheme == "dynamic", "activation_scheme", "only 'dynamic'")
        _require(len(self.weight_block_size) == 2 and all(
            isinstance(b, int) and b > 0 for b in self.weight_block_size), "weight_block_size",
            "expected two positive integers")


@dataclass
class SamplingDefaults:
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 4097
    ras_window: int = 16
    ras_recent: int = 4
    ras_temperature: float = 1.5
    ras_top_p: float = 0.95
    ras_top_k: int = 30
    max_new_frames: int = 2048


@dataclass
class TextChunking:
    text_chunk_size: int = 128
    text_chunk_mode: str = "tag_aware"

    def __post_init__(self):
        _positive_ints(text_chunk_size=self.text_chunk_size)
        _require(self.text_chunk_mode == "tag_aware", "text_chunk_mode", "only 'tag_aware'")


# --------------------------------------------------------------------------------------------
# top level
# --------------------------------------------------------------------------------------------

@dataclass
class DramaConfig:
    num_codebooks: int
    semantic_codebook_size: int
    residual_codebook_size: int
    codebook_vocab_size: int
    semantic_start_token_id: int
    semantic_end_token_id: int
    im_start_token_id: int
    im_end_token_id: int
    pad_token_id: int
    voice_token_id: int
    speaker_start_token_id: int
    text_config: TextConfig
    audio_decoder_config: AudioDecoderConfig
    codec_config: CodecConfig
    num_speakers: int = 16
    architectures: list[str] = field(default_factory=lambda: ["Drama3ForSpeech"])
    model_type: str = "fish_drama3"
    quantization_config: QuantizationConfig | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    text_chunking: TextChunking = field(default_factory=TextChunking)

    # Short aliases used throughout the code.
    @property
    def text(self) -> TextConfig:
        return self.text_config

    @property
    def tower(self) -> AudioDecoderConfig:
        return self.audio_decoder_config

    @property
    def codec(self) -> CodecConfig:
        return self.codec_config

    @property
    def sampling(self) -> SamplingDefaults:
        return self.sampling_defaults

    def __post_init__(self):
        _positive_ints(num_codebooks=self.num_codebooks,
                       semantic_codebook_size=self.semantic_codebook_size,
                       residual_codebook_size=self.residual_codebook_size,
                       codebook_vocab_size=self.codebook_vocab_size, num_speakers=self.num_speakers)
        _require(self.num_codebooks >= 2, "num_codebooks", "needs a semantic and >= 1 residual codebook")
        _require(self.semantic_end_token_id - self.semantic_start_token_id + 1 == self.semantic_codebook_size,
                 "semantic_end_token_id", "semantic token ids must be contiguous and span semantic_codebook_size")
        _require(self.codebook_vocab_size >= max(self.semantic_codebook_size, self.residual_codebook_size),
                 "codebook_vocab_size", "must hold every semantic and residual code")
        _require(self.semantic_start_token_id >= 0, "semantic_start_token_id", "must be >= 0")
        _require(self.speaker_start_token_id >= 0, "speaker_start_token_id", "must be >= 0")
        for key in ("semantic_end_token_id", "im_start_token_id", "im_end_token_id", "pad_token_id",
                    "voice_token_id"):
            _require(0 <= getattr(self, key) < self.text_config.vocab_size, key, "outside the vocabulary")
        _require(self.speaker_start_token_id + self.num_speakers <= self.text_config.vocab_size,
                 "speaker_start_token_id", "speaker tags outside the vocabulary")
        _require(self.audio_decoder_config.hidden_size == self.text_config.hidden_size,
                 "audio_decoder_config.hidden_size", "must equal text_config.hidden_size")
        _require(self.audio_decoder_config.num_residual_layers == self.num_codebooks - 1,
                 "audio_decoder_config.num_residual_layers", "must equal num_codebooks - 1")
        q = self.codec_config.quantizer
        _require(q.n_codebooks == self.num_codebooks - 1, "codec_config.quantizer.n_codebooks",
                 "must equal num_codebooks - 1")
        _require(q.codebook_size == self.residual_codebook_size, "codec_config.quantizer.codebook_size",
                 "must equal residual_codebook_size")
        _require(q.semantic_codebook_size == self.semantic_codebook_size,
                 "codec_config.quantizer.semantic_codebook_size", "must equal semantic_codebook_size")

    @classmethod
    def from_dict(cls, raw: dict) -> "DramaConfig":
        raw = dict(_object(raw, "config.json"))
        sections = {
            "text_config": lambda v: TextConfig.from_dict(v, "text_config"),
            "audio_decoder_config": lambda v: _build(AudioDecoderConfig, v, "audio_decoder_config"),
            "codec_config": lambda v: CodecConfig.from_dict(v, "codec_config"),
            "quantization_config": lambda v: _build(QuantizationConfig, v, "quantization_config"),
            "sampling_defaults": lambda v: _build(SamplingDefaults, v, "sampling_defaults"),
            "text_chunking": lambda v: _build(TextChunking, v, "text_chunking"),
        }
        for key, make in sections.items():
            if key in raw and raw[key] is not None:
                raw[key] = make(raw[key])
        return _build(cls, raw, "config.json")

    def to_dict(self) -> dict:
        """The JSON form (derived values excluded), so from_dict(to_dict()) round-trips."""
        return _to_json(self)


def _to_json(obj):
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            out[f.name] = _to_json(value)
        if isinstance(obj, TextConfig):   # legacy spellings are folded into rope_parameters
            out.pop("rope_theta", None)
            out.pop("partial_rotary_factor", None)
            out["rope_parameters"] = {**(obj.rope_parameters or {}), "rope_theta": obj.rope_theta,
                                      "partial_rotary_factor": obj.partial_rotary_factor}
        return out
    if isinstance(obj, list):
        return [_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    return obj


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None


def is_flat_text_config(raw: dict) -> bool:
    """A text-only HF checkpoint: no text_config section and no speech keys (MODEL.md §2.5 rule 2)."""
    return "text_config" not in raw and "num_codebooks" not in raw


def load_config(checkpoint_dir: str | Path, *, check_tokenizer: bool = True) -> DramaConfig:
    """config.json of a speech checkpoint; with `check_tokenizer`, and when the directory has a
    tokenizer.json, every token id of the config must equal the tokenizer's (MODEL.md §2.2)."""
    path = Path(checkpoint_dir) / "config.json"
    raw = _read_json(path)
    if is_flat_text_config(raw):
        raise ConfigError(f"{path}: a text-only Qwen3.5-MoE config; only the backbone loads it")
    try:
        cfg = DramaConfig.from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if check_tokenizer and (Path(checkpoint_dir) / "tokenizer.json").is_file():
        from services.common.tokenizer import check_token_ids, load_tokenizer   # tokenizers is heavy-ish

        try:
            check_token_ids(cfg, load_tokenizer(checkpoint_dir))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return cfg


def load_text_config(checkpoint_dir: str | Path) -> TextConfig:
    """The backbone's section, from our config or from a flat HF text config."""
    path = Path(checkpoint_dir) / "config.json"
    raw = _read_json(path)
    try:
        if is_flat_text_config(raw):
            return TextConfig.from_dict(raw, "config.json")
        return DramaConfig.from_dict(raw).text_config
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None

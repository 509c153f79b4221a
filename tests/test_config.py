"""config.json (MODEL.md §2.2): round trips, and refusals that name the offending key."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from services.common.config import ConfigError, DramaConfig, TextConfig, load_config, load_text_config
from services.common.make_checkpoint import preset_raw


@pytest.fixture()
def raw():
    return copy.deepcopy(preset_raw("tiny"))


def _refused(raw: dict, match: str):
    with pytest.raises(ConfigError, match=match):
        DramaConfig.from_dict(raw)


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_round_trip(preset):
    cfg = DramaConfig.from_dict(preset_raw(preset))
    again = DramaConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()


def test_tiny_derived_sizes(tiny_config):
    t = tiny_config.text
    assert (t.conv_dim, t.linear_key_dim, t.linear_value_dim, t.rotary_dim) == (128, 32, 64, 4)
    assert t.full_attention_layers == [3] and t.linear_attention_layers == [0, 1, 2]
    c = tiny_config.codec
    assert (c.latent_dim, c.hop_length, c.frame_samples, c.num_codebooks) == (64, 512, 2048, 10)
    assert tiny_config.tower.num_layers == 10 and tiny_config.sampling.top_k == 4097


@pytest.mark.parametrize("path,match", [
    ((), r"config.json: unknown key 'surprise'"),
    (("text_config",), r"text_config: unknown key 'surprise'"),
    (("audio_decoder_config",), r"audio_decoder_config: unknown key 'surprise'"),
    (("codec_config", "quantizer", "post_module"), r"codec_config.quantizer.post_module: unknown key 'surprise'"),
    (("sampling_defaults",), r"sampling_defaults: unknown key 'surprise'"),
], ids=["top", "text", "tower", "codec-post-module", "sampling"])
def test_unknown_key_is_refused_at_any_depth(raw, path, match):
    section = raw
    for key in path:
        section = section[key]
    section["surprise"] = 1
    _refused(raw, match)


@pytest.mark.parametrize("edit,match", [
    (lambda r: r["text_config"].update(hidden_act="gelu"), r"text_config.hidden_act: only 'silu'"),
    (lambda r: r["text_config"].update(use_sliding_window=True), r"text_config.use_sliding_window: unsupported value True"),
    (lambda r: r["text_config"]["rope_parameters"].update(rope_type="yarn"), r"rope_type: only 'default'"),
    (lambda r: r["text_config"].update(layer_types=["linear_attention"] * 3), r"layer_types: has 3 entries for 4 layers"),
    (lambda r: r["text_config"].update(num_key_value_heads=3), r"num_key_value_heads: must divide"),
    (lambda r: r["text_config"].update(vocab_size=True), r"vocab_size: expected a positive integer"),
    (lambda r: r["audio_decoder_config"].update(num_residual_layers=8), r"num_residual_layers: must equal num_codebooks - 1"),
    (lambda r: r["audio_decoder_config"]["rope_parameters"].update(rope_type="yarn"), r"rope_type: only 'default'"),
    (lambda r: r.update(semantic_end_token_id=346), r"semantic token ids must be contiguous"),
    (lambda r: r.update(voice_token_id=352), r"voice_token_id: outside the vocabulary"),
    (lambda r: r["codec_config"]["quantizer"].update(downsample_factor=[4]), r"downsample_factor: only stride-2"),
    (lambda r: r["codec_config"].update(encoder_transformer_layers=[1, 0, 0, 0]), r"encoder_transformer_layers\[0\]: block width 8"),
    (lambda r: r["codec_config"].update(decoder_dim=40), r"decoder_dim: must be divisible"),
    (lambda r: r["quantization_config"].update(fmt="e5m2"), r"quantization_config.fmt: only 'e4m3'"),
    (lambda r: r.update(text_config=5), r"text_config: expected a JSON object"),
    (lambda r: r["codec_config"].update(quantizer=1), r"codec_config.quantizer: expected a JSON object"),
], ids=["hidden_act", "sliding", "rope_type", "layer_types", "kv_heads", "bool-int", "tower-layers",
        "tower-rope", "semantic-ids", "voice-id", "downsample", "enc-transformer", "decoder-dim", "fp8-fmt",
        "not-object", "nested-not-object"])
def test_bad_values_are_refused(raw, edit, match):
    edit(raw)
    _refused(raw, match)


@pytest.mark.parametrize("path,key", [
    ((), "num_codebooks"), (("text_config",), "hidden_size"),
    (("codec_config", "quantizer"), "codebook_dim"), (("codec_config", "quantizer", "pre_module"), "window_size"),
], ids=["top", "text", "quantizer", "pre-module"])
def test_missing_key_is_refused(raw, path, key):
    section = raw
    for k in path:
        section = section[k]
    del section[key]
    _refused(raw, f"missing key\\(s\\) '{key}'")


def test_layer_types_from_interval_and_legacy_rope(raw):
    text = raw["text_config"]
    del text["layer_types"], text["rope_parameters"]
    text["num_hidden_layers"] = 8
    text["full_attention_interval"] = 4
    text["rope_theta"] = 1000.0
    cfg = TextConfig.from_dict(text)
    assert cfg.full_attention_layers == [3, 7]
    assert cfg.rope_theta == 1000.0 and cfg.partial_rotary_factor == 0.25


def test_token_id_mismatch_with_tokenizer(tmp_path, tiny_checkpoint):
    """load_config checks every config id against tokenizer.json (MODEL.md §2.2)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["im_end_token_id"], raw["im_start_token_id"] = 258, 259          # swapped
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"<\|im_start\|>: config says 259, tokenizer.json says 258"):
        load_config(ckpt)
    assert load_config(ckpt, check_tokenizer=False).im_end_token_id == 258

    raw["im_end_token_id"], raw["im_start_token_id"] = 259, 258
    raw["speaker_start_token_id"] = 267                                  # shifts all 16 speaker ids
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"<\|speaker:0\|>: config says 267, tokenizer.json says 268"):
        load_config(ckpt)


def test_config_errors_name_the_file(tmp_path, raw):
    raw["text_config"]["surprise"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.json'}: text_config: unknown key"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)


def test_flat_text_config(tmp_path, raw):
    """A transformers text-only config.json is read by load_text_config and refused by load_config."""
    flat = dict(raw["text_config"], architectures=["Qwen3_5MoeForCausalLM"], torch_dtype="bfloat16",
                mtp_num_hidden_layers=1, norm_topk_prob=True)
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert load_text_config(tmp_path).hidden_size == 64
    with pytest.raises(ConfigError, match="only the backbone loads it"):
        load_config(tmp_path)

"""Safetensors reader and the strict tensor check (MODEL.md §2.5), on the tiny checkpoint and on
broken copies of it rewritten in tmp_path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.checkpoint import (
    INDEX_FILE,
    WeightError,
    check_stage,
    check_tensors,
    detect_backbone_layout,
    open_safetensors,
)
from services.common.inventory import backbone_inventory, tower_inventory

P = "model.language_model."
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _load_all(ckpt_dir: Path) -> dict[str, tuple[torch.Tensor, str]]:
    ckpt = open_safetensors(ckpt_dir)
    return {n: (ckpt.get(n).clone(), ckpt.file_of(n)) for n in ckpt.names()}


def _write(dst: Path, src: Path, tensors: dict[str, tuple[torch.Tensor, str]], *, index: bool = True):
    """A copy of `src` whose safetensors hold `tensors` (name -> (tensor, shard file))."""
    dst.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "codec.pth"):
        shutil.copy(src / f, dst / f)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, (tensor, shard) in tensors.items():
        shards.setdefault(shard, {})[name] = tensor.contiguous()
    for shard, content in shards.items():
        save_file(content, str(dst / shard), metadata={"format": "pt"})
    if index:
        weight_map = {n: s for n, (_, s) in tensors.items()}
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture()
def tiny_tensors(tiny_checkpoint):
    return _load_all(tiny_checkpoint)


def _problems(ckpt_dir: Path, tiny_config, stage: str = "backbone") -> list[str]:
    with pytest.raises(WeightError) as info:
        check_stage(open_safetensors(ckpt_dir), tiny_config, stage)
    return info.value.problems


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def test_tiny_checkpoint_reads_lazily_with_stored_dtypes(tiny_checkpoint):
    ckpt = open_safetensors(tiny_checkpoint)
    w = f"{P}layers.0.mlp.experts.0.gate_proj.weight"
    assert ckpt.file_of(w) == SHARD1
    assert ckpt.shape_of(w) == (160, 64) and ckpt.dtype_of(w) == torch.float8_e4m3fn
    assert ckpt.shape_of(f"{w}_scale_inv") == (2, 1) and ckpt.dtype_of(f"{w}_scale_inv") == torch.float32
    assert ckpt.get(w).dtype == torch.float8_e4m3fn
    assert ckpt.dtype_of(f"{P}layers.0.linear_attn.A_log") == torch.float32
    assert ckpt.file_of("audio_decoder.codebook_embeddings.weight") == SHARD2
    assert "mtp.fc.weight" in ckpt and len(ckpt) == len(ckpt.names())
    with pytest.raises(KeyError, match="not in model.safetensors.index.json"):
        ckpt.file_of("nope")


def test_tiny_checkpoint_passes_both_stage_checks(tiny_checkpoint, tiny_config):
    ckpt = open_safetensors(tiny_checkpoint)
    check_stage(ckpt, tiny_config, "backbone")
    check_stage(ckpt, tiny_config, "tower")
    assert detect_backbone_layout(ckpt) == {"prefix": P, "fp8_experts": True, "fused_experts": False}


def test_a_stage_alone_reports_the_other_stage_as_unexpected(tiny_checkpoint, tiny_config):
    """Without other_stage_names the check is the whole-index check: tower names are unknown."""
    with pytest.raises(WeightError) as info:
        check_tensors(open_safetensors(tiny_checkpoint), backbone_inventory(tiny_config))
    assert f"unexpected: audio_decoder.codebook_embeddings.weight in {SHARD2} ([640, 64] bfloat16)" \
        in info.value.problems
    assert len(info.value.problems) == len(tower_inventory(tiny_config))


def test_single_file_checkpoint(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    single = {n: (t, "model.safetensors") for n, (t, _) in tiny_tensors.items()}
    ckpt_dir = _write(tmp_path / "single", tiny_checkpoint, single, index=False)
    ckpt = open_safetensors(ckpt_dir)
    assert ckpt.file_of(f"{P}norm.weight") == "model.safetensors"
    check_stage(ckpt, tiny_config, "backbone")


# --------------------------------------------------------------------------------------------
# the strict check: every problem, each with its file, in one error
# --------------------------------------------------------------------------------------------

def test_every_problem_is_listed_once_with_its_file(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    t = dict(tiny_tensors)
    scale = f"{P}layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    del t[scale]                                                               # missing FP8 scale
    t[f"{P}layers.0.mlp.surprise.weight"] = (torch.zeros(2, 2, dtype=torch.bfloat16), SHARD1)  # unexpected
    bad_shape = f"{P}layers.2.mlp.experts.5.gate_proj.weight_scale_inv"
    t[bad_shape] = (torch.ones(2, 2), SHARD2)                                  # [2, 2], expected [2, 1]
    bad_dtype = f"{P}layers.3.mlp.experts.1.up_proj.weight_scale_inv"
    t[bad_dtype] = (t[bad_dtype][0].to(torch.float16), SHARD2)                 # F16 scale
    bf16_expert = f"{P}layers.0.mlp.experts.2.up_proj.weight"
    t[bf16_expert] = (t[bf16_expert][0].float().to(torch.bfloat16), SHARD1)    # expert not FP8
    norm = f"{P}layers.1.input_layernorm.weight"
    t[norm] = (torch.zeros(65, dtype=torch.float32), SHARD1)                   # shape and dtype wrong

    problems = _problems(_write(tmp_path / "bad", tiny_checkpoint, t), tiny_config)
    assert sorted(problems) == sorted([
        f"missing: {scale} (expected [1, 2] float32/bfloat16; not in model.safetensors.index.json)",
        f"unexpected: {P}layers.0.mlp.surprise.weight in {SHARD1} ([2, 2] bfloat16)",
        f"wrong shape: {bad_shape} in {SHARD2} is [2, 2], expected [2, 1]",
        f"wrong dtype: {bad_dtype} in {SHARD2} is float16, expected float32/bfloat16",
        f"wrong dtype: {bf16_expert} in {SHARD1} is bfloat16, expected float8_e4m3fn",
        f"wrong shape: {norm} in {SHARD1} is [65], expected [64]",
        f"wrong dtype: {norm} in {SHARD1} is float32, expected bfloat16",
    ])


def test_tower_check_names_tower_problems(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    t = dict(tiny_tensors)
    del t["audio_decoder.residual_layers.8.head.weight"]
    t["audio_decoder.semantic_head.weight"] = (torch.zeros(64, 64, dtype=torch.bfloat16), SHARD2)  # optional, mis-shaped
    problems = _problems(_write(tmp_path / "bad", tiny_checkpoint, t), tiny_config, "tower")
    assert sorted(problems) == sorted([
        "missing: audio_decoder.residual_layers.8.head.weight (expected [32, 64] bfloat16; "
        "not in model.safetensors.index.json)",
        f"wrong shape: audio_decoder.semantic_head.weight in {SHARD2} is [64, 64], expected [65, 64]",
    ])
    # The backbone check does not own the tower's tensors, so it passes.
    check_stage(open_safetensors(tmp_path / "bad"), tiny_config, "backbone")


def test_bf16_scales_and_ignored_names_are_accepted(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    t = {n: ((v.to(torch.bfloat16) if n.endswith("_scale_inv") else v), s) for n, (v, s) in tiny_tensors.items()}
    t["model.visual.blocks.0.weight"] = (torch.zeros(1), SHARD1)
    t["model.vision_tower.x"] = (torch.zeros(1), SHARD1)
    t["mtp.layers.0.input_layernorm.weight"] = (torch.zeros(1), SHARD2)
    t[f"{P}layers.3.self_attn.rotary_emb.inv_freq"] = (torch.zeros(4), SHARD2)
    ckpt_dir = _write(tmp_path / "ok", tiny_checkpoint, t)
    check_stage(open_safetensors(ckpt_dir), tiny_config, "backbone")
    check_stage(open_safetensors(ckpt_dir), tiny_config, "tower")


def test_any_linear_may_be_fp8_with_its_scale(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    """§2.5 rule 4: a BF16 linear stored FP8 needs a [ceil(out/128), ceil(in/128)] scale."""
    from services.common.fp8 import quantize_block_fp8

    t = dict(tiny_tensors)
    q = f"{P}layers.3.self_attn.q_proj.weight"
    w_q, scale = quantize_block_fp8(t[q][0].float())
    t[q] = (w_q, SHARD2)
    t[f"{q}_scale_inv"] = (scale, SHARD2)
    check_stage(open_safetensors(_write(tmp_path / "ok", tiny_checkpoint, t)), tiny_config, "backbone")

    del t[f"{q}_scale_inv"]
    o_scale = f"{P}layers.3.self_attn.o_proj.weight_scale_inv"
    t[o_scale] = (torch.ones(1, 1), SHARD2)                      # a scale whose weight is BF16
    problems = _problems(_write(tmp_path / "bad", tiny_checkpoint, t), tiny_config)
    assert sorted(problems) == sorted([
        f"missing: {q}_scale_inv (the FP8 weight needs a [1, 1] scale; not in model.safetensors.index.json)",
        f"unexpected: {o_scale} in {SHARD2} (a scale whose weight {P}layers.3.self_attn.o_proj.weight is not FP8)",
    ])


def test_text_only_prefix_and_fused_experts(tmp_path, tiny_checkpoint, tiny_config, tiny_tensors):
    """§2.5 rules 2 and 3: `model.` prefix, fused BF16 experts; both prefixes at once is refused."""
    from services.common.fp8 import dequantize_block_fp8

    t = {}
    for name, (v, s) in tiny_tensors.items():
        if ".mlp.experts." in name:
            continue
        t[name.replace(P, "model.", 1) if name.startswith(P) else name] = (v, s)
    cfg = tiny_config.text_config
    for i in range(cfg.num_hidden_layers):
        def deq(proj, e):
            w = f"{P}layers.{i}.mlp.experts.{e}.{proj}.weight"
            return dequantize_block_fp8(tiny_tensors[w][0], tiny_tensors[f"{w}_scale_inv"][0])
        gate_up = torch.stack([torch.cat([deq("gate_proj", e), deq("up_proj", e)]) for e in range(cfg.num_experts)])
        down = torch.stack([deq("down_proj", e) for e in range(cfg.num_experts)])
        shard = tiny_tensors[f"{P}layers.{i}.input_layernorm.weight"][1]
        t[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (gate_up.to(torch.bfloat16), shard)
        t[f"model.layers.{i}.mlp.experts.down_proj"] = (down.to(torch.bfloat16), shard)
    ckpt = open_safetensors(_write(tmp_path / "fused", tiny_checkpoint, t))
    assert detect_backbone_layout(ckpt) == {"prefix": "model.", "fp8_experts": True, "fused_experts": True}
    check_stage(ckpt, tiny_config, "backbone")
    check_stage(ckpt, tiny_config, "tower")

    t[f"{P}embed_tokens.weight"] = (tiny_tensors[f"{P}embed_tokens.weight"][0].clone(), SHARD1)
    with pytest.raises(WeightError, match="exactly one backbone prefix"):
        check_stage(open_safetensors(_write(tmp_path / "both", tiny_checkpoint, t)), tiny_config, "backbone")


# --------------------------------------------------------------------------------------------
# index problems
# --------------------------------------------------------------------------------------------

def test_missing_shard_file_is_named(tmp_path, tiny_checkpoint):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    (dst / SHARD2).unlink()
    with pytest.raises(WeightError, match=f"shard file {SHARD2} is listed in {INDEX_FILE} but does not exist"):
        open_safetensors(dst)


def test_truncated_shard_is_named(tmp_path, tiny_checkpoint):
    """A shard cut short (an interrupted copy) is refused when the checkpoint is opened, naming
    the file, before any read could run past its end."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    os.truncate(dst / SHARD2, (dst / SHARD2).stat().st_size - 1000)
    with pytest.raises(WeightError, match=f"{SHARD2}: not a readable safetensors file: .*incomplete"):
        open_safetensors(dst)
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(dst / SHARD2, single / "model.safetensors")
    with pytest.raises(WeightError, match="model.safetensors: not a readable safetensors file"):
        open_safetensors(single)


def test_index_entry_absent_from_its_shard_is_named(tmp_path, tiny_checkpoint):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    index = json.loads((dst / INDEX_FILE).read_text())
    index["weight_map"][f"{P}ghost.weight"] = SHARD1
    name = f"{P}norm.weight"
    index["weight_map"][name] = SHARD1            # really stored in shard 2
    (dst / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightError) as info:
        open_safetensors(dst)
    assert sorted(info.value.problems) == sorted([
        f"{P}ghost.weight: listed in {INDEX_FILE} under {SHARD1}, but {SHARD1} does not contain it",
        f"{name}: listed in {INDEX_FILE} under {SHARD1}, but {SHARD1} does not contain it",
        f"{name}: stored in {SHARD2} but {INDEX_FILE} does not map it there",
    ])


def test_no_weights_at_all(tmp_path):
    with pytest.raises(WeightError, match="neither model.safetensors.index.json nor model.safetensors"):
        open_safetensors(tmp_path)


# --------------------------------------------------------------------------------------------
# inventories against the shapes MODEL.md spells out
# --------------------------------------------------------------------------------------------

def test_backbone_and_tower_inventory_match_section_10_1(tiny_config):
    """The 'derived tiny shapes' paragraph of MODEL.md §10.1, name by name."""
    b, t = backbone_inventory(tiny_config), tower_inventory(tiny_config)
    shapes = {n: s.shape for n, s in {**b, **t}.items()}
    a, g = f"{P}layers.3.self_attn.", f"{P}layers.0.linear_attn."
    e = f"{P}layers.1.mlp.experts.7."
    assert shapes[f"{a}q_proj.weight"] == (128, 64) and shapes[f"{a}k_proj.weight"] == (32, 64)
    assert shapes[f"{a}o_proj.weight"] == (64, 64) and shapes[f"{a}q_norm.weight"] == (16,)
    assert shapes[f"{g}in_proj_qkv.weight"] == (128, 64) and shapes[f"{g}in_proj_z.weight"] == (64, 64)
    assert shapes[f"{g}in_proj_b.weight"] == (4, 64) and shapes[f"{g}conv1d.weight"] == (128, 1, 4)
    assert shapes[f"{g}out_proj.weight"] == (64, 64) and shapes[f"{g}norm.weight"] == (16,)
    assert shapes[f"{e}gate_proj.weight"] == (160, 64) and shapes[f"{e}gate_proj.weight_scale_inv"] == (2, 1)
    assert shapes[f"{e}down_proj.weight"] == (64, 160) and shapes[f"{e}down_proj.weight_scale_inv"] == (1, 2)
    assert shapes[f"{P}layers.1.mlp.shared_expert.up_proj.weight"] == (96, 64)
    assert shapes[f"{P}layers.1.mlp.shared_expert.down_proj.weight"] == (64, 96)
    assert shapes[f"{P}embed_tokens.weight"] == shapes["lm_head.weight"] == (352, 64)
    assert shapes["audio_decoder.codebook_embeddings.weight"] == (640, 64)
    assert shapes["audio_decoder.residual_layers.8.fc.weight"] == (64, 128)
    assert shapes["audio_decoder.residual_layers.8.head.weight"] == (32, 64)
    assert f"{a}A_log" not in shapes and f"{g}q_proj.weight" not in shapes   # mixer by layer type
    assert b[f"{g}A_log"].dtypes == (torch.float32, torch.bfloat16)


def test_codec_inventory_spot_checks(tiny_config):
    """§2.4 key spellings with the tiny widths (encoder 4..64, decoder 32..2, C = 64)."""
    from services.common.inventory import codec_inventory

    real = {n: s.shape for n, s in codec_inventory(tiny_config).items()}
    wn = ".parametrizations.weight.original"
    assert real[f"encoder.block.0.conv{wn}1"] == (4, 1, 7) and real[f"encoder.block.0.conv{wn}0"] == (4, 1, 1)
    assert real[f"encoder.block.2.block.1.block.1.conv{wn}1"] == (8, 8, 7)
    assert real["encoder.block.2.block.1.block.2.alpha"] == (1, 8, 1)
    assert real[f"encoder.block.2.block.4.conv{wn}1"] == (16, 8, 8)          # k = 2 * stride 4
    assert real["encoder.block.4.block.5.layers.0.attention.wqkv.weight"] == (192, 64)
    assert real["encoder.block.4.block.5.norm.weight"] == (64,)
    assert not any(n.startswith("encoder.block.3.block.5.") for n in real)    # no transformer there
    assert real["encoder.block.5.alpha"] == (1, 64, 1) and real[f"encoder.block.6.conv{wn}1"] == (64, 64, 3)
    assert real["quantizer.semantic_quantizer.quantizers.0.in_proj.weight_v"] == (8, 64, 1)
    assert real["quantizer.quantizer.quantizers.8.out_proj.weight_g"] == (64, 1, 1)
    assert real["quantizer.quantizer.quantizers.8.codebook.weight"] == (32, 8)
    assert real["quantizer.post_module.layers.1.attention.wqkv.weight"] == (192, 64)
    assert real["quantizer.pre_module.layers.1.feed_forward.w2.weight"] == (64, 96)
    assert real["quantizer.downsample.1.0.conv.weight"] == (64, 64, 2)
    assert real["quantizer.upsample.0.1.dwconv.conv.weight"] == (64, 1, 7)
    assert real["quantizer.upsample.0.1.pwconv1.weight"] == (256, 64)
    assert real[f"decoder.model.0.conv{wn}1"] == (32, 64, 7)
    assert real[f"decoder.model.1.block.1.conv{wn}1"] == (32, 16, 16)         # transposed: [in, out, 2r]
    assert real[f"decoder.model.1.block.1.conv{wn}0"] == (32, 1, 1)           # g over V's dim 0
    assert real["decoder.model.1.block.1.conv.bias"] == (16,)                 # output channels
    assert real[f"decoder.model.4.block.4.block.3.conv{wn}1"] == (2, 2, 1)
    assert real["decoder.model.5.alpha"] == (1, 2, 1) and real[f"decoder.model.6.conv{wn}1"] == (1, 2, 7)
    folded = codec_inventory(tiny_config, style="folded")
    assert folded["decoder.model.6.conv.weight"].shape == (1, 2, 7) and len(folded) == len(real) - 80

"""Backbone vs transformers' Qwen3.5-MoE, and the loader's strictness (MODEL.md §2.5, §4).

A tiny random `Qwen3_5MoeForCausalLM` (odd sizes, grouped GDN heads, GQA, a hybrid layer
pattern) is saved with `save_pretrained` and loaded unchanged by `load_backbone`; its final-norm
hidden states and logits on a 100-token sequence must match transformers' to a relative RMS error
of 1e-4. The block-FP8 variant rewrites the experts per expert as FP8 + scales and compares with
transformers given the dequantised weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.checkpoint import WeightError
from services.common.fp8 import dequantize_block_fp8, quantize_block_fp8
from services.backbone.weights import load_backbone

transformers = pytest.importorskip("transformers")

TOKENS = 100


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _hf_config(tie: bool = False):
    return transformers.Qwen3_5MoeTextConfig(tie_word_embeddings=tie,
        vocab_size=101, hidden_size=40, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=3, num_key_value_heads=1, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=10,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=5, num_experts_per_tok=2,
        moe_intermediate_size=20, shared_expert_intermediate_size=14, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        attn_implementation="eager")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights in MODEL.md §10.2's spirit: non-zero norm gains (so a missing `1 +` shows), decays
    that matter, projections of unit gain."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                new = torch.rand(p.shape, generator=gen) * 2 - 1
            elif name.endswith("dt_bias"):
                new = torch.randn(p.shape, generator=gen) * 0.5
            elif name.endswith("linear_attn.norm.weight"):
                new = 1 + torch.randn(p.shape, generator=gen) * 0.3
            elif p.dim() == 1:
                new = torch.randn(p.shape, generator=gen) * 0.3
            elif "conv1d" in name:
                new = torch.randn(p.shape, generator=gen) * 0.4
            elif "embed_tokens" in name:
                new = torch.randn(p.shape, generator=gen)
            else:
                new = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            p.copy_(new)


def _hf_model(seed: int):
    """Seed 3 ties the LM head to the embedding (save_pretrained then omits lm_head.weight)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(_hf_config(tie=seed == 3)).eval()
    _randomise(model, seed)
    return model


def _hf_outputs(model, tokens):
    with torch.no_grad():
        out = model(tokens[None], output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0], out.logits[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{seed: (transformers model, directory of its save_pretrained)}."""
    out = {}
    for seed in (0, 1, 2, 3):
        model = _hf_model(seed)
        path = tmp_path_factory.mktemp(f"hf{seed}")
        model.save_pretrained(path)
        out[seed] = (model, path)
    return out


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 101, (TOKENS,), generator=torch.Generator().manual_seed(100 + seed))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_transformers(saved, seed):
    """Final-norm hidden states and logits of a 100-token sequence agree with transformers."""
    model, path = saved[seed]
    tokens = _tokens(seed)
    ref_hidden, ref_logits = _hf_outputs(model, tokens)
    hidden, logits = load_backbone(path).forward_tokens(tokens)
    errs = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    assert max(errs) <= 1e-4, f"rel err hidden {errs[0]:.2e} logits {errs[1]:.2e}, " \
                              f"max abs {float((hidden - ref_hidden).abs().max()):.2e}"


def _rewrite_fp8(src, dst) -> dict[str, torch.Tensor]:
    """Copy a save_pretrained dir with every expert matrix stored block-FP8 + F32 scale_inv.
    Returns the dequantised expert weights by name (what transformers gets)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    dequantised = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        w_q, scale = quantize_block_fp8(tensors[name])
        tensors[name], tensors[f"{name}_scale_inv"] = w_q, scale
        dequantised[name] = dequantize_block_fp8(w_q, scale)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dequantised


def _set_hf_experts(model, weights: dict[str, torch.Tensor]) -> None:
    """Put per-expert weights into transformers' fused expert parameters."""
    cfg = model.config
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for e in range(cfg.num_experts):
                p = f"model.layers.{i}.mlp.experts.{e}."
                experts.gate_up_proj[e] = torch.cat([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]])
                experts.down_proj[e] = weights[p + "down_proj.weight"]


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_experts_match_transformers_on_dequantised_weights(saved, seed, tmp_path):
    """Experts stored as float8_e4m3fn + weight_scale_inv load as stored and compute with the
    dequantised weights."""
    model, path = saved[seed]
    dequantised = _rewrite_fp8(path, tmp_path / "fp8")
    backbone = load_backbone(tmp_path / "fp8")
    experts = backbone.layers[0].mlp.experts
    assert experts.gate_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale_inv.dtype == torch.float32
    reference = _hf_model(seed)
    _set_hf_experts(reference, dequantised)
    tokens = _tokens(seed)
    ref_hidden, ref_logits = _hf_outputs(reference, tokens)
    hidden, logits = backbone.forward_tokens(tokens)
    errs = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    assert max(errs) <= 1e-4, f"rel err hidden {errs[0]:.2e} logits {errs[1]:.2e}"


def _rewrite(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_fused_experts_and_vl_prefix_load_the_same_model(saved, tmp_path):
    """The fused BF16 expert layout and the `model.language_model.` prefix give identical rows."""
    _, path = saved[0]
    cfg = _hf_config()

    def fuse(tensors):
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            gate_up, down = [], []
            for e in range(cfg.num_experts):
                gate_up.append(torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")]))
                down.append(tensors.pop(f"{p}{e}.down_proj.weight"))
            tensors[f"{p}gate_up_proj"] = torch.stack(gate_up).to(torch.bfloat16)
            tensors[f"{p}down_proj"] = torch.stack(down).to(torch.bfloat16)
        return tensors

    def vl_prefix(tensors):
        return {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}

    _rewrite(path, tmp_path / "fused", fuse)
    _rewrite(path, tmp_path / "vl", vl_prefix)
    tokens = _tokens(0)
    plain = load_backbone(path)
    # Same values in BF16: round the plain model's experts the same way before comparing.
    for layer in plain.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(layer.mlp.experts, name)
            w.data = w.data.to(torch.bfloat16).float()
    assert torch.equal(load_backbone(tmp_path / "fused").forward_tokens(tokens)[0], plain.forward_tokens(tokens)[0])
    assert torch.equal(load_backbone(tmp_path / "vl").forward_tokens(tokens)[1],
                       load_backbone(path).forward_tokens(tokens)[1])


def test_both_prefixes_is_an_error(saved, tmp_path):
    _, path = saved[0]

    def both(tensors):
        tensors["model.language_model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        return tensors

    _rewrite(path, tmp_path / "both", both)
    with pytest.raises(WeightError, match="exactly one backbone prefix"):
        load_backbone(tmp_path / "both")


def test_every_tensor_problem_in_one_error(tiny_checkpoint, tmp_path):
    """A missing, an unexpected and a mis-shaped tensor are all named, with their shard files."""
    ckpt = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    missing = "model.language_model.layers.1.linear_attn.in_proj_z.weight"
    reshaped = "model.language_model.layers.3.self_attn.q_norm.weight"
    files = {index["weight_map"][missing], index["weight_map"][reshaped]}
    for file in files:
        tensors = load_file(str(ckpt / file))
        tensors.pop(missing, None)
        if reshaped in tensors:
            tensors[reshaped] = torch.zeros(3, dtype=torch.bfloat16)
            tensors["model.language_model.layers.3.self_attn.extra.weight"] = torch.zeros(2)
            index["weight_map"]["model.language_model.layers.3.self_attn.extra.weight"] = file
        save_file(tensors, str(ckpt / file), metadata={"format": "pt"})
    del index["weight_map"][missing]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError) as err:
        load_backbone(ckpt)
    text = str(err.value)
    assert f"missing: {missing}" in text
    assert f"wrong shape: {reshaped} in {index['weight_map'][reshaped]}" in text
    assert "unexpected: model.language_model.layers.3.self_attn.extra.weight in" in text
    assert len(err.value.problems) == 3


def test_tiny_checkpoint_loads_with_fp8_experts_and_codebooks(tiny_checkpoint):
    model = load_backbone(tiny_checkpoint, lm_head=False)
    assert model.lm_head is None
    assert model.layers[0].mlp.experts.gate_proj.dtype == torch.float8_e4m3fn
    assert model.codebook_embeddings.weight.shape == (10 * 64, 64)
    assert model.audio.semantic_start_token_id == 284


def test_every_linear_stored_fp8_matches_transformers(saved, tmp_path):
    """Qwen's own FP8 checkpoints also quantise attention, GDN, router, shared-expert and head
    linears (§2.5 rule 4): all of them load, and compute with the dequantised weights."""
    model, path = saved[1]
    shutil.copytree(path, tmp_path / "all")
    file = tmp_path / "all" / "model.safetensors"
    tensors = load_file(str(file))
    dequantised = {}
    for name in [n for n, t in tensors.items() if t.dim() == 2 and "embed_tokens" not in n]:
        w_q, scale = quantize_block_fp8(tensors[name])
        tensors[name], tensors[f"{name}_scale_inv"] = w_q, scale.to(torch.bfloat16)   # BF16 scales too
        dequantised[name] = dequantize_block_fp8(w_q, scale.to(torch.bfloat16))
    save_file(tensors, str(file), metadata={"format": "pt"})
    backbone = load_backbone(tmp_path / "all")
    assert backbone.layers[1].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert backbone.layers[0].mlp.gate.weight.dtype == torch.float32          # router dequantised once
    reference = _hf_model(1)
    _set_hf_experts(reference, dequantised)
    state = reference.state_dict()
    with torch.no_grad():
        for name, w in dequantised.items():
            if name in state:
                state[name].copy_(w)
    tokens = _tokens(1)
    ref_hidden, ref_logits = _hf_outputs(reference, tokens)
    hidden, logits = backbone.forward_tokens(tokens)
    errs = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    assert max(errs) <= 1e-4, f"rel err hidden {errs[0]:.2e} logits {errs[1]:.2e}"

"""The tiny checkpoint generator (MODEL.md §10.2), its tokenizer, and `dramaturg checkpoint`."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.cli import main as cli_main
from services.common.checkpoint import open_safetensors
from services.common.config import DramaConfig, load_config
from services.common.fp8 import dequantize_block_fp8
from services.common.checkpoint_report import inspect_checkpoint
from services.common.inventory import codec_inventory, codec_weight_norm_convs
from services.common.make_checkpoint import make_checkpoint, plan_shards, preset_raw
from services.common.safe_pickle import load_torch_state_dict
from services.common.tokenizer import bytes_to_unicode, check_token_ids, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
P = "model.language_model."
FILES = ("config.json", "tokenizer.json", "codec.pth", "model.safetensors.index.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _hashes(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


# --------------------------------------------------------------------------------------------
# determinism and layout
# --------------------------------------------------------------------------------------------

def test_same_seed_gives_identical_bytes(tmp_path, tiny_checkpoint):
    start = time.perf_counter()
    again = make_checkpoint(tmp_path / "again", preset="tiny", seed=0, progress=False)
    elapsed = time.perf_counter() - start
    assert _hashes(again) == _hashes(tiny_checkpoint)
    assert elapsed < 10, f"tiny generation took {elapsed:.1f} s"


def test_different_seed_gives_different_weights(tmp_path, tiny_checkpoint):
    other = _hashes(make_checkpoint(tmp_path / "seed1", preset="tiny", seed=1, progress=False))
    base = _hashes(tiny_checkpoint)
    for f in ("codec.pth", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert other[f] != base[f], f
    for f in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert other[f] == base[f], f


def test_sharding_follows_the_recipe(tiny_checkpoint, tiny_config):
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]
    shard1 = {n for n, s in shard_of.items() if s == "model-00001-of-00002.safetensors"}
    assert shard1 == {n for n in shard_of if n.startswith((f"{P}layers.0.", f"{P}layers.1.",
                                                           f"{P}embed_tokens."))}
    assert shard_of["mtp.fc.weight"] == "model-00002-of-00002.safetensors"
    ckpt = open_safetensors(tiny_checkpoint)
    assert ckpt.shape_of("mtp.fc.weight") == (64, 128)
    sizes = sum(ckpt.nbytes_of(n) for n in ckpt.names())
    assert index["metadata"]["total_size"] == sizes


def test_config_json_is_the_preset(tiny_checkpoint):
    assert json.loads((tiny_checkpoint / "config.json").read_text()) == preset_raw("tiny")
    assert load_config(tiny_checkpoint).to_dict() == DramaConfig.from_dict(preset_raw("tiny")).to_dict()


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------

def _cat(ckpt, names):
    return torch.cat([ckpt.get(n).float().reshape(-1) for n in names])


def test_values_follow_the_recipe(tiny_checkpoint):
    """Each init rule of §10.2 is visible in the stored statistics."""
    ckpt = open_safetensors(tiny_checkpoint)
    names = ckpt.names()
    plus_norms = [n for n in names if n.endswith("norm.weight") and "linear_attn.norm" not in n]
    zero_centred = _cat(ckpt, plus_norms)
    assert abs(zero_centred.mean()) < 0.03 and 0.27 < zero_centred.std() < 0.33
    gains = _cat(ckpt, [n for n in names if n.endswith("linear_attn.norm.weight")])
    assert 0.9 < gains.mean() < 1.1
    a_log = _cat(ckpt, [n for n in names if n.endswith("A_log")])
    assert a_log.min() >= -1 and a_log.max() <= 1 and a_log.std() > 0.4
    emb = ckpt.get(f"{P}embed_tokens.weight").float()
    assert 0.95 < emb.std() < 1.05
    conv = _cat(ckpt, [n for n in names if n.endswith("conv1d.weight")])
    assert 0.37 < conv.std() < 0.43
    q = ckpt.get(f"{P}layers.3.self_attn.q_proj.weight").float()          # fan_in 64
    assert 0.9 < q.std() * math.sqrt(64) < 1.1


def test_fp8_experts_are_block_quantised(tiny_checkpoint):
    """Scale = block amax / 448, so each 128x128 block reaches +-448 exactly; partial blocks too."""
    ckpt = open_safetensors(tiny_checkpoint)
    for name in (f"{P}layers.2.mlp.experts.7.gate_proj.weight", f"{P}layers.0.mlp.experts.0.down_proj.weight"):
        w_q, scale = ckpt.get(name), ckpt.get(f"{name}_scale_inv")
        amax = w_q.float().abs()
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                assert amax[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].max() == 448.0
        w = dequantize_block_fp8(w_q, scale)
        assert 0.8 < w.std() * math.sqrt(w.shape[1]) < 1.2


def test_codec_pth_has_the_real_style_mix(tiny_checkpoint, tiny_config):
    state = load_torch_state_dict(tiny_checkpoint / "codec.pth")
    expected = codec_inventory(tiny_config.codec_config, style="real")
    assert list(state) == list(expected)
    assert all(t.dtype == torch.float32 and tuple(t.shape) == expected[n].shape for n, t in state.items())
    new = [n for n in state if n.endswith("parametrizations.weight.original1")]
    old = [n for n in state if n.endswith(".weight_v")]
    assert len(new) == 60 and len(old) == 20
    assert all(n.startswith(("encoder.", "decoder.")) for n in new)
    assert all(".in_proj." in n or ".out_proj." in n for n in old)
    g = torch.cat([state[n].reshape(-1) for n in state if n.endswith((".weight_g", ".original0"))])
    alpha = torch.cat([state[n].reshape(-1) for n in state if n.endswith("alpha")])
    gamma = torch.cat([state[n].reshape(-1) for n in state if n.endswith("gamma")])
    assert 0.5 <= g.min() and g.max() <= 1.5 and 0.5 <= alpha.min() and alpha.max() <= 1.5
    assert 0.05 <= gamma.min() and gamma.max() <= 0.2
    # torch's own safe loader agrees with ours.
    reference = torch.load(tiny_checkpoint / "codec.pth", weights_only=True)
    assert all(torch.equal(reference[n], state[n]) for n in state)


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def test_tokenizer_matches_section_10_2(tiny_checkpoint, tiny_config):
    raw = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    assert raw["model"]["type"] == "BPE" and raw["model"]["merges"] == []
    assert raw["model"]["vocab"] == {s: b for b, s in bytes_to_unicode().items()}
    assert raw["normalizer"] is None and raw["post_processor"] is None
    assert raw["pre_tokenizer"]["type"] == "ByteLevel" and raw["pre_tokenizer"]["use_regex"] is True
    assert raw["pre_tokenizer"]["add_prefix_space"] is False and raw["decoder"]["type"] == "ByteLevel"
    added = [(t["id"], t["content"]) for t in raw["added_tokens"]]
    assert added[:4] == [(256, "<|endoftext|>"), (257, "<|pad|>"), (258, "<|im_start|>"), (259, "<|im_end|>")]
    assert added[7] == (263, "<|voice|>") and added[12] == (268, "<|speaker:0|>")
    assert added[-1] == (347, "<|semantic:63|>") and len(added) == 92
    assert all(t["special"] for t in raw["added_tokens"])

    tok = load_tokenizer(tiny_checkpoint)
    check_token_ids(tiny_config, tok)
    text = "<|speaker:1|>Héllo [sighs] 世界<|semantic:5|>"
    ids = tok.encode(text).ids
    assert ids[0] == 269 and ids[-1] == 289
    assert ids[1:-1] == list("Héllo [sighs] 世界".encode())
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|semantic:64|>") is None and tok.get_vocab_size() == 348   # 348..351 padding


# --------------------------------------------------------------------------------------------
# inspect and the CLI
# --------------------------------------------------------------------------------------------

def test_inspect_clean_via_subprocess(tiny_checkpoint):
    run = subprocess.run([sys.executable, "-m", "services.cli", "checkpoint", "inspect", str(tiny_checkpoint)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].endswith(": OK")
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["backbone"][1] == "256" and rows["tower"][1] == "156" and rows["codec"][1] == "400"
    assert rows["ignored"][1] == "1"


def test_cli_make_then_inspect(tmp_path, capsys):
    out = tmp_path / "made"
    assert cli_main(["checkpoint", "make", "--preset", "tiny", str(out), "--seed", "7", "--no-progress"]) == 0
    assert cli_main(["checkpoint", "inspect", str(out)]) == 0
    assert ": OK" in capsys.readouterr().out


def test_inspect_lists_every_problem(tmp_path, tiny_checkpoint, capsys):
    """Token-id mismatch, a missing shard tensor and codec problems come back together."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["voice_token_id"] = 262
    (bad / "config.json").write_text(json.dumps(raw))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{P}layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    state = load_torch_state_dict(bad / "codec.pth")
    del state["decoder.model.6.conv.bias"]
    state["quantizer.upsample.0.1.gamma"] = torch.zeros(3)
    state["training.leftover"] = torch.zeros(1)
    # Fold one conv and switch another to the old style: both are accepted.
    p = "decoder.model.0.conv.parametrizations.weight."
    g, v = state.pop(f"{p}original0"), state.pop(f"{p}original1")
    state["decoder.model.0.conv.weight"] = g * v / v.norm(dim=(1, 2), keepdim=True)
    p = "encoder.block.0.conv"
    state[f"{p}.weight_g"] = state.pop(f"{p}.parametrizations.weight.original0")
    state[f"{p}.weight_v"] = state.pop(f"{p}.parametrizations.weight.original1")
    torch.save(state, bad / "codec.pth")

    assert cli_main(["checkpoint", "inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    report = inspect_checkpoint(bad)
    assert len(report.problems) == 4, report.problems
    assert "<|voice|>: config says 262, tokenizer.json says 263" in report.problems[0]
    assert any("model-00001-of-00002.safetensors does not contain it" in p for p in report.problems)
    assert "missing: decoder.model.6.conv.bias (expected [1] float32/bfloat16/float16; not in codec.pth)" \
        in report.problems
    assert "wrong shape: quantizer.upsample.0.1.gamma in codec.pth is [3], expected [64]" in report.problems
    assert report.warnings == ["unknown codec key (ignored): training.leftover in codec.pth"]
    assert "4 problem(s)" in err and "training.leftover" in err


def test_inspect_refuses_a_hostile_codec(tmp_path, tiny_checkpoint):
    import os

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    torch.save({"x": Evil()}, bad / "codec.pth", pickle_protocol=2)
    report = inspect_checkpoint(bad)
    assert len(report.problems) == 1 and "not on the allow-list" in report.problems[0]
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------------------------
# full preset (plan only) and a micro config
# --------------------------------------------------------------------------------------------

def test_full_preset_plan_matches_section_11(tmp_path, capsys):
    cfg = DramaConfig.from_dict(preset_raw("full"))
    shards = plan_shards(cfg)
    assert len(shards) == 20
    params = {}
    for shard in shards:
        for name, spec in shard.items():
            kind = "experts" if ".experts." in name else name.split(".")[0]
            if not name.endswith("_scale_inv"):
                params[kind] = params.get(kind, 0) + math.prod(spec.shape)
    assert params["experts"] == 40 * 256 * 3 * 2048 * 512                  # 32.2 B
    assert 2.4e9 < params["model"] + params["lm_head"] < 2.5e9              # other backbone
    assert 1.4e9 < params["audio_decoder"] < 1.6e9                          # tower
    codec = sum(math.prod(s.shape) for s in codec_inventory(cfg.codec_config).values())
    assert 0.38e9 < codec < 0.40e9

    out = make_checkpoint(tmp_path / "full", preset="full", dry_run=True, progress=False)
    assert "total" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json"]
    full = load_config(out)   # token ids checked against the written tokenizer
    assert full.semantic_start_token_id == 248320 and full.text_config.vocab_size == 252416


def test_micro_config_inventories():
    """num_codebooks = 3 (MODEL.md §10.2): nothing hard-codes 10."""
    raw = preset_raw("tiny")
    raw["num_codebooks"] = 3
    raw["audio_decoder_config"]["num_residual_layers"] = 2
    raw["codec_config"]["quantizer"]["n_codebooks"] = 2
    cfg = DramaConfig.from_dict(raw)
    styles = [c.real_style for c in codec_weight_norm_convs(cfg.codec_config).values()]
    assert styles.count("new") == 60 and styles.count("old") == 6
    from services.common.inventory import tower_inventory
    tower = tower_inventory(cfg)
    assert tower["audio_decoder.codebook_embeddings.weight"].shape == (3 * 64, 64)
    assert not any(n.startswith("audio_decoder.residual_layers.2.") for n in tower)

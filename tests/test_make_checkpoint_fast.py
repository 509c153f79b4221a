"""The fast checkpoint writer: the same bytes as the plain recipe, in parallel, with the disk
checked first (services/common/make_checkpoint.py)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from services.cli import main as cli_main
from services.common.checkpoint_report import inspect_checkpoint
from tests.test_checkpoint_read import FP8, _bits  # noqa: F401
from services.common.config import DramaConfig
from services.common.fp8 import quantize_block_fp8
from services.common.inventory import TensorSpec
from services.common import make_checkpoint as mc
from services.common.make_checkpoint import (
    DiskSpaceError,
    Scratch,
    checkpoint_nbytes,
    generate_tensors,
    make_checkpoint,
    plan_shards,
    preset_raw,
    quantize_whole_blocks_fp8_,
    scaled_config,
)

def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("shape", [(128, 256), (256, 384), (512, 256)])
def test_in_place_quantiser_matches_the_reference_bit_for_bit(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) / 40
    w[:128, :128] = 0.0                      # an all-zero block: the 1e-12 floor
    w[-128:, -128:] = -w[-128:, -128:].abs()  # an all-negative block: max|W| from min W
    want_q, want_s = quantize_block_fp8(w)
    got_q, got_s = quantize_whole_blocks_fp8_(w.clone())
    assert torch.equal(_bits(got_q), _bits(want_q)) and torch.equal(got_s, want_s)
    assert got_q.float().abs().amax() == 448.0     # the random blocks reach ±448


def test_in_place_quantiser_refuses_partial_blocks():
    with pytest.raises(ValueError, match="whole"):
        quantize_whole_blocks_fp8_(torch.randn(160, 128))


def _specs_to_check() -> dict[str, TensorSpec]:
    """Every tiny tensor, plus full-size shapes of each kind that takes the fast path."""
    specs = {name: spec for shard in plan_shards(DramaConfig.from_dict(preset_raw("tiny")))
             for name, spec in shard.items()}
    p = "model.language_model.layers.0."
    specs.update({
        f"{p}mlp.experts.3.gate_proj.weight": TensorSpec((512, 2048), (FP8,)),
        f"{p}mlp.experts.3.down_proj.weight": TensorSpec((2048, 512), (FP8,)),
        f"{p}linear_attn.in_proj_qkv.weight": TensorSpec((8192, 2048), (torch.bfloat16,)),
        f"{p}linear_attn.A_log": TensorSpec((32,), (torch.float32,)),
        f"{p}input_layernorm.weight": TensorSpec((2048,), (torch.bfloat16,)),
    })
    return specs


def test_scratch_generation_gives_the_same_bytes_and_never_aliases_the_scratch():
    scratch = Scratch()
    kept = {}
    for name, spec in _specs_to_check().items():
        if name.endswith("_scale_inv"):
            continue
        fast = generate_tensors(name, spec, seed=3, scratch=scratch)
        plain = generate_tensors(name, spec, seed=3)
        assert fast.keys() == plain.keys()
        for key in fast:
            assert fast[key].dtype == plain[key].dtype and torch.equal(_bits(fast[key]), _bits(plain[key])), key
        kept[name] = (fast, plain)
    for name, (fast, plain) in kept.items():      # later draws into the scratch changed nothing
        for key in fast:
            assert torch.equal(_bits(fast[key]), _bits(plain[key])), key


def test_parallel_processes_write_the_same_bytes(tmp_path, tiny_checkpoint):
    out = make_checkpoint(tmp_path / "parallel", preset="tiny", seed=0, progress=False, workers=2)
    assert _hashes(out) == _hashes(tiny_checkpoint)


def test_progress_lines_name_each_shard_and_the_space(tmp_path, capsys):
    make_checkpoint(tmp_path / "p", preset="tiny", seed=0, progress=True)
    out = capsys.readouterr().out
    assert "free there" in out and "1 process(es)" in out
    assert "model-00001-of-00002.safetensors" in out and "codec.pth" in out and "wrote " in out


def test_size_estimate_covers_what_is_written(tiny_checkpoint):
    written = sum(p.stat().st_size for p in tiny_checkpoint.iterdir())
    estimate = checkpoint_nbytes("tiny")
    assert written <= estimate < written + 4 * 2 ** 20


def test_no_room_is_refused_before_any_tensor_is_written(tmp_path, monkeypatch, capsys):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(mc.shutil, "disk_usage", lambda p: usage._replace(free=2 ** 30 + 1024))
    with pytest.raises(DiskSpaceError, match="only 1.00 GiB are free"):
        make_checkpoint(tmp_path / "full", preset="full", progress=False)
    assert not list((tmp_path / "full").glob("*.safetensors"))
    assert cli_main(["checkpoint", "make", "--preset", "full", str(tmp_path / "cli"), "--no-progress"]) == 1
    assert "not written" in capsys.readouterr().err


def test_scaled_config_writes_a_valid_checkpoint(tmp_path):
    raw = scaled_config("tiny", num_layers=8, num_experts=4)
    assert raw["text_config"]["layer_types"][3] == raw["text_config"]["layer_types"][7] == "full_attention"
    out = make_checkpoint(tmp_path / "scaled", preset="tiny", progress=False, config=raw)
    report = inspect_checkpoint(out)
    assert report.ok, report.problems
    assert len(list(out.glob("model-*-of-00004.safetensors"))) == 4

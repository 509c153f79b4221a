"""`--random-weights PRESET` for the stage entry points: the model at a preset's geometry with
random values made directly on the device, instead of tensors read from a checkpoint.

    python -m services.tower --random-weights full --device cuda       (or DRAMA_RANDOM_WEIGHTS=full)

The compute cost of every stage does not depend on the weight values, so this is how the full
geometry (MODEL.md §11) is benchmarked without writing and reading a ~37 GB checkpoint. The
geometry and every token id come from `services/common/presets/<preset>.json`, the same file
`make_checkpoint(out, preset)` writes as config.json: a gateway started on
`make_checkpoint(dir, preset, dry_run=True)` (config.json + tokenizer.json only) matches stages
started with `--random-weights` of that preset.

    add_argument(parser)                      --random-weights tiny|full, default $DRAMA_RANDOM_WEIGHTS
    preset_config(preset) -> DramaConfig
    write_config_dir(preset, directory)       config.json of the preset (for a server that reads one)
    random_backbone_stage(preset, device)     what load_backbone(..., lm_head=False) would give
    random_tower_stage(preset, device)        what load_tower would give (dtype by device)
    random_codec_stage(preset, device)        what load_codec would give (FP16 decode on CUDA)

Values follow MODEL.md §10.2's spirit (each builder's docstring says how), seeded, so two runs
with the same seed compute the same thing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from services.common.config import DramaConfig
from services.common.make_checkpoint import PRESETS, preset_raw

ENV = "DRAMA_RANDOM_WEIGHTS"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--random-weights PRESET` (default: $DRAMA_RANDOM_WEIGHTS, else off)."""
    default = os.environ.get(ENV) or None
    if default is not None and default not in PRESETS:
        parser.error(f"{ENV}={default!r}: expected one of {', '.join(PRESETS)}")
    parser.add_argument("--random-weights", default=default, choices=PRESETS, metavar="PRESET",
                        help=f"build the model at PRESET's geometry ({'|'.join(PRESETS)}) with random "
                             f"values on the device instead of reading --checkpoint ({ENV})")


def preset_config(preset: str) -> DramaConfig:
    return DramaConfig.from_dict(preset_raw(preset))


def write_config_dir(preset: str, directory: str | Path) -> Path:
    """Write the preset's config.json into `directory` (created if needed); returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(preset_raw(preset), indent=2) + "\n", encoding="utf-8")
    return directory


def _compute_dtype(device: torch.device) -> torch.dtype:
    """The servers' choice: float32 on CPU (the reference path), bfloat16 elsewhere."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def random_backbone_stage(preset: str, device: str | torch.device, seed: int = 0, decode_graphs: bool = False):
    """The backbone as the server loads it (no LM head; FP8 experts when the preset quantises;
    the kernel path where `default_kernels` picks it). decode_graphs: see Backbone."""
    from services.backbone.model import AudioSpec
    from services.backbone.weights import random_backbone

    cfg = preset_config(preset)
    device = torch.device(device)
    audio = AudioSpec(cfg.semantic_start_token_id, cfg.num_codebooks, cfg.codebook_vocab_size,
                      cfg.semantic_codebook_size, cfg.residual_codebook_size)
    return random_backbone(cfg.text_config, audio, device=device, dtype=_compute_dtype(device), seed=seed,
                           fp8_experts=cfg.quantization_config is not None, lm_head=False,
                           decode_graphs=decode_graphs)


def random_tower_stage(preset: str, device: str | torch.device, seed: int = 0):
    """(tower model, config) as the server loads them."""
    from services.tower.weights import random_tower

    cfg = preset_config(preset)
    device = torch.device(device)
    return random_tower(cfg, device=device, dtype=_compute_dtype(device), seed=seed), cfg


def random_codec_stage(preset: str, device: str | torch.device, seed: int = 0,
                       dtype: torch.dtype | None = None):
    """The codec built on `device` and prepared like `load_codec` (decode in FP16 on CUDA, float32
    on CPU; encode in float32). Values: snake alpha U(0.5, 1.5), layer-scale gamma U(0.05, 0.2),
    norm gains N(1, 0.3²), biases N(0, 0.1²), codebooks N(0, 1), other weights N(0, 1/fan_in)
    (the recipe of bench/codec.py)."""
    from services.codec.model import Codec

    device = torch.device(device)
    cfg = preset_config(preset).codec
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        codec = Codec(cfg)
    with torch.no_grad():
        for name, p in codec.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 1.5, generator=generator)
            elif name.endswith("gamma"):
                p.uniform_(0.05, 0.2, generator=generator)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3, generator=generator)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=generator)
            elif name.endswith("codebook.weight"):
                p.normal_(0.0, 1.0, generator=generator)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=generator)
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    return codec.prepare(device, dtype)

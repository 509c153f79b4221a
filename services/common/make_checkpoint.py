"""Random-weight checkpoints in our exact format (MODEL.md §10.2): the tiny one for tests, and a
full-size one (§11) for memory and throughput work on a GPU host.

    make_checkpoint(out_dir, preset="tiny", seed=0)       # < 1 s, a few MB
    make_checkpoint(out_dir, preset="full", dry_run=True)  # the shard plan only; the real thing is ~40 GB

Files: config.json (the preset), model-0000k-of-0000n.safetensors + model.safetensors.index.json
(backbone and tower; two layers per shard, the embedding with the first shard, the final norm,
LM head, tower and one `mtp.fc.weight` to exercise the ignore list with the last), tokenizer.json
and codec.pth (torch.save of an F32 OrderedDict with the real weight-norm style mix).

Every tensor draws from its own generator seeded by (seed, name), so the values do not depend on
the shard layout or generation order, the same seed gives byte-identical files, and a shard can
be written without holding any other in memory.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.config import DramaConfig
from services.common.fp8 import quantize_block_fp8
from services.common.inventory import (
    BACKBONE_PREFIX,
    TensorSpec,
    backbone_inventory,
    codec_inventory,
    tower_inventory,
)
from services.common.tokenizer import (
    FIXED_SPECIAL_TOKENS,
    build_byte_level_tokenizer,
    check_token_ids,
    semantic_token,
    speaker_token,
    tiny_special_ids,
)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("tiny", "full")
LAYERS_PER_SHARD = 2
SAFETENSORS_METADATA = {"format": "pt"}   # fixed, so identical inputs give identical bytes


def preset_raw(preset: str) -> dict:
    """The preset's config.json object."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return json.loads((PRESETS_DIR / f"{preset}.json").read_text(encoding="utf-8"))


def full_special_ids(cfg: DramaConfig) -> dict[str, int]:
    """Token ids of the full preset: Qwen3.5's public ids for <|endoftext|>, <|im_start|> and
    <|im_end|> (248044-248046), the other §8.1 tokens right after them, and the semantic tokens
    appended after Qwen3.5's padded 248320-row vocabulary (so vocab_size = 248320 + Q_s = 252416).
    Ids 256..248043 and the rest of 248072..248319 are unused embedding rows."""
    order = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [
        t for t in FIXED_SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    ids = {t: 248044 + i for i, t in enumerate(order)}
    start = 248044 + len(order)
    ids.update({speaker_token(i): start + i for i in range(cfg.num_speakers)})
    ids.update({semantic_token(i): cfg.semantic_start_token_id + i
                for i in range(cfg.semantic_codebook_size)})
    return ids


# --------------------------------------------------------------------------------------------
# values (§10.2 recipe), one pure function of (seed, name, shape)
# --------------------------------------------------------------------------------------------

def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _normal(std: float, mean: float = 0.0) -> Callable:
    return lambda shape, gen: torch.randn(shape, generator=gen) * std + mean


def _uniform(low: float, high: float) -> Callable:
    return lambda shape, gen: torch.rand(shape, generator=gen) * (high - low) + low


def _fan_in_normal(shape, gen) -> torch.Tensor:
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def init_rule(name: str) -> Callable:
    """How §10.2 draws the tensor called `name`: a function (shape, generator) -> float32 tensor."""
    codec = name.startswith(("encoder.", "decoder.", "quantizer."))
    if name.endswith(("embed_tokens.weight", "codebook_embeddings.weight", "codebook.weight")):
        return _normal(1.0)                                    # embeddings N(0, 1)
    if name.endswith("A_log"):
        return _uniform(-1.0, 1.0)
    if name.endswith("dt_bias"):
        return _normal(0.5)
    if name.endswith("linear_attn.conv1d.weight"):
        return _normal(0.4)
    if name.endswith("alpha"):                                 # Snake
        return _uniform(0.5, 1.5)
    if name.endswith("gamma"):                                 # layer scale (transformer, ConvNeXt)
        return _uniform(0.05, 0.2)
    if name.endswith((".weight_g", ".original0")):             # weight-norm magnitude
        return _uniform(0.5, 1.5)
    if name.endswith("linear_attn.norm.weight") or (codec and name.endswith("norm.weight")):
        return _normal(0.3, mean=1.0)                          # plain gains, near 1
    if name.endswith("norm.weight"):
        return _normal(0.3)                                    # RMSNorm+ gains, stored zero-centred
    if name.endswith("bias"):
        return _normal(0.1)   # [ours] §10.2 names no bias rule; non-zero so a dropped bias shows
    return _fan_in_normal                                      # every other matrix N(0, 1/fan_in)


def generate_tensors(name: str, spec: TensorSpec, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensor(s) for `name`: an FP8 weight comes with its `weight_scale_inv`."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    values = init_rule(name)(spec.shape, gen)
    if spec.dtypes[0] == torch.float8_e4m3fn:
        w_q, scale_inv = quantize_block_fp8(values)
        return {name: w_q, f"{name}_scale_inv": scale_inv}
    return {name: values.to(spec.dtypes[0])}


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------

def _extra_tensors(cfg: DramaConfig) -> dict[str, TensorSpec]:
    """A stand-in MTP tensor, which every loader must skip on purpose (§2.5 rule 5)."""
    h = cfg.text_config.hidden_size
    return {"mtp.fc.weight": TensorSpec((h, 2 * h), (torch.bfloat16,))}


def plan_shards(cfg: DramaConfig) -> list[dict[str, TensorSpec]]:
    """Safetensors content, shard by shard: two backbone layers each; the embedding joins the
    first shard; final norm, LM head, tower and the MTP stand-in join the last."""
    specs = {**backbone_inventory(cfg), **tower_inventory(cfg), **_extra_tensors(cfg)}
    n_layers = cfg.text_config.num_hidden_layers
    n_shards = max(1, math.ceil(n_layers / LAYERS_PER_SHARD))
    shards: list[dict[str, TensorSpec]] = [{} for _ in range(n_shards)]
    layer_prefix = f"{BACKBONE_PREFIX}layers."
    for name, spec in specs.items():
        if name.startswith(layer_prefix):
            layer = int(name[len(layer_prefix):].split(".", 1)[0])
            shards[layer // LAYERS_PER_SHARD][name] = spec
        elif name == f"{BACKBONE_PREFIX}embed_tokens.weight":
            shards[0][name] = spec
        else:
            shards[-1][name] = spec
    return shards


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _stored_names(specs: dict[str, TensorSpec]) -> list[str]:
    """Names to generate: an FP8 weight's scale is made together with its weight."""
    return [n for n in specs if not (n.endswith(".weight_scale_inv") and n[: -len("_scale_inv")] in specs)]


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * torch.empty(0, dtype=spec.dtypes[0]).element_size()


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------

def make_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, progress: bool = True,
                    *, dry_run: bool = False, max_shards: int | None = None) -> Path:
    """Write a random checkpoint of `preset` into `out_dir` (created if needed); returns its path.

    dry_run: write config.json and tokenizer.json and print the shard plan, but no tensors.
    max_shards: stop after that many safetensors shards (a smoke test of the full preset); the
    index and codec.pth are then not written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = preset_raw(preset)
    cfg = DramaConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")

    special_ids = tiny_special_ids(cfg) if preset == "tiny" else full_special_ids(cfg)
    tokenizer = build_byte_level_tokenizer(special_ids)
    check_token_ids(cfg, tokenizer)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    shards = plan_shards(cfg)
    files = [shard_name(k, len(shards)) for k in range(len(shards))]
    total = sum(spec_nbytes(s) for shard in shards for s in shard.values())
    if dry_run:
        for file, shard in zip(files, shards):
            print(f"{file}: {len(shard)} tensors, {sum(spec_nbytes(s) for s in shard.values()) / 2**30:.2f} GiB")
        print(f"total {total / 2**30:.2f} GiB in {len(files)} shards")
        return out

    bar = _progress_bar(total, progress, f"{preset} checkpoint")
    weight_map = {}
    for k, (file, shard) in enumerate(zip(files, shards)):
        if max_shards is not None and k >= max_shards:
            bar.close()
            return out
        tensors = {}
        for name in _stored_names(shard):
            made = generate_tensors(name, shard[name], seed)
            tensors.update(made)
            bar.update(sum(t.numel() * t.element_size() for t in made.values()))
        save_file(tensors, str(out / file), metadata=SAFETENSORS_METADATA)
        weight_map.update({name: file for name in tensors})
        del tensors   # bounded memory: one shard at a time
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    write_codec(out / "codec.pth", cfg, seed)
    return out


def write_codec(path: Path, cfg: DramaConfig, seed: int) -> None:
    """codec.pth: an F32 OrderedDict in §2.4's real key layout, written with torch.save."""
    state = collections.OrderedDict()
    for name, spec in codec_inventory(cfg.codec_config, style="real").items():
        gen = torch.Generator().manual_seed(tensor_seed(seed, f"codec/{name}"))
        state[name] = init_rule(name)(spec.shape, gen).to(torch.float32)
    torch.save(state, path)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

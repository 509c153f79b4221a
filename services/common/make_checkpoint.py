"""Random-weight checkpoints in our exact format (MODEL.md §10.2): the tiny one for tests, and a
full-size one (§11) for memory, throughput and start-up work on a GPU host.

    make_checkpoint(out_dir, preset="tiny", seed=0)        # < 1 s, a few MB, in this process
    make_checkpoint(out_dir, preset="full")                # ~40 GB: one process per shard, all cores
    make_checkpoint(out_dir, preset="full", dry_run=True)  # the shard plan only
    make_checkpoint(out_dir, "full", config=scaled_config("full", num_layers=8, num_experts=64))
                                                           # the full geometry, fewer layers/experts

Files: config.json (the preset), model-0000k-of-0000n.safetensors + model.safetensors.index.json
(backbone and tower; two layers per shard, the embedding with the first shard, the final norm,
LM head, tower and one `mtp.fc.weight` to exercise the ignore list with the last), tokenizer.json
and codec.pth (torch.save of an F32 OrderedDict with the real weight-norm style mix).

Every tensor draws from its own generator seeded by (seed, name), so the values do not depend on
the shard layout, the generation order or the number of worker processes, the same seed gives
byte-identical files, and a shard can be written without holding any other in memory. That is
what lets the full checkpoint be written by a pool of processes, one shard each (largest first,
so the big last shard is not the tail), at roughly (cores x ~0.1 GiB/s) until the disk is the limit.

Speed without changing a byte: values are drawn into one reused float32 scratch buffer per
process (no fresh 4-8 MB temporaries per matrix), and an FP8 matrix made of whole 128x128 blocks
is quantised in place (`quantize_whole_blocks_fp8_`), the arithmetic of `fp8.quantize_block_fp8`
without its padded copy and expanded scales; tests compare both paths bit for bit.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.config import DramaConfig
from services.common.fp8 import FP8_DTYPE, FP8_MAX, WEIGHT_SCALE_FLOOR, quantize_block_fp8
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
#
# Every rule is (shape, generator, out=None) -> float32 tensor, drawing into `out` when given (a
# scratch buffer of that shape) and computing in place: the same float32 operations in the same
# order as `torch.randn(shape) * std + mean`, so the bytes do not depend on `out`.

def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _normal(std: float, mean: float = 0.0) -> Callable:
    return lambda shape, gen, out=None: torch.randn(shape, generator=gen, out=out).mul_(std).add_(mean)


def _uniform(low: float, high: float) -> Callable:
    return lambda shape, gen, out=None: torch.rand(shape, generator=gen, out=out).mul_(high - low).add_(low)


def _fan_in_normal(shape, gen, out=None) -> torch.Tensor:
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return torch.randn(shape, generator=gen, out=out).div_(math.sqrt(fan_in))


def init_rule(name: str) -> Callable:
    """How §10.2 draws the tensor called `name`: a function (shape, generator, out=None) ->
    float32 tensor."""
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


def quantize_whole_blocks_fp8_(w: torch.Tensor, block_size: tuple[int, int] = (128, 128)
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_block_fp8` for a float32 [N, K] of whole blocks, overwriting `w`.

    Same arithmetic per block (S = max(|W|, 1e-12) / 448, W_q = e4m3(clamp(W / S, ±448))), so the
    same bits, but max|W| is max(max W, −min W) over a block view and W / S divides in place by
    the broadcast [N/b0, 1, K/b1, 1] scales: no padded copy, no |W| tensor, no expanded [N, K]
    scales (3 of the 4 passes over memory that the reference makes).
    """
    n, k = w.shape
    b0, b1 = block_size
    if w.dtype != torch.float32 or n % b0 or k % b1 or not w.is_contiguous():
        raise ValueError(f"needs a contiguous float32 [N, K] of whole {block_size} blocks, got "
                         f"{w.dtype} {tuple(w.shape)}")
    blocks = w.view(n // b0, b0, k // b1, b1)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    scale_inv = amax.clamp_min(WEIGHT_SCALE_FLOOR) / FP8_MAX
    blocks.div_(scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return w.to(FP8_DTYPE), scale_inv


class Scratch:
    """One growing float32 buffer that values are drawn into (one per writing process)."""

    def __init__(self):
        self._flat = torch.empty(0, dtype=torch.float32)

    def float32(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        if self._flat.numel() < n:
            self._flat = torch.empty(n, dtype=torch.float32)
        return self._flat[:n].view(shape)


def generate_tensors(name: str, spec: TensorSpec, seed: int, scratch: Scratch | None = None
                     ) -> dict[str, torch.Tensor]:
    """The stored tensor(s) for `name`: an FP8 weight comes with its `weight_scale_inv`.
    scratch: draw into its buffer (fast, same bytes); the returned tensors never alias it."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    out = scratch.float32(spec.shape) if scratch is not None else None
    values = init_rule(name)(spec.shape, gen, out=out)
    if spec.dtypes[0] == torch.float8_e4m3fn:
        whole = len(spec.shape) == 2 and spec.shape[0] % 128 == 0 and spec.shape[1] % 128 == 0
        if out is not None and whole:
            w_q, scale_inv = quantize_whole_blocks_fp8_(values)
        else:
            w_q, scale_inv = quantize_block_fp8(values)
        return {name: w_q, f"{name}_scale_inv": scale_inv}
    return {name: values.to(spec.dtypes[0], copy=out is not None)}


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------

def scaled_config(preset: str, *, num_layers: int | None = None, num_experts: int | None = None) -> dict:
    """The preset's config.json object with fewer backbone layers and/or routed experts (every
    other dimension, the vocabulary and the tower unchanged): a mid-size checkpoint for load
    benchmarks and tests. Attention layers stay every `full_attention_interval`-th layer."""
    raw = preset_raw(preset)
    text = raw["text_config"]
    if num_layers is not None:
        interval = text["full_attention_interval"]
        text["num_hidden_layers"] = num_layers
        text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(num_layers)]
    if num_experts is not None:
        text["num_experts"] = num_experts
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], num_experts)
    return raw


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


def codec_nbytes(cfg: DramaConfig) -> int:
    """codec.pth's tensor bytes (F32)."""
    return sum(math.prod(s.shape) for s in codec_inventory(cfg.codec_config, style="real").values()) * 4


def checkpoint_nbytes(preset: str, config: dict | None = None) -> int:
    """Bytes a `make_checkpoint(out, preset, config=config)` writes (tensors, headers, codec.pth;
    tokenizer.json and config.json are under 1 MiB)."""
    cfg = DramaConfig.from_dict(preset_raw(preset) if config is None else config)
    shards = plan_shards(cfg)
    return (sum(spec_nbytes(s) + 256 for shard in shards for s in shard.values())
            + codec_nbytes(cfg) + 2 * 2 ** 20)


# --------------------------------------------------------------------------------------------
# disk space
# --------------------------------------------------------------------------------------------

class DiskSpaceError(OSError):
    """The checkpoint would not fit on the output directory's file system."""


def check_disk_space(out: Path, needed: int, files: list[str]) -> tuple[int, int]:
    """(bytes needed beyond what `files` already take in `out`, bytes free there); raises
    DiskSpaceError when the first does not fit in the second with 1 GiB to spare (the repo, logs
    and the stages' own files share the disk)."""
    existing = sum((out / f).stat().st_size for f in files if (out / f).is_file())
    extra = max(0, needed - existing)
    free = shutil.disk_usage(out).free
    if extra + 2 ** 30 > free:
        raise DiskSpaceError(f"{out}: the checkpoint needs {needed / 2**30:.2f} GiB "
                             f"({extra / 2**30:.2f} GiB more than the files already there), but only "
                             f"{free / 2**30:.2f} GiB are free on that file system (1 GiB kept spare)")
    return extra, free


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------

def default_workers(total_bytes: int, jobs: int) -> int:
    """Processes to write with: one per core (at most one per job) for anything over 256 MiB;
    below that the spawn of a process costs more than it saves."""
    if total_bytes < 256 * 2 ** 20:
        return 1
    return max(1, min(os.cpu_count() or 1, jobs))


def write_shard(path: Path, specs: dict[str, TensorSpec], seed: int) -> tuple[dict[str, int], float]:
    """Generate and write one safetensors shard; returns ({stored name: bytes}, seconds)."""
    start = time.perf_counter()
    scratch = Scratch()
    tensors = {}
    for name in _stored_names(specs):
        tensors.update(generate_tensors(name, specs[name], seed, scratch))
    save_file(tensors, str(path), metadata=SAFETENSORS_METADATA)
    return {n: t.numel() * t.element_size() for n, t in tensors.items()}, time.perf_counter() - start


def write_codec(path: Path, cfg: DramaConfig, seed: int) -> float:
    """codec.pth: an F32 OrderedDict in §2.4's real key layout, written with torch.save.
    Returns the seconds it took."""
    start = time.perf_counter()
    state = collections.OrderedDict()
    for name, spec in codec_inventory(cfg.codec_config, style="real").items():
        gen = torch.Generator().manual_seed(tensor_seed(seed, f"codec/{name}"))
        state[name] = init_rule(name)(spec.shape, gen).to(torch.float32)
    torch.save(state, path)
    return time.perf_counter() - start


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2**20:.1f} MiB"


def _worker_init() -> None:
    torch.set_num_threads(1)   # the pool is the parallelism: one core per process


def make_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, progress: bool = True,
                    *, dry_run: bool = False, max_shards: int | None = None, workers: int | None = None,
                    config: dict | None = None) -> Path:
    """Write a random checkpoint of `preset` into `out_dir` (created if needed); returns its path.

    dry_run: write config.json and tokenizer.json and print the shard plan, but no tensors.
    max_shards: stop after that many safetensors shards (a smoke test of the full preset); the
    index and codec.pth are then not written.
    workers: processes writing shards (and codec.pth) at once; default one per core for a
    checkpoint over 256 MiB, else 1 (in this process). The bytes do not depend on it.
    config: a config.json object to use instead of the preset's (e.g. `scaled_config`); the
    preset still picks the token-id layout (tiny or full).
    Raises DiskSpaceError before writing any tensor when the files would not fit.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = preset_raw(preset) if config is None else config
    cfg = DramaConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")

    special_ids = tiny_special_ids(cfg) if preset == "tiny" else full_special_ids(cfg)
    tokenizer = build_byte_level_tokenizer(special_ids)
    check_token_ids(cfg, tokenizer)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    shards = plan_shards(cfg)
    files = [shard_name(k, len(shards)) for k in range(len(shards))]
    shard_bytes = [sum(spec_nbytes(s) for s in shard.values()) for shard in shards]
    total = sum(shard_bytes)
    if dry_run:
        for file, shard, nbytes in zip(files, shards, shard_bytes):
            print(f"{file}: {len(shard)} tensors, {nbytes / 2**30:.2f} GiB")
        print(f"total {total / 2**30:.2f} GiB in {len(files)} shards")
        return out

    jobs = list(range(len(shards) if max_shards is None else min(max_shards, len(shards))))
    with_codec = max_shards is None
    # safetensors headers are ~100 bytes a tensor; torch.save adds a little per tensor too
    needed = (sum(shard_bytes[k] + 256 * len(shards[k]) for k in jobs)
              + (codec_nbytes(cfg) + 2 ** 20 if with_codec else 0))
    extra, free = check_disk_space(out, needed, files + ["codec.pth"])
    workers = workers or default_workers(needed, len(jobs) + with_codec)
    say = print if progress else (lambda *a, **k: None)
    say(f"{preset} checkpoint -> {out}: {len(jobs)} shard(s){' + codec.pth' if with_codec else ''}, "
        f"{_size(needed)} ({_size(extra)} new; {_size(free)} free there), {workers} process(es)", flush=True)

    start = time.perf_counter()
    weight_map: dict[str, str] = {}
    done_bytes = 0

    def finished(label: str, nbytes: int, seconds: float, done: int) -> None:
        nonlocal done_bytes
        done_bytes += nbytes
        elapsed = time.perf_counter() - start
        say(f"  [{done}/{len(jobs) + with_codec}] {label}: {_size(nbytes)} in {seconds:.1f} s; "
            f"{_size(done_bytes)} of {_size(needed)} after {elapsed:.1f} s", flush=True)

    if workers <= 1:
        for done, k in enumerate(jobs, 1):
            sizes, seconds = write_shard(out / files[k], shards[k], seed)
            weight_map.update({name: files[k] for name in sizes})
            finished(files[k], sum(sizes.values()), seconds, done)
        if with_codec:
            finished("codec.pth", codec_nbytes(cfg), write_codec(out / "codec.pth", cfg, seed), len(jobs) + 1)
    else:
        context = multiprocessing.get_context("spawn")   # no fork of a process that holds torch threads
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init) as pool:
            futures = {}
            # largest first: the last shard (LM head, tower) is 3x the others and must not be the tail
            for k in sorted(jobs, key=lambda k: -shard_bytes[k]):
                futures[pool.submit(write_shard, out / files[k], shards[k], seed)] = k
            if with_codec:
                futures[pool.submit(write_codec, out / "codec.pth", cfg, seed)] = None
            for done, future in enumerate(as_completed(futures), 1):
                k = futures[future]
                if k is None:
                    finished("codec.pth", codec_nbytes(cfg), future.result(), done)
                    continue
                sizes, seconds = future.result()
                weight_map.update({name: files[k] for name in sizes})
                finished(files[k], sum(sizes.values()), seconds, done)
    if max_shards is not None:
        return out
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    elapsed = time.perf_counter() - start
    say(f"wrote {_size(needed)} in {elapsed:.1f} s ({needed / 2**30 / max(elapsed, 1e-9):.2f} GiB/s)", flush=True)
    return out

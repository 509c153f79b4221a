"""Tower weights: the name map, the strict loader, and random weights for tests and benchmarks.

Module parameter names equal the checkpoint names minus the `audio_decoder.` prefix (MODEL.md
§2.3), so the map is one prefix, plus the semantic head (§4.8), which comes from one of

    audio_decoder.semantic_head.weight                    [Q_s + 1, H], if the checkpoint has it
    lm_head.weight rows start..end, then row im_end       (embed_tokens when tied)

and of the LM-head tensor only those `Q_s + 1` rows are read (§2.5 rule 6).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.common.checkpoint import check_stage, open_safetensors
from services.common.config import DramaConfig, load_config
from services.common.fp8 import dequantize_block_fp8
from services.common.inventory import TOWER_PREFIX
from services.tower.model import RMSNormPlus, RowLinear, TowerModel

PREFIX = TOWER_PREFIX
SEMANTIC_HEAD = PREFIX + "semantic_head.weight"


def checkpoint_name(parameter_name: str) -> str:
    return PREFIX + parameter_name


def semantic_head_source(cfg: DramaConfig, tensor_names) -> tuple[str, list[int] | None]:
    """(tensor name, rows to read or None for all) of the semantic head for this checkpoint."""
    if SEMANTIC_HEAD in tensor_names:
        return SEMANTIC_HEAD, None
    prefixes = ("model.language_model.", "model.")
    if cfg.text.tie_word_embeddings:
        candidates = [p + "embed_tokens.weight" for p in prefixes]
    else:
        candidates = ["lm_head.weight"]
    found = [name for name in candidates if name in tensor_names]
    if not found:
        raise KeyError(f"semantic head: none of {candidates} or {SEMANTIC_HEAD} in the checkpoint")
    rows = list(range(cfg.semantic_start_token_id, cfg.semantic_end_token_id + 1)) + [cfg.im_end_token_id]
    return found[0], rows


def read_rows(ckpt, name: str, rows: list[int] | None, block_size: tuple[int, int]) -> torch.Tensor:
    """Rows of a 2-D checkpoint tensor, reading only those rows from its shard, in a float dtype.

    The semantic rows are one contiguous range plus the im_end row: two slices. (The whole LM
    head of the real model is about 1 GB; the tower needs 16 MB of it.) An FP8 head (§2.5 rule 4)
    is dequantised row by row with the scale row of each row's block.
    """
    if rows is None:
        return read_weight(ckpt, name, block_size)
    with safe_open(str(Path(ckpt.directory) / ckpt.file_of(name)), framework="pt") as shard:
        piece = shard.get_slice(name)
        first, last, extra = rows[0], rows[-2], rows[-1]
        selected = torch.cat([piece[first:last + 1], piece[extra:extra + 1]])
    if selected.dtype != torch.float8_e4m3fn:
        return selected
    b0, b1 = block_size
    scales = ckpt.get(name + "_scale_inv").float()[torch.tensor(rows) // b0]          # [rows, K / b1]
    scales = scales.repeat_interleave(b1, dim=1)[:, :selected.shape[1]]
    return selected.float() * scales


def read_weight(ckpt, name: str, block_size: tuple[int, int]) -> torch.Tensor:
    """A tower tensor in a float dtype: an FP8 linear weight (allowed by MODEL.md §2.5 rule 4,
    which the strict check has already validated with its scale) is dequantised once."""
    tensor = ckpt.get(name)
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_block_fp8(tensor, ckpt.get(name + "_scale_inv"), block_size)
    return tensor


def read_tower_state(ckpt, cfg: DramaConfig, parameter_names: list[str], device: torch.device,
                     dtype: torch.dtype, block_size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """{parameter name: tensor on `device` in `dtype`} for the tower's parameters.

    The stored-as-is tensors (all of them in our checkpoints) are read in parallel, a thread per
    shard, each copied once straight to `device` (SafetensorsCheckpoint.read_parallel); an FP8
    one (§2.5 rule 4) is dequantised on the host first, and the semantic head reads its rows.
    """
    head = "semantic_head.weight"
    by_checkpoint_name = {checkpoint_name(n): n for n in parameter_names if n != head}
    plain = [n for n in by_checkpoint_name if ckpt.dtype_of(n) != torch.float8_e4m3fn]
    state: dict[str, torch.Tensor] = {}

    def read(name: str, mapped: torch.Tensor, copier) -> None:
        state[by_checkpoint_name[name]] = copier.new(mapped, dtype)   # each thread its own keys

    ckpt.read_parallel(plain, read, device=device)
    for name in set(by_checkpoint_name) - set(plain):
        state[by_checkpoint_name[name]] = read_weight(ckpt, name, block_size).to(device=device, dtype=dtype)
    if head in parameter_names:
        source, rows = semantic_head_source(cfg, set(ckpt.names()))
        state[head] = read_rows(ckpt, source, rows, block_size).to(device=device, dtype=dtype)
    return state


def load_tower(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, batch_invariant: bool | None = None) -> TowerModel:
    """The tower of a checkpoint, checked strictly (every problem listed in one WeightError).

    dtype defaults to float32 on CPU (the reference path) and bfloat16 elsewhere;
    batch_invariant defaults to True on CPU.
    """
    device = torch.device(device)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if batch_invariant is None:
        batch_invariant = device.type == "cpu"
    cfg = load_config(checkpoint_dir)
    ckpt = open_safetensors(checkpoint_dir)
    check_stage(ckpt, cfg, "tower")
    block_size = tuple(cfg.quantization_config.weight_block_size) if cfg.quantization_config else (128, 128)

    # Built on meta, filled with assign=True: nothing is allocated twice, and `__init__`'s
    # placeholder values never exist (they would be meaningless anyway).
    with torch.device("meta"):
        model = TowerModel(cfg, batch_invariant=batch_invariant)
    state = read_tower_state(ckpt, cfg, [name for name, _ in model.named_parameters()], device, dtype,
                             block_size)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def random_tower(cfg: DramaConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, batch_invariant: bool | None = None) -> TowerModel:
    """A tower with random weights made on `device`, in the spirit of MODEL.md §10.2: norm
    weights N(0, 0.3^2) (zero-centred, so a missing `1 +` shows), embeddings N(0, 1), every
    other matrix N(0, 1/fan_in)."""
    device = torch.device(device)
    if batch_invariant is None:
        batch_invariant = device.type == "cpu"
    with torch.device("meta"):
        model = TowerModel(cfg, batch_invariant=batch_invariant)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNormPlus):
                module.weight.normal_(0.0, 0.3, generator=generator)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=generator)
            elif isinstance(module, RowLinear):
                module.weight.normal_(0.0, module.in_features ** -0.5, generator=generator)
    return model.eval()

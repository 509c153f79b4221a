"""`dramaturg checkpoint inspect`: validate a whole checkpoint directory and summarise it per stage.

(Not called inspect.py: a module of that name would shadow the standard library's `inspect` for
anything run from this directory.)

    report = inspect_checkpoint(checkpoint_dir)
    report.problems   # every config, token-id and tensor problem (empty when the checkpoint is clean)
    report.warnings   # reported but not fatal: unknown codec.pth keys (§2.5 rule 7)
    report.stages     # StageSummary per stage (backbone, tower, codec, ignored)

Each stage is checked the way its loader checks it (MODEL.md §2.5), so a checkpoint that inspects
clean loads everywhere, and a broken one comes back as one list instead of the first error.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.checkpoint import (
    STAGES,
    SafetensorsCheckpoint,
    WeightError,
    dtype_name,
    find_tensor_problems,
    open_safetensors,
    stage_expectations,
)
from services.common.config import CodecConfig, ConfigError, DramaConfig, load_config
from services.common.inventory import TensorSpec, codec_inventory, detect_weight_norm_styles, is_ignored

CODEC_FILE = "codec.pth"


@dataclass
class StageSummary:
    stage: str
    tensors: int = 0
    parameters: int = 0            # elements of weights (FP8 scales are not parameters)
    bytes: int = 0
    dtypes: Counter = field(default_factory=Counter)

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        numel = math.prod(shape)
        self.tensors += 1
        self.bytes += numel * torch.empty(0, dtype=dtype).element_size()
        self.dtypes[dtype_name(dtype)] += 1
        if not name.endswith("weight_scale_inv"):
            self.parameters += numel


@dataclass
class InspectReport:
    directory: Path
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    stages: list[StageSummary] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def codec_tensor_problems(tensors: Mapping[str, torch.Tensor], codec: CodecConfig,
                          source: str = CODEC_FILE) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a codec state dict against §2.4, any weight-norm style per conv
    (new, old or folded). Missing, mis-shaped and wrong-dtype tensors are problems; unknown keys
    are warnings (training leftovers are reported and ignored, §2.5 rule 7)."""
    expected = codec_inventory(codec, style=detect_weight_norm_styles(tensors, codec))
    problems, warnings = [], []
    for name, spec in expected.items():
        if name not in tensors:
            problems.append(f"missing: {name} (expected {spec}; not in {source})")
            continue
        t = tensors[name]
        if tuple(t.shape) != spec.shape:
            problems.append(f"wrong shape: {name} in {source} is {list(t.shape)}, expected {list(spec.shape)}")
        if t.dtype not in spec.dtypes:
            problems.append(f"wrong dtype: {name} in {source} is {dtype_name(t.dtype)}, expected "
                            + "/".join(dtype_name(d) for d in spec.dtypes))
    for name in tensors:
        if name not in expected:
            warnings.append(f"unknown codec key (ignored): {name} in {source}")
    return problems, warnings


def _summarise_safetensors(ckpt: SafetensorsCheckpoint, stage: str,
                           expected: Mapping[str, TensorSpec]) -> StageSummary:
    summary = StageSummary(stage)
    for name in ckpt.names():
        owned = name in expected or (name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in expected)
        if owned:
            summary.add(name, ckpt.shape_of(name), ckpt.dtype_of(name))
    return summary


def inspect_checkpoint(directory: str | Path) -> InspectReport:
    """Check config.json (and its token ids against tokenizer.json), every safetensors tensor
    against the backbone and tower inventories, and codec.pth (read with the allow-list unpickler)
    against the codec inventory."""
    directory = Path(directory)
    report = InspectReport(directory)
    try:
        cfg = load_config(directory, check_tokenizer=False)
    except ConfigError as exc:
        report.problems.append(f"config: {exc}")
        return report            # nothing else can be checked without a config
    _check_tokenizer(directory, cfg, report)
    _check_safetensors(directory, cfg, report)
    _check_codec(directory, cfg, report)
    return report


def _check_tokenizer(directory: Path, cfg: DramaConfig, report: InspectReport) -> None:
    from services.common.tokenizer import check_token_ids, load_tokenizer

    try:
        check_token_ids(cfg, load_tokenizer(directory))
    except ConfigError as exc:
        report.problems.append(f"tokenizer: {exc}")
    except Exception as exc:  # a tokenizer.json that tokenizers cannot parse
        report.problems.append(f"tokenizer: {directory / 'tokenizer.json'} is unreadable ({exc})")


def _check_safetensors(directory: Path, cfg: DramaConfig, report: InspectReport) -> None:
    try:
        ckpt = open_safetensors(directory)
    except WeightError as exc:
        report.problems.extend(exc.problems)
        return
    block = tuple(cfg.quantization_config.weight_block_size) if cfg.quantization_config else (128, 128)
    seen = set()
    for stage in STAGES:
        try:
            expected, optional, other = stage_expectations(ckpt, cfg, stage)
        except WeightError as exc:
            report.problems.extend(exc.problems)
            return
        for problem in find_tensor_problems(ckpt, expected, optional=optional,
                                            other_stage_names=other, block_size=block):
            if problem not in seen:   # an unexpected tensor is unexpected for both stages
                seen.add(problem)
                report.problems.append(problem)
        report.stages.append(_summarise_safetensors(ckpt, stage, {**expected, **optional}))
    ignored = StageSummary("ignored")
    for name in ckpt.names():
        if is_ignored(name):
            ignored.add(name, ckpt.shape_of(name), ckpt.dtype_of(name))
    report.stages.append(ignored)


def _check_codec(directory: Path, cfg: DramaConfig, report: InspectReport) -> None:
    from services.common.safe_pickle import UnsafePickleError, load_torch_state_dict

    path = directory / CODEC_FILE
    if not path.is_file():
        report.problems.append(f"{CODEC_FILE}: not found in {directory}")
        return
    try:
        state = load_torch_state_dict(path)
    except (UnsafePickleError, ValueError) as exc:
        report.problems.append(f"{CODEC_FILE}: {exc}")
        return
    problems, warnings = codec_tensor_problems(state, cfg.codec_config)
    report.problems.extend(problems)
    report.warnings.extend(warnings)
    summary = StageSummary("codec")
    for name, t in state.items():
        summary.add(name, tuple(t.shape), t.dtype)
    report.stages.append(summary)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_report(report: InspectReport) -> str:
    """The per-stage table for a clean checkpoint, or the numbered problem list."""
    lines = []
    if report.problems:
        lines.append(f"{report.directory}: {len(report.problems)} problem(s)")
        lines.extend(f"  {i}. {p}" for i, p in enumerate(report.problems, 1))
    else:
        lines.append(f"{report.directory}: OK")
        lines.append(f"{'stage':<10}{'tensors':>9}{'parameters':>16}{'bytes':>13}  dtypes")
        for s in report.stages:
            dtypes = ", ".join(f"{d} x{c}" for d, c in sorted(s.dtypes.items()))
            lines.append(f"{s.stage:<10}{s.tensors:>9}{s.parameters:>16,}{_human_bytes(s.bytes):>13}  {dtypes}")
    for w in report.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)

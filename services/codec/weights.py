"""codec.pth -> the codec's parameters (MODEL.md §2.4, §2.5 rule 7, §7.3).

The module tree uses the checkpoint's names, so the map is the identity except for the
weight-normed convs. Those are marked by `conv.weight_normed = True` and accept three spellings
of the same weight `<conv>.weight`:
- new style:     `<conv>.parametrizations.weight.original0` (g), `.original1` (V);
- old style:     `<conv>.weight_g` (g), `<conv>.weight_v` (V);
- already folded `<conv>.weight`.
g and V are folded once in float32: W = V · (g / ‖V‖), the norm over every dim but 0 (one per
output channel of a conv, per input channel of a transposed conv). That is the association
torch's own weight-norm uses, so a folded real checkpoint gives the same bits.

Strictness: every missing, mis-shaped, wrongly typed, partial or doubly spelled tensor is
collected and raised once as `CodecWeightError`; unknown keys (training leftovers) are logged
and ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NEW_STYLE = (".parametrizations.weight.original0", ".parametrizations.weight.original1")
OLD_STYLE = (".weight_g", ".weight_v")


class CodecWeightError(ValueError):
    """codec.pth does not fit the config; the message lists every problem."""


def fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """W = V · (g / ‖V‖) in float32; g [dim0, 1, …], V [dim0, …] -> [dim0, …] float32."""
    v = v.float()
    norm = v.reshape(v.shape[0], -1).norm(2, dim=1).reshape(v.shape[0], *[1] * (v.dim() - 1))
    return v * (g.float().reshape(norm.shape) / norm)


def weight_normed_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose `.weight` is stored weight-normed in the checkpoint."""
    return [name for name, m in model.named_modules() if getattr(m, "weight_normed", False)]


def checkpoint_spellings(prefix: str, style: str) -> tuple[str, ...]:
    """The checkpoint keys of one weight-normed weight in a given style ("new", "old", "folded")."""
    suffixes = {"new": NEW_STYLE, "old": OLD_STYLE, "folded": (".weight",)}[style]
    return tuple(prefix + s for s in suffixes)


@dataclass
class LoadReport:
    unexpected: list[str] = field(default_factory=list)
    styles: dict[str, int] = field(default_factory=lambda: {"new": 0, "old": 0, "folded": 0})


def _check_tensor(name: str, tensor, problems: list[str]) -> bool:
    if not isinstance(tensor, Tensor):
        problems.append(f"{name}: not a tensor ({type(tensor).__name__})")
        return False
    if tensor.dtype not in ACCEPTED_DTYPES:
        problems.append(f"{name}: dtype {tensor.dtype}, expected one of F32/F16/BF16")
        return False
    return True


def _resolve_weight_normed(prefix: str, shape: torch.Size, checkpoint: dict, used: set[str],
                           problems: list[str], report: LoadReport) -> Tensor | None:
    """Find and fold `<prefix>.weight` from whichever single spelling is present."""
    present = [style for style in ("new", "old", "folded")
               if any(k in checkpoint for k in checkpoint_spellings(prefix, style))]
    if not present:
        problems.append(f"missing {prefix}.weight (as {prefix}{NEW_STYLE[0]}/{NEW_STYLE[1][-9:]}, "
                        f"{prefix}.weight_g/weight_v or {prefix}.weight) {list(shape)}")
        return None
    if len(present) > 1:
        problems.append(f"{prefix}: weight given in more than one spelling ({', '.join(present)})")
        used.update(k for s in present for k in checkpoint_spellings(prefix, s) if k in checkpoint)
        return None
    style = present[0]
    keys = checkpoint_spellings(prefix, style)
    used.update(k for k in keys if k in checkpoint)
    absent = [k for k in keys if k not in checkpoint]
    if absent:
        problems.append(f"missing {', '.join(absent)} (the rest of {prefix}'s {style}-style weight is present)")
        return None
    if not all(_check_tensor(k, checkpoint[k], problems) for k in keys):
        return None
    report.styles[style] += 1
    if style == "folded":
        weight = checkpoint[keys[0]]
        if weight.shape != shape:
            problems.append(f"{keys[0]}: shape {list(weight.shape)}, expected {list(shape)}")
            return None
        return weight.float()
    g, v = checkpoint[keys[0]], checkpoint[keys[1]]
    if v.shape != shape:
        problems.append(f"{keys[1]}: shape {list(v.shape)}, expected {list(shape)}")
        return None
    g_shape = [shape[0]] + [1] * (len(shape) - 1)
    if list(g.shape) != g_shape:
        problems.append(f"{keys[0]}: shape {list(g.shape)}, expected {g_shape}")
        return None
    return fold_weight_norm(g, v)


def resolve_state_dict(model: nn.Module, checkpoint: dict[str, Tensor]) -> tuple[dict[str, Tensor], LoadReport]:
    """Map a codec.pth state dict onto `model`'s parameter names, float32, weight norm folded.

    `model` may live on the meta device: only names and shapes are read from it.
    """
    expected = {name: p.shape for name, p in model.state_dict().items()}
    normed = {f"{m}.weight" for m in weight_normed_modules(model)}
    resolved: dict[str, Tensor] = {}
    used: set[str] = set()
    problems: list[str] = []
    report = LoadReport()
    for name, shape in expected.items():
        if name in normed:
            weight = _resolve_weight_normed(name[: -len(".weight")], shape, checkpoint, used,
                                            problems, report)
            if weight is not None:
                resolved[name] = weight
            continue
        if name not in checkpoint:
            problems.append(f"missing {name} {list(shape)}")
            continue
        used.add(name)
        tensor = checkpoint[name]
        if not _check_tensor(name, tensor, problems):
            continue
        if tensor.shape != shape:
            problems.append(f"{name}: shape {list(tensor.shape)}, expected {list(shape)}")
            continue
        resolved[name] = tensor.float()
    if problems:
        raise CodecWeightError(f"codec.pth does not match codec_config ({len(problems)} problem(s)):\n  "
                               + "\n  ".join(problems))
    report.unexpected = sorted(set(checkpoint) - used)
    if report.unexpected:
        log.warning("codec.pth: ignoring %d unknown tensor(s): %s", len(report.unexpected),
                    ", ".join(report.unexpected[:20]) + (" …" if len(report.unexpected) > 20 else ""))
    return resolved, report


def export_state_dict(model: nn.Module, style: dict[str, str] | None = None) -> dict[str, Tensor]:
    """The inverse map, for tests and tools: the model's weights as codec.pth keys.

    Weight-normed weights are written in the given style per module prefix (default: the real
    file's mix, old style for the RVQ projections and new style elsewhere), with g = ‖W‖ so that
    folding returns W up to rounding.
    """
    out: dict[str, Tensor] = {}
    normed = set(weight_normed_modules(model))
    for name, tensor in model.state_dict().items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix in normed:
            kind = (style or {}).get(prefix) or ("old" if ".quantizers." in prefix else "new")
            if kind == "folded":
                out[name] = tensor.clone()
                continue
            w = tensor.float()
            g = w.reshape(w.shape[0], -1).norm(2, dim=1).reshape(w.shape[0], *[1] * (w.dim() - 1))
            g_key, v_key = checkpoint_spellings(prefix, kind)
            out[g_key], out[v_key] = g, w.clone()
        else:
            out[name] = tensor.clone()
    return out

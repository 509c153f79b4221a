"""Loading the backbone from a checkpoint directory (MODEL.md §2.3, §2.5).

    load_backbone(path, device="cpu", dtype=torch.float32, *, lm_head=True) -> Backbone
    model, reads = start_backbone_load(path, device, dtype, lm_head=False)   # experts still arriving
    ...                                    # warm up (compile, capture graphs) meanwhile
    reads.wait()                           # the routed experts are in place (or the read error)

Accepted, unchanged: our speech checkpoints (prefix `model.language_model.`, the tower's
`audio_decoder.codebook_embeddings.weight` read for audio rows) and plain HF Qwen3.5-MoE text
checkpoints written by transformers' `save_pretrained` (prefix `model.`, flat config.json, no
audio rows). Routed experts may be per-expert (BF16/F32, or block-FP8 with `weight_scale_inv`)
or fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); any linear may be
block-FP8. Non-FP8 float tensors may be stored BF16 or F32 (a float32 `save_pretrained` writes
F32) and are cast to the compute dtype; FP8 weights and their scales stay as stored (except an
FP8 router, dequantised once: it runs in F32).

Order (§2.5 rule 1): check every tensor name, shape and dtype against the inventory and raise one
WeightError naming each problem with its shard file; then build the model on the meta device,
fill every parameter from the name map below, and refuse a model with anything left unfilled.

`start_backbone_load` returns once everything but the per-expert routed weights is in place; those
(~95% of a full checkpoint's bytes: 32 of 34 GiB) go on reading on a background thread straight
into the tensors the model already holds, in their final layout (on the kernel path gate and up
land in the two halves of the packed `w_gate_up`, so `Backbone.prepare` copies nothing). Nothing
the warm-up does depends on their values: Triton compiles and autotunes by shape, and a CUDA graph
records the tensors' addresses, so graph capture can run while the disk is still being read (on
the H200 from a cold page cache: ~39 s of reading at the disk's ~0.9 GB/s, a 41-45 s warm-up). The warm-up's
outputs are garbage meanwhile and go nowhere (its slots are reset before any request uses them).
This load reads with EXPERT_READ_THREADS readers (unless $DRAMA_LOAD_THREADS says otherwise):
on the H200, 8 readers beside the warm-up slowed it from 41 to 63 s (their copies, syncs and GIL
turns between the warm-up's launches) and read no faster than 2 (45 s against 39 s). The server
does this by default on CUDA (DRAMA_LOAD_OVERLAP=0 turns it off; server.load_overlap_for).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import torch
from torch import nn

from services.common.checkpoint import (
    WeightError,
    check_tensors,
    detect_backbone_layout,
    open_safetensors,
    stage_expectations,
)
from services.common.config import is_flat_text_config, load_config, load_text_config
from services.common.fp8 import dequantize_block_fp8
from services.common.inventory import TOWER_PREFIX, TensorSpec, backbone_inventory, tower_inventory

from .model import AudioSpec, Backbone, default_kernels

CODEBOOK_EMBEDDINGS = f"{TOWER_PREFIX}codebook_embeddings.weight"

# Checkpoint name (after the backbone prefix) -> how it lands in the module tree.
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_FUSED_GATE_UP = re.compile(r"^(layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(layers\.\d+\.mlp\.experts)\.down_proj$")


def _widen(specs: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """Let every BF16 tensor also be F32: we upcast anyway, and transformers writes F32 models as F32."""
    out = {}
    for name, spec in specs.items():
        if torch.bfloat16 in spec.dtypes and torch.float32 not in spec.dtypes:
            spec = TensorSpec(spec.shape, spec.dtypes + (torch.float32,))
        out[name] = spec
    return out


def _expectations(path: Path, ckpt):
    """(expected, other stage's names, AudioSpec or None, FP8 block size) for this directory."""
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if is_flat_text_config(raw):
        text = load_text_config(path)
        expected = backbone_inventory(text, **detect_backbone_layout(ckpt))
        return _widen(expected), set(), None, (128, 128)
    cfg = load_config(path)
    expected, _, other = stage_expectations(ckpt, cfg, "backbone")
    # The backbone reads the tower's codebook table too (§2.5 rule 6), so it checks it as its own.
    expected = {**expected, CODEBOOK_EMBEDDINGS: tower_inventory(cfg)[CODEBOOK_EMBEDDINGS]}
    other = set(other) - {CODEBOOK_EMBEDDINGS}
    audio = AudioSpec(cfg.semantic_start_token_id, cfg.num_codebooks, cfg.codebook_vocab_size,
                      cfg.semantic_codebook_size, cfg.residual_codebook_size)
    block = tuple(cfg.quantization_config.weight_block_size) if cfg.quantization_config else (128, 128)
    return _widen(expected), other, audio, block


# readers of the experts beside the warm-up (module docstring): enough for the H200's disk, few
# enough to leave the warm-up its GIL turns
EXPERT_READ_THREADS = 2
_F32_PARAMETERS = ("mlp.gate.weight", "A_log", "dt_bias")   # router and decay parameters run in F32


def _kept(name: str, expected: dict[str, TensorSpec], lm_head: bool) -> bool:
    """Whether the backbone reads `name`: its own tensors and their FP8 scales; the LM head only
    when it is built. Another stage's tensors and the ignored ones were checked, not read."""
    if name not in expected and not (name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in expected):
        return False
    return lm_head or not name.startswith("lm_head.")


def _assign(model: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    """Replace the parameter or buffer at `dotted` (e.g. layers.0.mlp.gate.weight) by `tensor`."""
    module_path, _, attr = dotted.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise KeyError(dotted)


def load_backbone(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  *, lm_head: bool = True, exact: bool | None = None, kernels: bool | None = None,
                  decode_graphs: bool = False) -> Backbone:
    """The backbone of checkpoint directory `path`, on `device`, computing in `dtype`.

    lm_head=False skips the [V, H] LM head (the service never computes logits; §2.5 rule 6); it
    is still checked. exact: force the exact per-row path on or off (default: on for CPU; see
    model.py). kernels: force the GPU kernel path on or off (default: on for CUDA + Triton +
    BF16; its load-time layouts are built here, see Backbone.prepare). decode_graphs: replay
    decode steps from CUDA graphs. Raises ConfigError for config problems and one WeightError
    for all tensor problems.
    """
    model, _ = _load(path, device, dtype, lm_head=lm_head, exact=exact, kernels=kernels,
                     decode_graphs=decode_graphs, experts_in_background=False)
    return model


def start_backbone_load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        *, lm_head: bool = True, exact: bool | None = None, kernels: bool | None = None,
                        decode_graphs: bool = False) -> tuple[Backbone, "ExpertReads"]:
    """`load_backbone`, but it returns as soon as every tensor except the per-expert routed
    weights is in place (checked, placed, `Backbone.prepare`d), with those still being read on a
    background thread into the tensors the model holds (module docstring). Until
    `ExpertReads.wait()` returns, the model may be warmed up (compiled, captured), never served.
    Fused-expert checkpoints (`experts.gate_up_proj`) are read whole before it returns."""
    return _load(path, device, dtype, lm_head=lm_head, exact=exact, kernels=kernels,
                 decode_graphs=decode_graphs, experts_in_background=True)


class ExpertReads:
    """The routed experts' reads on their own thread: `wait()` joins it and raises the first read
    error (a WeightError naming the file, or the OSError); `seconds` is how long they took."""

    def __init__(self, read=None):
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._thread = None
        if read is not None:
            self._thread = threading.Thread(target=self._run, args=(read,), name="expert-reads", daemon=True)
            self._thread.start()

    def _run(self, read) -> None:
        started = time.perf_counter()
        try:
            read()
        except BaseException as exc:   # handed to wait(); a thread's exception would be lost
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - started

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error


def _load(path, device, dtype, *, lm_head: bool, exact: bool | None, kernels: bool | None,
          decode_graphs: bool, experts_in_background: bool) -> tuple[Backbone, ExpertReads]:
    """load_backbone / start_backbone_load."""
    path, device = Path(path), torch.device(device)
    ckpt = open_safetensors(path)
    expected, other, audio, block = _expectations(path, ckpt)
    check_tensors(ckpt, expected, other_stage_names=other, block_size=block)
    prefix = detect_backbone_layout(ckpt)["prefix"]
    text = load_text_config(path)

    # Build on meta (no memory, no init), then put real tensors in; nothing is computed on meta.
    exact = device.type == "cpu" if exact is None else exact
    model = Backbone(text, audio, dtype=dtype, device="meta", lm_head=lm_head, exact=exact,
                     kernels=default_kernels(device, dtype, exact) if kernels is None else kernels,
                     decode_graphs=decode_graphs)
    for module in model.modules():
        if hasattr(module, "block_size"):
            module.block_size = block

    # Reading (§2.5 rule 1 happened above): every tensor this stage keeps is read in parallel,
    # a thread per shard, each copied straight to `device` in its compute dtype; routed experts
    # go straight into their stacked [E, ...] tensors, preallocated here. Nothing is held twice.
    wanted = [name for name in ckpt.names() if _kept(name, expected, lm_head)]

    def compute_dtype(name: str) -> torch.dtype:
        """The router and the decay parameters run in F32, everything else in `dtype`."""
        return torch.float32 if name.removeprefix(prefix).endswith(_F32_PARAMETERS) else dtype

    def target_dtype(name: str) -> torch.dtype:
        """As read: FP8 stays FP8 (dequantised later where its module keeps no scale), scales
        are F32, anything else is cast to its compute dtype."""
        if ckpt.dtype_of(name) == torch.float8_e4m3fn:
            return torch.float8_e4m3fn
        return torch.float32 if name.endswith("_scale_inv") else compute_dtype(name)

    stacked: dict[str, torch.Tensor] = {}        # module path -> [E, ...] on device
    expert_slot: dict[str, tuple[str, int]] = {}   # checkpoint name -> (module path, expert)
    # On the kernel path FP8 gate and up are read straight into the halves of one [E, 2I, H]
    # tensor (and their scales into one [E, 2I/128, H/128]): the layout Backbone.prepare packs
    # them into (moe.pack_kernels takes it as it is), so nothing is copied after the reads.
    packs: dict[tuple[str, str], torch.Tensor] = {}   # (experts path, weight | weight_scale_inv) -> packed
    for name in wanted:
        if m := _PER_EXPERT.match(name.removeprefix(prefix)):
            base, e, proj, kind = m.groups()
            target = f"{base}.{proj}" if kind == "weight" else f"{base}.{proj}_scale_inv"
            expert_slot[name] = (target, int(e))
            if target in stacked:
                continue
            shape = (text.num_experts,) + ckpt.shape_of(name)
            if model.kernels and proj != "down_proj" and _fp8_experts(ckpt, prefix, base):
                if (base, kind) not in packs:
                    packs[base, kind] = torch.empty((shape[0], 2 * shape[1]) + shape[2:],
                                                    dtype=target_dtype(name), device=device)
                packed = packs[base, kind]
                half = packed.shape[1] // 2
                if shape[1] != half:
                    raise WeightError([f"{name}: gate and up of one expert must have one shape to be "
                                       f"packed, got {shape[1]} rows against {half}"], f"checkpoint {path}")
                stacked[target] = packed[:, :half] if proj == "gate_proj" else packed[:, half:]
            else:
                stacked[target] = torch.empty(shape, dtype=target_dtype(name), device=device)
    loaded: dict[str, torch.Tensor] = {}

    def read(name: str, mapped: torch.Tensor, copier) -> None:
        """On a reader thread: a fresh copy on `device` (never a view of the memory-mapped shard:
        CPU GEMM results depend on the weight's alignment, and a copy is always aligned)."""
        if name in expert_slot:
            target, e = expert_slot[name]
            copier.copy_into(stacked[target][e], mapped)
        else:
            loaded[name] = copier.new(mapped, target_dtype(name))

    # Experts stored as they are kept (FP8 and its F32 scales, or the compute dtype) land in their
    # stack's slice in runs of neighbours (read_into_parallel: ~61k tensors in a full checkpoint);
    # the others (a dtype to convert) one by one through `read`.
    in_place = {name: stacked[target][e] for name, (target, e) in expert_slot.items()
                if ckpt.dtype_of(name) == stacked[target].dtype}
    experts_one_by_one = [name for name in wanted if name in expert_slot and name not in in_place]
    others = [name for name in wanted if name not in expert_slot]
    # In the background (start_backbone_load) the experts come last, into tensors placed below.
    background = experts_in_background and bool(expert_slot)
    # with the experts in the background every read takes EXPERT_READ_THREADS readers, as measured
    # (None: read_parallel's default, which follows $DRAMA_LOAD_THREADS when it is set)
    threads = EXPERT_READ_THREADS if background and not os.environ.get("DRAMA_LOAD_THREADS") else None
    ckpt.read_parallel(others if background else others + experts_one_by_one, read, device=device, threads=threads)
    if not background:
        ckpt.read_into_parallel(in_place, device=device, threads=threads)

    def read_experts(sync_device: bool) -> None:
        ckpt.read_parallel(experts_one_by_one, read, device=device, threads=threads, sync_device=sync_device)
        ckpt.read_into_parallel(in_place, device=device, threads=threads, sync_device=sync_device)

    def place(target: str, name: str) -> None:
        """Checkpoint tensor `name` into module path `target`. An FP8 weight whose module keeps
        no scale (the router, which runs in F32) is dequantised here, once; a scale goes to its
        module's `*_scale_inv` slot, or nowhere when its weight was dequantised."""
        module_path, _, attr = target.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        if attr.endswith("_scale_inv"):
            if attr in module._buffers:
                _assign(model, target, loaded[name])
            return
        t = loaded[name]
        if t.dtype == torch.float8_e4m3fn and f"{attr}_scale_inv" not in module._buffers:
            t = dequantize_block_fp8(t, loaded[f"{name}_scale_inv"], block, compute_dtype(name))
        _assign(model, target, t)

    for name in wanted:
        if name in expert_slot:
            continue   # already in its stacked tensor
        if name.startswith("lm_head."):
            place(name, name)
            continue
        if name == CODEBOOK_EMBEDDINGS:
            place("codebook_embeddings.weight", name)
            continue
        local = name.removeprefix(prefix)
        if m := _FUSED_GATE_UP.match(local):
            gate, up = loaded[name].chunk(2, dim=1)        # rows 0..I−1 gate, I..2I−1 up (§2.5 rule 3)
            _assign(model, f"{m.group(1)}.gate_proj", gate.contiguous())
            _assign(model, f"{m.group(1)}.up_proj", up.contiguous())
        elif m := _FUSED_DOWN.match(local):
            _assign(model, f"{m.group(1)}.down_proj", loaded[name])
        else:
            place(local, name)
    loaded.clear()
    for target, tensor in stacked.items():
        _assign(model, target, tensor)
    for (base, kind), tensor in packs.items():
        if kind == "weight" and (base, "weight_scale_inv") in packs:
            model.get_submodule(base).packed_gate_up = (tensor, packs[base, "weight_scale_inv"])
    if lm_head and model.lm_head is not None and text.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    unfilled = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if unfilled:
        raise WeightError([f"not filled from the checkpoint: {n}" for n in unfilled], f"checkpoint {path}")
    model.prepare()
    if not background:
        return model.eval(), ExpertReads()
    # sync_device=False: each reader waits for its own copy stream; a device-wide synchronize
    # would break a CUDA graph being captured meanwhile on another thread.
    return model.eval(), ExpertReads(lambda: read_experts(sync_device=False))


def _fp8_experts(ckpt, prefix: str, base: str) -> bool:
    """Whether the routed experts of `base` (a layer's experts path) are stored block-FP8."""
    return ckpt.dtype_of(f"{prefix}{base}.0.gate_proj.weight") == torch.float8_e4m3fn


def random_backbone(text, audio: AudioSpec | None = None, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0, fp8_experts: bool = True,
                    lm_head: bool = False, exact: bool | None = None, kernels: bool | None = None,
                    decode_graphs: bool = False) -> Backbone:
    """A backbone with random weights made directly on `device` (benchmarks, no checkpoint), in
    MODEL.md §10.2's spirit: zero-centred norm gains N(0, 0.3²), plain gains 1 + N(0, 0.3²),
    A_log ~ U(−1, 1), dt_bias ~ N(0, 0.5²), conv N(0, 0.4²), embeddings N(0, 1), matrices
    N(0, 1/fan_in). fp8_experts: experts stored float8_e4m3fn (values N(0, 1)) with constant
    block scales fan_in^−1/2, as a real Drama 3 checkpoint stores them."""
    device = torch.device(device)
    exact = device.type == "cpu" if exact is None else exact
    model = Backbone(text, audio, dtype=dtype, device="meta", lm_head=lm_head, exact=exact,
                     kernels=default_kernels(device, dtype, exact) if kernels is None else kernels,
                     decode_graphs=decode_graphs)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, std=1.0, mean=0.0, dtype=dtype):
        return torch.empty(shape, dtype=dtype, device=device).normal_(mean, std, generator=gen)

    for name, p in list(model.named_parameters()):
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device).uniform_(-1, 1, generator=gen)
        elif name.endswith("dt_bias"):
            t = normal(shape, 0.5, dtype=torch.float32)
        elif name.endswith("linear_attn.norm.weight"):
            t = normal(shape, 0.3, 1.0)
        elif len(shape) == 1:
            t = normal(shape, 0.3)
        elif "conv1d" in name:
            t = normal(shape, 0.4)
        elif "embed" in name:
            t = normal(shape)
        elif ".mlp.experts." in name and fp8_experts:
            t = normal(shape, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            blocks = (shape[0],) + tuple(-(-n // b) for n, b in zip(shape[1:], (128, 128)))
            _assign(model, f"{name}_scale_inv", torch.full(blocks, shape[2] ** -0.5, device=device))
        else:
            t = normal(shape, shape[-1] ** -0.5, dtype=p.dtype)
        _assign(model, name, t)
    model.prepare()
    return model.eval()

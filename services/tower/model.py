"""The tower: Drama 3's codebook-MTP audio decoder (MODEL.md §5), top to bottom.

A step of the tower takes backbone hidden rows `b_t` [T, D] of any number of sessions and their
target frames [T, N] (-1 = none), and runs

    u_t = shared layers (b_t)                                   the trunk, every row
    c_0 ~ semantic_head(b_t)                                    draw rows only (§4.8)
    for j = 0 .. N-2:                                           every row
        h_j = residual_layers[j](fuse(embed_j(c_j), h_{j-1}))   with h_{-1} = u_t
        c_{j+1} ~ head_j(norm(h_j))                             draw rows only

where a teacher-forced row's `c_j` is its target frame and a draw row's is drawn just before. Every
layer keeps a KV cache over the whole timeline in a preallocated pool of session slots; each row
writes its key/value at (slot, position) and then attends over positions 0..p of its slot, so rows
of one session processed together in one call (a prefill piece) see each other causally, and
rows of different sessions never meet.

Batch invariance (CPU float32): with `batch_invariant=True` every op computes each row with
arithmetic that does not depend on the other rows of the call: linears are batched matrix-vector
products (`torch.bmm` with one row per batch item; a plain GEMM changes its summation order with
the row count) and attention runs one row at a time over exactly its own `p + 1` positions. That
is what makes prefill split invariance and batch invariance bit-exact. On GPU the fast path
is used instead: GEMMs, and the Triton kernels of services/tower/kernels.py for decode attention,
RMSNorm+ and the q/k norm + RoPE (SDPA without cuDNN for multi-row prefill segments). It keeps
batch invariance (issue #8) by other means: the GEMMs go through invariant.linear_rows (cuBLAS
always sees 128-row pieces, services/common/invariant.py), the norm, prologue and draw kernels
work per row, decode attention splits a row's history by the pool length only, and a prefill
segment's SDPA call holds one session's rows. Prefill split invariance is not kept there.

Shape letters: T rows in the call, D hidden size, N codebooks, H query heads, K KV heads,
d head dim, L cache length (max_context), S session slots.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.common.config import DramaConfig
from services.common.grpcutil import env_default
from services.common.invariant import linear_rows, padded_input

# The GPU path's bf16 projections in frame steps (RowBatch.decode_step), by kind: through the
# backbone's Triton decode GEMM (services/backbone/kernels/decode_gemm.decode_linear: no padding to
# 128 rows; a row's bits depend on the weight's shape only, at any row count) or cuBLAS over 128-row
# pieces (invariant.linear_rows), which prompt steps always take. Either way a row's bits do not
# depend on the rows beside it: the choice is the kind's and the step kind's, never the row count's.
# DRAMA_TOWER_DECODE_GEMM: 1 (all kinds, the default), 0 (none), or a comma-separated list of kinds.
# H200, graphed frame step with the tower's kernels on PDL (session 19, `python3 bench/tower.py
# --batch 1 8 128 --graphs on --decode-gemm on down,o_proj,fc off`, one engine per setting in one
# process), ms at batch 1 / 8 / 128: all 1.76 / 1.92 / 4.33; down, o_proj, fc 1.91 / 1.95 / 3.98;
# none 2.09 / 2.15 / 3.95 (2.33 / 2.41 / 5.04 in another process); none without PDL (the old
# default) 2.10 / 2.2-2.3 / 4.46. All kinds is the fastest single stream and no slower at 128 rows
# than the old default. Prompt steps keep cuBLAS: the decode GEMM was equal there at 134 rows (4.03
# against 3.99 ms) and is not measured on longer prompts, where cuBLAS's 128-row tiles should win.
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down", "fc", "head")


def decode_gemm_kinds(value: str | None) -> frozenset[str]:
    """DRAMA_TOWER_DECODE_GEMM's (or bench/tower.py --decode-gemm's) value as a set of kinds."""
    value = (value or "").strip().lower()
    if value in ("", "0", "off", "false", "no", "none"):
        return frozenset()
    if value in ("1", "on", "true", "yes", "all"):
        return frozenset(PROJECTIONS)
    kinds = frozenset(k.strip() for k in value.split(",") if k.strip())
    if unknown := sorted(kinds - set(PROJECTIONS)):
        raise ValueError(f"DRAMA_TOWER_DECODE_GEMM: unknown projection kinds {unknown}; "
                         f"use 0, 1 or a comma-separated list of {', '.join(PROJECTIONS)}")
    return kinds


TOWER_DECODE_GEMM = decode_gemm_kinds(env_default("DRAMA_TOWER_DECODE_GEMM", "1"))

# draw(draw_index, logits [R, M]) -> codes [R]: a sampler for the draw rows (FrameDraws wraps it).
Sampler = Callable[[int, Tensor], Tensor]


class FrameDraws:
    """How forward_rows draws the frames of a step's draw rows: `semantic` (draw 0, which also
    decides which rows stop at EOS) and then `residual` for codebooks 1..N-1, each writing its
    codes into `codes` at the draw rows (-1 for a stopped row).

    This one wraps a `Sampler` callback and does the writes with torch ops (the CPU path and the
    tests). The engine's GPU draws (kernels.FusedFrameDraws) do each draw and its writes in one
    launch, the sampler's RAS switch and repetition penalty too: ~75 small torch launches fewer
    per frame step.
    """
    float32_logits = True        # the heads' logits reach the draws as float32 (else as computed)

    def __init__(self, sample: Sampler, eos: int):
        self.sample = sample
        self.eos = eos

    def semantic(self, logits: Tensor, codes: Tensor, draw_rows: Tensor) -> Tensor:
        """Draw 0 from logits [R, Q_s + 1] into codes[draw_rows, 0]; returns stopped bool [R]."""
        semantic = self.sample(0, logits)
        stopped = semantic == self.eos
        codes[draw_rows, 0] = torch.where(stopped, torch.full_like(semantic, -1), semantic)
        return stopped

    def residual(self, column: int, logits: Tensor, codes: Tensor, draw_rows: Tensor, stopped: Tensor) -> None:
        """Draw `column` (1..N-1) from logits [R, Q_r] into codes[draw_rows, column]."""
        drawn = self.sample(column, logits)
        codes[draw_rows, column] = torch.where(stopped, torch.full_like(drawn, -1), drawn)


@dataclass(frozen=True)
class RowBatch:
    """Where each row of a call lives: segments of consecutive positions of one cache slot.

    `segments` is `(slot, first_position, n_rows)` per segment, in row order; rows of one slot
    appear in at most one segment per call. Index tensors are built once per call, on the
    device, so no layer copies host lists to the GPU (each such copy waits for the GPU).
    """
    segments: tuple[tuple[int, int, int], ...]
    slots: Tensor              # int64 [T]
    positions: Tensor          # int64 [T]
    decode_rows: Tensor        # int64 [R]: rows that are single-row segments (decode steps)
    decode_slots: Tensor       # int64 [R]
    decode_positions: Tensor   # int64 [R]
    decode_length: int         # 1 + the largest decode position (0 without decode rows)
    all_decode: bool = False   # every row is a single-row segment, in order (decode_rows = 0..T-1)
    # A frame step's rows (each entry one drawing row, so every row draws, in order; TowerEngine
    # decides): the projections whose kind is in TOWER_DECODE_GEMM take the decode GEMM, and the
    # draws read the heads' rows without a gather. Prompt steps keep cuBLAS over 128-row pieces.
    decode_step: bool = False
    # cos/sin per (rotary_dim, theta), made by the first layer and shared by the others.
    _rotary: dict = field(default_factory=dict, compare=False, repr=False)

    def rotary(self, rotary_dim: int, theta: float, table: tuple[Tensor, Tensor] | None = None
               ) -> tuple[Tensor, Tensor]:
        """cos, sin [T, r/2] at the rows' positions: the rows of `table` (rotary_tables of every
        cache position, made once by setup_caches) when given, two gathers a step where the
        tables' arithmetic took ~8 launches; else computed. The same values either way: each
        element is the same F32 product and cos/sin of it."""
        key = (rotary_dim, theta)
        if key not in self._rotary:
            if table is None:
                self._rotary[key] = rotary_tables(self.positions, rotary_dim, theta)
            else:
                self._rotary[key] = tuple(t.index_select(0, self.positions) for t in table)
        return self._rotary[key]

    @classmethod
    def from_segments(cls, segments, device=None, decode_step: bool = False) -> "RowBatch":
        segments = tuple((int(s), int(p), int(n)) for s, p, n in segments)
        slots = [s for s, _, n in segments for _ in range(n)]
        positions = [p + i for _, p, n in segments for i in range(n)]
        starts = [sum(n for _, _, n in segments[:i]) for i in range(len(segments))]
        decode = [(row, s, p) for row, (s, p, n) in zip(starts, segments) if n == 1]

        def index(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(segments, index(slots), index(positions), index([r for r, _, _ in decode]),
                   index([s for _, s, _ in decode]), index([p for _, _, p in decode]),
                   1 + max((p for _, _, p in decode), default=-1),
                   all_decode=bool(segments) and len(decode) == len(segments) == len(slots),
                   decode_step=decode_step)

    @classmethod
    def decode_only(cls, slots: Tensor, positions: Tensor, max_position: int,
                    decode_step: bool = False) -> "RowBatch":
        """T single-row segments given as device tensors (a CUDA-graph bucket's static buffers).
        `segments` then holds placeholders: no path reads them for single-row segments except
        the CPU `attend_rowwise`, which the graphs never use. max_position bounds the positions
        (for the padded SDPA fallback only)."""
        rows = slots.shape[0]
        order = torch.arange(rows, dtype=torch.int64, device=slots.device)
        return cls(tuple((-1, -1, 1) for _ in range(rows)), slots, positions, order, slots, positions,
                   max_position + 1, all_decode=True, decode_step=decode_step)


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------

class TowerModel(nn.Module):
    """Parameter names equal the checkpoint names without the `audio_decoder.` prefix (§2.3);
    `semantic_head.weight` is filled from the LM-head rows of §4.8 unless the checkpoint has it."""

    def __init__(self, cfg: DramaConfig, *, batch_invariant: bool = True):
        super().__init__()
        tower = cfg.tower
        self.num_codebooks = cfg.num_codebooks
        self.codebook_vocab_size = cfg.codebook_vocab_size
        self.semantic_codebook_size = cfg.semantic_codebook_size
        self.residual_codebook_size = cfg.residual_codebook_size
        self.hidden_size = tower.hidden_size
        self.rms_norm_eps = tower.rms_norm_eps
        self.batch_invariant = batch_invariant

        self.codebook_embeddings = nn.Embedding(cfg.num_codebooks * cfg.codebook_vocab_size, tower.hidden_size)
        self.shared_layers = nn.ModuleList(
            TowerLayer(tower, batch_invariant) for _ in range(tower.num_shared_layers))
        self.residual_layers = nn.ModuleList(
            ResidualLayer(tower, batch_invariant, cfg.residual_codebook_size)
            for _ in range(tower.num_residual_layers))
        self.semantic_head = RowLinear(tower.hidden_size, cfg.semantic_codebook_size + 1, batch_invariant, "head")

    def setup_caches(self, max_sessions: int, max_context: int) -> None:
        """Allocate every layer's KV pool: [S, K, L, d] keys and values in the weights' dtype.

        `torch.empty`, not zeros: a position is always written before it is read, and untouched
        pages of a large CPU pool are then never committed. On the GPU path (not batch_invariant,
        CUDA) the projections are fused first (fuse_projections).
        """
        weight = self.codebook_embeddings.weight
        if weight.is_cuda and not self.batch_invariant:
            self.fuse_projections()
        tables = {}               # cos/sin of every cache position, one pair per RoPE setting
        for layer in self.layers():
            attn = layer.self_attn
            attn.setup_cache(max_sessions, max_context, weight.dtype, weight.device)
            key = (attn.rotary_dim, attn.rope_theta)
            if key not in tables:
                tables[key] = rotary_tables(torch.arange(max_context, device=weight.device), *key)
            attn.rope_table = tables[key]

    def fuse_projections(self) -> None:
        """The GPU path's load-time layout: each layer's q, k and v weights as one [N_q+2·N_kv, D]
        tensor and gate and up as one [2·I, D] (one GEMM each per step instead of three and two,
        26 launches fewer per frame step); the checkpoint's parameters become views into them,
        so the weights are held once. Idempotent."""
        for layer in self.layers():
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        if self.codebook_embeddings.weight.is_cuda:
            torch.cuda.empty_cache()     # the replaced weights' blocks: not kept reserved (nvidia-smi)

    def layers(self) -> list["TowerLayer"]:
        return [*self.shared_layers, *self.residual_layers]

    # The three parts of a step; `forward_rows` below strings them together.

    def trunk(self, hidden: Tensor, rows: RowBatch) -> Tensor:
        """u [T, D] from the backbone hidden rows b [T, D] (§5.3 step 1)."""
        x = hidden
        for layer in self.shared_layers:
            x = layer(x, rows)
        return x

    def semantic_logits(self, hidden: Tensor, decode: bool = False, float32: bool = True) -> Tensor:
        """s [R, Q_s + 1] float32 (else in the weights' dtype) from backbone hidden rows (§4.8);
        index Q_s is EOS."""
        logits = self.semantic_head(hidden, decode=decode)
        return logits.float() if float32 else logits

    def embed_codes(self, codebook: int, codes: Tensor) -> Tensor:
        """[T, D] embeddings of codebook `codebook`'s values `codes` [T]; exact zeros where -1."""
        known = codes >= 0
        index = codebook * self.codebook_vocab_size + codes.clamp(min=0)
        embedded = self.codebook_embeddings(index)
        return torch.where(known[:, None], embedded, torch.zeros_like(embedded))


def forward_rows(model: TowerModel, hidden: Tensor, targets: Tensor, rows: RowBatch,
                 draw_rows: Tensor | None = None, sample: Sampler | FrameDraws | None = None) -> tuple[Tensor, Tensor]:
    """Run the tower on T rows: teacher-forced rows and draw rows together (§5.3, §5.4).

    hidden [T, D] backbone rows; targets int64 [T, N], -1 = none (the target row of a draw row
    is -1); rows: their slots and positions; draw_rows int64 [R] indices into T (every row, in
    order, in a frame step: rows.decode_step); sample: the draws, a `FrameDraws` or a `Sampler`
    called for draw index 0 (semantic, M = Q_s + 1) then 1..N-1.

    Returns (codes [T, N], stopped bool [R]): the targets with each draw row's drawn frame filled
    in (-1 for a stopped row). Every layer writes every row into its cache, so the invariant
    "after row t every layer holds t + 1 entries" always holds. A row whose semantic draw is EOS
    runs the residual layers with no target: that is exactly the pass §5.4 asks for before a
    stopped timeline continues, done at once so no row is ever left pending.
    """
    codes = targets.clone()
    num_draws = 0 if draw_rows is None else draw_rows.numel()
    h = model.trunk(hidden, rows)
    if not num_draws:
        stopped = torch.zeros(0, dtype=torch.bool, device=hidden.device)
    else:
        draws = sample if isinstance(sample, FrameDraws) else FrameDraws(sample, model.semantic_codebook_size)
        # a frame step's draw rows are its rows, in order: no gather
        every_row = rows.decode_step and num_draws == hidden.shape[0]

        def drawing(x: Tensor) -> Tensor:
            return x if every_row else x[draw_rows]

        stopped = draws.semantic(model.semantic_logits(drawing(hidden), rows.decode_step, draws.float32_logits),
                                 codes, draw_rows)
    for j, layer in enumerate(model.residual_layers):
        h = layer(fuse_codes(model, layer, j, codes[:, j], h, rows.decode_step), rows)
        if num_draws:
            draws.residual(j + 1, layer.codebook_logits(drawing(h), rows.decode_step, draws.float32_logits),
                           codes, draw_rows, stopped)
    return codes, stopped


def fuse(layer: "ResidualLayer", embedding: Tensor, hidden: Tensor, decode: bool = False) -> Tensor:
    """The MTP-style fusion of §5.3 [ours]: fc(concat(norm(e), norm(h_prev))) -> [T, D].

    Kept alone on purpose (MODEL.md §12.1): a real checkpoint may wire this differently.
    A zero embedding (no target) stays exactly zero through its norm.
    """
    return layer.fc(torch.cat([layer.pre_fc_norm_embedding(embedding),
                               layer.pre_fc_norm_hidden(hidden)], dim=-1), decode=decode)


def fuse_codes(model: TowerModel, layer: "ResidualLayer", j: int, codes: Tensor, hidden: Tensor,
               decode: bool = False) -> Tensor:
    """fuse(layer, model.embed_codes(j, codes), hidden); on the GPU path the embedding, both norms
    and the concat are one kernel (kernels.fusion_input: the same values), then fc."""
    if model.batch_invariant or not hidden.is_cuda:
        return fuse(layer, model.embed_codes(j, codes), hidden, decode)
    from services.tower import kernels

    fc_input = kernels.fusion_input(codes, model.codebook_embeddings.weight, j * model.codebook_vocab_size,
                                    hidden, layer.pre_fc_norm_embedding.weight, layer.pre_fc_norm_hidden.weight,
                                    layer.pre_fc_norm_hidden.eps)
    return layer.fc(fc_input, decode=decode)


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------

class TowerLayer(nn.Module):
    """A Qwen3.5 gated-attention layer with a dense SwiGLU MLP (§5.2), pre-norm residual."""

    def __init__(self, cfg, batch_invariant: bool):
        super().__init__()
        self.input_layernorm = RMSNormPlus(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GatedAttention(cfg, batch_invariant)
        self.post_attention_layernorm = RMSNormPlus(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, batch_invariant)

    def forward(self, x: Tensor, rows: RowBatch) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), rows, residual=x)          # x + attention
        return self.mlp(self.post_attention_layernorm(h), residual=h, decode=rows.decode_step)   # h + MLP


class ResidualLayer(TowerLayer):
    """Residual layer j: the fusion's norms and projection, the layer, the head for codebook j+1."""

    def __init__(self, cfg, batch_invariant: bool, head_size: int):
        super().__init__(cfg, batch_invariant)
        d = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNormPlus(d, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNormPlus(d, cfg.rms_norm_eps)
        self.fc = RowLinear(2 * d, d, batch_invariant, "fc")
        self.norm = RMSNormPlus(d, cfg.rms_norm_eps)
        self.head = RowLinear(d, head_size, batch_invariant, "head")

    def codebook_logits(self, h: Tensor, decode: bool = False, float32: bool = True) -> Tensor:
        """l [R, Q_r] float32 (else in the weights' dtype) for codebook j+1 from this layer's
        output h [R, D]."""
        logits = self.head(self.norm(h), decode=decode)
        return logits.float() if float32 else logits


class GatedAttention(nn.Module):
    """§4.4 with the tower's sizes: q/gate projection, q/k RMSNorm+, partial NeoX RoPE, GQA,
    causal attention over the row's own cache slot, sigmoid output gate."""

    def __init__(self, cfg, batch_invariant: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.rope_theta = cfg.rope_theta
        self.batch_invariant = batch_invariant
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = RowLinear(d, 2 * self.num_heads * hd, batch_invariant, "qkv")
        self.k_proj = RowLinear(d, self.num_kv_heads * hd, batch_invariant, "qkv")
        self.v_proj = RowLinear(d, self.num_kv_heads * hd, batch_invariant, "qkv")
        self.o_proj = RowLinear(self.num_heads * hd, d, batch_invariant, "o_proj")
        self.q_norm = RMSNormPlus(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNormPlus(hd, cfg.rms_norm_eps)
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.qkv_weight: Tensor | None = None    # fuse_projections: q, k, v stacked
        self.rope_table: tuple[Tensor, Tensor] | None = None   # cos, sin of every cache position (setup_caches)

    def fuse_projections(self) -> None:
        if self.qkv_weight is None:
            self.qkv_weight = _fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def setup_cache(self, max_sessions: int, max_context: int, dtype, device) -> None:
        shape = (max_sessions, self.num_kv_heads, max_context, self.head_dim)
        self.k_cache = torch.empty(shape, dtype=dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device)

    def forward(self, x: Tensor, rows: RowBatch, residual: Tensor | None = None) -> Tensor:
        """The attention's output [T, D], plus `residual` when given (on the GPU path added in
        o_proj's GEMM epilogue, one rounding)."""
        t = x.shape[0]
        n_q, n_kv = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:  # one GEMM; q, k, v are column views of its output
            qkv = tower_linear(x, self.qkv_weight, kind="qkv", decode=rows.decode_step)
            q_and_gate, k, v = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv], qkv[:, n_q + n_kv:]
        else:
            x = padded_input(x)          # CUDA: q, k and v read one padded copy (invariant.linear_rows)
            q_and_gate, k, v = (p(x, decode=rows.decode_step) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, gate = q_and_gate.view(t, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rows.rotary(self.rotary_dim, self.rope_theta, self.rope_table)
        q = norm_rope(q, self.q_norm, cos, sin)

        # Write first, then attend: rows of one segment then see each other causally.
        gpu_path = not self.batch_invariant and x.is_cuda
        if gpu_path:                     # k's norm, RoPE and both writes in one kernel
            from services.tower import kernels

            kernels.norm_rope_to_cache(k, v, self.k_norm.weight, self.k_norm.eps, cos, sin,
                                       self.k_cache, self.v_cache, rows.slots, rows.positions)
        else:
            self.k_cache[rows.slots, :, rows.positions] = norm_rope(k, self.k_norm, cos, sin)
            self.v_cache[rows.slots, :, rows.positions] = v
        if gpu_path and rows.all_decode:  # decode rows: the output gate in the merge's launch
            o = kernels.decode_attention(q, self.k_cache, self.v_cache, rows.decode_slots,
                                         rows.decode_positions, gate=gate)
        else:
            attend = attend_rowwise if self.batch_invariant else attend_segments
            o = gate_output(attend(q, self.k_cache, self.v_cache, rows), gate)   # [T, H, d]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim), residual, decode=rows.decode_step)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, batch_invariant: bool):
        super().__init__()
        self.gate_proj = RowLinear(hidden_size, intermediate_size, batch_invariant, "gate_up")
        self.up_proj = RowLinear(hidden_size, intermediate_size, batch_invariant, "gate_up")
        self.down_proj = RowLinear(intermediate_size, hidden_size, batch_invariant, "down")
        self.gate_up_weight: Tensor | None = None    # fuse_projections: gate, up stacked

    def fuse_projections(self) -> None:
        if self.gate_up_weight is None:
            self.gate_up_weight = _fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor, residual: Tensor | None = None, decode: bool = False) -> Tensor:
        """down(silu(gate(x)) ⊙ up(x)), plus `residual` when given (on the GPU path in down's GEMM);
        `decode`: a frame step's rows (RowBatch.decode_step)."""
        if self.gate_up_weight is not None and x.dtype == torch.bfloat16:
            from services.backbone.kernels.decode_graph import silu_mul   # one kernel: bf16(silu(g)·u)

            inter = self.gate_proj.weight.shape[0]
            gate_up = tower_linear(x, self.gate_up_weight, kind="gate_up", decode=decode)
            return self.down_proj(silu_mul(gate_up[:, :inter], gate_up[:, inter:]), residual, decode=decode)
        x = padded_input(x)              # CUDA: gate and up read one padded copy
        gate, up = self.gate_proj(x, decode=decode), self.up_proj(x, decode=decode)
        return self.down_proj(F.silu(gate) * up, residual, decode=decode)


class RMSNormPlus(nn.Module):
    """RMSNorm+ (§0): x_hat * (1 + w), statistics and scaling in float32, zero-centred weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:      # one Triton kernel (services/tower/kernels.py); same function
            from services.tower import kernels

            return kernels.rms_norm_plus(x, self.weight, self.eps)
        return rms_norm_plus(x, self.weight, self.eps)


class RowLinear(nn.Linear):
    """A bias-free linear whose batch-invariant mode computes every row as its own
    matrix-vector product (bmm with one row per batch item), so a row's result never depends on
    how many rows share the call. MKL's GEMM picks its kernel by row count, which changes the
    summation order; measured on torch 2.13 CPU: row counts 1, 2, 3, 5, 7, 9 all differ.
    The other mode (the GPU's) is `linear_rows`: on CUDA a GEMM over 128-row pieces, invariant
    too and about as fast as one GEMM; on the CPU the plain product."""

    def __init__(self, in_features: int, out_features: int, batch_invariant: bool, kind: str):
        super().__init__(in_features, out_features, bias=False)
        self.batch_invariant = batch_invariant
        self.kind = kind                 # tower_linear's projection kind (PROJECTIONS)

    def forward(self, x: Tensor, residual: Tensor | None = None, decode: bool = False) -> Tensor:
        """x·Wᵀ, plus `residual` when given: in the GEMM (linear_rows, one rounding) on the GPU
        path, a separate add in the batch-invariant mode (as the layer did before). `decode`: a
        frame step's rows (tower_linear)."""
        if not self.batch_invariant:
            if x.dim() == 2:
                return tower_linear(x, self.weight, residual, kind=self.kind, decode=decode)
            out = F.linear(x, self.weight)
            return out if residual is None else residual + out
        rows = x.shape[0]
        weight_t = self.weight.t()
        out = torch.bmm(x[:, None, :], weight_t.expand(rows, *weight_t.shape)).squeeze(1)
        return out if residual is None else residual + out


def tower_linear(x: Tensor, weight: Tensor, residual: Tensor | None = None, *, kind: str,
                 decode: bool = False) -> Tensor:
    """The GPU path's x·Wᵀ (+ residual, one rounding) for a projection of `kind`: in a frame step
    (`decode`) with bf16 x and weight and the kind in TOWER_DECODE_GEMM, the backbone's choice for
    a decode step (decode_gemm.dense_linear: decode_linear on CUDA unless DRAMA_DECODE_GEMM=cublas);
    else invariant.linear_rows, as prompt steps always (measured on the H200 at frame steps only).
    A row's bits thus depend on its kind and its step's kind, never on the rows beside it."""
    if decode and kind in TOWER_DECODE_GEMM and x.dtype == weight.dtype == torch.bfloat16:
        from services.backbone.kernels.decode_gemm import dense_linear

        return dense_linear(True, x)(x, weight, residual)
    return linear_rows(x, weight, residual)


def _fuse_rows(*linears: nn.Linear) -> Tensor:
    """The linears' weights stacked along the output dim into one tensor; each linear's weight
    becomes a view of its rows (held once)."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------

def gate_output(o: Tensor, gate: Tensor) -> Tensor:
    """§4.4's output gate: o ⊙ bf16(σ(F32 gate)), in o's dtype (kernels.decode_attention(gate=)
    gives these bits in its merge launch)."""
    return o * torch.sigmoid(gate.float()).to(o.dtype)


def rms_norm_plus(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * (mean(x^2) + eps)^(-1/2) * (1 + weight), over the last dim, in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rotary_tables(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, r/2] float32 for the NeoX pairs (i, i + r/2) at the given row positions."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim
    inv_freq = (theta ** -exponents).to(torch.float32)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def norm_rope(x: Tensor, norm: RMSNormPlus, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rotary(norm(x)): the q/k prologue; on CUDA one fused kernel (kernels.norm_rope)."""
    if x.is_cuda:
        from services.tower import kernels

        return kernels.norm_rope(x, norm.weight, norm.eps, cos, sin)
    return apply_rotary(norm(x), cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Partial NeoX RoPE on the first r dims of each head of x [T, heads, d]; the rest pass."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.to(x.dtype)


def attend_rowwise(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: RowBatch) -> Tensor:
    """Causal GQA attention one row at a time, each over exactly positions 0..p of its slot.

    q [T, H, d]; caches [S, K, L, d]; returns [T, H, d]. Elementwise products and sums only, so
    a row's arithmetic depends on nothing but its own position (the batch-invariant path).
    """
    t, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    row = 0
    for slot, first, count in rows.segments:
        for position in range(first, first + count):
            keys = k_cache[slot, :, :position + 1]                                   # [K, P, d]
            values = v_cache[slot, :, :position + 1]
            query = q[row].view(num_kv, group, 1, head_dim)                         # [K, G, 1, d]
            scores = (query * keys[:, None]).sum(dim=-1).float() * scale           # [K, G, P]
            # exp / sum by hand: torch.softmax splits even tiny rows over threads (a barrier
            # per call), which costs milliseconds per row on a busy 2-core machine.
            weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(values.dtype)
            out[row] = (weights[..., None] * values[:, None]).sum(dim=-2).reshape(num_heads, head_dim)
            row += 1
    return out


def attend_segments(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: RowBatch) -> Tensor:
    """The fast path: one fused SDPA call per multi-row segment, and one call for all single-row
    segments (decode rows).

    On CUDA the decode rows go to `kernels.decode_attention`, which reads each row's own
    positions straight from the pool with the lengths on the device: nothing is gathered or
    padded, nothing depends on a host-side length, so it is CUDA-graph safe. (cuDNN's SDPA,
    which torch picks for the masked call, builds a new plan for every key length: 3.7 ms of
    host time per layer per step.) Multi-row segments keep SDPA but never its cuDNN backend.
    Elsewhere the decode rows take one SDPA call, padded to their longest history and masked.
    """
    from services.tower import kernels

    out = torch.empty_like(q)
    row = 0
    for slot, first, count in rows.segments:
        if count > 1:
            length = first + count
            mask = (torch.arange(length, device=q.device)[None, :]
                    <= torch.arange(first, length, device=q.device)[:, None])             # [n, P]
            with _no_cudnn_sdpa(q):
                o = F.scaled_dot_product_attention(
                    q[row:row + count].transpose(0, 1)[None], k_cache[slot, :, :length][None],
                    v_cache[slot, :, :length][None], attn_mask=mask, enable_gqa=True)
            out[row:row + count] = o[0].transpose(0, 1)
        row += count
    if rows.decode_length and kernels.use_triton(q, k_cache):
        if rows.all_decode:
            return kernels.decode_attention(q, k_cache, v_cache, rows.decode_slots, rows.decode_positions)
        out[rows.decode_rows] = kernels.decode_attention(q[rows.decode_rows], k_cache, v_cache,
                                                         rows.decode_slots, rows.decode_positions)
    elif rows.decode_length:
        length = rows.decode_length
        keys = k_cache[rows.decode_slots, :, :length]                                 # [R, K, P, d]
        values = v_cache[rows.decode_slots, :, :length]
        mask = torch.arange(length, device=q.device)[None, :] <= rows.decode_positions[:, None]
        with _no_cudnn_sdpa(q):
            o = F.scaled_dot_product_attention(q[rows.decode_rows][:, :, None], keys, values,
                                               attn_mask=mask[:, None, None, :], enable_gqa=True)
        out[rows.decode_rows] = o[:, :, 0]
    return out


def _no_cudnn_sdpa(q: Tensor):
    """SDPA on CUDA without the cuDNN backend (it re-plans per key length); a no-op elsewhere."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

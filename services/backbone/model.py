"""The Drama 3 backbone: a Qwen3.5-MoE hybrid (Gated DeltaNet + gated attention, MoE in every
layer) over text and audio rows (MODEL.md §4). Outer to inner:

    Backbone                 embed_tokens, layers, final norm, optional lm_head (parity only)
      .embed(token_ids [R], frames [R, N] | None) -> input rows [R, H]              (§4.1)
      .forward_rows(x [R, H], segments, caches)    -> final-norm hidden [R, H], caches advanced
      .forward_tokens(token_ids [T])               -> (hidden [T, H], logits [T, V]) of a fresh sequence
      .allocate_caches(slots, max_context)         -> BackboneCaches (one entry per layer)
    DecoderLayer             h = x + Mixer(RMSNorm⁺(x)); x' = h + MoE(RMSNorm⁺(h))    (§4.2)
    GatedDeltaNet / GatedAttention / SparseMoE    in gated_deltanet.py, attention.py, moe.py

Rows of several sessions run in one call as `Segment`s of a `RowBatch`; row-wise work goes
through `per_row`, which on the exact (CPU) path gives every row the same arithmetic however the
rows were grouped (see layers.py). Three paths, chosen once in __init__:

    exact     CPU default: per-row arithmetic, bit-identical however rows are batched (issue #4)
    batched   plain torch over whole tensors, a loop over sessions for the mixers (reference-speed)
    kernels   CUDA + Triton + BF16 default (issue #7): fused projections, the FP8 MoE, GDN and
              norm kernels of services/backbone/kernels, slot-pool caches updated in place; a
              decode step (one row per session) is one batched forward with no per-session work,
              optionally replayed from a CUDA graph per batch bucket (`decode_graphs`); a prefill
              segment, optionally replayed from CUDA graphs of padded pieces (`prefill_graphs`)

Why prefill graphs: an eager prefill step is host-bound, ~3900 launches and ~150-200 ms of Python
on the H200 whatever its size, which set the time to first audio and, on the prefill lane's thread,
held the GIL against the decode loop. A graphed piece is one launch. What makes a piece capturable
(no host sync, shapes fixed by its bucket): the slot, start and length live in a device tensor; the
attention rows read the pool row by row (the decode kernel, lengths from positions); the GDN runs
one sequence without cu_seqlens, padding rows' gates zeroed so the state passes them unchanged;
the MoE is the decode MoE (no host-built block table); padding rows write their keys and conv
state to the spare slot the decode graphs pad with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from services.common import invariant
from services.common.config import TextConfig
from services.common.grpcutil import env_switch

from .attention import GatedAttention, KVCache
from .gated_deltanet import GatedDeltaNet, GDNCache
from .kernels import HAS_TRITON, decode_gemm
from .kernels import decode_graph as dg
from .kernels import fp8_moe, moe_decode
from .layers import Linear, RowBatch, Segment, StepPlan, Weight, per_row, rms_norm_plus
from .moe import SparseMoE
from .rope import RotaryTable


# Batch sizes with a captured decode graph (decode_graphs); a step runs in the smallest that holds
# it, padding rows computed in full. Steps of 16 rows apart above 64: at 128 streams most steps had
# 65-128 rows, and on the H200 65 rows in the 128-row graph took 20.0 ms against 15.5 for 64
# (session 9, bench/backbone.py --batch 64 65 128), ~0.076 ms per row.
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
# Rows per piece of a captured prefill graph (prefill_graphs). Between 64 and 512 the steps are
# 1.25-1.5x, not 2x: a piece's time grows with its rows past the expert read (~10 ms on the H200
# at any size), ~0.056 ms per row between 128 and 192 rows (18.8 / 22.4 ms with the serving pool);
# a 20-word prompt of ~134 rows (the byte-level test tokenizer) padded to 256 ran 23.8 ms, to 192
# 22.4, and 160 cuts that padding again where most short prompts fall. 768 and 1024: a longer
# prompt (a voice reference of 10-20 s is 450-900 rows) in one piece reads the ~32 GB of experts
# once, where pieces of 512 read them once per piece.
PREFILL_BUCKETS = (16, 32, 64, 96, 128, 160, 192, 256, 384, 512, 768, 1024)
# Piece counts with a prefill graph per bucket, at most PREFILL_GRAPH_ROWS rows in all. Why 1024:
# on the H200 a packed replay costs ~75 µs per row from ~1000 rows on (13.4k rows/s at 1024 and at
# 2048 rows; bench/backbone.py --prefill-sessions), so larger graphs only hold the GPU longer
# against the decode steps; the counts between powers of two cut the padding of a lane step's
# group (10 pieces of 128 rows ran as 16 before).
PREFILL_GRAPH_ROWS = 1024
PREFILL_GRAPH_PIECES = (1, 2, 3, 4, 6, 8, 12, 16)
# Eager runs of a prefill graph's step before its capture (cuda_graphs.capture). One does what a
# capture must not: Triton's compiles and fla's autotuning (by shape), cuBLAS's workspace for the
# capture stream. The start captures ~56 of these graphs, each run costing ~0.1-0.2 s of Python, so
# the second run torch's examples make costs seconds of every start.
PREFILL_CAPTURE_WARMUP = 1


def prefill_cuts(rows: int, buckets: tuple[int, ...] = PREFILL_BUCKETS) -> list[tuple[int, int]]:
    """[(rows, bucket)]: how a prefill segment of `rows` rows runs through the prefill graphs,
    in order: pieces of the largest bucket while more rows are left than it holds, then the rest
    padded to the smallest bucket that holds it (padding < half a bucket above the smallest).
    A function of the segment's length alone, so a session's cut (and with it the bits: GDN chunks
    restart at each piece) never depends on the other sessions of the step (issue #8)."""
    cuts = []
    while rows > buckets[-1]:
        cuts.append((buckets[-1], buckets[-1]))
        rows -= buckets[-1]
    if rows:
        cuts.append((rows, next(b for b in buckets if b >= rows)))
    return cuts


# Rows per dense GEMM call in a prefill graph whose bucket is a multiple of it (else
# invariant.TILE = 128): a 1024-row piece ran each projection as 8 GEMMs of 128 rows, each
# reading the weight (H200, session 9, bench/backbone.py --prefill: 1024 rows 53.4 -> 37.7 ms with
# the 1024-row bucket and GEMMs of 256 rows, 34.5 with one GEMM per 1024-row piece; 256 rows
# 18.9 -> 17.2).
PIECE_GEMM_ROWS = 256


def piece_gemm_rows(bucket: int) -> int:
    """Rows per dense GEMM call in a prefill graph of `bucket` rows per piece. A piece sits at a
    multiple of its graph's bucket, so with the bucket a multiple of this each GEMM holds rows of
    one piece, at their positions in the piece: a row's GEMM shape and position are the same in
    any graph of the same GEMM rows (prefill_groups packs pieces only there). A graph that holds
    one piece only (768, 1024) runs one GEMM of the whole piece."""
    if graph_pieces(bucket) == (1,):
        return bucket
    return PIECE_GEMM_ROWS if bucket % PIECE_GEMM_ROWS == 0 else invariant.TILE


def piece_kernels(bucket: int) -> tuple[int, str]:
    """What a piece's row bits depend on besides its own rows: its dense GEMMs' rows
    (piece_gemm_rows) and its routed experts' MMA (moe_decode.piece_mma). prefill_groups packs a
    piece only into a graph whose bucket gives the same."""
    return piece_gemm_rows(bucket), moe_decode.piece_mma(bucket)


def graph_pieces(bucket: int) -> tuple[int, ...]:
    """The piece counts with a prefill graph of `bucket` rows per piece (at least one piece)."""
    return tuple(n for n in PREFILL_GRAPH_PIECES if n == 1 or n * bucket <= PREFILL_GRAPH_ROWS)


@dataclass(frozen=True)
class DecodeGraph:
    """A decode bucket's graphs and their static tensors (Backbone._decode_graph)."""
    layers: object              # GraphedStep (dg.EagerStep off CUDA): the layers on `rows`
    rows: torch.Tensor          # [bucket, H] the layers' input rows
    index: torch.Tensor         # [2, bucket] slots; positions (a view of `inputs`)
    inputs: torch.Tensor        # int64 [slots | positions | ids | frames] on the device
    host: torch.Tensor          # their pinned host copy (decode_from_ids fills it)
    embedding: object           # GraphedStep: the staged ids' and frames' embedding into `rows`


@dataclass(frozen=True)
class PrefillGroup:
    """One prefill-graph replay: `pieces` = (segment index, first row in the segment, rows) of up
    to `slots` pieces, each padded to `bucket` rows (slots x bucket rows in all)."""
    bucket: int
    slots: int
    pieces: tuple[tuple[int, int, int], ...]


def prefill_groups(lengths: list[int], buckets: tuple[int, ...] = PREFILL_BUCKETS) -> list[PrefillGroup]:
    """The replays that run prefill segments of these lengths, in order. Each segment is cut by
    `prefill_cuts`; round r holds every segment's r-th piece (a segment's pieces run one after
    another), and a round's pieces are packed into graphs, the largest buckets first, each graph
    taking pieces of its first piece's bucket or smaller with the same `piece_kernels` (a piece
    padded further is the same bits, tests/test_prefill_graphs.py). Why pack: a piece
    of any size reads nearly every expert of every layer (~32 GB), so pieces of many sessions in
    one replay share that read."""
    cuts = [prefill_cuts(n, buckets) for n in lengths]
    groups = []
    for r in range(max((len(c) for c in cuts), default=0)):
        todo = sorted(((cuts[i][r][1], i) for i in range(len(cuts)) if r < len(cuts[i])), key=lambda t: (-t[0], t[1]))
        while todo:
            bucket = todo[0][0]
            most = graph_pieces(bucket)[-1]
            members = [t for t in todo if piece_kernels(t[0]) == piece_kernels(bucket)][:most]
            todo = [t for t in todo if t not in members]        # (bucket, segment): each one once
            slots = next(n for n in graph_pieces(bucket) if n >= len(members))
            pieces = tuple((i, sum(n for n, _ in cuts[i][:r]), cuts[i][r][0]) for _, i in members)
            groups.append(PrefillGroup(bucket, slots, pieces))
    return groups


@dataclass(frozen=True)
class AudioSpec:
    """What the backbone needs to embed audio rows (top-level keys of our config.json)."""
    semantic_start_token_id: int
    num_codebooks: int              # N
    codebook_vocab_size: int        # B, rows per codebook in codebook_embeddings
    semantic_codebook_size: int     # Q_s
    residual_codebook_size: int     # Q_r


@dataclass
class BackboneCaches:
    """One cache per layer (GDNCache or KVCache), all preallocated for `slots` sessions."""
    layers: list
    slots: int
    max_context: int
    _reset_views: dict = field(default_factory=dict, repr=False)   # slot -> its state views, made once

    def reset(self, slot: int) -> None:
        """Zero one slot's state in every layer, as one foreach launch over the slot's views: it
        runs on the scheduler's event loop at each admission, where one zero_ per layer tensor
        (~60 launches at full size) held up the session's Started and its prefill."""
        views = self._reset_views.get(slot)
        if views is None:
            views = self._reset_views[slot] = [view for cache in self.layers for view in cache.reset_views(slot)]
        if views:
            torch._foreach_zero_(views)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers for t in c.tensors())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, dtype, device):
        super().__init__()
        self.layer_type = layer_type
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = Weight(cfg.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm = Weight(cfg.hidden_size, dtype=dtype, device=device)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype, device)
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype, device)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = SparseMoE(cfg, dtype, device)

    def forward(self, x, batch: RowBatch, cache, cos, sin):
        if batch.plan is not None:
            return self.forward_kernels(x, batch, cache)
        u = per_row(lambda r: rms_norm_plus(r, self.input_layernorm.weight, self.eps), x, exact=batch.exact)
        if self.layer_type == "linear_attention":
            h = x + self.linear_attn(u, batch, cache)
        else:
            h = x + self.self_attn(u, batch, cache, cos, sin)
        u = per_row(lambda r: rms_norm_plus(r, self.post_attention_layernorm.weight, self.eps), h,
                    exact=batch.exact)
        return h + self.mlp(u, batch.exact)

    def forward_kernels(self, x, batch: RowBatch, cache, u=None, next_norm=None, x_owned: bool = False):
        """The kernel path: residual adds fused into the mixers' out-projection GEMM and the MoE
        combine. u: RMSNorm⁺(x) when the previous layer's combine made it (else computed here);
        next_norm: the gain of the norm that follows this layer; x_owned: x is ours to overwrite
        (the out-projection then adds into it in place: no copy of x per layer). Returns h, or
        (h, RMSNorm⁺(h; next_norm)) with next_norm."""
        if u is None:
            u = dg.rms_norm_plus(x, self.input_layernorm.weight, self.eps)
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        if decode_gemm.enabled(batch.plan.decode, u):
            # a decode step on the dense decode GEMM: the out-projection's launches give the
            # post-attention norm too (decode_gemm's `norm`: in its split reduce's launch)
            h, u = mixer.forward_kernels(u, x, batch, cache, x_owned=x_owned,
                                         post_norm=(self.post_attention_layernorm.weight, self.eps))
            u32 = None
        else:
            h = mixer.forward_kernels(u, x, batch, cache, x_owned=x_owned)
            # padded prefill pieces take the decode MoE too: no host sync (they are graph-captured);
            # the dense decode GEMM (kernels/decode_gemm) is for true decode steps only. Other
            # steps route on cuBLAS's F32 logits, whose input the norm writes in F32 too (no copy).
            widened = not batch.plan.decode
            normed = dg.rms_norm_plus(h, self.post_attention_layernorm.weight, self.eps, widened=widened)
            u, u32 = normed if widened else (normed, None)
        return self.mlp.forward_kernels(u, h, decode=batch.plan.decode or batch.plan.row_mask is not None,
                                        config=batch.plan.moe_config, dense_decode=batch.plan.decode,
                                        gemm_rows=batch.plan.gemm_rows, norm_weight=next_norm, eps=self.eps, u32=u32)


def default_kernels(device, dtype: torch.dtype, exact: bool) -> bool:
    """The kernel path is the default on CUDA with Triton, in BF16, off the exact path."""
    return torch.device(device).type == "cuda" and HAS_TRITON and dtype == torch.bfloat16 and not exact


class Backbone(nn.Module):
    """The backbone stage. `exact=None` picks the exact per-row path on CPU, batched elsewhere;
    `kernels=None` picks the kernel path where `default_kernels` says so (pass it explicitly when
    building on meta). kernels=True on CPU runs the same code through the kernels' torch references
    (tests). `decode_graphs`: replay decode steps from CUDA graphs (kernel path on CUDA only);
    `prefill_graphs`: prefill segments as padded pieces from CUDA graphs (default: with the decode
    graphs unless DRAMA_PREFILL_GRAPHS=0; off CUDA the pieces run eagerly, for tests)."""

    def __init__(self, cfg: TextConfig, audio: AudioSpec | None = None, *, dtype=torch.float32,
                 device="cpu", lm_head: bool = True, exact: bool | None = None, kernels: bool | None = None,
                 decode_graphs: bool = False, prefill_graphs: bool | None = None):
        super().__init__()
        self.config, self.audio, self.dtype = cfg, audio, dtype
        self.exact = (torch.device(device).type == "cpu") if exact is None else exact
        self.kernels = default_kernels(device, dtype, self.exact) if kernels is None else kernels
        if self.kernels and (self.exact or dtype != torch.bfloat16):
            raise ValueError("the kernel path computes in bfloat16 and is not the exact path")
        self.decode_graphs = decode_graphs and self.kernels
        if prefill_graphs is None:     # default: with the decode graphs, unless DRAMA_PREFILL_GRAPHS=0
            prefill_graphs = self.decode_graphs and env_switch("DRAMA_PREFILL_GRAPHS") is not False
        # prefill_graphs=True off CUDA runs the same padded pieces eagerly (tests of their math)
        self.prefill_graphs = prefill_graphs and self.kernels
        # decode steps staged into their graph from the ids (decode_from_ids): on unless
        # DRAMA_DECODE_FROM_IDS=0 (~0.1 ms less host time a step on the H200, docs/perf.md session 16)
        self.decode_from_ids_on = env_switch("DRAMA_DECODE_FROM_IDS") is not False
        self._packed = False
        self._graphs: dict = {}
        # (memory pool, capture stream) of every prefill graph: own ones, because prefill groups
        # replay on the prefill lane's stream while decode graphs replay on the main loop's
        self._prefill_pool = None
        self._decode_stream = None
        self.graph_replays = 0          # decode steps replayed from a graph (tests, logs)
        self.prefill_replays = 0        # prefill groups replayed (from a graph on CUDA; tests, logs)
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, dtype, device) for t in cfg.layer_types)
        self.norm = Weight(cfg.hidden_size, **kw)
        # Parity entry point only: the service never computes logits (§4.8).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, **kw) if lm_head else None
        self.codebook_embeddings = (Weight(audio.num_codebooks * audio.codebook_vocab_size, cfg.hidden_size, **kw)
                                    if audio is not None else None)
        self._rotary = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rotary(self) -> RotaryTable:
        if self._rotary is None:   # built lazily: the module may have been created on meta
            self._rotary = RotaryTable(self.config.rotary_dim, self.config.rope_theta, self.device)
        return self._rotary

    # ----------------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor, frames: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Input rows (§4.1). token_ids int64 [R]; frames int64 [R, N], a row all −1 is a text row.

        Audio row: (embed_tokens[semantic_start + c_0] + Σ_k codebook_embeddings[k·B + c_k]) / √(N+1),
        summed in F32 in that order (elementwise, so each row's bits are its own).
        Ids and codes are assumed valid (the engine checks them first). `out`: [R, H] to write
        the rows into (a decode graph's static input), else a new tensor.
        """
        table = self.embed_tokens.weight
        if self.kernels and dg.use_triton(token_ids, table) and table.dtype == self.dtype and table.is_contiguous():
            spec = self.audio
            return dg.embed_rows(token_ids, frames if frames is not None and frames.numel() else None, table,
                                 self.codebook_embeddings.weight if spec is not None else None,
                                 spec.semantic_start_token_id if spec is not None else 0,
                                 spec.codebook_vocab_size if spec is not None else 0, out=out)
        x = self._embed_torch(token_ids, frames)
        return x if out is None else out.copy_(x)

    def _embed_torch(self, token_ids: torch.Tensor, frames: torch.Tensor | None) -> torch.Tensor:
        table = self.embed_tokens.weight
        x = table[token_ids].float()
        if frames is None or frames.numel() == 0:
            return x.to(self.dtype)
        audio_rows = (frames[:, 0] >= 0).nonzero(as_tuple=True)[0]
        if audio_rows.numel():
            spec, codes = self.audio, frames[audio_rows]
            acc = table[spec.semantic_start_token_id + codes[:, 0]].float()
            cb = self.codebook_embeddings.weight
            for k in range(spec.num_codebooks):
                acc = acc + cb[k * spec.codebook_vocab_size + codes[:, k]].float()
            x[audio_rows] = acc / math.sqrt(spec.num_codebooks + 1)
        return x.to(self.dtype)

    def allocate_caches(self, slots: int, max_context: int) -> BackboneCaches:
        cfg, device = self.config, self.device
        # decode graphs pad a batch to its bucket with rows that write into one spare slot, and
        # padded prefill pieces their padding rows
        pool = slots + 1 if self.decode_graphs or self.prefill_graphs else slots
        layers = [GDNCache.allocate(cfg, pool, self.dtype, device, self.exact, channels_first=self.kernels)
                  if t == "linear_attention" else KVCache.allocate(cfg, pool, max_context, self.dtype, device)
                  for t in cfg.layer_types]
        return BackboneCaches(layers, slots, max_context)

    def prepare(self) -> None:
        """Build the kernel path's load-time layouts (fused projections, stacked FP8 experts) once,
        after the weights are in; a no-op on the other paths or when done."""
        if self.kernels and not self._packed:
            for layer in self.layers:
                (layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn).pack_kernels()
                layer.mlp.pack_kernels()
            self._packed = True

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        """x [R, H] input rows of all segments (in segment order) -> final-norm hidden [R, H].

        Each segment's rows must continue its slot's sequence (segment.start = rows held).
        """
        if self.kernels:
            return self._forward_kernels(x, segments, caches)
        positions = torch.cat([torch.arange(s.start, s.start + s.count) for s in segments]).to(self.device)
        batch = RowBatch(tuple(segments), positions, self.exact)
        cos, sin = self.rotary().lookup(positions)
        for layer, cache in zip(self.layers, caches.layers):
            x = layer(x, batch, cache, cos, sin)
        return per_row(lambda r: rms_norm_plus(r, self.norm.weight, self.config.rms_norm_eps), x,
                       exact=batch.exact)

    # kernel path ------------------------------------------------------------------------------
    def _forward_kernels(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        """One-row segments (decode rows) and longer ones (prefill pieces) always run apart: the
        decode rows through the decode kernels (replayed from the graph of their batch bucket when
        decode graphs are on, see `_decode_rows`), the prefill segments in padded pieces replayed
        from the prefill graphs (`_prefill_graphed`) or else eagerly in one varlen call. Segments
        touch disjoint slots, so the split changes no row's math. Keeping the two apart even
        without graphs is what makes a row's bits independent of the other sessions (issue #8): a
        decode row never goes through the prefill kernels just because another session's prompt
        shares its step. (The scheduler mixes decode rows and prefill pieces in one step whenever
        a session is admitted or a long prompt is cut into pieces while others decode.)"""
        self.prepare()
        singles = [s for s in segments if s.count == 1]
        if len(singles) == len(segments):
            return self._decode_rows(x, segments, caches)
        if not singles and not self.prefill_graphs:
            return self._eager_kernels(x, segments, caches)
        out = torch.empty(x.shape[0], x.shape[1], dtype=self.dtype, device=x.device)
        if singles:
            index = torch.tensor([s.offset for s in singles], dtype=torch.int64).to(x.device)
            out.index_copy_(0, index, self._decode_rows(
                x.index_select(0, index), [Segment(s.slot, s.start, 1, i) for i, s in enumerate(singles)], caches))
        others = [s for s in segments if s.count != 1]
        if self.prefill_graphs:
            self._prefill_graphed(x, others, caches, out)
            return out
        index = torch.cat([torch.arange(s.offset, s.offset + s.count) for s in others]).to(x.device)
        repacked, offset = [], 0
        for s in others:
            repacked.append(Segment(s.slot, s.start, s.count, offset))
            offset += s.count
        out.index_copy_(0, index, self._eager_kernels(x.index_select(0, index), repacked, caches))
        return out

    # prefill graphs ---------------------------------------------------------------------------
    def _prefill_graphed(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches,
                         out: torch.Tensor) -> None:
        """Prefill segments' rows (of x, at their offsets) through padded pieces (prefill_groups),
        each group replayed from the graph of its (bucket, piece slots) (run eagerly off CUDA);
        their final-norm hidden rows go to the same rows of out."""
        for group in prefill_groups([s.count for s in segments], self._prefill_buckets(caches)):
            step, static_x, index = self._prefill_graph(group.bucket, group.slots, caches)
            host = torch.zeros(3, group.slots, dtype=torch.int64)
            host[0] = caches.slots                                   # empty piece slots: the spare slot
            for j, (i, first, rows) in enumerate(group.pieces):
                host[:, j] = torch.tensor([segments[i].slot, segments[i].start + first, rows])
            index.copy_(host)                                        # [slots; starts; rows]
            static_x.zero_()
            view = static_x.view(group.slots, group.bucket, -1)
            for j, (i, first, rows) in enumerate(group.pieces):
                view[j, :rows].copy_(x[segments[i].offset + first:][:rows])
            result = step.replay().view(group.slots, group.bucket, -1)
            for j, (i, first, rows) in enumerate(group.pieces):
                out[segments[i].offset + first:][:rows].copy_(result[j, :rows])
            self.prefill_replays += 1

    def _prefill_buckets(self, caches: BackboneCaches) -> tuple[int, ...]:
        """PREFILL_BUCKETS that fit the pool's context (padding rows take spare-slot positions
        0..bucket−1), at least the smallest."""
        return tuple(b for b in PREFILL_BUCKETS if b <= caches.max_context) or PREFILL_BUCKETS[:1]

    def _piece_plan(self, index: torch.Tensor, bucket: int, caches: BackboneCaches) -> StepPlan:
        """The StepPlan of a group of padded pieces from its device index [3, P] (slot, start, rows
        of each piece slot), built with device ops only (inside the capture, so each replay derives
        it from the index it finds). Piece j's row i is the slot's position start + i; padding rows
        (i >= rows) go to the spare slot at position i (clamped to the pool): their keys are
        written there and their GDN gates zeroed (row_mask). Each piece is a segment of `bucket`
        rows in the GDN front (kernels/gdn.prefill_front), `rows` of them real."""
        slot, start, rows = index[0], index[1], index[2]
        dev = index.device
        i = torch.arange(bucket, dtype=torch.int64, device=dev)
        valid = i < rows[:, None]                                            # [P, bucket]
        row_slots = torch.where(valid, slot[:, None], caches.slots).flatten()
        positions = torch.where(valid, start[:, None] + i, i.clamp(max=caches.max_context - 1)).flatten()
        pieces = torch.arange(index.shape[1], dtype=torch.int64, device=dev)
        return StepPlan(row_slots, positions, slot, None, decode=False, context=caches.max_context,
                        seg_first=pieces * bucket, seg_rows=rows, row_seg=pieces.repeat_interleave(bucket),
                        row_mask=valid.flatten().to(torch.float32), moe_config=moe_decode.piece_config(bucket),
                        gemm_rows=piece_gemm_rows(bucket))

    def _prefill_graph(self, bucket: int, slots: int, caches: BackboneCaches):
        """(step with .replay(), static rows [slots·bucket, H], static index [3, slots]) of a group
        shape, made once per pool: a CUDA graph on CUDA (all share one memory pool and capture
        stream: groups replay one after another, on the lane's stream while decode graphs replay
        on the main loop's), the same function run eagerly elsewhere. The capture, and the warm-up
        runs before it, see empty piece slots only (the spare slot, no rows)."""
        key = ("prefill", bucket, slots, id(caches))
        if key not in self._graphs:
            from .kernels.decode_graph import GraphedStep

            device = self.device
            index = torch.zeros(3, slots, dtype=torch.int64, device=device)
            index[0] = caches.slots
            static_x = torch.zeros(slots * bucket, self.config.hidden_size, dtype=self.dtype, device=device)
            segments = tuple(Segment(caches.slots, 0, bucket, j * bucket) for j in range(slots))

            def piece():
                batch = RowBatch(segments, None, False, self._piece_plan(index, bucket, caches))
                return self._layers_kernels(static_x, batch, caches)

            if device.type == "cuda":
                if self._prefill_pool is None:
                    self._prefill_pool = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
                pool, stream = self._prefill_pool
                step = GraphedStep(piece, pool=pool, stream=stream, warmup=PREFILL_CAPTURE_WARMUP)
            else:
                step = dg.EagerStep(piece)
            self._graphs[key] = (step, static_x, index)
        return self._graphs[key]

    def capture_prefill_graphs(self, caches: BackboneCaches) -> list[int]:
        """Capture the prefill graphs of every (bucket, piece slots) before serving; returns them.
        A no-op without prefill graphs or off CUDA."""
        if not (self.prefill_graphs and self.device.type == "cuda"):
            return []
        self.prepare()
        shapes = [(bucket, slots) for bucket in self._prefill_buckets(caches) for slots in graph_pieces(bucket)]
        with torch.inference_mode():
            for bucket, slots in shapes:
                self._prefill_graph(bucket, slots, caches)
        return shapes

    def _decode_rows(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        """Rows of one-row segments: replayed from a decode graph when graphs are on and a bucket
        holds them, else the same decode kernels eagerly (plan.decode: same math as the graph)."""
        if self.decode_graphs and self._can_graph(x) and len(segments) <= DECODE_BUCKETS[-1]:
            return self._decode_graphed(x, segments, caches)
        return self._eager_kernels(x, segments, caches)

    def _can_graph(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda"

    def _graph_device(self) -> bool:
        """Does this model replay decode graphs on its device (decode_from_ids)? CUDA only."""
        return self.device.type == "cuda"

    def _eager_kernels(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        # Batch invariance: decode attention sizes its splits by `context`, so with padding on an
        # eager step takes the pool length, as a captured graph does, not its own longest row.
        context = caches.max_context if invariant.active(x) else None
        return self._layers_kernels(x, RowBatch(tuple(segments), None, False, self.plan(segments, context)), caches)

    def _layers_kernels(self, x: torch.Tensor, batch: RowBatch, caches: BackboneCaches) -> torch.Tensor:
        # each layer's combine also applies the norm that follows it (the next layer's input norm,
        # the final norm after the last), so a layer hands on (residual, normed residual). The
        # residual a layer receives from the one before is its own to overwrite; the step's input
        # rows (the caller's) are not
        x, u = x.to(self.dtype), None
        for i, (layer, cache) in enumerate(zip(self.layers, caches.layers)):
            last = i + 1 == len(self.layers)
            next_norm = self.norm.weight if last else self.layers[i + 1].input_layernorm.weight
            x, u = layer.forward_kernels(x, batch, cache, u, next_norm, x_owned=i > 0)
        return u

    def plan(self, segments: list[Segment], context: int | None = None) -> StepPlan:
        """The step's index tensors (layers.StepPlan), built on the host and copied in one transfer."""
        counts = [s.count for s in segments]
        decode = all(c == 1 for c in counts)
        parts = [torch.cat([torch.full((s.count,), s.slot, dtype=torch.int64) for s in segments]),
                 torch.cat([torch.arange(s.start, s.start + s.count) for s in segments]),
                 torch.tensor([s.slot for s in segments], dtype=torch.int64),
                 torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)]
        if not decode:    # the GDN front's segment table (kernels/gdn.prefill_front)
            parts += [parts[3][:-1], torch.tensor(counts, dtype=torch.int64),
                      torch.arange(len(segments)).repeat_interleave(torch.tensor(counts))]
        sizes = [p.numel() for p in parts]
        tensors = torch.cat(parts).to(self.device).split(sizes)
        context = max(s.start + s.count for s in segments) if context is None else context
        return StepPlan(*tensors[:4], decode=decode, context=context, **dict(zip(
            ("seg_first", "seg_rows", "row_seg"), tensors[4:])))

    def _decode_graphed(self, x: torch.Tensor, segments: list[Segment], caches: BackboneCaches) -> torch.Tensor:
        """A decode step replayed from the CUDA graph of its batch bucket (captured on first use,
        or ahead of time by `capture_decode_graphs`).

        Static inputs: the rows x and the plan's slots and positions, refreshed before each replay.
        Padding rows use the spare slot caches.slots at position 0 (their outputs are dropped; the
        decode path is row-wise, so they never touch a real row). The capture itself, and the
        warm-up runs before it, see only padding rows, so they change nothing but the spare slot.
        Attention reads each row's keys [0, position] from the pool with the lengths in a tensor
        (kernels/attention.py, splits sized for max_context), so one graph serves every position.
        Returns a view of the graph's output (valid until the next replay)."""
        rows = len(segments)
        bucket = next(b for b in DECODE_BUCKETS if b >= rows)
        graphs = self._decode_graph(bucket, caches)
        pad = caches.slots
        host = torch.tensor([[s.slot for s in segments] + [pad] * (bucket - rows),
                             [s.start for s in segments] + [0] * (bucket - rows)], dtype=torch.int64)
        graphs.index.copy_(host)           # [slots; positions]: plan.row_slots / seg_slots and positions view it
        graphs.rows[:rows].copy_(x)
        graphs.rows[rows:].zero_()
        self.graph_replays += 1
        return graphs.layers.replay()[:rows]

    @torch.inference_mode()       # as forward_rows: the graphs' static tensors are inference tensors
    def decode_from_ids(self, token_ids: torch.Tensor, frames: torch.Tensor | None, segments: list[Segment],
                        caches: BackboneCaches, fill=None) -> torch.Tensor | None:
        """A decode step from its rows' ids on the host (BackboneEngine.step): final-norm hidden
        [R, H] (a view of the graph's output, valid until the next replay), or None when the
        decode graphs do not serve it (a segment of more than one row, graphs off or not on CUDA,
        more rows than the largest bucket): the caller then embeds and calls forward_rows.

        Why: the host work before a replay is GPU idle time, and engine.step measured ~0.5 ms
        above its graph's 2.8 ms at batch 1 on the H200 (session 15). Here the ids, frames, slots
        and positions go to the graph's static inputs in one copy from pinned memory (was three
        pageable copies) and the embedding is written straight into the graph's input rows (was
        a copy and a zeroing launch), and the embedding replays from a graph of its own (its
        Triton launch alone took ~45 µs of host time): the same kernels on the same values as
        embed + forward_rows, so the same bits. Padding rows embed token 0 as a text row (their
        outputs are dropped, their writes go to the spare slot). On unless DRAMA_DECODE_FROM_IDS=0
        (`decode_from_ids_on`): the host's time before the replay went 0.2 -> 0.05 ms on the H200
        (docs/perf.md, session 16). `_graph_device` off CUDA is for tests: the same staging before
        the graph's function run eagerly.

        `fill(ids [R], codes [R, N])`, int64 views of the staged inputs on the device: queued after
        they are staged and before the embedding, to write the rows' ids and codes on the GPU
        (the device hand-off's chained step, BackboneEngine.launch_to_host); token_ids and frames
        then only stand in for them."""
        if not (self.decode_from_ids_on and self.kernels and self.decode_graphs and self._graph_device()
                and 0 < len(segments) <= DECODE_BUCKETS[-1] and all(s.count == 1 for s in segments)):
            return None
        self.prepare()
        rows = len(segments)
        bucket = next(b for b in DECODE_BUCKETS if b >= rows)
        graphs = self._decode_graph(bucket, caches)
        width = 0 if frames is None else frames.shape[1]
        pad = bucket - rows
        # [slots | positions | ids | frames] as one list, one numpy assignment into the pinned
        # buffer (~4 µs at batch 1 where eight slice assignments took ~9)
        staged = ([s.slot for s in segments] + [caches.slots] * pad + [s.start for s in segments] + [0] * pad
                  + token_ids.tolist() + [0] * pad)
        if width:
            staged += frames.reshape(-1).tolist() + [-1] * (pad * width)
        graphs.host.numpy()[:] = staged
        # The step's end syncs its stream (BackboneEngine._step), so the next step never refills `host`
        # while this copy may still read it.
        graphs.inputs.copy_(graphs.host, non_blocking=True)
        if fill is not None:
            fill(graphs.inputs[2 * bucket:2 * bucket + rows],
                 graphs.inputs[3 * bucket:3 * bucket + rows * width].view(rows, width))
        graphs.embedding.replay()              # the embedding of the staged rows into graphs.rows
        self.graph_replays += 1
        return graphs.layers.replay()[:rows]

    def _decode_graph(self, bucket: int, caches: BackboneCaches) -> DecodeGraph:
        """A bucket's DecodeGraph, captured once per pool. The staged inputs are int64
        [slots (bucket) | positions (bucket) | ids (bucket) | frames (bucket·N)] on the device, index
        a view of their first 2·bucket (decode_from_ids fills them all in one copy). The embedding
        graph writes the staged rows' embedding into the static rows: a graph of its own, so the
        layers' graph still serves forward_rows' rows as they come, and its replay costs the host
        ~10 µs where the embedding's Triton launch took ~45 µs (H200, session 16)."""
        key = (bucket, id(caches))
        if key not in self._graphs:
            from .kernels.decode_graph import GraphedStep

            device = self.device
            width = self.audio.num_codebooks if self.audio is not None else 0
            inputs = torch.zeros((3 + width) * bucket, dtype=torch.int64, device=device)
            host = torch.zeros_like(inputs, device="cpu")
            if device.type == "cuda":
                host = host.pin_memory()         # the staged copy is then asynchronous
            index = inputs[:2 * bucket].view(2, bucket)
            index[0] = caches.slots                                   # padding rows: the spare slot
            plan = StepPlan(index[0], index[1], index[0],
                            torch.arange(bucket + 1, dtype=torch.int64, device=device),
                            decode=True, context=caches.max_context)
            static_x = torch.zeros(bucket, self.config.hidden_size, dtype=self.dtype, device=device)
            segments = tuple(Segment(caches.slots, 0, 1, i) for i in range(bucket))
            batch = RowBatch(segments, None, False, plan)
            staged_ids = inputs[2 * bucket:3 * bucket]
            staged_frames = inputs[3 * bucket:].view(bucket, width) if width else None

            def embed():
                return self.embed(staged_ids, staged_frames, out=static_x)

            if device.type == "cuda":
                if self._decode_stream is None:  # one capture stream for the decode graphs (one cuBLAS workspace)
                    self._decode_stream = torch.cuda.Stream(device)
                graph = GraphedStep(lambda: self._layers_kernels(static_x, batch, caches), stream=self._decode_stream)
                # captured after the layers' graph: its warm-up runs see the zeros staged above
                embedding = GraphedStep(embed, stream=self._decode_stream)
            else:                                # tests of the staging (decode_from_ids) off CUDA
                graph = dg.EagerStep(lambda: self._layers_kernels(static_x, batch, caches))
                embedding = dg.EagerStep(embed)
            self._graphs[key] = DecodeGraph(graph, static_x, index, inputs, host, embedding)
        return self._graphs[key]

    def capture_decode_graphs(self, caches: BackboneCaches, max_batch: int) -> list[int]:
        """Capture the decode graphs of every bucket a step of up to max_batch sessions can use
        (before serving, so no request pays a capture); returns the buckets. A no-op without
        decode graphs or off CUDA."""
        if not (self.decode_graphs and self.device.type == "cuda"):
            return []
        self.prepare()
        top = next((b for b in DECODE_BUCKETS if b >= max_batch), DECODE_BUCKETS[-1])
        buckets = [b for b in DECODE_BUCKETS if b <= top]
        with torch.inference_mode():
            for bucket in buckets:
                self._decode_graph(bucket, caches)
        return buckets

    def warm_route_tables(self) -> None:
        """The eager prefill MoE's block-table kernel for every pair count a prompt piece can have
        (kernels/fp8_moe.warm_route_blocks), so no request waits for its compile. Nothing to do
        with prefill graphs: their pieces take the decode MoE, and no prefill runs eagerly."""
        moe = next((layer.mlp for layer in self.layers if getattr(layer.mlp, "fp8_kernels", False)), None)
        if moe is None or self.prefill_graphs:
            return
        with torch.inference_mode():
            fp8_moe.warm_route_blocks(self.device, moe.w_gate_up.shape[0], moe.top_k,
                                      fp8_moe.kernel_config(grouped=False)["BM"])

    @torch.inference_mode()
    def forward_tokens(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Parity entry point: token_ids int64 [T] of a fresh sequence -> (hidden [T, H], logits [T, V])."""
        if self.lm_head is None:
            raise RuntimeError("this Backbone was loaded without lm_head")
        token_ids = token_ids.to(self.device)
        caches = self.allocate_caches(1, max(1, token_ids.shape[0]))
        hidden = self.forward_rows(self.embed(token_ids), [Segment(0, 0, token_ids.shape[0], 0)], caches)
        return hidden, F.linear(hidden, self.lm_head.dense_weight())

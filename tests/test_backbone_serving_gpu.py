"""The backbone as the server runs it (issue #7): decode attention over the slot pool, CUDA-graph
decode steps captured in the warm-up, and mixed decode + prefill steps.

- kernels/attention.py's Triton flash-decoding against the gathered, masked SDPA reference
  (random pools, slots out of order, positions from 0 to the end of the context, the full
  geometry's heads: 16 query heads over 2 KV heads of 256), eager (splits sized by the largest
  position) and graph-style (splits sized by max_context);
- the step's attention launches no cuDNN kernel (cuDNN's SDPA re-plans for every key length);
- an engine-level served sequence (sessions open, prefill in pieces, decode steps, sessions
  joining while others decode, leaving, a slot reused) gives the same hidden rows with decode
  graphs as without, and its decode rows really are replayed from graphs captured in warm_up;
- on CPU: the split of a mixed step (one-row segments to the graph, the rest eager) with the
  graph replaced by the eager kernel path, against the unsplit step; the settings' default.
"""

from __future__ import annotations

import pytest
import torch

from services.backbone.engine import BackboneEngine, cuda_warm_up_plan
from services.backbone.kernels import attention as kattn
from services.backbone.model import AudioSpec
from services.backbone.weights import random_backbone
from test_backbone_gpu import MID, copy_to, cosine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------------------------
# decode attention kernel
# --------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("b,n_q,n_kv,d,slots,max_len,context", [
    (1, 16, 2, 256, 3, 300, 300),         # full geometry, batch 1
    (5, 16, 2, 256, 9, 2100, 2049),       # several splits, one row at the last key
    (64, 4, 2, 64, 70, 200, 200),         # MID heads, a big batch
    (3, 8, 8, 128, 4, 8192, 8192),        # no GQA, the server's max_context
])
def test_decode_attention_matches_sdpa_reference(b, n_q, n_kv, d, slots, max_len, context):
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + d)
    q = torch.randn(b, n_q, d, device="cuda", generator=gen).to(torch.bfloat16)
    k_pool = torch.randn(slots, n_kv, max_len, d, device="cuda", generator=gen).to(torch.bfloat16)
    v_pool = torch.randn(slots, n_kv, max_len, d, device="cuda", generator=gen).to(torch.bfloat16)
    slot = torch.randperm(slots, device="cuda", generator=gen)[:b]
    pos = torch.randint(0, context, (b,), device="cuda", generator=gen)
    pos[0] = context - 1
    if b > 2:
        pos[1] = 0
    ref = kattn.naive_decode_attention(q.float(), k_pool.float(), v_pool.float(), slot, pos, context, d ** -0.5)
    for seen in (int(pos.max()) + 1, max_len):           # eager splits, graph-style splits
        out = kattn.decode_attention(q, k_pool, v_pool, slot, pos, seen, d ** -0.5)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        err = float((out.float() - ref).norm() / ref.norm())
        print(f"decode attention b={b} n_q={n_q} n_kv={n_kv} d={d} context={seen}: rel err {err:.2e}")
        assert err < 1e-2, err


@cuda
def test_attention_launches_no_cudnn():
    """A prefill (from 0 and after it) and an eager decode step of the kernel path: the profiler
    sees no cuDNN kernel or op (torch's default SDPA choice with a mask on the H200)."""
    model = copy_to(random_backbone(MID, device="cpu", seed=5), "cuda", kernels=True)
    engine = BackboneEngine(model, max_sessions=2, max_context=300)
    a, b = engine.open(), engine.open()
    engine.step([(a, torch.arange(70), None)])            # compile outside the profile
    engine.step([(a, torch.arange(1), None), (b, torch.arange(1), None)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step([(b, torch.arange(33), None)])
        engine.step([(a, torch.arange(20), None)])
        engine.step([(a, torch.arange(1), None), (b, torch.arange(1), None)])
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not [n for n in names if "cudnn" in n.lower()], sorted(n for n in names if "cudnn" in n.lower())


# --------------------------------------------------------------------------------------------
# served sequence, graphs vs eager
# --------------------------------------------------------------------------------------------

def split_like_the_graph_path(engine: BackboneEngine):
    """engine.step with each step cut as Backbone._forward_kernels cuts it under decode graphs:
    the one-row entries first as their own step, then the others; rows back in the step's order."""
    def run(work):
        singles = [i for i, w in enumerate(work) if w[1].shape[0] == 1]
        others = [i for i, w in enumerate(work) if w[1].shape[0] != 1]
        out = [None] * len(work)
        for group in (singles, others) if singles and others else (list(range(len(work))),):
            for i, rows in zip(group, engine.step([work[i] for i in group])):
                out[i] = rows
        return out
    return run


def served_sequence(engine: BackboneEngine, seed: int = 7, shrink: int = 1, run=None) -> list[torch.Tensor]:
    """What the scheduler does to an engine: sessions open, prompts in pieces, decode steps (one
    row per decoding session) with new sessions' prefill pieces in the same steps, sessions
    leaving, a freed slot reopened. Returns every hidden row in order. shrink divides the
    prompt pieces (at least 2 rows each, so the steps keep their shape; CPU runs); run replaces
    engine.step."""
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        n = n if n == 1 else max(2, n // shrink)
        return torch.randint(0, vocab, (n,), generator=gen)

    out = []

    def step(work):
        out.extend((run or engine.step)(work))

    a, b = engine.open(), engine.open()
    step([(a, ids(40), None), (b, ids(70), None)])                  # two prompts
    for _ in range(4):
        step([(a, ids(1), None), (b, ids(1), None)])                # decode at batch 2
    c = engine.open()
    step([(a, ids(1), None), (b, ids(1), None), (c, ids(30), None)])   # c joins: mixed step
    step([(a, ids(1), None), (b, ids(1), None), (c, ids(45), None)])   # c's second piece
    for _ in range(5):
        step([(c, ids(1), None), (a, ids(1), None), (b, ids(1), None)])  # batch 3 (bucket 4)
    engine.release(a)                                                 # a leaves
    d = engine.open()                                                 # reuses a's slot
    step([(b, ids(1), None), (d, ids(5), None), (c, ids(1), None)])
    for _ in range(4):
        step([(d, ids(1), None), (b, ids(1), None), (c, ids(1), None)])
    engine.release(b)
    for _ in range(3):
        step([(c, ids(1), None)])                                     # batch 1
    return out


@cuda
def test_served_sequence_graphs_equal_eager_and_replay():
    ref = random_backbone(MID, device="cpu", seed=3)
    eager = copy_to(ref, "cuda", kernels=True)
    # Decode graphs against the same kernels run eagerly: the prompts take the eager varlen path
    # in both engines. Prefill graphs (padded pieces) are other arithmetic for the prompt rows
    # (moe_decode's routing, the router as K-range partials), nearly the same rows within
    # test_prefill_graphs' 0.9995, and their small differences carried through the caches left a
    # late decode row at cosine 0.99987 here (H200, session 16).
    graphed = copy_to(ref, "cuda", kernels=True, decode_graphs=True, prefill_graphs=False)
    engines = [BackboneEngine(m, max_sessions=4, max_context=300) for m in (eager, graphed, eager)]
    assert engines[0].warm_up() == []
    assert engines[1].warm_up() == [1, 2, 4]                        # every bucket a batch of <= 4 uses
    captured = len(graphed._graphs)
    replays = graphed.graph_replays
    plain = torch.cat(served_sequence(engines[0]))                 # mixed steps run whole, eagerly
    rows = torch.cat(served_sequence(engines[1]))
    split = torch.cat(served_sequence(engines[2], run=split_like_the_graph_path(engines[2])))
    assert len(graphed._graphs) == captured                          # nothing captured while serving
    # every step with one-row segments (all but the first, 3 of them mixed): 4 + 2 + 5 + 1 + 4 + 3
    assert graphed.graph_replays - replays == 19
    assert eager.graph_replays == 0
    same_cut, whole = cosine(rows, split), cosine(rows, plain)
    print(f"served sequence, graphs vs eager cut the same way: min cosine {float(same_cut.min()):.7f}; "
          f"vs eager with mixed steps whole: min {float(whole.min()):.7f} median {float(whole.median()):.7f} "
          f"({len(whole)} rows)")
    assert same_cut.min() >= 0.9999, f"min cosine {float(same_cut.min()):.7f}"
    # whole mixed steps run their decode rows through the varlen chunk kernels instead of the
    # recurrent decode kernel: other BF16 roundings, amplified by the FP8 activation quantisation
    # (the same comparison on CPU through the references: min 0.9995)
    assert whole.min() >= 0.998 and whole.median() >= 0.9999, (float(whole.min()), float(whole.median()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_decode_steps_from_ids_equal_embed_then_graph(device, monkeypatch):
    """With decode_from_ids on (the default; DRAMA_DECODE_FROM_IDS=0 turns it off), engine.step's
    decode steps go to the graph from their ids (one staged copy, the embedding's own graph
    writing the graph's input rows);
    the same bits as embedding first and replaying through forward_rows, for text and audio rows,
    at batch 3 (bucket 4, a padding row) and 1, and the graph replays either way. On the CPU both
    models run their decode graphs' functions eagerly (Backbone._graph_device, _can_graph)."""
    audio = AudioSpec(semantic_start_token_id=300, num_codebooks=4, codebook_vocab_size=64,
                      semantic_codebook_size=60, residual_codebook_size=64)
    ref = random_backbone(MID, audio, device="cpu", seed=3)
    models = [copy_to(ref, device, kernels=True, decode_graphs=True) for _ in range(2)]
    assert models[0].decode_from_ids_on                                    # on by default
    models[1].decode_from_ids_on = False
    if device == "cpu":
        monkeypatch.setattr(models[0], "_graph_device", lambda: True)
        monkeypatch.setattr(models[1], "_can_graph", lambda x: True)
    outs = []
    for model in models:
        engine = BackboneEngine(model, max_sessions=4, max_context=100)
        gen = torch.Generator().manual_seed(5)
        slots = [engine.open() for _ in range(3)]
        rows = engine.step([(s, torch.randint(0, 300, (7,), generator=gen), None) for s in slots])
        replays = model.graph_replays
        for step in range(6):
            work = []
            for s in slots[:1] if step >= 4 else slots:
                if (step + s) % 2:              # an audio row: c_0 and the residual codes
                    codes = torch.cat([torch.randint(0, 60, (1, 1), generator=gen),
                                       torch.randint(0, 64, (1, 3), generator=gen)], 1)
                    work.append((s, audio.semantic_start_token_id + codes[:, 0], codes))
                else:
                    work.append((s, torch.randint(0, 300, (1,), generator=gen), None))
            rows += engine.step(work)
        assert model.graph_replays - replays == 6
        outs.append(torch.cat(rows))
    assert torch.equal(outs[0], outs[1])


def test_warm_up_plan_covers_both_routings_and_fits_the_pool():
    plan = cuda_warm_up_plan(3, 8192)
    rows = [sum(n for _, n in step) for step, _ in plan]
    assert any(r * MID.num_experts_per_tok > 1024 for r in rows)     # grouped MoE routing
    assert any(1 < r and r * 8 <= 1024 for r in rows)               # decode routing, several rows
    assert {r % 16 == 0 for r in rows} == {True, False}
    small = cuda_warm_up_plan(2, 50)
    assert all(i < 2 for step, _ in small for i, _ in step)
    held = [0, 0]
    for step, _ in small:
        for i, n in step:
            held[i] += n
    assert max(held) <= 50


# --------------------------------------------------------------------------------------------
# CPU: the mixed-step split, the settings
# --------------------------------------------------------------------------------------------

def test_mixed_step_split_matches_unsplit_step_on_cpu():
    """One-row segments go to the (here: eager stand-in for the) graph, the rest eagerly, and
    the rows come back in the step's order: bit for bit what the same two groups give as two
    engine steps."""
    ref = random_backbone(MID, device="cpu", seed=3)
    whole = copy_to(ref, "cpu", kernels=True)
    # the decode split alone: prefill pieces stay on the eager path (tests/test_prefill_graphs.py
    # covers the prefill graphs beside decode rows)
    split = copy_to(ref, "cpu", kernels=True, decode_graphs=True, prefill_graphs=False)
    calls = []

    def stand_in(x, segments, caches):
        calls.append([s.slot for s in segments])
        return split._eager_kernels(x, segments, caches)

    split._can_graph = lambda x: True
    split._decode_graphed = stand_in
    rows = []
    for model in (whole, split):
        engine = BackboneEngine(model, max_sessions=4, max_context=200)
        run = split_like_the_graph_path(engine) if model is whole else None
        rows.append(torch.cat(served_sequence(engine, seed=11, shrink=10, run=run)))
    assert len(calls) == 19                                          # every step with one-row segments
    assert [len(c) for c in calls].count(2) == 4 + 2 + 1              # 2 decode rows beside a prefill piece too
    assert torch.equal(rows[1], rows[0])


def test_decode_graphs_default_on_for_cuda_only(monkeypatch):
    from services.backbone import __main__ as entry
    from services.backbone.server import Settings, decode_graphs_for

    assert decode_graphs_for(Settings("ckpt", "tower", device="cuda")) is True
    assert decode_graphs_for(Settings("ckpt", "tower", device="cuda:1")) is True
    assert decode_graphs_for(Settings("ckpt", "tower", device="cpu")) is False
    assert decode_graphs_for(Settings("ckpt", "tower", device="cuda", decode_graphs=False)) is False
    monkeypatch.delenv("DRAMA_DECODE_GRAPHS", raising=False)
    assert entry.parse_args(["--checkpoint", "x", "--device", "cuda"]).decode_graphs is None
    monkeypatch.setenv("DRAMA_DECODE_GRAPHS", "0")
    assert entry.parse_args(["--checkpoint", "x", "--device", "cuda"]).decode_graphs is False
    monkeypatch.setenv("DRAMA_DECODE_GRAPHS", "1")
    assert entry.parse_args(["--checkpoint", "x"]).decode_graphs is True



def test_load_overlap_is_on_for_cuda_unless_turned_off(monkeypatch):
    from services.backbone import __main__ as entry
    from services.backbone.server import Settings, load_overlap_for

    assert load_overlap_for(Settings("ckpt", "tower", device="cuda")) is True
    assert load_overlap_for(Settings("ckpt", "tower", device="cpu")) is False
    assert load_overlap_for(Settings("ckpt", "tower", device="cpu", load_overlap=True)) is True
    assert load_overlap_for(Settings("ckpt", "tower", device="cuda", load_overlap=False)) is False
    monkeypatch.setenv("DRAMA_LOAD_OVERLAP", "1")
    settings, _ = entry.parse_args_and_preset(["--checkpoint", "x", "--device", "cuda"])
    assert load_overlap_for(settings) is True
    monkeypatch.setenv("DRAMA_LOAD_OVERLAP", "0")
    settings, _ = entry.parse_args_and_preset(["--checkpoint", "x", "--device", "cuda"])
    assert load_overlap_for(settings) is False

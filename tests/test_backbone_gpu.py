"""The backbone's kernel path (issue #7) against the CPU float32 reference.

The kernel path (`Backbone.kernels`: BF16 activations, §4.7 FP8 experts with dynamic activation
quantisation, fla / Triton GDN, fused norms) runs on CUDA; the reference is the exact CPU path in
float32 with the same weights. Compared: the final-norm hidden rows of a 300-row prompt fed in
pieces (several sessions in one step, slots not in order) and of 20 decode steps of 3 sessions at
different positions, by per-row cosine; and a decode step replayed from a CUDA graph against the
eager one. The same code also runs on CPU through the kernels' torch references (kernels=True on
CPU), which is what CI checks.

Why the bounds are not MODEL-level 0.9999 per row: §4.7 quantises every expert input to e4m3 (3
mantissa bits), so a BF16 input that differs from the F32 one in the last bit moves about one
element in 64 to the next e4m3 value, ~1.5% noise in each expert output, and BF16 rows flip a
router's top-k whenever two experts are within rounding. Measured on the H200 (2026-11-29): MID
rows min 0.9983, median 0.99955 (on CPU through the references: 0.9975 / 0.9995, and 0.9997 /
0.99993 without the activation quantisation); the tiny checkpoint with its top-2-of-8 routers has
rows at 0.85 and medians 0.998-0.9988, with zeroed routers one row at 0.899 (the plain batched
path in BF16, no kernels, has rows at 0.55 and 0.885 there). So: the reference
gets §4.7's activation quantisation too (`quantised_swiglu`, the spec's reference arithmetic; the
CPU path dequantises weights only), MID routes to all its experts (no flips) and is bounded per
row, the tiny checkpoint by the median (zeroed routers, ties: experts 0 and 1 on both sides, also
by a loose per-row bound) and as stored. Wrong slots, positions or states give cosines
far below these bounds.
"""

from __future__ import annotations

import pytest
import torch

from services.backbone import moe
from services.backbone.engine import BackboneEngine
from services.backbone.kernels import fp8_moe
from services.backbone.model import Backbone
from services.backbone.weights import load_backbone, random_backbone
from services.common.config import TextConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A random mid-size config at fla's tested head sizes (d_k = d_v = 128), GQA, partial RoPE, FP8
# experts with a partial 128-block (I = 320), and a router that picks all its experts (no flips).
MID = TextConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 num_experts=8, num_experts_per_tok=8, moe_intermediate_size=320,
                 shared_expert_intermediate_size=128,
                 layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])

PIECES = [0, 1, 64, 65, 130, 257, 300]          # prompt cuts: single rows, chunk-crossing pieces


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double().cpu(), b.double().cpu(), dim=-1)


def copy_to(model: Backbone, device, **kwargs) -> Backbone:
    """The same weights in a new Backbone on `device` (BF16; FP8 and F32 tensors kept as they are)."""
    out = Backbone(model.config, model.audio, dtype=torch.bfloat16, device="meta", lm_head=False,
                   exact=False, **kwargs)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("lm_head."):
            continue
        module_path, _, attr = name.rpartition(".")
        module = out.get_submodule(module_path)
        target = getattr(module, attr)
        dtype = t.dtype if t.dtype == torch.float8_e4m3fn or target is None else target.dtype
        t = t.to(device=device, dtype=dtype, copy=True)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    out.prepare()
    return out.eval()


def quantised_swiglu(x, w_gate, w_up, w_down):
    """moe.swiglu with §4.7's dynamic 1x128 activation quantisation before each expert GEMM (the
    spec's reference arithmetic; the CPU path multiplies dequantised weights only), float32."""
    def fp8_linear(a, w):
        a_q, scale = fp8_moe.quantize_rows_fp8(a)
        return (a_q.float() * scale.repeat_interleave(fp8_moe.GROUP, dim=-1)[..., :a.shape[-1]]) @ w.float().T
    x = x.float()
    return fp8_linear(torch.nn.functional.silu(fp8_linear(x, w_gate)) * fp8_linear(x, w_up), w_down)


def run_both(ref: Backbone, fast: Backbone, seed: int = 0, pieces: list[int] = PIECES, decode_steps: int = 20):
    """Prompt pieces (with a second session's rows in the same steps) then decode steps of 3
    sessions; returns per-row cosines (prompt [300], decode [20·3]) and the fast decode rows."""
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    engines = [BackboneEngine(m, max_sessions=4, max_context=400) for m in (ref, fast)]
    prompt = torch.randint(0, vocab, (pieces[-1],), generator=gen)
    other = torch.randint(0, vocab, (40,), generator=gen)
    tails = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 70)]
    steps = torch.randint(0, vocab, (decode_steps, 3), generator=gen)
    hidden = []
    for engine in engines:
        quantise = engine.model is ref
        saved, moe.swiglu = moe.swiglu, (quantised_swiglu if quantise else moe.swiglu)
        spare = engine.open()                       # slot 0 stays open: the sessions below sit in 1..3
        a, b, c = engine.open(), engine.open(), engine.open()
        engine.release(spare)
        rows = []
        for i, (lo, hi) in enumerate(zip(pieces[:-1], pieces[1:])):
            work = [(b, prompt[lo:hi], None)]
            if i < 2:                               # another session's rows share the first steps
                work.insert(0, (c, other[20 * i:20 * i + 20], None))
            rows.append(engine.step(work)[-1])
        engine.step([(a, tails[0], None), (c, tails[1], None)])
        decode = []
        for t in steps:
            decode += engine.step([(c, t[0:1], None), (a, t[1:2], None), (b, t[2:3], None)])
        moe.swiglu = saved
        hidden.append((torch.cat(rows), torch.stack([d[0] for d in decode])))
    (p_ref, d_ref), (p_fast, d_fast) = hidden
    return cosine(p_fast, p_ref), cosine(d_fast, d_ref), d_fast


def check_mid(device, exact_reference: bool = True, **sizes):
    ref = random_backbone(MID, device="cpu", seed=1, exact=exact_reference)
    fast = copy_to(ref, device, kernels=True)
    assert fast.kernels and not fast.exact
    prompt_cos, decode_cos, _ = run_both(ref, fast, **sizes)
    for what, cos in (("prompt", prompt_cos), ("decode", decode_cos)):
        print(f"mid on {device} {what}: min {float(cos.min()):.6f} median {float(cos.median()):.6f}")
        assert cos.min() >= 0.99, f"{what}: min cosine {float(cos.min()):.6f}"
        assert cos.median() >= 0.999, f"{what}: median cosine {float(cos.median()):.6f}"


def check_tiny(checkpoint, device, zero_routers: bool):
    ref = load_backbone(checkpoint, lm_head=False)
    fast = load_backbone(checkpoint, device=device, dtype=torch.bfloat16, lm_head=False, exact=False, kernels=True)
    if zero_routers:
        for model in (ref, fast):
            for layer in model.layers:
                layer.mlp.gate.weight.zero_()
    prompt_cos, decode_cos, _ = run_both(ref, fast, seed=2)
    for what, cos in (("prompt", prompt_cos), ("decode", decode_cos)):
        print(f"tiny zero_routers={zero_routers} {what}: min {float(cos.min()):.6f} median {float(cos.median()):.6f}")
        if zero_routers:
            # a few tiny-checkpoint rows are ill-conditioned in BF16 whatever the code (H200,
            # 2026-11-29: one prompt row at 0.899, median 0.99916; the BF16 batched path: 0.885)
            assert cos.min() >= 0.85, f"{what}: min cosine {float(cos.min()):.6f}"
            assert cos.median() >= 0.998, f"{what}: median cosine {float(cos.median()):.6f}"
        else:
            assert cos.median() >= 0.995, f"{what}: median cosine {float(cos.median()):.6f}"


# --------------------------------------------------------------------------------------------
# CPU: the kernel path's code through the kernels' torch references
# --------------------------------------------------------------------------------------------

def test_kernel_path_on_cpu_mid_config():
    """Fused projections, slot pools, varlen conv/GDN, per-row attention lengths, FP8 MoE: the
    kernel path's integration, run through the references, agrees with the float32 reference
    (here the batched path, held equal to the exact one by test_backbone_engine, and fewer rows
    than on CUDA: the exact path with per-row quantisation takes minutes on 2 busy cores)."""
    check_mid("cpu", exact_reference=False, pieces=[0, 1, 64, 70], decode_steps=3)


def test_kernel_path_is_the_default_only_on_cuda_bf16(tiny_checkpoint):
    model = load_backbone(tiny_checkpoint, lm_head=False)
    assert model.exact and not model.kernels
    with pytest.raises(ValueError):
        Backbone(MID, dtype=torch.float32, device="meta", exact=False, kernels=True)


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

@cuda
def test_gpu_mid_config_matches_cpu_reference():
    check_mid("cuda")


@cuda
@pytest.mark.parametrize("zero_routers", [True, False], ids=["zero-routers", "as-stored"])
def test_gpu_tiny_checkpoint_matches_cpu_reference(tiny_checkpoint, zero_routers):
    check_tiny(tiny_checkpoint, "cuda", zero_routers)


@cuda
def test_load_backbone_on_cuda_picks_the_kernel_path(tiny_checkpoint):
    model = load_backbone(tiny_checkpoint, device="cuda", dtype=torch.bfloat16, lm_head=False)
    assert model.kernels and not model.exact
    experts = model.layers[0].mlp.experts
    assert experts.gate_proj.dtype == torch.float8_e4m3fn
    assert model.layers[0].mlp.w_gate_up.data_ptr() == experts.gate_proj.data_ptr()   # held once


@cuda
def test_graphed_decode_equals_eager_decode():
    """Decode steps replayed from CUDA graphs (buckets 2 and 4 here, padded rows in the spare
    slot) give the eager kernel path's rows, step after step."""
    ref = random_backbone(MID, device="cpu", seed=3)
    eager = copy_to(ref, "cuda", kernels=True)
    graphed = copy_to(ref, "cuda", kernels=True, decode_graphs=True)
    gen = torch.Generator().manual_seed(4)
    engines = [BackboneEngine(m, max_sessions=4, max_context=200) for m in (eager, graphed)]
    prompts = [torch.randint(0, MID.vocab_size, (n,), generator=gen) for n in (3, 50, 90)]
    steps = torch.randint(0, MID.vocab_size, (12, 3), generator=gen)
    out = []
    for engine in engines:
        slots = [engine.open() for _ in prompts]
        engine.step([(s, p, None) for s, p in zip(slots, prompts)])
        rows = []
        for i, t in enumerate(steps):
            live = slots if i % 3 else slots[:2]           # batch 3 (bucket 4) and batch 2
            rows += engine.step([(s, t[j:j + 1], None) for j, s in enumerate(live)])
        out.append(torch.cat(rows))
    # not bit for bit: the eager step reads keys [0, max position] and runs its GEMMs at 3 rows, the
    # graph reads [0, max_context) and runs them at the bucket's 4
    cos = cosine(out[1], out[0])
    print(f"graphed vs eager decode: min cosine {float(cos.min()):.7f}")
    assert cos.min() >= 0.9999, f"min cosine {float(cos.min()):.7f}"


@cuda
def test_programmatic_dependent_launch_changes_no_bit(monkeypatch):
    """Graphed prefill and decode steps with PDL (kernels.pdl_args: kernels start while the one
    before drains and wait in pdl_prologue) give the same bits as without it, over many steps: a
    kernel reading before its predecessor finished would show as a flipped bit somewhere."""
    from services.backbone import kernels

    ref = random_backbone(MID, device="cpu", seed=5)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, MID.vocab_size, (n,), generator=gen) for n in (7, 40, 130)]
    steps = torch.randint(0, MID.vocab_size, (16, 3), generator=gen)
    out, used = {}, {}
    for pdl in (True, False):
        monkeypatch.setattr(kernels, "PDL", pdl)
        used[pdl] = bool(kernels.pdl_args())
        engine = BackboneEngine(copy_to(ref, "cuda", kernels=True, decode_graphs=True), max_sessions=4,
                                max_context=200)
        slots = [engine.open() for _ in prompts]
        rows = list(engine.step([(s, p, None) for s, p in zip(slots, prompts)]))
        for t in steps:
            rows += engine.step([(s, t[j:j + 1], None) for j, s in enumerate(slots)])
        out[pdl] = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    print(f"PDL used: {used[True]} (a GPU of compute capability 9 or more)")
    assert not used[False]
    assert torch.equal(out[True], out[False])


@cuda
def test_a_graphed_step_filled_from_the_towers_frames_equals_the_step_given_its_rows(tiny_checkpoint):
    """A chained decode step (services/common/device_handoff.py: the tower's frames published
    into the Mailbox, Mailbox.fill writing them into the decode graph's staged inputs) gives the
    bits of the same graph given those rows by the host; a frame that stopped gives a padding
    row, which only its own row sees (the other row's bits stay)."""
    from services.common import device_handoff as dh

    model = load_backbone(tiny_checkpoint, device="cuda", dtype=torch.bfloat16, lm_head=False,
                          decode_graphs=True)
    spec = model.audio
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, spec.semantic_start_token_id, (n,), generator=gen) for n in (9, 17)]
    codes = torch.randint(0, spec.residual_codebook_size, (6, 2, spec.num_codebooks), generator=gen)
    codes[..., 0] = torch.randint(0, spec.semantic_codebook_size, (6, 2), generator=gen)
    box = dh.Mailbox(2, model.config.hidden_size, torch.bfloat16, "cuda", slots=4, code_columns=spec.num_codebooks + 1)
    box.frames_ready = True
    try:
        out = {}
        for chained in (False, True):
            engine = BackboneEngine(model, max_sessions=2, max_context=64)
            slots = [engine.open() for _ in prompts]
            engine.step([(s, p, None) for s, p in zip(slots, prompts)])
            rows = []
            for i, frame in enumerate(codes):
                stop = torch.tensor([[0], [int(i == 4)]])                 # row 1's frame 4 stopped
                ids = spec.semantic_start_token_id + frame[:, 0]
                if not chained:
                    host_ids, host_frames = ids.clone(), frame.clone()
                    host_ids[1], host_frames[1] = (0, -1) if i == 4 else (host_ids[1], host_frames[1])
                    work = [(s, host_ids[j:j + 1], host_frames[j:j + 1]) for j, s in enumerate(slots)]
                    rows.append(engine.finish(engine.launch_to_host(work)).clone())
                    continue
                seq = box.publish(torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16, device="cuda"))
                dh.publish_rows(box.frame_words, box.rows, box.slots, seq,
                                torch.cat([frame, stop], 1).to("cuda"))       # as the tower would
                stand_in = [(s, prompts[0][:1], None) for s in slots]        # text rows: replaced
                fill = lambda ids_, codes_: box.fill(seq, ids_, codes_, spec.semantic_start_token_id,  # noqa: E731
                                                     spec.semantic_codebook_size, spec.residual_codebook_size)
                rows.append(engine.finish(engine.launch_to_host(stand_in, fill=fill)).clone())
                box.answered(seq)
                assert not box.fill_timed_out()
            out[chained] = torch.stack([r.cpu() for r in rows])
        assert model.graph_replays > 0
        assert torch.equal(out[True], out[False])
    finally:
        box.close()

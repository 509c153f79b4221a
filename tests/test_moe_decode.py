"""kernels/moe_decode.py (the decode step's routed FP8 experts) against fp8_moe.naive_moe_fp8.

CUDA only (Triton kernels); skipped without a GPU. On a machine with Triton but no GPU the same
checks can be run in Triton's interpreter: TRITON_INTERPRET=1 python -m pytest tests/test_moe_decode.py
(the kernels then multiply in float32, see moe_decode._dot_args); the comparison with the naive
reference is GPU-only, because the interpreter does not round fp8_moe's split-K reduce (bf16 and
fp8 casts) the way the GPU does.
"""

import os

import pytest
import torch

from services.backbone.kernels import HAS_TRITON, fp8_moe, moe_decode

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON) and not INTERPRET,
                                reason="needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 with Triton)")


@pytest.fixture(autouse=True)
def kernels_in_the_interpreter(monkeypatch):
    """On the CPU route_decode and fp8_moe.router_topk take their torch references; under
    TRITON_INTERPRET=1 make them launch their kernels (in the interpreter) so the tests check those."""
    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(moe_decode, "use_triton", lambda *tensors: True)
        monkeypatch.setattr(fp8_moe, "use_triton", lambda *tensors: True)


def experts(e, i, h, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_gate = (torch.randn(e, i, h, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    w_up = (torch.randn(e, i, h, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s_gate = torch.rand(e, -(-i // 128), -(-h // 128), generator=gen) * 0.02 + 0.01
    s_up = torch.rand(e, -(-i // 128), -(-h // 128), generator=gen) * 0.02 + 0.01
    w_gate_up, s_gate_up = fp8_moe.pack_gate_up(w_gate, s_gate, w_up, s_up)
    w_down = (torch.randn(e, h, i, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s_down = torch.rand(e, -(-h // 128), -(-i // 128), generator=gen) * 0.02 + 0.01
    return [t.to(DEVICE) for t in (w_gate_up, s_gate_up, w_down, s_down)]


def routes(t, e, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 256 if e < 64 else 2048, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(torch.bfloat16)
    return x, ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (3, 8, 3), (20, 4, 2), (33, 16, 4)])
def test_expert_lists(t, e, k):
    _, ids, _ = routes(t, e, k)
    counts, lists, active, num_active = moe_decode.expert_lists(ids, e)
    flat = ids.reshape(-1).cpu()
    assert sorted(active[:int(num_active)].tolist()) == sorted(set(flat.tolist()))
    for expert in range(e):
        pairs = (flat == expert).nonzero().flatten().tolist()
        assert int(counts[expert]) == len(pairs)
        assert lists[expert, :len(pairs)].tolist() == pairs


@pytest.mark.parametrize("h,i,e,k,t", [(256, 256, 8, 2, 1), (256, 128, 8, 3, 5), (128, 256, 4, 2, 20),
                                       (384, 256, 16, 4, 33)])
@pytest.mark.skipif(INTERPRET, reason="the interpreter's bf16/fp8 casts in the split-K reduce differ")
def test_matches_naive(h, i, e, k, t):
    weights = experts(e, i, h)
    x, ids, w = routes(t, e, k)
    # seeded: the threshold below sits ~2x above what an F32 sum-order difference can do through
    # the §4.7 requantisation of h (one FP8 step of one h element); with the global RNG the inputs,
    # and whether a near-tie in that requantisation flips, depended on which tests ran before
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    ref = fp8_moe.naive_moe_fp8(x, ids, w, *weights)
    errors = {}
    for config in (moe_decode.DECODE_CONFIG, dict(moe_decode.DECODE_CONFIG, SPLIT=1, BN_GU=128, BN_DOWN=32),
                   dict(moe_decode.DECODE_CONFIG, FP8_DOT=False), moe_decode.SMALL_PIECE_CONFIG,
                   moe_decode.LARGE_PIECE_CONFIG, moe_decode.WIDE_PIECE_CONFIG):
        got = moe_decode.moe_decode_pairs(x, ids, w, *weights, config=config)
        assert got.shape == (t, k, h)
        diff = got.sum(1) - ref
        errors[str(config)] = (config["BM"] >= 64 and config.get("FP8_DOT", False),
                               float(diff.abs().max() / ref.abs().max()), float(diff.norm() / ref.norm()))
    # The §4.7 requantisation of h happens at the same point in both; only the F32 sums before it
    # differ. The bf16 dot and the per-warp FP8 MMA (BM 16, 32) sum exactly in F32 (H200: 1e-7 of
    # the largest output). The warpgroup MMA (BM 64 with FP8 operands) keeps ~14 bits within a
    # 128-wide K block (moe_decode.WIDE_PIECE_CONFIG): its sums flip some bf16 roundings of gate/up
    # and FP8 roundings of h, each one step of one element (H200: 4.7e-3 of the largest output in
    # bench/moe_decode.py at full size; here an output sums only 128-256 h elements, so one flip
    # weighs more). Bounded apart, still far below what a wrong scale, row or lost K block does (O(1)).
    failing = {name: (worst, overall) for name, (warpgroup, worst, overall) in errors.items()
               if ((worst >= 5e-2 or overall >= 1e-2) if warpgroup else worst >= 1e-3)}
    assert not failing, (failing, errors)


def test_rows_do_not_depend_on_the_batch():
    h, i, e, k, t = 256, 256, 16, 4, 40
    weights = experts(e, i, h)
    x = torch.randn(t, h).to(torch.bfloat16).to(DEVICE)
    _, ids, w = routes(t, e, k)
    together = moe_decode.moe_decode_pairs(x, ids, w, *weights)
    for r in (0, 7, 39):
        alone = moe_decode.moe_decode_pairs(x[r:r + 1], ids[r:r + 1], w[r:r + 1], *weights)
        assert torch.equal(alone, together[r:r + 1])


# route_decode as it was before the keyed top-k and the unrolled GEMV (the same bits)
LOOP_LAYOUT = dict(moe_decode.ROUTER_LAYOUT, UNROLL=False)
ARGMAX = dict(KEYED_TOPK=False)


def bits(x):
    """x as integers of its width: equal bits compare equal, NaN included."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def router_case(t, e, h, seed=2):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    u[0, :128] *= 50.0                                   # one 128-group with a much larger scale
    router = torch.randn(e, h, generator=gen) / h ** 0.5
    return u.to(DEVICE), router.to(DEVICE)


@pytest.mark.parametrize("t,e,h,k", [(1, 256, 2048, 8), (5, 16, 200, 4), (40, 64, 384, 8)])
def test_route_decode_matches_reference(t, e, h, k):
    u, router = router_case(t, e, h)
    got = moe_decode.route_decode(u, router, k)
    ref = moe_decode.route_decode_reference(u, router, k)
    # logits summed in another order: the same experts (no near-ties in these cases), the same
    # renormalised weights up to one bf16 rounding
    assert torch.equal(got.ids, ref.ids)
    torch.testing.assert_close(got.weights.float(), ref.weights.float(), rtol=2 ** -7, atol=0)
    # u's §4.7 quantisation is the reference's, bit for bit (xq on the GPU only: the interpreter's
    # F32 -> e4m3 cast rounds some values just below a power of two down to the one below it)
    assert torch.equal(got.xa, ref.xa)
    assert INTERPRET or torch.equal(got.xq.view(torch.uint8), ref.xq.view(torch.uint8))
    assert int(got.num_active) == (k if t == 1 else 0)       # one row: counted with its expert lists
    # the caller's logits instead of the GEMV: the same routing
    given = moe_decode.route_decode(u, router, k, logits=(u.float() @ router.T).contiguous())
    assert torch.equal(given.ids, ref.ids) and torch.equal(given.xq.view(torch.uint8), got.xq.view(torch.uint8))


@pytest.mark.parametrize("t,e,h,tile,split", [(256, 256, 2048, 256, 8), (96, 64, 384, 32, 4), (48, 16, 200, 16, 8)])
def test_router_partials(t, e, h, tile, split):
    """A piece's router (moe_decode.router_partials): the partials sum, in range order, to the
    float64 logits within F32 rounding; routing on them equals routing on the plain F32 product
    (no near-ties here); a row's partials are the same bits at every position of a tile and in
    every tile (cuBLAS's kernel is one per GEMM shape), and route_decode takes the stack as it is.
    h = 200 with split 8 does not divide: one range."""
    u, router = router_case(t, e, h)
    partials = moe_decode.router_partials(u, router, tile, split)
    ranges = split if h % split == 0 else 1
    assert partials.shape == (ranges, t, e) and partials.dtype == torch.float32
    summed = partials[0].clone()
    for s in range(1, ranges):
        summed += partials[s]
    exact = u.double() @ router.double().T
    torch.testing.assert_close(summed.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())
    got = moe_decode.route_decode(u, router, 8 if e > 16 else 4, logits=partials)
    ref = moe_decode.route_decode(u, router, 8 if e > 16 else 4, logits=(u.float() @ router.T).contiguous())
    assert torch.equal(got.ids, ref.ids)
    torch.testing.assert_close(got.weights.float(), ref.weights.float(), rtol=2 ** -7, atol=0)
    # one row moved to every position of the first tile, and into the last tile: the same bits
    row = u[3:4]
    for pos in sorted({0, 1, tile // 2, tile - 1}) + [t - 1]:
        moved = u.clone()
        moved[pos] = row[0]
        again = moe_decode.router_partials(moved, router, tile, split)
        assert torch.equal(bits(again[:, pos]), bits(partials[:, 3])), pos


@pytest.mark.parametrize("layout,route_config", [(None, None), (LOOP_LAYOUT, ARGMAX)], ids=["default", "today"])
def test_route_decode_rows_do_not_depend_on_the_batch(layout, route_config):
    u, router = router_case(40, 64, 384)
    u[17, 5] = float("nan")                              # a NaN row routes like any other
    together = moe_decode.route_decode(u, router, 8, layout=layout, route_config=route_config)
    assert ((together.ids >= 0) & (together.ids < 64)).all()
    for r in (0, 17, 39):
        alone = moe_decode.route_decode(u[r:r + 1], router, 8, layout=layout, route_config=route_config)
        for a, b in zip(alone[:4], together[:4]):
            assert torch.equal(bits(a), bits(b)[r:r + 1])


def awkward_logits(e, seed=4):
    """Rows that stress the top-k's order: random; exact ties (a coarse grid); every logit equal;
    a NaN; +inf (softmax NaN everywhere); -inf for all but three (k > 3 then picks p = 0 by index);
    a tie across the k-th place."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(e, generator=gen),
            torch.randint(0, 4, (e,), generator=gen).float(),
            torch.full((e,), 0.25),
            torch.randn(e, generator=gen),
            torch.randn(e, generator=gen),
            torch.full((e,), -float("inf")),
            torch.randn(e, generator=gen)]
    rows[3][e // 3] = float("nan")
    rows[4][e - 1] = float("inf")
    rows[5][[1, e // 2, e - 2]] = torch.tensor([0.5, 2.0, 1.0])
    rows[6][[3, 9, e - 1]] = 5.0                 # three equal leaders: with k = 2 the third is out
    rows[6][[4, 7]] = 4.0
    return torch.stack(rows)


@pytest.mark.parametrize("e,k", [(256, 8), (200, 8), (16, 2)])
def test_topk_matches_reference_ids_exactly(e, k):
    """fp8_moe._softmax_topk (one int64 max per pick) gives router_topk_reference's ids on every
    row, ties (lower index first) and NaN rows included, through both kernels that use it; and on
    every non-NaN row the same ids and weight bits as the two-reduction form it replaced."""
    logits = awkward_logits(e).to(DEVICE)
    finite = ~torch.isnan(torch.softmax(logits.float(), -1)).any(-1)
    ref_ids, ref_w = fp8_moe.router_topk_reference(logits, k)
    u = torch.zeros(logits.shape[0], 128, dtype=torch.bfloat16, device=DEVICE)
    router = torch.zeros(e, 128, device=DEVICE)
    keyed = moe_decode.route_decode(u, router, k, logits=logits.contiguous())
    argmax = moe_decode.route_decode(u, router, k, logits=logits.contiguous(), route_config=ARGMAX)
    prefill_ids, prefill_w = fp8_moe.router_topk(logits, k)
    for ids, w in ((keyed.ids, keyed.weights), (prefill_ids, prefill_w)):
        assert torch.equal(ids, ref_ids)
        assert torch.isnan(w[~finite].float()).all()
        # p from the kernel's own exp and division: one bf16 rounding of the reference's (the
        # interpreter's bf16 cast truncates: two)
        torch.testing.assert_close(w[finite].float(), ref_w[finite].float(), rtol=2 ** -7, atol=0)
    assert torch.equal(keyed.ids[finite], argmax.ids[finite])
    assert torch.equal(bits(keyed.weights[finite]), bits(argmax.weights[finite]))
    assert torch.equal(bits(prefill_w[finite]), bits(keyed.weights[finite]))
    # the two-reduction form's NaN rows match no expert (they take E-1 k times), but stay in range
    assert ((argmax.ids >= 0) & (argmax.ids < e)).all()


def test_route_decode_new_launches_equal_today():
    """The unrolled GEMV and the keyed top-k change when loads are issued and how many reductions
    a pick takes, not the arithmetic: every output bit for bit as the loop GEMV with the
    two-reduction top-k (the same num_warps)."""
    h, e, k, t = 384, 64, 8, 9
    u, router = router_case(t, e, h)
    _, _, gate = shared_expert(128, h)
    new = moe_decode.route_decode(u, router, k, shared_gate=gate)
    today = moe_decode.route_decode(u, router, k, shared_gate=gate, layout=LOOP_LAYOUT, route_config=ARGMAX)
    for name, a, b in zip(new._fields, new, today):
        if name in ("lists", "tickets"):         # None: 9 rows
            assert a is None and b is None
            continue
        assert torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("t,e,h,bk", [(1, 256, 2048, 32), (9, 64, 384, 32), (1, 64, 200, 16)])
def test_router_weights_loaded_before_the_wait_give_the_same_bits(t, e, h, bk):
    """The router GEMV's weights loaded before its PDL wait (layout PRELOAD), and the routing
    launch's quantisation and shared gate before its wait (route_config PRELOAD; both
    DRAMA_PDL_PRELOAD): the same steps in the same order, so every output bit for bit as without.
    H 200 in steps of 16: ranges of 16 and a last range past H (zeros)."""
    u, router = router_case(t, e, h)
    _, _, gate = shared_expert(128, h)
    layout = dict(moe_decode.ROUTER_LAYOUT, BK=bk, PRELOAD=False)
    plain = moe_decode.route_decode(u, router, 8, layout=layout, shared_gate=gate, route_config=dict(PRELOAD=False))
    early = moe_decode.route_decode(u, router, 8, layout=dict(layout, PRELOAD=True), shared_gate=gate,
                                    route_config=dict(PRELOAD=True))
    for name, a, b in zip(plain._fields, plain, early):
        if name in ("lists", "tickets"):        # written from ids (partly left unset)
            continue
        assert torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("e,k", [(256, 8), (16, 4), (8, 8)])
def test_one_row_route_writes_the_expert_lists(e, k):
    """A one-row step's routing launch writes expert_lists' output itself (DecodeRoute.lists):
    the same active experts, each with the one pair that picked it; more rows leave it to
    expert_lists."""
    u, router = router_case(1, e, 256)
    route = moe_decode.route_decode(u, router, k)
    assert route.lists is not None and int(route.num_active) == k
    counts, lists, active = route.lists
    want_counts, want_lists, want_active, want_num = moe_decode.expert_lists(route.ids, e)
    assert int(want_num) == k
    assert sorted(active.tolist()) == sorted(want_active[:k].tolist()) == sorted(route.ids[0].tolist())
    for expert in active.tolist():
        assert int(counts[expert]) == int(want_counts[expert]) == 1
        assert int(lists[expert, 0]) == int(want_lists[expert, 0])
    assert moe_decode.route_decode(torch.cat([u, u]), router, k).lists is None


@pytest.mark.skipif(INTERPRET, reason="the interpreter's standalone quantiser rounds some bf16 -> fp8 casts down")
@pytest.mark.parametrize("t", [9, 1])       # 1: the route's own expert lists
def test_moe_decode_pairs_with_route_equals_without(t):
    h, i, e, k = 256, 256, 16, 4
    weights = experts(e, i, h)
    u, router = router_case(t, e, h)
    route = moe_decode.route_decode(u, router, k)
    assert (route.lists is not None) == (t == 1)
    with_route = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route)
    without = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights)
    assert torch.equal(with_route, without)


@pytest.mark.parametrize("i_s,split", [(None, 4), (256, 4), (128, 3), (384, 4)])
def test_reduce_in_gate_up_equals_its_own_launch(i_s, split, monkeypatch):
    """One row: the split reduce done by gate/up's last program per 128-column group
    (DECODE_CONFIG's LAST_REDUCES) gives the bits of the separate reduce launch, without and with
    the shared expert (I_s below, equal to and above I; an odd K split too), and again on the same
    route (the last program zeroes its ticket). The fused calls' new float buffers start as NaN,
    so a reduce that did not run, or ran before every partial sum was in, cannot pass on stale
    memory."""
    h, i, e, k = 256, 256, 16, 4
    weights = experts(e, i, h)
    u, router = router_case(1, e, h)
    gate_up, down, gate = shared_expert(i_s, h) if i_s else (None, None, None)
    shared = (gate_up, down) if i_s else None
    route = moe_decode.route_decode(u, router, k, shared_gate=gate)
    assert route.tickets is not None and moe_decode.DECODE_CONFIG["LAST_REDUCES"]
    config = dict(moe_decode.DECODE_CONFIG, SPLIT=split)
    want = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route, shared=shared,
                                       config=dict(config, LAST_REDUCES=False))
    monkeypatch.setattr(moe_decode, "_split_reduce_shared_kernel", None)      # a launch of either raises
    monkeypatch.setattr(fp8_moe, "_split_reduce_quant_kernel", None)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: nan_filled(empty(*args, **kwargs)))
    for _ in range(2):
        got = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route, shared=shared,
                                          config=config)
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("t,i,i_s", [(1, 512, 256), (1, 200, None), (9, 256, None), (5, 200, 128)])
def test_down_weights_loaded_before_the_wait_give_the_same_bits(t, i, i_s):
    """The down launch's expert weights and scales loaded before its PDL wait (config DOWN_PRELOAD,
    DRAMA_PDL_PRELOAD): the same dots in the same order, so the same bits, with the shared expert
    and without, I of 4 and 2 K blocks (200: the last one partial)."""
    if INTERPRET and t > 1:
        pytest.skip("several rows through the expert lists corrupt the interpreter's heap, old kernels too")
    h, e, k = 256, 16, 4
    weights = experts(e, i, h)
    u, router = router_case(t, e, h)
    gate_up, down, gate = shared_expert(i_s, h) if i_s else (None, None, None)
    route = moe_decode.route_decode(u, router, k, shared_gate=gate)
    runs = [moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route,
                                        shared=(gate_up, down) if i_s else None,
                                        config=dict(moe_decode.DECODE_CONFIG, DOWN_PRELOAD=preload))
            for preload in (False, True)]
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in runs)):
        assert torch.equal(bits(a), bits(b))


def nan_filled(x):
    return x.fill_(float("nan")) if x.is_floating_point() else x


def shared_expert(i_s, h, seed=3):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * i_s, h, generator=gen) / h ** 0.5).to(torch.bfloat16)
    down = (torch.randn(h, i_s, generator=gen) / i_s ** 0.5).to(torch.bfloat16)
    gate = (torch.randn(h, generator=gen) / h ** 0.5).to(torch.bfloat16)
    return gate_up.to(DEVICE), down.to(DEVICE), gate.to(DEVICE)


@pytest.mark.parametrize("h,i,i_s,e,k,t", [(256, 256, 256, 16, 4, 1), (256, 160, 96, 8, 2, 5),
                                           (384, 128, 256, 16, 4, 33)])
def test_shared_expert_in_the_routed_launches(h, i, i_s, e, k, t):
    """moe_decode_pairs(shared=): the routed pairs are bit for bit those without the shared
    expert, the shared expert's output and gate logit follow their torch references."""
    weights = experts(e, i, h)
    u, router = router_case(t, e, h)
    gate_up, down, gate = shared_expert(i_s, h)
    route = moe_decode.route_decode(u, router, k, shared_gate=gate)
    pairs, shared = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route,
                                                shared=(gate_up, down))
    alone = moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights,
                                        route=moe_decode.route_decode(u, router, k))
    assert torch.equal(pairs, alone)
    ref = moe_decode.shared_expert_reference(u, gate_up, down)
    assert shared.shape == (t, h) and shared.dtype == torch.float32
    # F32 sums in another order, so a bf16 rounding of gate, up or h may differ by one ulp (the
    # interpreter's bf16 casts do not round to nearest: a looser bound there)
    assert float((shared - ref).abs().max() / ref.abs().max()) < 2e-2
    assert float((shared - ref).norm() / ref.norm()) < (3e-2 if INTERPRET else 2e-3)
    # against float64 (what the three BF16 GEMMs approximate)
    exact = naive_shared(u, gate_up, down)
    assert float((shared.double() - exact).norm() / exact.norm()) < (3e-2 if INTERPRET else 1e-2)
    want = moe_decode.route_decode_reference(u, router, k, shared_gate=gate).shared_gate_logit
    torch.testing.assert_close(route.shared_gate_logit.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def naive_shared(u, gate_up, down):
    i_s = down.shape[1]
    gu = u.double() @ gate_up.double().T
    g, up = gu[:, :i_s], gu[:, i_s:]
    return (g * torch.sigmoid(g) * up) @ down.double().T


def test_shared_expert_rows_do_not_depend_on_the_batch():
    h, i, i_s, e, k, t = 256, 256, 128, 16, 4, 40
    weights = experts(e, i, h)
    u, router = router_case(t, e, h)
    gate_up, down, gate = shared_expert(i_s, h)

    def run(rows):
        route = moe_decode.route_decode(rows, router, k, shared_gate=gate)
        pairs, shared = moe_decode.moe_decode_pairs(rows, route.ids, route.weights, *weights, route=route,
                                                    shared=(gate_up, down))
        return pairs, shared, route.shared_gate_logit

    together = run(u)
    for r in (0, 17, 39):
        for a, b in zip(run(u[r:r + 1]), together):
            assert torch.equal(a, b[r:r + 1])


def test_warps_and_column_blocks_do_not_change_a_bit():
    """BN, warps, stages and the grid's order (N_FAST) only change which threads compute an
    element and when, never its sums (the tiles' rows and the K split stay): DECODE_CONFIG and its
    BN 64, 2-warp, column-blocks-first variant give the same bits, so either may be tuned without
    touching a row's results (bench/moe_decode.py --shared); so do the 256-row pieces' config and
    the one it replaced (BN_GU 64, slots first)."""
    h, i, i_s, e, k, t = 256, 256, 128, 16, 4, 40
    weights = experts(e, i, h)
    u, router = router_case(t, e, h)
    gate_up, down, gate = shared_expert(i_s, h)
    other = dict(moe_decode.DECODE_CONFIG, BN_GU=64, BN_DOWN=64, num_warps=2, DOWN_WARPS=2, num_stages=2,
                 N_FAST=True)

    def run(config):
        route = moe_decode.route_decode(u, router, k, shared_gate=gate)
        return moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route,
                                           shared=(gate_up, down), config=config)

    for a, b in zip(run(moe_decode.DECODE_CONFIG), run(other)):
        assert torch.equal(a, b)
    piece, before = moe_decode.SMALL_PIECE_CONFIG, dict(moe_decode.SMALL_PIECE_CONFIG, BN_GU=64, N_FAST=False)
    route = moe_decode.route_decode(u, router, k)
    assert torch.equal(moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, config=piece),
                       moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, config=before))


def test_shared_expert_arguments_are_checked():
    h, i, e, k = 256, 256, 8, 2
    weights = experts(e, i, h)
    u, router = router_case(3, e, h)
    gate_up, down, _ = shared_expert(128, h)
    route = moe_decode.route_decode(u, router, k)
    with pytest.raises(ValueError, match="shared expert"):
        moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route,
                                    shared=(gate_up.float(), down))
    with pytest.raises(ValueError, match="shared expert"):
        moe_decode.moe_decode_pairs(u, route.ids, route.weights, *weights, route=route,
                                    shared=(gate_up[:, :128], down))

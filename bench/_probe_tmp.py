"""temporary: router bf16x3 vs F32 SGEMM at 256 rows; MoE piece variants with N_FAST."""
import sys, math
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from bench.moe_decode import layer_weights, do_bench, H, I, E, K
from services.backbone.kernels import moe_decode, fp8_moe
from services.backbone.kernels import decode_graph as dg

def split3(w):
    hi = w.bfloat16(); r = w - hi.float(); lo = r.bfloat16(); lo2 = (r - lo.float()).bfloat16()
    return hi, lo, lo2

def router():
    L = 40
    torch.manual_seed(0)
    ws = [torch.randn(E, H, device="cuda") * 0.02 for _ in range(L)]
    cats = []
    for w in ws:
        hi, lo, lo2 = split3(w)
        assert torch.equal(hi.float() + lo.float() + lo2.float(), w), "split not exact"
        cats.append(torch.cat([hi, lo, lo2], dim=1).contiguous())
    for t in (256, 1024):
        u = torch.randn(t, H, device="cuda").bfloat16()
        u32 = torch.empty(t, H, device="cuda"); u3 = torch.empty(t, 3 * H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(t, E, device="cuda")
        def sgemm():
            for w in ws:
                torch.mm(u32.copy_(u), w.T, out=out)
        def x3():
            for c in cats:
                u3.view(t, 3, H).copy_(u[:, None, :].expand(t, 3, H))
                torch.mm(u3, c.T, out_dtype=torch.float32, out=out)
        def x3_nocopy():
            for c in cats:
                torch.mm(u3, c.T, out_dtype=torch.float32, out=out)
        for name, fn in (("u32 copy + sgemm", sgemm), ("u3 copy + bf16x3 mm", x3), ("bf16x3 mm alone", x3_nocopy)):
            g = dg.GraphedStep(fn)
            print(f"router {t} rows {name}: {do_bench(g.replay)*1e3/L:.2f} us/layer", flush=True)
        ref = u.double() @ ws[0].double().T
        a = torch.mm(u.float(), ws[0].T)
        u3.view(t, 3, H).copy_(u[:, None, :].expand(t, 3, H))
        b = torch.mm(u3, cats[0].T, out_dtype=torch.float32)
        print(f"router {t}: max |err| vs f64: sgemm {(a.double()-ref).abs().max():.3e} bf16x3 {(b.double()-ref).abs().max():.3e}; "
              f"mean {(a.double()-ref).abs().mean():.3e} / {(b.double()-ref).abs().mean():.3e}; max |logit| {ref.abs().max():.2f}", flush=True)
        # top-8 agreement
        ta = torch.topk(torch.softmax(a, -1), 8).indices.sort().values
        tb = torch.topk(torch.softmax(b, -1), 8).indices.sort().values
        print(f"router {t}: rows with the same top-8 sgemm vs bf16x3: {(ta == tb).all(-1).float().mean():.4f}", flush=True)

def moe():
    L = 40
    layers = [layer_weights(i) for i in range(L)]
    t = 256
    x = torch.randn(t, H, device="cuda").bfloat16()
    routes = [fp8_moe.router_topk(torch.randn(t, E, device="cuda"), K) for _ in layers]
    base = dict(moe_decode.SMALL_PIECE_CONFIG)
    ref = moe_decode.moe_decode_pairs(x, *routes[0], *layers[0], config=base)
    nf = dict(base, N_FAST=True, BN_GU=32)
    for cfg in [base, nf, dict(nf, num_stages=2), dict(nf, num_stages=4), dict(nf, num_warps=2),
                dict(nf, num_warps=8), dict(nf, DOWN_WARPS=4), dict(nf, DOWN_STAGES=2), dict(nf, DOWN_STAGES=4),
                dict(nf, BN_DOWN=128, DOWN_WARPS=4), base, nf]:
        def run(cfg=cfg):
            for w, (ids, tw) in zip(layers, routes):
                moe_decode.moe_decode_pairs(x, ids, tw, *w, config=cfg)
        g = dg.GraphedStep(run)
        ms = do_bench(g.replay)
        same = torch.equal(moe_decode.moe_decode_pairs(x, *routes[0], *layers[0], config=cfg), ref)
        print(f"moe 256 rows {cfg}: {ms:.3f} ms/40 layers, bits as served: {same}", flush=True)

router()
moe()

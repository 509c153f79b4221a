"""Backbone prefill and decode step at the real Drama 3 geometry (MODEL.md §11), one table.

    python bench/backbone.py                                full geometry on cuda (BF16, FP8 experts)
    python bench/backbone.py --preset tiny --device cpu     smoke test (add --batch 1 8 --context 64 for seconds)
    python bench/backbone.py --peer                         also transformers' decode step, batch 1
    python bench/backbone.py --out backbone.json            also write the numbers as JSON

Random weights are made on the device (`random_backbone`, no checkpoint, no LM head). Timed
through `BackboneEngine.step_to_host`, i.e. what the server runs per step, host ids in and hidden
rows out on the host: prefill of one session with 256 and 1024 text rows (the first call, then the median of
`--prefill-repeats`), then for each batch size B, B sessions prefilled with `--context` rows and
`--steps` decode steps of one row per session (median and p90 ms, rows/s). `--served-warm-up`
first runs the server's warm-up (BackboneEngine.warm_up) and times it; `--profile-prefill ROWS`
prints profiler tables of one prefill; `--host-phases B` stamps where a decode step's wall time goes
on the host (the host's time before the graph's replay call is GPU idle time). Peak memory is the
device's max allocated bytes during each measurement.
This times the model code of services/backbone as it is: on CUDA in BF16 that is the kernel path
(issue #7); --decode-graphs times each batch size eagerly and then replayed from CUDA graphs (the
first graphed step of each batch bucket captures, so keep --warmup >= 1, or --served-warm-up).

H200, 2026-11-29 21:37 UTC (commit b2d2057: Triton decode attention, decode graphs captured in the
warm-up; the GPU tests ran at the same time on the same machine, so a little noisy):
`python3 bench/backbone.py --preset full --device cuda --prefill 256 1024 --batch 1 8 32 --context 256
--steps 10 --warmup 3 --decode-graphs --served-warm-up --profile-prefill 1024`

    served warm-up 81.2 s (Triton/fla compilation and autotuning, graphs for buckets 1..32)
    prefill 256 rows: first call 166.8 ms, steady 146.4 ms; 1024 rows: 173.0 / 134.2 ms
    decode ms (median), eager / graphed: batch 1 42.5 / 5.41, batch 8 65.2 / 10.0, batch 32 63.8 / 20.5
    prefill 1024 profile: 176 ms host, 66.5 ms device (MoE grouped gate_up 20.4 + down 12.7 ms,
    GEMMs 7.2 ms); fla's ChunkGatedDeltaRuleFunction 41.8 ms of host time over 30 calls, 3079 launches
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.step_settings import SETTINGS, applied  # noqa: E402
from services.backbone.engine import BackboneEngine  # noqa: E402
from services.backbone.model import AudioSpec  # noqa: E402
from services.backbone.weights import random_backbone  # noqa: E402
from services.common.config import DramaConfig  # noqa: E402
from services.common.make_checkpoint import preset_raw  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefill", type=int, nargs="+", default=[256, 1024], help="prefill lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=256, help="rows per session before decoding")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--peer", action="store_true", help="also time transformers at batch 1")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS),
                        help="with --decode-graphs: time the graphed decode step under each kernel setting "
                             "(bench/step_settings.py) in turn, its graphs recaptured, instead of eager then graphed")
    parser.add_argument("--decode-graphs", action="store_true",
                        help="replay decode steps from CUDA graphs (kernel path on CUDA; captured on first use)")
    parser.add_argument("--served-warm-up", action="store_true",
                        help="run BackboneEngine.warm_up first (what the server does before SERVING: compiles "
                             "the step shapes, captures the decode graphs) and report its time")
    parser.add_argument("--profile-prefill", type=int, metavar="ROWS",
                        help="print torch.profiler tables of one prefill of ROWS rows")
    parser.add_argument("--profile-decode", type=int, nargs="+", metavar="BATCH",
                        help="print the top kernels of a decode step at each of these batch sizes (graph replay "
                             "with --decode-graphs): where the step's device time goes, kernel by kernel")
    parser.add_argument("--host-phases", type=int, nargs="+", metavar="BATCH",
                        help="where a decode step's wall time goes on the host at each of these batch sizes: "
                             "stamps around the row check, the embedding, the graph replay call "
                             "and the final wait for the device (host time before the replay is GPU idle time)")
    parser.add_argument("--profile-rows", type=int, default=30, metavar="N",
                        help="rows of each profiler table (the top N kernels or ops)")
    parser.add_argument("--prefill-sessions", type=int, nargs="+", default=[1], metavar="P",
                        help="time each prefill length also with P sessions' prompts in one step (one "
                             "packed prefill-graph replay when they fit one: what a lane step does)")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per length after the first")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on cpu, where the exact "
                        "per-row path is many tiny ops that threads only slow down)")
    parser.add_argument("--max-context", type=int, default=0, metavar="ROWS",
                        help="size the cache pool's context like a server's (DRAMA_MAX_CONTEXT_TOKENS, e.g. 4096)")
    parser.add_argument("--max-sessions", type=int, default=1, metavar="SLOTS",
                        help="cache slots at least (DRAMA_MAX_ROWS of a server, e.g. 128)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _text_rows(n: int, vocab: int, gen: torch.Generator):
    return torch.randint(0, vocab, (n,), generator=gen), None


def bench_prefill(engine, n: int, gen, device, repeats: int = 3, sessions: int = 1) -> dict:
    """`sessions` prompts of n text rows each in one step: the first call at this size (Triton
    compilation for new specialisations included, unless the served warm-up ran), then the
    median of `repeats` more (steady state)."""
    vocab = engine.model.config.vocab_size
    times = []
    _reset_peak(device)
    for _ in range(1 + repeats):
        slots = [engine.open() for _ in range(sessions)]
        work = [(slot, *_text_rows(n, vocab, gen)) for slot in slots]
        _sync(device)
        started = time.perf_counter()
        engine.step_to_host(work)
        _sync(device)
        times.append((time.perf_counter() - started) * 1000)
        for slot in slots:
            engine.release(slot)
    steady = statistics.median(times[1:]) if repeats else times[0]
    return {"rows": n, "sessions": sessions, "first_ms": times[0], "ms": steady,
            "rows_per_s": n * sessions / steady * 1000, "peak_gib": _peak_gib(device)}


def profile_prefill(engine, n: int, gen, device, rows: int = 25) -> str:
    """torch.profiler tables (by device time and by host time) of one steady-state prefill of n rows."""
    vocab = engine.model.config.vocab_size
    slot = engine.open()
    engine.step_to_host([(slot, *_text_rows(n, vocab, gen))])
    engine.release(slot)
    slot = engine.open()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        engine.step_to_host([(slot, *_text_rows(n, vocab, gen))])
        _sync(device)
    engine.release(slot)
    table = prof.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return (table.table(sort_by=sort, row_limit=rows, max_name_column_width=60) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def profile_decode(engine, batch: int, args, gen, device, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler table of `steps` decode steps of `batch` sessions: device time per kernel
    (kernels inside a replayed CUDA graph are traced one by one), kernels per step and the device
    total per step, to compare with the wall time and the bandwidth floor."""
    vocab = engine.model.config.vocab_size
    slots = [engine.open() for _ in range(batch)]
    engine.step_to_host([(s, *_text_rows(args.context, vocab, gen)) for s in slots])
    for _ in range(3):
        engine.step_to_host([(s, *_text_rows(1, vocab, gen)) for s in slots])
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step_to_host([(s, *_text_rows(1, vocab, gen)) for s in slots])
        _sync(device)
    for s in slots:
        engine.release(s)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    count = sum(e.count for e in kernels) / steps
    device_ms = sum(e.self_device_time_total for e in kernels) / steps / 1000
    head = (f"decode step profile, batch {batch}, graphs {engine.model.decode_graphs}: {count:.0f} kernels and "
            f"{device_ms:.2f} ms of kernel time per step")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return head + "\n" + events.table(sort_by=sort, row_limit=rows, max_name_column_width=70)


# host_phases: (label, where the phase starts, where it ends); stamps are "<name>>" on entry and
# "<name><" on exit of the wrapped calls, "step>" / "step<" around engine.step_to_host
HOST_PHASES = (("row check", "check>", "check<"),
               ("embed", "embed>", "embed<"),
               ("step start -> first replay call", "step>", "replay>"),
               ("replay calls", "replay>", "replay<"),       # the embedding's graph, then the layers'
               ("replay -> wait", "replay<", "sync>"),
               ("wait for the device", "sync>", "sync<"),
               ("after the wait", "sync<", "step<"),
               ("the whole step", "step>", "step<"))


def host_phases(engine, batch: int, args, gen, device) -> dict:
    """Median µs per phase of --steps decode steps at `batch` (HOST_PHASES): perf_counter stamps
    at the entry and exit of the engine's row check, the model's embedding, the graph replay call
    and the stream wait, with no synchronisation added. The host's time before the replay call is
    GPU idle time; the wait is the graph's device time less what ran while the host worked. A
    phase a step never reaches (no graph: no replay) is left out."""
    model = engine.model
    stamps: list[tuple[str, float]] = []

    def wrapped(fn, name):
        def call(*a, **k):
            stamps.append((name + ">", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                stamps.append((name + "<", time.perf_counter()))
        return call

    patches = [(engine, "_check_work", "check"), (model, "embed", "embed")]
    for obj, attr, name in patches:
        setattr(obj, attr, wrapped(getattr(obj, attr), name))
    classes = []
    if device.type == "cuda":
        classes = [(torch.cuda.CUDAGraph, "replay", "replay"), (torch.cuda.Stream, "synchronize", "sync")]
    saved_cls = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in classes]
    for cls, attr, name in classes:
        setattr(cls, attr, wrapped(cls.__dict__[attr], name))
    vocab = engine.model.config.vocab_size
    slots = [engine.open() for _ in range(batch)]
    phases: dict[str, list[float]] = {}
    try:
        engine.step_to_host([(s, *_text_rows(args.context, vocab, gen)) for s in slots])
        for step in range(args.warmup + args.steps):
            work = [(s, *_text_rows(1, vocab, gen)) for s in slots]
            _sync(device)
            stamps.clear()
            stamps.append(("step>", time.perf_counter()))
            engine.step_to_host(work)
            stamps.append(("step<", time.perf_counter()))
            if step < args.warmup:
                continue
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            for key, t in stamps:
                first.setdefault(key, t)
                last[key] = t
            for label, start, end in HOST_PHASES:
                if start in first and end in last:
                    phases.setdefault(label, []).append((last[end] if end.endswith("<") else first[end])
                                                        - first[start])
    finally:
        for obj, attr, _ in patches:
            delattr(obj, attr)                # the instance's own wrapper: the class's method again
        for cls, attr, fn in saved_cls:
            setattr(cls, attr, fn)
        for s in slots:
            engine.release(s)
    return {label: statistics.median(times) * 1e6 for label, times in phases.items()}


def bench_decode(engine, batch: int, args, gen, device) -> dict:
    vocab = engine.model.config.vocab_size
    slots = [engine.open() for _ in range(batch)]
    engine.step_to_host([(s, *_text_rows(args.context, vocab, gen)) for s in slots])
    _reset_peak(device)
    times = []
    for step in range(args.warmup + args.steps):
        work = [(s, *_text_rows(1, vocab, gen)) for s in slots]
        _sync(device)
        started = time.perf_counter()
        hidden = engine.step_to_host(work)
        _sync(device)
        if step >= args.warmup:
            times.append((time.perf_counter() - started) * 1000)
        assert hidden.shape[0] == batch
    for s in slots:
        engine.release(s)
    times.sort()
    median = statistics.median(times)
    return {"batch": batch, "median_ms": median, "p90_ms": times[int(0.9 * (len(times) - 1))],
            "rows_per_s": batch / median * 1000, "peak_gib": _peak_gib(device)}


def bench_peer(cfg: DramaConfig, args, device) -> dict:
    """transformers' Qwen3_5MoeForCausalLM (BF16 experts: it has no FP8 path) decode at batch 1."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    raw = cfg.text_config
    text = Qwen3_5MoeTextConfig(
        vocab_size=raw.vocab_size, hidden_size=raw.hidden_size, num_hidden_layers=raw.num_hidden_layers,
        layer_types=raw.layer_types, num_attention_heads=raw.num_attention_heads,
        num_key_value_heads=raw.num_key_value_heads, head_dim=raw.head_dim,
        linear_num_key_heads=raw.linear_num_key_heads, linear_num_value_heads=raw.linear_num_value_heads,
        linear_key_head_dim=raw.linear_key_head_dim, linear_value_head_dim=raw.linear_value_head_dim,
        linear_conv_kernel_dim=raw.linear_conv_kernel_dim, num_experts=raw.num_experts,
        num_experts_per_tok=raw.num_experts_per_tok, moe_intermediate_size=raw.moe_intermediate_size,
        shared_expert_intermediate_size=raw.shared_expert_intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": raw.rope_theta,
                         "partial_rotary_factor": raw.partial_rotary_factor},
        max_position_embeddings=4096)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(text)
    model = model.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1, 1)
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for m in model.modules():
            if hasattr(m, "inv_freq") and hasattr(m, "compute_default_rope_parameters"):
                inv, _ = m.compute_default_rope_parameters(m.config, device)
                m.inv_freq.copy_(inv)
                m.original_inv_freq.copy_(inv)
    _reset_peak(device)
    ids = torch.randint(0, raw.vocab_size, (1, args.context), device=device)
    times = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for step in range(args.warmup + args.steps):
            _sync(device)
            started = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
            _sync(device)
            if step >= args.warmup:
                times.append((time.perf_counter() - started) * 1000)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return {"transformers": transformers.__version__, "batch": 1, "median_ms": statistics.median(times),
            "peak_gib": _peak_gib(device)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    cfg = DramaConfig.from_dict(preset_raw(args.preset))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    audio = AudioSpec(cfg.semantic_start_token_id, cfg.num_codebooks, cfg.codebook_vocab_size,
                      cfg.semantic_codebook_size, cfg.residual_codebook_size)
    started = time.perf_counter()
    model = random_backbone(cfg.text_config, audio, device=device, dtype=dtype, seed=0,
                            decode_graphs=args.decode_graphs)
    build_s = time.perf_counter() - started
    max_context = max(max(args.prefill), args.context + args.warmup + args.steps) + 8
    if args.max_context:        # the serving pool's context (prefill and decode graphs attend over it)
        max_context = max(max_context, args.max_context)
    engine = BackboneEngine(model, max_sessions=max(args.batch + args.prefill_sessions + (args.host_phases or [])
                                                    + [args.max_sessions]),
                            max_context=max_context)
    mem = engine.memory_bytes()
    gen = torch.Generator().manual_seed(0)
    print(f"backbone {args.preset} on {device} ({dtype}, exact rows: {model.exact}, kernels: {model.kernels}, "
          f"decode graphs: {model.decode_graphs}, prefill graphs: {model.prefill_graphs}): "
          f"weights {mem['weights'] / 2**30:.2f} GiB, cache pool {mem['cache'] / 2**30:.2f} GiB "
          f"({engine.max_sessions} x {max_context} rows), built in {build_s:.1f} s")
    results = {"prefill": [], "decode": [], "peer": None}
    if args.served_warm_up:
        started = time.perf_counter()
        buckets = engine.warm_up()
        results["warm_up"] = {"s": time.perf_counter() - started, "graph_buckets": buckets}
        print(f"served warm-up: {results['warm_up']['s']:.1f} s, decode graph buckets {buckets}")
    print(f"{'prefill rows':>12} {'sessions':>8} {'first ms':>10} {'ms':>10} {'rows/s':>10} {'peak GiB':>9}")
    for n in args.prefill:
        for sessions in args.prefill_sessions:
            if sessions > engine.max_sessions:
                continue
            r = bench_prefill(engine, n, gen, device, args.prefill_repeats, sessions)
            results["prefill"].append(r)
            print(f"{n:>12} {sessions:>8} {r['first_ms']:>10.1f} {r['ms']:>10.1f} {r['rows_per_s']:>10.1f} "
                  f"{_fmt(r['peak_gib']):>9}")
    if args.profile_prefill:
        print(profile_prefill(engine, args.profile_prefill, gen, device, rows=args.profile_rows))
    print(f"{'batch':>5} {'graphs':>6} {'median ms':>10} {'p90 ms':>8} {'rows/s':>9} {'peak GiB':>9}   (context {args.context})")
    for batch in args.batch:
        if args.settings and model.decode_graphs:
            for name in args.settings:      # graphed only, each setting's graphs captured afresh
                with applied(name):
                    model._graphs = {key: v for key, v in model._graphs.items() if key[0] == "prefill"}
                    r = bench_decode(engine, batch, args, gen, device)
                r.update(graphs=True, setting=name)
                results["decode"].append(r)
                print(f"{batch:>5} {name:>6} {r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['rows_per_s']:>9.1f} "
                      f"{_fmt(r['peak_gib']):>9}")
            continue
        for graphs in ((False, True) if model.decode_graphs else (False,)):   # eager, then graphed
            model.decode_graphs = graphs
            r = bench_decode(engine, batch, args, gen, device)
            r["graphs"] = graphs
            results["decode"].append(r)
            print(f"{batch:>5} {str(graphs):>6} {r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['rows_per_s']:>9.1f} "
                  f"{_fmt(r['peak_gib']):>9}")
    for batch in args.profile_decode or ():
        print(profile_decode(engine, batch, args, gen, device, rows=args.profile_rows))
    if args.host_phases:
        results["host_phases"] = {}
        model.decode_graphs = bool(args.decode_graphs)
        for batch in args.host_phases:
            phases = results["host_phases"][batch] = host_phases(engine, batch, args, gen, device)
            print(f"host phases of a decode step, batch {batch}, graphs {model.decode_graphs} (median µs): "
                  + ", ".join(f"{label} {us:.0f}" for label, us in phases.items()))
    if args.peer:
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results["peer"] = bench_peer(cfg, args, device)
        print(f"transformers {r['transformers']} decode, batch 1: {r['median_ms']:.2f} ms, peak {_fmt(r['peak_gib'])} GiB")
    if args.out:
        results["meta"] = {"preset": args.preset, "device": str(device), "dtype": str(dtype),
                           "context": args.context, "steps": args.steps, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()

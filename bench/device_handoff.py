"""How fast can two stage processes hand a step to each other on the GPU itself, without their hosts?

    bash bench/with_mps.sh python3 bench/device_handoff.py           (MPS: both processes' kernels run at once)
    python3 bench/device_handoff.py --trips 2000 --rows 1 128

A single stream's frame is backbone step -> tower step -> backbone step ..., and today every hand-off
goes through both hosts: the GPU finishes, a host wakes, bytes cross a socket, the other host wakes
and launches (~0.6 ms of a ~5 ms frame, docs/perf.md). Here two processes (A, the backbone's side,
and B, the tower's) share one small buffer of A's memory through CUDA IPC (torch.multiprocessing
hands B the tensor) and hand rows back and forth with two kernels each, enqueued ahead in CUDA
graphs, no host in the loop:

    A: signal (copy `--rows` x 4 KB into the buffer, then count up flag AB with a release)
       -> wait (spin until flag BA has counted up, acquire, copy the reply out)
    B: wait on AB -> signal BA

Its kernels are not services/common/device_handoff.py's: there the host names each step's number,
here each side keeps its count on the device, so the trips can be captured in CUDA graphs and
replayed without a host launch per trip (a Triton launch from Python takes longer than a trip).

Printed: µs per round trip on the GPU; the same round trip with the hosts in the loop (each side
waits for its kernel, then sends the bytes through a pipe: the floor of today's hand-off without
asyncio or gRPC); and whether a spinning waiter in B slows A's own work (a run of decode GEMMs
with B idle against B spinning beside it). A waiter gives up after `--timeout-ms` and says so:
a peer that dies never hangs the other (without MPS the spinning kernel can hold the GPU from the
peer for a whole time slice, so run it under MPS).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from services.backbone.kernels import HAS_TRITON  # noqa: E402

ROW_WORDS = 1024                 # a 2048-wide bf16 row as int32 words
FLAG_AB, FLAG_BA, SEEN_A, SEEN_B, STATUS = 0, 32, 64, 96, 128     # one 128-byte line each
PAYLOAD = 256                    # words before the payloads

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _signal_kernel(src_ptr, dst_ptr, flag_ptr, N: tl.constexpr):
        """Copy N words src -> dst (one program), then count the flag up with a release at system
        scope: whoever acquires the new count sees the words."""
        offs = tl.arange(0, N)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
        tl.debug_barrier()
        tl.atomic_add(flag_ptr, 1, sem="release", scope="sys")

    @triton.jit
    def _wait_kernel(flag_ptr, seen_ptr, src_ptr, dst_ptr, status_ptr, timeout_ns, N: tl.constexpr):
        """Spin until the flag passes this side's count of what it has seen (acquire), then copy N
        words src -> dst and count one more seen. Past timeout_ns: status += 1, and go on."""
        want = tl.load(seen_ptr) + 1
        start = _now()
        now = start
        count = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        while (count < want) & (now - start < timeout_ns):
            count = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = _now()
        if count < want:
            tl.atomic_add(status_ptr, 1)
        offs = tl.arange(0, N)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, cache_modifier=".cg"))
        tl.store(seen_ptr, want)


def _compile(shared: torch.Tensor, local: torch.Tensor) -> None:
    """Compile both kernels on scratch words (a wait with no time left gives up at once)."""
    scratch = shared[STATUS + 8:]
    _signal_kernel[(1,)](local, local, scratch, N=local.numel())
    _wait_kernel[(1,)](scratch[8:], scratch[16:], local, local, scratch[24:], 0, N=local.numel())
    torch.cuda.synchronize()


def _capture(fn, repeats: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph


def side_b(shared: torch.Tensor, rows: int, trips: int, per_graph: int, timeout_ns: int, ready, start, conn,
           mode: str) -> None:
    """Process B: answer `trips` hand-offs on the GPU (mode "gpu"), through the host ("host"), or
    spin once until A's work is done ("spin"). Sets `ready` once it is only waiting for A."""
    torch.cuda.set_device(shared.device)
    n = rows * ROW_WORDS
    local = torch.zeros(n, dtype=torch.int32, device=shared.device)
    ab = shared[PAYLOAD:PAYLOAD + n]
    ba = shared[PAYLOAD + n:PAYLOAD + 2 * n]
    _compile(shared, local)

    def wait():
        _wait_kernel[(1,)](shared[FLAG_AB:], shared[SEEN_B:], ab, local, shared[STATUS:], timeout_ns, N=n)
    if mode == "gpu":
        def trip():
            wait()
            _signal_kernel[(1,)](local, ba, shared[FLAG_BA:], N=n)
        graph = _capture(trip, per_graph)
        ready.set()
        start.wait()
        for _ in range(trips // per_graph):
            graph.replay()
    elif mode == "host":
        ready.set()
        start.wait()
        for _ in range(trips):
            local.copy_(torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.int32).to(local.device))
            conn.send_bytes(local.cpu().numpy().tobytes())
    else:
        wait()
        ready.set()
    torch.cuda.synchronize()


def run_side_a(shared, rows, trips, per_graph, timeout_ns, mode, work=None) -> float:
    """Start B, do A's part, return µs per round trip (or per run of `work` for mode "spin")."""
    ctx = mp.get_context("spawn")
    ready, start = ctx.Event(), ctx.Event()
    conn_a, conn_b = ctx.Pipe()
    shared.zero_()
    torch.cuda.synchronize()
    proc = ctx.Process(target=side_b, args=(shared, rows, trips, per_graph, timeout_ns, ready, start, conn_b, mode))
    proc.start()
    n = rows * ROW_WORDS
    local = torch.arange(n, dtype=torch.int32, device=shared.device)
    ab = shared[PAYLOAD:PAYLOAD + n]
    ba = shared[PAYLOAD + n:PAYLOAD + 2 * n]
    try:
        _compile(shared, local)
        if not ready.wait(120):
            raise RuntimeError("side B did not get ready")
        if mode == "gpu":
            def trip():
                _signal_kernel[(1,)](local, ab, shared[FLAG_AB:], N=n)
                _wait_kernel[(1,)](shared[FLAG_BA:], shared[SEEN_A:], ba, local, shared[STATUS:], timeout_ns, N=n)
            graph = _capture(trip, per_graph)
            start.set()
            t0 = time.perf_counter()
            for _ in range(trips // per_graph):
                graph.replay()
            torch.cuda.synchronize()
            result = (time.perf_counter() - t0) * 1e6 / (trips // per_graph * per_graph)
        elif mode == "host":
            start.set()
            t0 = time.perf_counter()
            for _ in range(trips):
                conn_a.send_bytes(local.cpu().numpy().tobytes())
                local.copy_(torch.frombuffer(bytearray(conn_a.recv_bytes()), dtype=torch.int32).to(local.device))
            torch.cuda.synchronize()
            result = (time.perf_counter() - t0) * 1e6 / trips
        else:
            result = work()                            # B's spinner is resident
            _signal_kernel[(1,)](local, ab, shared[FLAG_AB:], N=n)          # let it go
            torch.cuda.synchronize()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if int(shared[STATUS].item()):
        raise RuntimeError(f"{int(shared[STATUS].item())} waits timed out ({mode}, {rows} rows)")
    return result


def gemm_work(layers: int = 40) -> callable:
    """A run of decode GEMMs on distinct weights (the backbone's in_proj and out_proj shapes),
    graphed: µs per run, median of 20."""
    from services.backbone.kernels import decode_gemm

    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(layers) for n, k in ((12352, 2048), (2048, 4096))]
    xs = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for k in (2048, 4096)}

    def step():
        for w in weights:
            decode_gemm.decode_linear(xs[w.shape[1]], w)
    step()
    torch.cuda.synchronize()
    graph = _capture(step, 1)

    def timed() -> float:
        reps = []
        for _ in range(20):
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            reps.append((time.perf_counter() - t0) * 1e6)
        return sorted(reps)[len(reps) // 2]
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--per-graph", type=int, default=100)
    parser.add_argument("--host-trips", type=int, default=500)
    parser.add_argument("--timeout-ms", type=float, default=2000.0)
    args = parser.parse_args()
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit("bench/device_handoff.py needs a CUDA GPU and Triton")
    timeout_ns = int(args.timeout_ms * 1e6)
    dev = torch.device("cuda")
    print(f"{'rows':>5}{'GPU hand-off us/round trip':>28}{'through the hosts us':>22}", flush=True)
    for rows in args.rows:
        shared = torch.zeros(PAYLOAD + 2 * rows * ROW_WORDS, dtype=torch.int32, device=dev)
        gpu = run_side_a(shared, rows, args.trips, args.per_graph, timeout_ns, "gpu")
        host = run_side_a(shared, rows, args.host_trips, 1, timeout_ns, "host")
        print(f"{rows:>5}{gpu:>28.2f}{host:>22.2f}", flush=True)
    work = gemm_work()
    alone = work()
    shared = torch.zeros(PAYLOAD + 2 * ROW_WORDS, dtype=torch.int32, device=dev)
    beside = run_side_a(shared, 1, 1, 1, timeout_ns, "spin", work)
    print(f"A's 80 decode GEMMs: {alone:.1f} us alone, {beside:.1f} us with B spinning beside them", flush=True)


if __name__ == "__main__":
    main()

"""What a hop between two stages costs when both sides compute between messages (issue #7).

    python3 bench/hops.py                         the table below, ~20 s
    python3 bench/hops.py --rounds 50 --cases bare compute     (CPU smoke test)

A frame crosses the Tower.Step stream twice (backbone -> tower, tower -> backbone) with a step
computed on each side in between. `bench/timeline.py` cut a served frame at its hand-offs: ~1.5
ms of hops on the H200 (session 20), where a bare grpc.aio ping-pong of the same messages takes
~0.3 ms a round trip. This separates the two: a real grpc.aio server (the Tower service's Step
stream, an echo) in one process and a client in another, the Tower's messages (a 4 KB bf16
hidden row; a 20-byte frame back), each round

    client: `compute` ms, write, read       server: read, `compute` ms, write

and reports per round: wall time - both computes = what the two hops cost. Cases:

    bare        no compute: the transport's floor
    compute     both sides block their event loop thread (the stages' steps run inline on the
                loop and wait for the GPU): busy on the CPU (`--block spin`) or asleep (`sleep`)
    idle        both sides await asyncio.sleep instead (the loop idles; does the wait alone cost?)
    spin-read   as compute, and the client polls its read with asyncio.sleep(0) instead of
                awaiting it (its event loop never sleeps in epoll while a frame is due)
    spin-both   as spin-read, and the server's event loop spins too (services.common.aio.Spinner)
                from a response until the next request arrives
    spin-writes both sides spin from before their write (its completion comes back through
                grpc's poller thread too) until the next message is in: what the stages do
                with DRAMA_SPIN_WAIT_MS (session 22)
    lane-bare, lane-compute, lane-spin
                bare, compute and spin-writes over the same-host lane instead of gRPC: the
                same messages over a Unix socket that each event loop reads itself
                (services/common/local_lane.py), a request of 64 KB or more through the
                connection's shared memory as the stages do (--rows 16 and up)

Each side's compute is what it measured (the server sends its own back in `tower_us`), so an
asyncio.sleep's overshoot counts as compute, not as a hop. Whether the H200 host (16 cores) pays
what the 2-core dev box does for a wait before a message (docs/perf.md, session 21), and whether
spinning while a response is due buys it back, is what this measures there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from drama.tower.v1 import tower_pb2, tower_pb2_grpc  # noqa: E402
from services.common import local_lane  # noqa: E402
from services.common.aio import Spinner  # noqa: E402

CASES = ("bare", "compute", "idle", "spin-read", "spin-both", "spin-writes", "lane-bare", "lane-compute",
         "lane-spin")
# what each lane case does over gRPC
_GRPC_CASE = {"lane-bare": "bare", "lane-compute": "compute", "lane-spin": "spin-writes"}
ROW_BYTES = 4096               # one bf16 hidden row of the full preset (H = 2048)


def block(ms: float, how: str) -> None:
    """Hold this thread for `ms`: busy (a step that polls the GPU) or asleep (one that blocks)."""
    if ms <= 0:
        return
    if how == "sleep":
        time.sleep(ms / 1000)
        return
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def wait_compute(ms: float, case: str, how: str) -> None:
    if case == "idle":
        await asyncio.sleep(ms / 1000)
    elif case != "bare":
        block(ms, how)


class Echo(tower_pb2_grpc.TowerServicer):
    def __init__(self, case: str, compute_ms: float, how: str):
        self.case, self.compute_ms, self.how = case, compute_ms, how

    async def Step(self, request_iterator, context=None):
        spinner = Spinner(max_s=0.05) if self.case in ("spin-both", "spin-writes") else None
        async for request in request_iterator:
            if spinner is not None:
                spinner.stop()
            started = time.perf_counter()
            await wait_compute(self.compute_ms, self.case, self.how)
            took_us = int((time.perf_counter() - started) * 1e6)    # the client subtracts what it took
            if spinner is not None and self.case == "spin-writes":
                spinner.start()
            yield tower_pb2.StepResponse(step_id=request.step_id, codes=b"\0" * 20, stop=[False], tower_us=took_us)
            if spinner is not None:
                spinner.start()


def lane_path(port: int) -> str:
    return f"/tmp/dramaturg-hops-{port}.sock"


async def serve(port: int, case: str, compute_ms: float, how: str) -> None:
    if case in _GRPC_CASE:
        echo = Echo(_GRPC_CASE[case], compute_ms, how)

        async def handle(reader, writer):
            ring = local_lane.Ring(lane_path(port))           # as the tower: large requests come through it
            writer.write(local_lane.encode(tower_pb2.TowerInfo(step_ring=ring.name)))     # the hello
            async for response in echo.Step(local_lane.read_requests(reader, tower_pb2.StepRequest, ring)):
                writer.write(local_lane.encode(response))
            writer.close()
            ring.close()

        await local_lane.serve(lane_path(port), handle)
        print("ready", flush=True)
        await asyncio.Event().wait()
    server = grpc.aio.server()
    tower_pb2_grpc.add_TowerServicer_to_server(Echo(case, compute_ms, how), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def client(port: int, case: str, compute_ms: float, how: str, rounds: int, rows: int = 1) -> list[float]:
    """Per round: wall ms less both sides' compute, as each measured its own (an asyncio.sleep
    overshoots by up to a millisecond: that is the timer's, not the hop's)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if case in _GRPC_CASE:
            call, _ = await local_lane.connect(lane_path(port), tower_pb2.TowerInfo, tower_pb2.StepResponse,
                                               timeout_s=5)
            case = _GRPC_CASE[case]
        else:
            call = tower_pb2_grpc.TowerStub(channel).Step()
        spinner = Spinner(max_s=0.05) if case == "spin-writes" else None
        hidden = b"\1" * (ROW_BYTES * rows)
        overheads = []
        started = time.perf_counter()
        for i in range(rounds + 20):
            computed = time.perf_counter()
            await wait_compute(compute_ms, case, how)
            computed = time.perf_counter() - computed
            if spinner is not None:
                spinner.start()
            await call.write(tower_pb2.StepRequest(step_id=i, hidden=hidden))
            if spinner is not None:
                response = await call.read()
                spinner.stop()
            elif case in ("spin-read", "spin-both"):
                read = asyncio.ensure_future(call.read())
                while not read.done():
                    await asyncio.sleep(0)
                response = read.result()
            else:
                response = await call.read()
            assert response.step_id == i
            now = time.perf_counter()
            if i >= 20:                        # the first rounds open the stream, warm caches
                overheads.append((now - started - computed) * 1000 - response.tower_us / 1000)
            started = now
        call.cancel()
    return overheads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, compute_ms: float, how: str, rounds: int, port: int, rows: int = 1) -> dict:
    """The server in its own process (as the stages are), the client here."""
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--cases", case,
                               "--compute-ms", str(compute_ms), "--block", how],
                              stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the echo server for {case} did not start")
        values = sorted(asyncio.run(client(port, case, compute_ms, how, rounds, rows)))
    finally:
        server.kill()
        server.wait()
    return {"case": case, "compute_ms": 0.0 if case.endswith("bare") else compute_ms, "block": how, "rounds": rounds,
            "rows": rows,
            "median_ms": statistics.median(values), "p90_ms": values[int(0.9 * (len(values) - 1))]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--compute-ms", type=float, default=2.5, help="each side's step between messages")
    parser.add_argument("--block", choices=["spin", "sleep"], default="spin",
                        help="how a blocking step holds its thread (compute, spin-read)")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--rows", type=int, nargs="+", default=[1],
                        help="hidden rows per request (4 KB each): 1 a decode frame; a chunk's prompt of "
                        "the 200-word request is 308 rows")
    parser.add_argument("--port", type=int, default=0, help="the echo servers' first port (0: free ones)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)   # the echo server
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.cases[0], args.compute_ms, args.block))
        return []
    print(f"{'case':>12} {'rows':>5} {'compute ms':>10} {'block':>6} {'hops ms (median)':>17} {'p90':>7}   "
          f"GRPC_POLL_STRATEGY={os.environ.get('GRPC_POLL_STRATEGY', '(default)')}")
    results = []
    cases = [(case, rows) for rows in args.rows for case in args.cases]
    for n, (case, rows) in enumerate(cases):
        r = run_case(case, args.compute_ms, args.block, args.rounds, args.port + n if args.port else free_port(), rows)
        results.append(r)
        print(f"{case:>12} {rows:>5} {r['compute_ms']:>10.1f} {r['block']:>6} {r['median_ms']:>17.3f} "
              f"{r['p90_ms']:>7.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()

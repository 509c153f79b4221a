"""The Step stream's same-host lane (services/common/local_lane.py): the tower's side over a real
Unix socket, and the backbone's TowerClient choosing it or the gRPC stream. Tiny random weights,
CPU."""

from __future__ import annotations

import asyncio
import os
import struct

import grpc
import pytest
import torch

from drama.tower.v1 import tower_pb2, tower_pb2_grpc
from services.backbone.scheduler import TowerEntry, TowerStep
from services.backbone.tower_client import TowerClient
from services.common import grpcutil, local_lane
from services.common.tensors import tensor_to_bytes
from services.tower.engine import TowerEngine
from services.tower.server import serve
from services.tower.weights import random_tower
from test_tower_model import TINY, _prompt
from test_tower_server import N, _codes, _expected_frames, _request, _row, _session_plan

SESSIONS, CONTEXT = 4, 64


class Tower:
    """A tower on port 0 with its lane at `socket`, torn down on exit."""

    def __init__(self, socket: str):
        self.socket = socket

    async def __aenter__(self):
        self.server, self.port, _, self.servicer = await serve(
            None, port=0, max_sessions=SESSIONS, max_context=CONTEXT, step_socket=self.socket,
            model=random_tower(TINY, seed=7), cfg=TINY)
        self.addr = f"127.0.0.1:{self.port}"
        self.channel = grpcutil.create_channel(self.addr, traced=False)
        self.stub = tower_pb2_grpc.TowerStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        self.servicer.close_lane()
        await self.server.stop(None)
        self.servicer.worker.shutdown(wait=True)

    async def info(self) -> tower_pb2.TowerInfo:
        return await self.stub.GetInfo(tower_pb2.GetInfoRequest())

    async def connect(self):
        return await local_lane.connect(self.socket, tower_pb2.TowerInfo, tower_pb2.StepResponse, timeout_s=5)


@pytest.fixture
def socket_path(tmp_path):
    return str(tmp_path / "lane" / "tower.sock")     # a directory serve() has to make


async def _wait_open_sessions(tower: Tower, want: int) -> int:
    for _ in range(250):
        if (got := (await tower.info()).open_sessions) == want:
            return got
        await asyncio.sleep(0.02)
    return got


async def test_the_lane_serves_the_engines_frames_and_names_its_tower(socket_path):
    async with Tower(socket_path) as tower:
        info = await tower.info()
        assert info.step_socket == socket_path and len(info.instance_id) == 32
        assert os.stat(os.path.dirname(socket_path)).st_mode & 0o777 == 0o700   # made private
        call, hello = await tower.connect()
        assert hello.instance_id == info.instance_id and hello.hidden_dim == 64
        hidden, targets = _prompt(TINY, 24, seed=9)
        plan = _session_plan("s", hidden, targets[:18], [10, 8], frames=5)
        frames = []
        for step_id, (rows, h, t) in enumerate(plan, start=1):
            await call.write(_request(step_id, rows, h, t))
            response = await call.read()
            assert response.step_id == step_id and not response.row_errors and response.tower_us > 0
            if rows[-1].draw:
                frames.append(_codes(response, 1)[0].tolist())
        assert frames == _expected_frames(plan)
        assert (await tower.info()).open_sessions == 1
        call.cancel()                                   # a closed connection frees its sessions
        assert await _wait_open_sessions(tower, 0) == 0


async def test_a_broken_message_ends_only_its_connection(socket_path):
    async with Tower(socket_path) as tower:
        keep, _ = await tower.connect()
        await keep.write(_request(1, [_row("keep", 0, 2)], torch.randn(2, 64), torch.full((2, N), -1)))
        await keep.read()
        for bad in (struct.pack("<I", local_lane.DEFAULT_LIMIT_BYTES + 1),     # over the limit
                    struct.pack("<I", 5) + b"\xff" * 5,                         # not a StepRequest
                    struct.pack("<II", local_lane.RING_FLAG | 10, local_lane.RING_BYTES),  # outside the ring
                    struct.pack("<I", 100) + b"\0" * 10):                       # cut off
            reader, writer = await asyncio.open_unix_connection(socket_path)
            assert await local_lane.read_message(reader, tower_pb2.TowerInfo) is not None   # the hello
            writer.write(bad)
            if bad.endswith(b"\0" * 10):
                writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b""              # the tower hung up
            writer.close()
        # the other connection and its session go on
        await keep.write(_request(2, [_row("keep", 2, 1, draw=True)], torch.randn(1, 64), torch.full((1, N), -1)))
        response = await keep.read()
        assert response.step_id == 2 and not response.row_errors
        assert (await tower.info()).open_sessions == 1
        keep.cancel()


async def test_a_device_handoff_is_declined_off_the_gpu_and_its_requests_fail_cleanly(socket_path, monkeypatch):
    """On the CPU the tower offers no device hand-off (no device_uuid in the hello) and answers a
    set-up request handoff_ready=False; a request whose rows are said to be in GPU memory fails
    its entries INVALID_ARGUMENT, and the connection and its sessions go on."""
    monkeypatch.setenv("DRAMA_DEVICE_HANDOFF", "1")      # asked for, but there is no GPU
    async with Tower(socket_path) as tower:
        call, hello = await tower.connect()
        assert hello.device_uuid == ""
        await call.write(tower_pb2.StepRequest(step_id=1, handoff_handle=b"\1" * 64, handoff_rows=4,
                                               handoff_slots=4, handoff_code_columns=11))
        response = await call.read()
        assert response.step_id == 1 and not response.handoff_ready and not response.codes
        assert not response.handoff_frames_ready
        await call.write(_request(2, [_row("s", 0, 2)], torch.randn(2, 64), torch.full((2, N), -1)))
        assert not (await call.read()).row_errors
        handed = tower_pb2.StepRequest(step_id=3, rows=[_row("s", 2, 1, draw=True)], handoff_seq=1,
                                       targets=tensor_to_bytes(torch.full((1, N), -1, dtype=torch.int16)))
        await call.write(handed)
        response = await call.read()
        assert response.step_id == 3 and [e.code for e in response.row_errors] == [
            grpc.StatusCode.INVALID_ARGUMENT.value[0]]
        assert "without a device hand-off" in response.row_errors[0].message
        await call.write(_request(4, [_row("s", 2, 1, draw=True)], torch.randn(1, 64), torch.full((1, N), -1)))
        response = await call.read()
        assert response.step_id == 4 and not response.row_errors and _codes(response, 1)[0, 0] >= 0
        call.cancel()


async def test_requests_through_the_ring_give_the_engines_frames(socket_path, monkeypatch):
    """Every request through the connection's shared memory (RING_MIN_BYTES 0), in a ring so small
    that the places wrap around: the same frames as over the socket. The ring's file is gone from
    the socket's directory once the first request has arrived; the tower's GetInfo names no ring."""
    monkeypatch.setattr(local_lane, "RING_MIN_BYTES", 0)
    monkeypatch.setattr(local_lane, "RING_BYTES", 4096)
    async with Tower(socket_path) as tower:
        assert (await tower.info()).step_ring == ""
        call, hello = await tower.connect()
        ring_file = os.path.join(os.path.dirname(socket_path), hello.step_ring)
        assert hello.step_ring.startswith("tower.sock.ring-") and os.path.exists(ring_file)
        assert os.stat(ring_file).st_blocks * 512 >= 4096        # its space reserved, not a sparse file
        assert call.ring is not None and len(call.ring) == 4096
        hidden, targets = _prompt(TINY, 24, seed=9)
        plan = _session_plan("s", hidden, targets[:18], [10, 8], frames=5)
        frames, sizes = [], []
        for step_id, (rows, h, t) in enumerate(plan, start=1):
            request = _request(step_id, rows, h, t)
            sizes.append(request.ByteSize())
            await call.write(request)
            response = await call.read()
            assert not os.path.exists(ring_file)
            assert response.step_id == step_id and not response.row_errors
            if rows[-1].draw:
                frames.append(_codes(response, 1)[0].tolist())
        assert frames == _expected_frames(plan)
        assert call.ring_messages == len(plan) and sum(sizes) > 4096      # every one, wrapping
        call.cancel()
        assert await _wait_open_sessions(tower, 0) == 0


def test_ring_places_follow_the_unanswered_requests():
    """A request's place in the ring is after the unanswered ones, wraps to the start when the end
    is taken, and is refused (the request goes through the socket) while nothing fits."""
    call = local_lane.LaneCall(None, None, tower_pb2.StepResponse, ring=bytearray(100))

    def place(size):
        got = call._place(size)
        if got is not None:
            call._placed.append(got)
        return got

    def answer():
        call._placed.popleft()

    assert place(40) == (0, 40) and place(40) == (40, 80)
    assert place(30) is None and place(101) is None
    answer()                                    # [0, 40) is free again
    assert place(30) == (0, 30) and place(10) == (30, 40)
    assert place(5) is None                     # [40, 80) is still unanswered
    answer()
    assert place(5) == (40, 45)


async def test_a_ring_the_backbone_cannot_map_leaves_the_requests_on_the_socket(socket_path, tmp_path,
                                                                             monkeypatch):
    """map_ring opens only a regular file beside the socket, named as the tower names its rings;
    otherwise (or when it is gone) the call has no ring and its requests cross the socket."""
    monkeypatch.setattr(local_lane, "RING_MIN_BYTES", 0)
    async with Tower(socket_path) as tower:
        directory = os.path.dirname(socket_path)
        outside = tmp_path / "tower.sock.ring-outside"
        outside.write_bytes(b"\0" * local_lane.RING_MIN_BYTES)
        os.symlink(outside, os.path.join(directory, "tower.sock.ring-link"))
        for name in ("", "../tower.sock.ring-outside", "other.sock.ring-x", "tower.sock.ring-link",
                     "tower.sock.ring-missing"):
            assert local_lane.map_ring(socket_path, name) is None, name
        call, hello = await tower.connect()
        assert call.ring is not None
        call.cancel()
        call, hello = await local_lane.connect(socket_path, tower_pb2.TowerInfo, tower_pb2.StepResponse,
                                               timeout_s=5, use_ring=False)
        await call.write(_request(1, [_row("s", 0, 10)], torch.randn(10, 64), torch.full((10, N), -1)))
        assert not (await call.read()).row_errors and call.ring is None and call.ring_messages == 0
        call.cancel()


async def test_a_ring_that_cannot_be_made_leaves_the_lane_on_the_socket(socket_path, monkeypatch):
    """When the tower cannot reserve a connection's ring (a full file system), its hello names
    none and the requests cross the socket."""
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    monkeypatch.setattr(local_lane, "RING_MIN_BYTES", 0)
    async with Tower(socket_path) as tower:
        call, hello = await tower.connect()
        assert hello.step_ring == "" and call.ring is None
        assert [n for n in os.listdir(os.path.dirname(socket_path)) if ".ring-" in n] == []
        await call.write(_request(1, [_row("s", 0, 10)], torch.randn(10, 64), torch.full((10, N), -1)))
        assert not (await call.read()).row_errors and call.ring_messages == 0
        call.cancel()


async def test_a_failing_step_hangs_up_the_lane(socket_path, monkeypatch):
    async with Tower(socket_path) as tower:
        call, _ = await tower.connect()

        def broken(*args, **kwargs):
            raise RuntimeError("simulated device error")

        monkeypatch.setattr(TowerEngine, "step", broken)
        await call.write(_request(1, [_row("z", 0, 1)], torch.randn(1, 64), torch.full((1, N), -1)))
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF


async def test_a_stale_socket_file_is_replaced(socket_path):
    async with Tower(socket_path):
        pass                                            # close_lane removed the file...
    os.makedirs(os.path.dirname(socket_path), exist_ok=True)
    import socket
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(socket_path)                             # ...so leave one as a killed tower would
    stale.close()
    stale_ring = socket_path + ".ring-killed"           # and the ring of its connection
    open(stale_ring, "wb").close()
    async with Tower(socket_path) as tower:
        assert not os.path.exists(stale_ring)
        _, hello = await tower.connect()
        assert hello.instance_id == (await tower.info()).instance_id


async def test_a_live_lane_is_not_taken_over_and_other_files_are_left_alone(socket_path, tmp_path):
    """A second tower configured with the socket a running tower listens on (or a path that is
    not a socket) serves without a lane; the first tower's lane goes on."""
    async with Tower(socket_path) as first:
        async with Tower(socket_path) as second:
            assert (await second.info()).step_socket == "" and second.servicer.lane_server is None
            assert (await first.info()).step_socket == socket_path
            _, hello = await first.connect()
            assert hello.instance_id == (await first.info()).instance_id
        assert os.path.exists(socket_path)              # the second one's close left it be
    plain = tmp_path / "plain-file"
    plain.write_text("not a socket")
    async with Tower(str(plain)) as tower:
        assert (await tower.info()).step_socket == ""
    assert plain.read_text() == "not a socket"


def test_socket_path_settings():
    default = local_lane.socket_path(None, 50052)
    assert default.endswith(os.path.join(f"dramaturg-{os.getuid()}", "tower-50052.sock"))
    assert local_lane.socket_path("", 7) == local_lane.socket_path(None, 7)
    assert local_lane.socket_path("off", 7) == local_lane.socket_path("0", 7) == ""
    assert local_lane.socket_path("/run/dramaturg/tower.sock", 7) == "/run/dramaturg/tower.sock"


# --------------------------------------------------------------------------------------------
# the backbone's side
# --------------------------------------------------------------------------------------------

def _client(addr: str, **kwargs) -> TowerClient:
    return TowerClient(addr, hidden_dim=64, hidden_dtype=torch.float32, codebooks=N, max_rows=SESSIONS,
                       max_context_tokens=CONTEXT, **kwargs)


async def _frames(client: TowerClient, session: str) -> tuple[list, list]:
    """A prompt and four frames through the client's Step stream, and the engine's own."""
    from services.backbone.scheduler import Sampling
    hidden, targets = _prompt(TINY, 16, seed=5)
    plan = _session_plan(session, hidden, targets[:12], [12], frames=4)
    frames = []
    for rows, h, t in plan:
        r = rows[0]
        entry = TowerEntry(r.session_id, r.first_row, r.n_rows, r.draw, frame_index=r.frame_index,
                           sampling=Sampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                             repetition_penalty=r.repetition_penalty, seed=r.seed,
                                             max_new_tokens=8))
        result = await client.step(TowerStep([entry], h.float(), t, release=[]))
        assert not result.row_errors
        if r.draw:
            frames.append(result.codes[0].tolist())
    return frames, _expected_frames(plan)


async def test_the_client_takes_the_lane_when_it_reaches_it_and_grpc_otherwise(socket_path, tmp_path):
    async with Tower(socket_path) as tower, Tower(str(tmp_path / "other.sock")) as other:
        cases = [
            ("lane", tower.addr, {}),
            ("grpc", tower.addr, {"local_lane": False}),          # DRAMA_TOWER_LOCAL_LANE=0
        ]
        for want, addr, kwargs in cases:
            client = _client(addr, **kwargs)
            client.start()
            try:
                assert await client.wait_ready(10), client.last_error
                assert client.transport == want
                got, expected = await _frames(client, f"s-{want}")
                assert got == expected
            finally:
                await client.close()
        # a tower that names a socket another tower listens on (another container sharing the
        # directory), or one nothing listens on: the gRPC stream
        for path in (other.socket, str(tmp_path / "nothing.sock")):
            tower.servicer.step_socket = path
            client = _client(tower.addr)
            client.start()
            try:
                assert await client.wait_ready(10), client.last_error
                assert client.transport == "grpc"
                got, expected = await _frames(client, "fallback")
                assert got == expected
            finally:
                await client.close()
        tower.servicer.step_socket = socket_path


async def test_the_client_reconnects_when_the_lane_breaks(socket_path):
    """The tower hangs up the lane: outstanding steps fail TowerUnavailable, on_lost fires, and the
    client is ready again (over the lane) after its backoff."""
    async with Tower(socket_path) as tower:
        lost = []
        client = _client(tower.addr, on_lost=lambda: lost.append(1), backoff_min_s=0.05)
        client.start()
        try:
            assert await client.wait_ready(10)
            call = client._call
            call._writer.transport.abort()              # as if the tower's process died
            for _ in range(200):
                if lost and client.ready:
                    break
                await asyncio.sleep(0.02)
            assert lost and client.ready and client.transport == "lane" and client._call is not call
            got, expected = await _frames(client, "again")
            assert got == expected
        finally:
            await client.close()


async def test_a_message_larger_than_the_read_buffer_crosses_whole(tmp_path):
    """A long prompt piece's message (12 MB here, over the streams' 4 MB buffer limit, under the
    16 MB message limit) arrives in one piece; one byte over the limit is refused by the reader."""
    path = str(tmp_path / "echo.sock")
    got = []

    async def echo(reader, writer):
        try:
            while (message := await local_lane.read_message(reader, tower_pb2.StepRequest)) is not None:
                got.append(len(message.hidden))
                writer.write(local_lane.encode(tower_pb2.StepResponse(step_id=message.step_id)))
        except local_lane.LaneError as exc:
            got.append(str(exc))
        writer.close()

    server = await local_lane.serve(path, echo)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        call = local_lane.LaneCall(reader, writer, tower_pb2.StepResponse)
        big = bytes(range(256)) * (12 * 1024 * 1024 // 256)
        await call.write(tower_pb2.StepRequest(step_id=1, hidden=big))
        assert (await asyncio.wait_for(call.read(), 10)).step_id == 1
        assert got == [len(big)]
        try:   # the server hangs up after the header: the write may or may not finish first
            await call.write(tower_pb2.StepRequest(step_id=2, hidden=b"\0" * local_lane.DEFAULT_LIMIT_BYTES))
            assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
        except ConnectionResetError:
            pass
        for _ in range(100):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        assert "over the" in got[-1]
        call.cancel()
    finally:
        local_lane.close_server(server, path)
    assert not os.path.exists(path)

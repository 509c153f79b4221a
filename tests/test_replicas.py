"""Stage replicas behind one name (deploy/k8s: headless Services, client-side round_robin).

A headless Service makes DNS return one address per ready pod; our channels
(`grpcutil.create_channel`, `grpc.lb_policy_name=round_robin`) then open a subchannel to each
address and hand out calls in turn. Here two real codec replicas with the tiny checkpoint listen
on loopback, and one channel reaches both through a two-address target
(`ipv4:127.0.0.1:P1,127.0.0.1:P2`), which is what the DNS resolver produces for a headless
Service with two ready pods. Each replica's own `GetInfo.open_sessions` tells where the
sessions went.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest_asyncio
import torch

from drama.codec.v1 import codec_pb2, codec_pb2_grpc
from services.codec.server import serve
from services.common import grpcutil
from services.common.tensors import codes_to_wire

CODEC_MESSAGE_MB = 32
SESSIONS = 6


class Replica:
    def __init__(self, server, port, servicer):
        self.server, self.port, self.servicer = server, port, servicer
        self.channel = grpcutil.create_channel(f"127.0.0.1:{port}", max_message_mb=CODEC_MESSAGE_MB)
        self.stub = codec_pb2_grpc.CodecStub(self.channel)

    async def open_sessions(self) -> int:
        info = await self.stub.GetInfo(codec_pb2.GetInfoRequest(), timeout=5)
        return info.open_sessions

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.servicer.close()


async def start_replica(checkpoint) -> Replica:
    """One codec replica loading the checkpoint itself, as a pod would, on a free port."""
    server, port, _health, servicer = await serve(str(checkpoint), port=0)
    return Replica(server, port, servicer)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def replicas(tiny_checkpoint):
    started = [await start_replica(tiny_checkpoint) for _ in range(2)]
    yield started
    for replica in started:
        await replica.stop()


def one_name_for(replicas: list[Replica]) -> str:
    """The target a DNS lookup of a headless Service with these pods amounts to."""
    return "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)


def test_client_channels_balance_round_robin():
    assert ("grpc.lb_policy_name", "round_robin") in grpcutil.client_options()


async def open_session(stub: codec_pb2_grpc.CodecStub, session_id: str, codebooks: int):
    """Start a Decode stream and decode one frame on it; returns the open call."""
    call = stub.Decode()
    await call.write(codec_pb2.DecodeRequest(start=codec_pb2.DecodeStart(session_id=session_id)))
    codes = torch.zeros(codebooks, 1, dtype=torch.int64)
    await call.write(codec_pb2.DecodeRequest(frames=codec_pb2.DecodeFrames(
        first_frame_index=0, n_frames=1, codes=codes_to_wire(codes))))
    reply = await call.read()
    assert reply.WhichOneof("msg") == "pcm" and len(reply.pcm.samples) > 0
    return call


async def close_session(call) -> None:
    await call.write(codec_pb2.DecodeRequest(end=codec_pb2.DecodeEnd()))
    reply = await call.read()
    assert reply.WhichOneof("msg") == "done"
    await call.done_writing()


async def sessions_per_replica(channel: grpc.aio.Channel, replicas: list[Replica]) -> list[int]:
    """Open SESSIONS decode streams over `channel`, count them on each replica, close them."""
    await asyncio.wait_for(channel.channel_ready(), 10)
    await asyncio.sleep(0.2)          # ready = one subchannel up; give the other its connect too
    stub = codec_pb2_grpc.CodecStub(channel)
    codebooks = replicas[0].servicer.codec.num_codebooks
    calls = [await open_session(stub, f"s{i}", codebooks) for i in range(SESSIONS)]
    counts = [await r.open_sessions() for r in replicas]
    for call in calls:
        await close_session(call)
    return counts


async def test_one_channel_spreads_sessions_over_both_replicas(replicas):
    channel = grpcutil.create_channel(one_name_for(replicas), max_message_mb=CODEC_MESSAGE_MB)
    try:
        counts = await sessions_per_replica(channel, replicas)
    finally:
        await channel.close()
    assert sum(counts) == SESSIONS
    assert min(counts) >= 2, f"sessions per replica {counts}: round_robin should alternate"


async def test_pick_first_would_pin_every_session_to_one_replica(replicas):
    """The control: the same target under gRPC's default policy uses one address only, so the
    balancing above comes from our channel options, not from the target."""
    options = [opt for opt in grpcutil.client_options(CODEC_MESSAGE_MB) if opt[0] != "grpc.lb_policy_name"]
    channel = grpc.aio.insecure_channel(one_name_for(replicas),
                                        options=options + [("grpc.lb_policy_name", "pick_first")])
    try:
        counts = await sessions_per_replica(channel, replicas)
    finally:
        await channel.close()
    assert sorted(counts) == [0, SESSIONS]


async def test_a_stopped_replica_leaves_the_rotation(tiny_checkpoint):
    """A pod that goes away (drained, evicted) takes no new sessions; the survivor takes them all."""
    survivor, leaving = [await start_replica(tiny_checkpoint) for _ in range(2)]
    channel = grpcutil.create_channel(one_name_for([survivor, leaving]), max_message_mb=CODEC_MESSAGE_MB)
    try:
        assert min(await sessions_per_replica(channel, [survivor, leaving])) > 0
        await leaving.stop()
        await asyncio.sleep(0.3)      # the client sees the connection close
        stub = codec_pb2_grpc.CodecStub(channel)
        codebooks = survivor.servicer.codec.num_codebooks
        calls = [await open_session(stub, f"after{i}", codebooks) for i in range(4)]
        assert await survivor.open_sessions() == 4
        for call in calls:
            await close_session(call)
    finally:
        await channel.close()
        await survivor.stop()
        await leaving.stop()          # a no-op when it stopped above

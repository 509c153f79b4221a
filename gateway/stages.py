"""The gateway's gRPC clients: one channel each to the backbone and the codec (API.md §3.1).
The tower has no channel here: its state comes from `Backbone.GetInfo().tower_ready`."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from drama.codec.v1 import codec_pb2_grpc
from services.common.grpcutil import create_channel


class Stages:
    def __init__(self, backbone_addr: str, codec_addr: str):
        self.backbone_addr, self.codec_addr = backbone_addr, codec_addr
        self.backbone_channel = create_channel(backbone_addr, max_message_mb=16)
        self.codec_channel = create_channel(codec_addr, max_message_mb=32)
        self.backbone = backbone_pb2_grpc.BackboneStub(self.backbone_channel)
        self.codec = codec_pb2_grpc.CodecStub(self.codec_channel)
        self._health = {"backbone": health_pb2_grpc.HealthStub(self.backbone_channel),
                        "codec": health_pb2_grpc.HealthStub(self.codec_channel)}

    async def close(self) -> None:
        await asyncio.gather(self.backbone_channel.close(), self.codec_channel.close())

    async def _check(self, stage: str, timeout: float) -> str:
        try:
            reply = await self._health[stage].Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            # Answered but without a status for "" (no health service): UNKNOWN; no answer: UNREACHABLE.
            unreachable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return "UNREACHABLE" if unreachable else "UNKNOWN"

    async def _tower(self, timeout: float) -> str:
        try:
            info = await self.backbone.GetInfo(backbone_pb2.GetInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return "UNKNOWN"
        return "SERVING" if info.tower_ready else "NOT_SERVING"

    async def readiness(self, timeout: float = 1.0) -> dict[str, str]:
        """{"backbone", "tower", "codec"} -> SERVING / NOT_SERVING / UNKNOWN / UNREACHABLE."""
        backbone, codec, tower = await asyncio.gather(
            self._check("backbone", timeout), self._check("codec", timeout), self._tower(timeout))
        if backbone == "UNREACHABLE":
            tower = "UNKNOWN"
        return {"backbone": backbone, "tower": tower, "codec": codec}

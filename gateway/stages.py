"""The gateway's gRPC side (API.md §3): one channel each to the backbone and the codec, the
status -> HTTP table of §3.2, and the wire layouts of codes and token ids.

The tower has no channel here: its state comes from `Backbone.GetInfo().tower_ready`."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from drama.codec.v1 import codec_pb2_grpc
from gateway.errors import ApiError
from services.common.grpcutil import create_channel, error_details

log = logging.getLogger("gateway.stages")


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


# --------------------------------------------------------------------------------------------
# gRPC status -> HTTP (API.md §3.2 table)
# --------------------------------------------------------------------------------------------

def caller_param(wire_param: str | None, text_param: str = "text") -> str | None:
    """A stage's field path (GenerateRequest) as the caller's field of the HTTP request."""
    if not wire_param:
        return wire_param
    if wire_param.startswith("sampling."):
        return wire_param[len("sampling."):]
    if wire_param == "text" or wire_param.startswith("chunks"):
        return text_param
    if wire_param.startswith("system"):
        return "references"
    if wire_param.startswith("history"):
        return "history"
    return wire_param


def grpc_error(exc: grpc.aio.AioRpcError, stage: str, text_param: str = "text") -> ApiError:
    code = exc.code()
    drama_code, wire_param = error_details(exc)
    param = caller_param(wire_param, text_param)
    details = exc.details() or f"{stage} call failed"
    status = grpc.StatusCode
    if code == status.INVALID_ARGUMENT and wire_param == "sampling.max_new_tokens" and drama_code == "out_of_range":
        # Valid for the API (1..4096) but more than this backbone's context holds: a context error.
        return ApiError(400, "context_length_exceeded", details, param)
    if code == status.INVALID_ARGUMENT:
        return ApiError(400, drama_code or "invalid_value", details, param)
    if code == status.OUT_OF_RANGE:
        return ApiError(400, "context_length_exceeded", details, param)
    if code == status.NOT_FOUND:
        return ApiError(503, "upstream_unavailable", f"{stage}: {details}")
    if code == status.RESOURCE_EXHAUSTED and drama_code in ("queue_full", "queue_timeout"):
        return ApiError(503, "server_overloaded", "The server is overloaded; retry shortly.",
                        headers={"Retry-After": "1", "retry-after-ms": "1000"})
    if code == status.UNAVAILABLE:
        if drama_code == "not_ready":
            return ApiError(503, "not_ready", f"The {stage} stage is not ready: {details}")
        return ApiError(503, "upstream_unavailable", f"The {stage} stage is unavailable: {details}")
    if code == status.DEADLINE_EXCEEDED:
        return ApiError(504, "timeout", "The request deadline passed.")
    if code == status.CANCELLED:
        return ApiError(499, "cancelled", "The request was cancelled.")
    # ALREADY_EXISTS (a gateway bug), RESOURCE_EXHAUSTED (message size), INTERNAL, UNKNOWN, ...
    log.error("%s call failed: %s %s", stage, code.name, details)
    return ApiError(500, "internal_error", "The server had an error while processing your request.")


# --------------------------------------------------------------------------------------------
# Wire layouts (DEVELOPING.md): codes int16 frame-major [T, N], token ids int32, little-endian
# --------------------------------------------------------------------------------------------

def codes_to_wire(codes: torch.Tensor) -> bytes:
    """[N, T] -> int16 frame-major [T, N] bytes."""
    return np.ascontiguousarray(codes.to(torch.int16).numpy().T).astype("<i2").tobytes()


def codes_from_wire(data: bytes, num_codebooks: int) -> torch.Tensor:
    """int16 frame-major [T, N] bytes -> int64 [N, T]."""
    frames = np.frombuffer(data, dtype="<i2").reshape(-1, num_codebooks)
    return torch.from_numpy(frames.T.astype(np.int64))


def ids_to_wire(ids) -> bytes:
    return np.asarray(list(ids), dtype="<i4").tobytes()


def segment_to_proto(segment) -> backbone_pb2.Segment:
    if segment.tokens is not None:
        return backbone_pb2.Segment(tokens=ids_to_wire(segment.tokens))
    return backbone_pb2.Segment(codes=codes_to_wire(segment.codes))

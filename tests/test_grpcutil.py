"""gRPC plumbing: health goes NOT_SERVING -> SERVING, reflection lists the services, errors carry
the API error code in trailing metadata, and the health probe's exit code follows the status."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common import grpcutil


class _Abort(grpc.GenericRpcHandler):
    """A tiny generic service whose one method aborts with drama metadata."""

    def service(self, details):
        if details.method != "/test.Svc/Fail":
            return None

        async def fail(request, context):
            await grpcutil.abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad codes",
                                 drama_code="invalid_value", param="frames.codes")

        return grpc.unary_unary_rpc_method_handler(fail)


async def test_health_reflection_and_error_metadata():
    server, port, health = await grpcutil.start_server(
        add_servicers=[lambda s: s.add_generic_rpc_handlers((_Abort(),))],
        service_names=["test.Svc"], host="127.0.0.1", port=0)
    addr = f"127.0.0.1:{port}"
    try:
        assert await grpcutil.check_health(addr) == "NOT_SERVING"
        await grpcutil.set_serving(health, True)
        assert await grpcutil.check_health(addr) == "SERVING"
        assert await grpcutil.check_health(addr, service="test.Svc") == "SERVING"

        channel = grpcutil.create_channel(addr)
        call = channel.unary_unary("/test.Svc/Fail")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert grpcutil.error_details(info.value) == ("invalid_value", "frames.codes")

        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [r async for r in stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"test.Svc", "grpc.health.v1.Health"} <= names
        await channel.close()

        probe = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "services.common.healthprobe", "--addr", addr],
            capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        await health.enter_graceful_shutdown()
        probe = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "services.common.healthprobe", "--addr", addr],
            capture_output=True, text=True, timeout=30)
        assert probe.returncode == 1 and "NOT_SERVING" in probe.stdout
    finally:
        await server.stop(0)


async def test_unreachable_is_reported():
    assert await grpcutil.check_health("127.0.0.1:1", timeout=0.5) == "UNREACHABLE"


def test_health_status_names_match_api():
    assert health_pb2.HealthCheckResponse.ServingStatus.Name(1) == "SERVING"

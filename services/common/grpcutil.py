"""gRPC plumbing shared by every stage and the gateway (API.md §3.2).

One place decides message limits, keepalive, TLS, health, reflection and tracing interceptors, so
each `server.py` stays a thin translator:

    server, port, health = await start_server(
        add_servicers=[lambda s: codec_pb2_grpc.add_CodecServicer_to_server(servicer, s)],
        service_names=["drama.codec.v1.Codec"], host="127.0.0.1", port=0, max_message_mb=32)
    ...load weights, warm up...
    await set_serving(health, True)

    channel = create_channel("127.0.0.1:50053", max_message_mb=32)

Errors carry the API's error code and field path in trailing metadata:
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "codes out of range",
                drama_code="invalid_value", param="frames.codes")
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

ERROR_CODE_KEY = "drama-error-code"
ERROR_PARAM_KEY = "drama-error-param"

# Services whose calls are never traced: health probes and reflection are noise, and the Step
# stream lives as long as the process, so a span around it would be useless (API.md §3.6).
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.", "drama.tower.v1.Tower/Step")


def _message_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def server_options(max_message_mb: int = 16) -> list[tuple[str, int]]:
    # min_recv_ping_interval below the clients' 30 s keepalive, so no too_many_pings GOAWAY;
    # no max_connection_age, which would cut long streams.
    return _message_options(max_message_mb) + [
        ("grpc.keepalive_time_ms", 60000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 20000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def client_options(max_message_mb: int = 16) -> list[tuple[str, int | str]]:
    return _message_options(max_message_mb) + [
        ("grpc.keepalive_time_ms", 30000),
        ("grpc.keepalive_timeout_ms", 10000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Every address the name resolves to (a headless Service's pods) takes calls in turn.
        ("grpc.lb_policy_name", "round_robin"),
        # A restarted stage is found again within 5 s (issue #9): gRPC's default reconnect
        # backoff grows to 120 s, far longer than any restart.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]


# ------------------------------------------------------------------------------------------
# TLS from PEM files (DRAMA_GRPC_TLS_CERT / _KEY / _CA)
# ------------------------------------------------------------------------------------------

def _read_pem(env: str) -> bytes | None:
    path = os.environ.get(env)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise RuntimeError(f"{env}={path}: cannot read ({exc})") from None


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS server credentials, or None for plaintext. A CA file makes the server require client
    certificates (mutual TLS)."""
    cert, key, ca = (_read_pem(e) for e in ("DRAMA_GRPC_TLS_CERT", "DRAMA_GRPC_TLS_KEY", "DRAMA_GRPC_TLS_CA"))
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise RuntimeError("DRAMA_GRPC_TLS_CERT and DRAMA_GRPC_TLS_KEY must be set together")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """TLS client credentials when DRAMA_GRPC_TLS_CA is set (with an optional client identity)."""
    ca = _read_pem("DRAMA_GRPC_TLS_CA")
    if ca is None:
        return None
    cert, key = _read_pem("DRAMA_GRPC_TLS_CERT"), _read_pem("DRAMA_GRPC_TLS_KEY")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# ------------------------------------------------------------------------------------------
# Tracing interceptors
# ------------------------------------------------------------------------------------------

def _traced(details) -> bool:
    method = getattr(details, "method", "") or ""
    if isinstance(method, bytes):
        method = method.decode()
    return not any(method.lstrip("/").startswith(s) for s in _UNTRACED_SERVICES)


class _StreamsEndInTheirTask(grpc.aio.ServerInterceptor):
    """Response streams written by a coroutine that closes the handler's generator in its own task.

    grpc.aio drives an async-generator handler with `async for response in handler(...): await
    write(response)` and does not close the generator when that loop is left: when the client
    cancels (or the write fails) while the handler is suspended at its `yield`, the generator is
    abandoned and later closed by asyncio's finalizer hook, in a new task. The OpenTelemetry
    interceptor's generator has attached the trace context in the call's task, so its `detach`
    then fails ("Failed to detach context ... was created in a different Context") and the
    handler's own `finally` runs late and elsewhere. Listed first, so it wraps the traced
    handler: the call's task writes the responses itself and, however the loop ends, closes the
    generator (GeneratorExit at the `yield`) before the task finishes.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
        if not inspect.isasyncgenfunction(behavior):
            return handler

        async def write_responses(request_or_iterator, context):
            responses = behavior(request_or_iterator, context)
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                await responses.aclose()

        factory = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                   else grpc.unary_stream_rpc_method_handler)
        return factory(write_responses, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def _server_interceptors() -> list:
    try:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor
    except ImportError:  # tracing is optional at run time
        return [_StreamsEndInTheirTask()]
    return [_StreamsEndInTheirTask(), aio_server_interceptor(filter_=_traced)]


def _client_interceptors() -> list:
    try:
        from opentelemetry.instrumentation.grpc import aio_client_interceptors
    except ImportError:
        return []
    return list(aio_client_interceptors(filter_=_traced))


# ------------------------------------------------------------------------------------------
# Servers and channels
# ------------------------------------------------------------------------------------------

async def start_server(add_servicers: Iterable[Callable[[grpc.aio.Server], None]],
                       service_names: Iterable[str], host: str = "127.0.0.1", port: int = 0,
                       *, max_message_mb: int = 16,
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build, bind and start a grpc.aio server with health (NOT_SERVING until `set_serving`) and
    reflection (unless DRAMA_GRPC_REFLECTION=0). Returns (server, bound port, health servicer)."""
    service_names = list(service_names)
    server = grpc.aio.server(interceptors=_server_interceptors(), options=server_options(max_message_mb))
    for add in add_servicers:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if os.environ.get("DRAMA_GRPC_REFLECTION", "1") != "0":
        from grpc_reflection.v1alpha import reflection
        reflection.enable_server_reflection(
            [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    creds = server_credentials()
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    health_servicer._drama_names = ["", *service_names]  # remembered for set_serving
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Set every service's health; turning SERVING also starts naming late kernel compiles
    (kernel_watch: after the warm-up, a new kernel specialisation is a shape it missed)."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    if serving:
        from services.common.kernel_watch import watch_after_serving
        watch_after_serving()
    for name in getattr(health_servicer, "_drama_names", [""]):
        await health_servicer.set(name, status)


def create_channel(addr: str, *, max_message_mb: int = 16, traced: bool = True) -> grpc.aio.Channel:
    """An aio channel with our limits, keepalive, optional TLS and tracing interceptors."""
    interceptors = _client_interceptors() if traced else None
    creds = channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(addr, creds, options=client_options(max_message_mb),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(addr, options=client_options(max_message_mb),
                                     interceptors=interceptors)


async def check_health(addr: str, timeout: float = 1.0, service: str = "") -> str:
    """One grpc.health.v1 Check: 'SERVING', 'NOT_SERVING', 'UNKNOWN' or 'UNREACHABLE'."""
    channel = create_channel(addr, traced=False)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"
    finally:
        await channel.close()


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------

def error_metadata(drama_code: str | None = None, param: str | None = None) -> tuple:
    md = []
    if drama_code:
        md.append((ERROR_CODE_KEY, drama_code))
    if param:
        md.append((ERROR_PARAM_KEY, param))
    return tuple(md)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, *,
                drama_code: str | None = None, param: str | None = None) -> None:
    """End the call with `code`, putting the API error code and field path in trailing metadata."""
    await context.abort(code, message, trailing_metadata=error_metadata(drama_code, param))


def error_details(exc: grpc.aio.AioRpcError) -> tuple[str | None, str | None]:
    """(drama-error-code, drama-error-param) from a failed call's trailing metadata."""
    code = param = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_CODE_KEY:
            code = value
        elif key == ERROR_PARAM_KEY:
            param = value
    return code, param


# ------------------------------------------------------------------------------------------
# Process lifecycle
# ------------------------------------------------------------------------------------------

async def serve_until_signalled(server: grpc.aio.Server, health_servicer, *, grace_s: float = 30.0,
                                on_shutdown: Callable[[], object] | None = None) -> None:
    """Wait for SIGTERM/SIGINT, then drain: health NOT_SERVING at once (load balancers stop
    sending), `on_shutdown` (stop admitting), and let in-flight calls finish within the grace."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # not on the main thread / platform without signals
            pass
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received: draining for up to %.0f s", grace_s)
        await health_servicer.enter_graceful_shutdown()
        if on_shutdown is not None:
            result = on_shutdown()
            if asyncio.iscoroutine(result):
                await result
        await server.stop(grace_s)
    waiter.cancel()
    stopper.cancel()


def env_default(name: str, fallback=None, cast=str):
    value = os.environ.get(name)
    return fallback if value in (None, "") else cast(value)


def env_switch(name: str) -> bool | None:
    """An on/off variable: unset or empty -> None (the caller's default, e.g. on for CUDA),
    0/false/off/no -> False, anything else -> True."""
    value = env_default(name, None)
    return None if value is None else value.strip().lower() not in ("0", "false", "off", "no")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """A variable that names one of `choices` (lower-cased; unset or empty: the first, the
    default); anything else is a ValueError naming the variable and the choices."""
    value = (env_default(name, None) or choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def run_stage(service_name: str, serve_coro_factory: Callable[[], object]) -> int:
    """The body of every stage's `main`: logging from DRAMA_LOG_LEVEL, OpenTelemetry under
    `service_name`, then run the server coroutine until it returns; Ctrl-C is a clean exit (0)."""
    logging.basicConfig(level=env_default("DRAMA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.common.telemetry import setup_telemetry
    setup_telemetry(service_name)
    try:
        asyncio.run(serve_coro_factory())
    except KeyboardInterrupt:
        pass
    return 0

"""OpenTelemetry setup from the standard OTEL_* environment (API.md §3.6).

`setup_telemetry("drama-codec")` installs a TracerProvider (and a MeterProvider) once per process.
With no OTEL_EXPORTER_OTLP_* endpoint and OTEL_TRACES_EXPORTER unset, nothing is exported: spans
are still created (so trace ids exist for headers and tests) but go nowhere. Tests can pass their
own span processor (an in-memory exporter) to collect spans.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanProcessor

log = logging.getLogger(__name__)
_configured = False

# Histogram buckets of the stage series (API.md §1.7, docs/metrics.md), given to the SDK as
# advisory boundaries: a step or decode call takes about 1 ms on a GPU and up to about 1 s on a
# CPU (the SDK's default buckets, 0-10000, suit milliseconds, not seconds); batch sizes (rows per
# backbone step, sessions per codec call) in powers of two up to a full prefill budget.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _exporting(signal: str) -> bool:
    chosen = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER")
    if chosen is not None:
        return chosen.strip().lower() not in ("", "none")
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))


def setup_telemetry(service_name: str, *, span_processor: SpanProcessor | None = None) -> TracerProvider:
    """Configure tracing (and OTLP metrics when exporting) for this process; idempotent.

    OTEL_SERVICE_NAME overrides `service_name`; OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG)
    and OTEL_PROPAGATORS are read by the SDK itself.
    """
    global _configured
    provider = trace.get_tracer_provider()
    if _configured and isinstance(provider, TracerProvider):
        if span_processor is not None:
            provider.add_span_processor(span_processor)
        return provider
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if span_processor is not None:
        provider.add_span_processor(span_processor)
    if _exporting("traces"):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        except ImportError:
            log.warning("OTLP exporter not installed: traces are not exported")
    trace.set_tracer_provider(provider)
    if _exporting("metrics"):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            metrics.set_meter_provider(MeterProvider(
                resource=resource, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())]))
        except ImportError:
            log.warning("OTLP metric exporter not installed: metrics are not exported")
    _configured = True
    return provider


def inject_context() -> dict[str, str]:
    """The current span's W3C context as a dict (for StepRequest.trace_context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: dict[str, str]):
    return propagate.extract(dict(carrier))

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


def exporters(signal: str) -> set[str]:
    """The exporters chosen for `signal` ("traces" or "metrics") by the standard environment:
    OTEL_<SIGNAL>_EXPORTER is a comma-separated list of "otlp", "console" and "none"; unset, it
    is "otlp" when an OTLP endpoint is configured and nothing otherwise (so a process with no
    collector sends nothing anywhere)."""
    chosen = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER")
    if chosen is None:
        endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))
        return {"otlp"} if endpoint else set()
    names = {name.strip().lower() for name in chosen.split(",")} - {"", "none"}
    unknown = names - {"otlp", "console"}
    if unknown:
        log.warning("OTEL_%s_EXPORTER: %s not supported (otlp, console, none); ignored",
                    signal.upper(), ", ".join(sorted(unknown)))
    return names - unknown


def metrics_json_line(metrics_data) -> str:
    """The console metric exporter's format: one compact JSON document per line (the SDK's
    default is indented over many lines, which cannot be picked out of a log)."""
    return metrics_data.to_json(indent=None) + "\n"


def setup_telemetry(service_name: str, *, span_processor: SpanProcessor | None = None) -> TracerProvider:
    """Configure tracing and metrics for this process from the environment; idempotent.

    OTEL_SERVICE_NAME overrides `service_name`; OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG),
    OTEL_PROPAGATORS and OTEL_METRIC_EXPORT_INTERVAL are read by the SDK itself. Exporters: see
    `exporters` ("console" metrics: one JSON line per export on stdout, e.g. for benchmarks that
    read the stage histograms from the logs; bench/stage_metrics.py).
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
    trace_exporters = exporters("traces")
    if "otlp" in trace_exporters:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        except ImportError:
            log.warning("OTLP exporter not installed: traces are not exported")
    if "console" in trace_exporters:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    readers = []
    metric_exporters = exporters("metrics")
    if metric_exporters:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
        if "otlp" in metric_exporters:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
                readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
            except ImportError:
                log.warning("OTLP metric exporter not installed: metrics are not exported over OTLP")
        if "console" in metric_exporters:
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(formatter=metrics_json_line)))
        if readers:
            metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    _configured = True
    return provider


def inject_context() -> dict[str, str]:
    """The current span's W3C context as a dict (for StepRequest.trace_context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: dict[str, str]):
    return propagate.extract(dict(carrier))

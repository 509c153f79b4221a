"""The stage series of API.md §1.7 (docs/metrics.md "Stage series"), from the real stages: codec,
tower and backbone gRPC servers with the tiny checkpoint and the gateway in front (the Stack of
test_gateway_e2e), all in this process, read through an in-memory metric reader.

The global MeterProvider can be set once per process, so the first test that needs it installs one
holding an InMemoryMetricReader and keeps the reader on it; the stages' instruments come from the
global meter (proxies made before it is set are bound to it then). Readings are cumulative over
the process, so each test compares counts before and after its own requests, against what the
stages were really asked to do (counted by wrapping the engines' and the batcher's calls).
"""

from __future__ import annotations

import threading
import time

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.telemetry import BATCH_SIZE_BUCKETS, STEP_SECONDS_BUCKETS
from test_gateway_e2e import MAX_NEW, Stack

HISTOGRAMS = {"drama_backbone_batch_rows": BATCH_SIZE_BUCKETS,
              "drama_backbone_step_seconds": STEP_SECONDS_BUCKETS,
              "drama_tower_step_seconds": STEP_SECONDS_BUCKETS,
              "drama_codec_decode_seconds": STEP_SECONDS_BUCKETS,
              "drama_codec_batch_size": BATCH_SIZE_BUCKETS}
GAUGES = ("drama_backbone_queue_depth", "drama_backbone_kv_usage_ratio")


def process_metric_reader() -> InMemoryMetricReader:
    provider = metrics.get_meter_provider()
    reader = getattr(provider, "drama_test_reader", None)
    if reader is not None:
        return reader
    if isinstance(provider, MeterProvider):
        pytest.fail("a MeterProvider without an in-memory reader is already set for this process "
                    "(OTEL_METRICS_EXPORTER or an OTLP endpoint in the test environment?)")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.drama_test_reader = reader
    metrics.set_meter_provider(provider)
    assert metrics.get_meter_provider() is provider
    return reader


def read_points(reader: InMemoryMetricReader) -> dict:
    """{series name: its one data point}; the stage series carry no attributes."""
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name in HISTOGRAMS or m.name in GAUGES:
                    assert len(m.data.data_points) == 1, m
                    points[m.name] = m.data.data_points[0]
    return points


class CallCounter:
    """Wraps an object's method in place, counting calls (and what `measure` says of the args)."""

    def __init__(self, owner, name, measure=lambda *a, **k: 0, is_async=False):
        self.calls, self.measured, self.lock = 0, 0, threading.Lock()
        real = getattr(owner, name)

        def count(args, kwargs):
            with self.lock:
                self.calls += 1
                self.measured += measure(*args, **kwargs)

        if is_async:
            async def wrapper(*args, **kwargs):
                count(args, kwargs)
                return await real(*args, **kwargs)
        else:
            def wrapper(*args, **kwargs):
                count(args, kwargs)
                return real(*args, **kwargs)
        setattr(owner, name, wrapper)


@pytest.fixture(scope="module")
def metered_stack(tiny_checkpoint):
    reader = process_metric_reader()
    stack = Stack(tiny_checkpoint)
    yield stack, reader
    stack.close()


def wait_until(condition, timeout=5.0):
    """Instruments are recorded just after the work they time returns; give them that moment."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_step_and_decode_series_count_every_call(metered_stack):
    stack, reader = metered_stack
    backbone, tower, codec = stack.handles
    before = read_points(reader)

    def so_far(name, field="count"):
        return getattr(read_points(reader)[name], field) - getattr(before.get(name), field, 0)

    backbone_steps = CallCounter(backbone.scheduler.engine, "launch_to_host",
                                 lambda work, **_: sum(len(token_ids) for _, token_ids, _ in work))
    tower_steps = CallCounter(tower.servicer.engine, "step")
    chunks = CallCounter(codec.servicer.batcher, "decode", is_async=True)
    codec_calls_before = codec.servicer.batcher.batches

    # Two requests at once, so steps and decode calls may batch sessions; plus one alone.
    results = [None, None]

    def post(i, text):
        results[i] = stack.http.post("/v1/audio/speech", json={
            "input": text, "voice": "alloy", "response_format": "pcm", "seed": 3 + i,
            "max_new_tokens": MAX_NEW})
    threads = [threading.Thread(target=post, args=(i, t)) for i, t in enumerate(("One here.", "Two there."))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    post(0, "And a third.")
    assert all(r is not None and r.status_code == 200 for r in results), results

    codec_calls = codec.servicer.batcher.batches - codec_calls_before
    assert backbone_steps.calls > 0 and tower_steps.calls > 0 and codec_calls > 0 and chunks.calls > 0
    assert wait_until(lambda: (so_far("drama_backbone_step_seconds"), so_far("drama_backbone_batch_rows"),
                               so_far("drama_tower_step_seconds"), so_far("drama_codec_decode_seconds"),
                               so_far("drama_codec_batch_size"))
                      == (backbone_steps.calls, backbone_steps.calls, tower_steps.calls, codec_calls, codec_calls))
    # Rows per step add up to the rows the engine computed; sessions per decode call to the chunks.
    assert so_far("drama_backbone_batch_rows", "sum") == backbone_steps.measured
    assert so_far("drama_codec_batch_size", "sum") == chunks.calls

    points = read_points(reader)
    for name, bounds in HISTOGRAMS.items():
        point = points[name]
        assert tuple(point.explicit_bounds) == tuple(float(b) for b in bounds), name
        assert point.min > 0, name                      # a time is positive, a batch holds one or more
        if name.endswith("_seconds"):
            assert point.max < 60, name                 # a tiny model's step on a CPU
        else:
            assert point.min >= 1 and point.max <= 4096, name
    # With three requests some steps held rows of more than one row (prefill pieces).
    assert points["drama_backbone_batch_rows"].max > 1


class EngineGate:
    """Lets the backbone's engine make `passes` steps, then holds its thread at the next one until
    released, so the scheduler's state stands still while the gauges are read."""

    def __init__(self, engine, passes=0):
        self.engine, self.real, self.open_ = engine, engine.launch_to_host, threading.Event()
        self.passes = passes

        def step(*args, **kwargs):
            if self.passes > 0:
                self.passes -= 1
            else:
                self.open_.wait(60)
            return self.real(*args, **kwargs)
        engine.launch_to_host = step      # what the scheduler calls (then finish)

    def release(self):
        self.open_.set()
        self.engine.launch_to_host = self.real


def post_in_threads(stack, n):
    results = [None] * n

    def post(i):
        results[i] = stack.http.post("/v1/audio/speech", json={
            "input": f"Session {i}.", "voice": "alloy", "response_format": "pcm", "seed": 20 + i,
            "max_new_tokens": MAX_NEW})
    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def join(threads, results):
    for t in threads:
        t.join(120)
    assert all(r is not None and r.status_code == 200 for r in results), results


def test_kv_usage_follows_the_rows_held(metered_stack):
    stack, reader = metered_stack
    scheduler = stack.handles[0].scheduler
    # Rows count as held once computed: the prompt's prefill (one piece) goes through, the next
    # step waits.
    gate = EngineGate(scheduler.engine, passes=1)
    try:
        threads, results = post_in_threads(stack, 1)
        assert wait_until(lambda: scheduler.open_sessions == 1 and scheduler.kv_usage_ratio > 0, timeout=30)
        during = read_points(reader)
        assert during["drama_backbone_kv_usage_ratio"].value == scheduler.kv_usage_ratio
        assert 0 < during["drama_backbone_kv_usage_ratio"].value <= 1
        assert during["drama_backbone_queue_depth"].value == 0
    finally:
        gate.release()
    join(threads, results)
    # The session ended and released its rows; the gauge says so.
    assert wait_until(lambda: scheduler.open_sessions == 0, timeout=30)
    after = read_points(reader)
    assert after["drama_backbone_kv_usage_ratio"].value == 0.0
    assert after["drama_backbone_queue_depth"].value == 0


def test_queue_depth_counts_sessions_waiting_for_admission(metered_stack):
    """The scheduler admits sessions between steps; while its engine is held at a step, the
    sessions that arrive meanwhile wait in the queue, and the gauge reads them."""
    stack, reader = metered_stack
    scheduler = stack.handles[0].scheduler
    sessions = 4
    gate = EngineGate(scheduler.engine)
    try:
        threads, results = post_in_threads(stack, sessions)
        assert wait_until(lambda: scheduler.open_sessions + scheduler.queued_sessions == sessions
                          and scheduler.queued_sessions >= 1, timeout=30)
        points = read_points(reader)
        assert points["drama_backbone_queue_depth"].value == scheduler.queued_sessions >= 1
        assert 0 <= points["drama_backbone_kv_usage_ratio"].value <= 1
    finally:
        gate.release()
    join(threads, results)
    assert wait_until(lambda: scheduler.open_sessions + scheduler.queued_sessions == 0, timeout=30)
    assert read_points(reader)["drama_backbone_queue_depth"].value == 0

"""Gateway-side Prometheus series (API.md §1.7), in the text exposition format.

A few dozen lines instead of a dependency: counters, gauges and fixed-bucket histograms with
labels. Labels never carry text, voice audio or API keys.
"""

from __future__ import annotations

import math
import threading

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
_PHASE_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0)
_AUDIO_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


def _labels(names, values) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, labels
        self._values: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(labels.get(n, "") for n in self.label_names)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        return self._values.get(tuple(labels.get(n, "") for n in self.label_names), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}"
                                for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def dec(self, amount: float = 1.0, **labels) -> None:
        self.inc(-amount, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, labels=(), buckets=_LATENCY_BUCKETS):
        super().__init__(name, help_text, labels)
        self.buckets = tuple(buckets) + (math.inf,)

    def observe(self, value: float, **labels) -> None:
        key = tuple(labels.get(n, "") for n in self.label_names)
        with self._lock:
            counts, total = self._values.get(key, ([0] * len(self.buckets), 0.0))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            self._values[key] = (counts, total + value)

    def render(self) -> list[str]:
        lines = self.header()
        for key, (counts, total) in sorted(self._values.items()):
            for bound, count in zip(self.buckets, counts):
                names = self.label_names + ("le",)
                lines.append(f"{self.name}_bucket{_labels(names, key + (_num(bound),))} {count}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {counts[-1]}")
        return lines


class GatewayMetrics:
    def __init__(self):
        self.http_requests = Counter("drama_http_requests_total", "HTTP requests by route and status",
                                     ("route", "status"))
        self.in_flight = Gauge("drama_speech_in_flight", "Speech requests in progress", ("route",))
        self.queue_wait = Histogram("drama_speech_queue_wait_seconds", "Backbone admission wait")
        self.ttfa = Histogram("drama_speech_ttfa_seconds", "Arrival to first audio byte written")
        # where the time to first audio goes: arrival -> each milestone of a request, by phase
        # (admitted: the backbone's Started; first_frames: the backbone's first frames message;
        # first_pcm: the codec's first PCM; first_byte: written to the client, as ttfa)
        self.phase = Histogram("drama_speech_phase_seconds", "Arrival to each milestone of a speech request",
                               ("phase",), buckets=_PHASE_BUCKETS)
        self.e2e = Histogram("drama_speech_e2e_seconds", "Arrival to last byte written")
        self.rtf = Histogram("drama_speech_rtf", "Generation wall time / audio duration",
                             buckets=_RATIO_BUCKETS)
        self.audio_seconds = Histogram("drama_speech_audio_seconds", "Audio duration per request",
                                       buckets=_AUDIO_BUCKETS)
        self.chunk_interval = Histogram("drama_speech_chunk_interval_seconds",
                                        "Time between audio chunks written")
        self.underrun = Histogram("drama_speech_underrun_seconds",
                                  "Largest playback deficit of a completed stream played from its first byte")
        self.output_frames = Counter("drama_speech_output_frames_total", "Generated frames")
        self.reference_encode = Histogram("drama_reference_encode_seconds", "Codec.Encode time per clip")
        self.reference_cache_hits = Counter("drama_reference_cache_hits_total",
                                            "Reference clips served from the codes cache")
        self._all = [self.http_requests, self.in_flight, self.queue_wait, self.ttfa, self.phase, self.e2e, self.rtf,
                     self.audio_seconds, self.chunk_interval, self.underrun, self.output_frames,
                     self.reference_encode, self.reference_cache_hits]

    def render(self) -> str:
        lines = []
        for metric in self._all:
            lines += metric.render()
        return "\n".join(lines) + "\n"

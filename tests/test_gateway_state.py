"""Gateway state without HTTP: settings from the environment, the take store (LRU + TTL), voice
resolution and seeds, the metrics exposition."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.takes import Take, TakeStore
from gateway.voices import VoiceRegistry, seed_for_voice


def test_settings_from_env():
    env = {"DRAMA_CHECKPOINT": "/ckpt", "DRAMA_BACKBONE_ADDR": "backbone:50051", "DRAMA_API_KEYS": "key-alpha, key-beta,",
           "DRAMA_TAKE_TTL_S": "60", "DRAMA_VOICE_ALIASES": '{"Alloy": "Narrator"}',
           "DRAMA_METRICS_REQUIRE_AUTH": "1", "DRAMA_ALLOWED_MEDIA_DOMAINS": "Example.com"}
    settings = Settings.from_env(env, codec_addr="codec:1")
    assert str(settings.checkpoint) == "/ckpt" and settings.backbone_addr == "backbone:50051"
    assert settings.codec_addr == "codec:1" and settings.api_keys == ["key-alpha", "key-beta"] and settings.take_ttl_s == 60
    assert settings.voice_aliases == {"alloy": "narrator"} and settings.metrics_require_auth
    assert settings.allowed_media_domains == ["example.com"]
    assert "key-alpha" not in repr(settings)                     # keys are never logged
    with pytest.raises(ValueError):
        Settings.from_env({"DRAMA_OPENAI_MAX_INPUT_CHARS": "40000"})


def _take(take_id: str, frames: int = 100) -> Take:
    return Take(id=take_id, text="hi", codes=np.zeros((10, frames), np.int16), speakers=[0], sample_rate=44100, seed=1)


def test_take_store_expires_after_ttl():
    now = [0.0]
    store = TakeStore(max_mb=1, ttl_s=10, clock=lambda: now[0])
    store.put(_take("a"))
    now[0] = 9.0
    assert store.get("a") is not None
    now[0] = 10.5
    assert store.get("a") is None and len(store) == 0


def test_take_store_evicts_least_recently_used():
    one = _take("x").nbytes
    store = TakeStore(max_mb=3.5 * one / 2**20, ttl_s=100)
    for name in "abc":
        store.put(_take(name))
    assert store.get("a") is not None          # a is now the most recent
    store.put(_take("d"))
    assert store.get("b") is None and all(store.get(n) for n in "acd")


def test_voice_resolution_and_stable_seeds():
    voices = VoiceRegistry(aliases={"echo": "default"})
    alloy = voices.resolve("ALLOY")
    assert alloy.id == "alloy" and alloy.voice is None and alloy.seed == seed_for_voice("alloy")
    # Pinned: a seeded voice must sound the same after restarts and upgrades.
    assert seed_for_voice("alloy") == 2759055006 and seed_for_voice("alloy") != seed_for_voice("ash")
    assert voices.resolve("default").seed is None
    assert voices.resolve("echo").id == "default"               # an alias to another voice
    with pytest.raises(ApiError) as info:
        voices.resolve("nobody")
    assert info.value.code == "voice_not_found" and info.value.status == 400


def test_metrics_exposition():
    metrics = GatewayMetrics()
    metrics.http_requests.inc(route="/v1/audio/speech", status="200")
    metrics.ttfa.observe(0.3)
    metrics.ttfa.observe(7.0)
    text = metrics.render()
    assert 'drama_http_requests_total{route="/v1/audio/speech",status="200"} 1' in text
    assert 'drama_speech_ttfa_seconds_bucket{le="0.5"} 1' in text
    assert 'drama_speech_ttfa_seconds_bucket{le="+Inf"} 2' in text
    assert "drama_speech_ttfa_seconds_count 2" in text and "drama_speech_ttfa_seconds_sum 7.3" in text
    for name in ("drama_speech_in_flight", "drama_speech_queue_wait_seconds", "drama_speech_e2e_seconds",
                 "drama_speech_rtf", "drama_speech_audio_seconds", "drama_speech_chunk_interval_seconds",
                 "drama_speech_underrun_seconds", "drama_speech_output_frames_total",
                 "drama_reference_encode_seconds", "drama_reference_cache_hits_total"):
        assert f"# TYPE {name} " in text

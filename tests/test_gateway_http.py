"""Gateway HTTP surface without the model stages: strict parsing, the error envelope, auth, voices,
models, health and metrics (API.md §1).

The app is built with the tiny checkpoint (so the prompt builder and voice resolution are real)
but the stage addresses point at a closed port, so a request that passes validation ends in a
503 from the gRPC error mapping; that 503 is how these tests see "validation passed".
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import soundfile as sf
import uvicorn
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from gateway.validation import OPENAI_VOICES


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _settings(checkpoint, **overrides) -> Settings:
    addr = _closed_port()
    return Settings(checkpoint=checkpoint, backbone_addr=addr, codec_addr=addr, **overrides)


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    store = tmp_path_factory.mktemp("voices")
    with TestClient(create_app(_settings(tiny_checkpoint, voice_store_dir=store))) as c:
        yield c


def sine_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    expected_type = "server_error" if response.status_code >= 500 else "invalid_request_error"
    assert body["error"]["type"] == expected_type
    return body["error"]


def speech(client, body, **kwargs):
    return client.post("/v1/audio/speech", json=body, **kwargs)


# --------------------------------------------------------------------------------------------
# Strict parsing (§1.1, §1.2)
# --------------------------------------------------------------------------------------------

def test_unknown_field_is_refused_with_its_path(client):
    err = error_of(r := speech(client, {"input": "hi", "voice": {"id": "alloy", "speed": 2}}))
    assert r.status_code == 400
    assert err["code"] == "unknown_parameter" and err["param"] == "voice.speed"
    assert err["message"] == "Unrecognized request argument supplied: voice.speed"


def test_unknown_field_deep_in_tts_references(client):
    ref = {"vq_codes": [[1]] * 10, "text": "x"}
    body = {"text": "hi", "references": [ref, ref, {**ref, "sped": 1}]}
    err = error_of(client.post("/v1/tts", json=body))
    assert (err["code"], err["param"]) == ("unknown_parameter", "references[2].sped")


def test_duplicate_key_is_refused_with_its_path(client):
    body = b'{"text": "hi", "prosody": {"speed": 1, "speed": 2}}'
    r = client.post("/v1/tts", content=body, headers={"content-type": "application/json"})
    err = error_of(r)
    assert r.status_code == 400 and (err["code"], err["param"]) == ("duplicate_parameter", "prosody.speed")


@pytest.mark.parametrize("field,value,expected", [
    ("speed", "1.0", "a number"), ("seed", True, "an integer"), ("top_k", 2.5, "an integer"),
    ("stream", 1, "a boolean"), ("input", 5, "a string"),
])
def test_no_type_coercion(client, field, value, expected):
    err = error_of(r := speech(client, {"input": "hi", field: value}))
    assert r.status_code == 400 and err["code"] == "invalid_type" and err["param"] == field
    assert f"expected {expected}" in err["message"]


def test_integer_accepted_for_number_and_null_means_absent(client):
    r = speech(client, {"input": "hi", "speed": 1, "instructions": None, "seed": None, "voice": None})
    assert r.status_code == 503 and error_of(r)["code"] == "upstream_unavailable"


def test_invalid_json(client):
    r = client.post("/v1/audio/speech", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"


@pytest.mark.parametrize("body,code,param", [
    ({}, "missing_required_parameter", "input"),
    ({"input": None}, "missing_required_parameter", "input"),
    ({"input": "   "}, "empty_string", "input"),
    ({"input": "x" * 4097}, "string_above_max_length", "input"),
    ({"input": "<|speaker:16|>hi"}, "invalid_value", "input"),
    ({"input": "hi <|im_end|>"}, "invalid_value", "input"),
    ({"input": "hi", "response_format": "ogg"}, "invalid_value", "response_format"),
    ({"input": "hi", "speed": 5}, "out_of_range", "speed"),
    ({"input": "hi", "response_format": "opus", "sample_rate": 44100}, "invalid_value", "sample_rate"),
    ({"input": "hi", "response_format": "flac", "stream_format": "sse"}, "conflicting_parameters", "stream_format"),
    ({"input": "hi", "stream": False, "stream_format": "sse"}, "conflicting_parameters", "stream_format"),
    ({"input": "hi", "voice": "bad voice!"}, "invalid_value", "voice"),
    ({"input": "hi", "instructions": "y" * 4097}, "string_above_max_length", "instructions"),
])
def test_openai_field_errors(client, body, code, param):
    r = speech(client, body)
    err = error_of(r)
    assert r.status_code == 400 and (err["code"], err["param"]) == (code, param)


def test_error_messages_follow_openai_wording(client):
    err = error_of(speech(client, {"input": "x" * 4097}))
    assert err["message"] == ("Invalid 'input': string too long. Expected a string with maximum length 4096, "
                              "but got a string with length 4097 instead.")
    err = error_of(speech(client, {"input": "hi", "stream_format": "x"}))
    assert err["message"] == "Invalid value: 'x'. Supported values are: 'audio' and 'sse'."
    err = error_of(speech(client, {"input": "<|speaker:16|>hi"}))
    assert err["message"] == "Invalid speaker tag '<|speaker:16|>': speaker index must be between 0 and 15."


def test_unknown_model_is_404_and_aliases_pass(client):
    r = speech(client, {"input": "hi", "model": "tts-2"})
    assert r.status_code == 404 and error_of(r) == {
        "message": "The model 'tts-2' does not exist.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    for alias in ("tts-1", "gpt-4o-mini-tts", "fishaudio/drama-3"):
        assert speech(client, {"input": "hi", "model": alias}).status_code == 503


def test_unknown_voice_is_400_voice_not_found(client):
    err = error_of(r := speech(client, {"input": "hi", "voice": "nobody"}))
    assert r.status_code == 400 and (err["code"], err["param"]) == ("voice_not_found", "voice")
    assert err["message"] == "Voice 'nobody' was not found. List voices with GET /v1/audio/voices."


def test_unknown_take_is_400_take_not_found(client):
    err = error_of(client.post("/v1/tts", json={"text": "hi", "history": [{"take_id": "take_x"}]}))
    assert (err["code"], err["param"]) == ("take_not_found", "history[0].take_id")


@pytest.mark.parametrize("body,code,param", [
    ({"text": "hi", "references": [{"text": "x"}]}, "missing_required_parameter", "references[0].audio"),
    ({"text": "hi", "references": [{"vq_codes": [[1]] * 10, "audio": "AAAA", "text": "x"}]},
     "conflicting_parameters", "references[0].audio"),
    ({"text": "hi", "references": [[{"vq_codes": [[1]] * 10, "text": "x"}], {"text": "y"}]},
     "invalid_type", "references"),
    ({"text": "hi", "references": [[{"vq_codes": [[1]] * 10, "text": "x", "speaker": 1}]]},
     "unknown_parameter", "references[0][0].speaker"),
    ({"text": "hi", "references": [{"vq_codes": [[1]] * 9, "text": "x"}]}, "invalid_value", "references[0].vq_codes"),
    ({"text": "hi", "references": [{"vq_codes": [[1, 2]] + [[1]] * 9, "text": "x"}]},
     "invalid_value", "references[0].vq_codes[1]"),
    ({"text": "hi", "references": [{"vq_codes": [[1]] * 9 + [[99999]], "text": "x"}]},
     "out_of_range", "references[0].vq_codes[9][0]"),
    ({"text": "hi", "references": [{"audio": "!!notbase64", "text": "x"}]}, "audio_undecodable", "references[0].audio"),
    ({"text": "hi", "references": [{"audio_path": "file:///etc/passwd", "text": "x"}]},
     "invalid_value", "references[0].audio_path"),
    ({"text": "hi", "reference_id": ["alloy", 3]}, "invalid_type", "reference_id[1]"),
    ({"text": "hi", "reference_id": "nobody"}, "voice_not_found", "reference_id"),
    ({"text": "hi", "references": [{"vq_codes": [[1]] * 10, "text": "x"}], "reference_id": "alloy"},
     "conflicting_parameters", "reference_id"),
    ({"text": "hi", "format": "wav", "stream_format": "sse"}, "conflicting_parameters", "stream_format"),
    ({"text": "hi", "prosody": {"speed": 1, "pitch": 2}}, "unknown_parameter", "prosody.pitch"),
    ({"text": "hi", "chunk_length": 10}, "out_of_range", "chunk_length"),
    ({"text": "hi", "use_memory_cache": True}, "invalid_type", "use_memory_cache"),
    ({"text": "hi", "latency": "fast"}, "invalid_value", "latency"),
])
def test_tts_field_errors(client, body, code, param):
    err = error_of(r := client.post("/v1/tts", json=body))
    assert r.status_code == 400 and (err["code"], err["param"]) == (code, param), err


def test_tts_accepts_fish_sdk_msgpack_body(client):
    """fish-audio-sdk 1.3 sends MessagePack with raw bytes audio and these defaults (exclude_none)."""
    body = {"text": "hello", "chunk_length": 200, "format": "mp3", "mp3_bitrate": 128, "opus_bitrate": 32,
            "references": [{"audio": sine_wav(), "text": "a tone"}], "normalize": True, "latency": "balanced",
            "top_p": 0.7, "temperature": 0.7, "max_new_tokens": 1024, "repetition_penalty": 1.2,
            "min_chunk_length": 50, "condition_on_previous_chunks": True, "early_stop_threshold": 1.0,
            "prosody": {"speed": 1.0, "volume": 0.0}}
    r = client.post("/v1/tts", content=msgpack.packb(body, use_bin_type=True),
                    headers={"content-type": "application/msgpack", "model": "s2-pro"})
    # Validation passed; the codec (for the reference) is unreachable.
    assert r.status_code == 503 and error_of(r)["code"] == "upstream_unavailable"
    r = client.post("/v1/tts", content=msgpack.packb({**body, "extra": 1}, use_bin_type=True),
                    headers={"content-type": "application/msgpack"})
    assert (r.status_code, error_of(r)["param"]) == (400, "extra")
    r = client.post("/v1/tts", content=msgpack.packb({**body, "condition_on_previous_chunks": False}),
                    headers={"content-type": "application/msgpack"})
    assert (r.status_code, error_of(r)["param"]) == (400, "condition_on_previous_chunks")
    r = client.post("/v1/tts", content=msgpack.packb({"text": "hi"}),
                    headers={"content-type": "application/msgpack", "model": "speech-9"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"


def test_body_limit_from_content_length_and_while_reading(client):
    big = b'{"input": "' + b"a" * (1024 * 1024) + b'"}'
    r = client.post("/v1/audio/speech", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

    def chunked():                       # no Content-Length: the limit is enforced while reading
        yield b'{"input": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    r = client.post("/v1/audio/speech", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_wrong_content_type_is_415(client):
    r = client.post("/v1/audio/speech", content=b"input=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    r = client.post("/v1/audio/speech", content=b'{"input":"hi"}',
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 503


def test_unknown_route_and_query_parameter(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = client.post("/v1/audio/speech?fast=1", json={"input": "hi"})
    assert r.status_code == 400 and (error_of(r)["code"], error_of(r)["param"]) == ("unknown_parameter", "fast")


def test_incoming_traceparent_is_honoured(client):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = client.get("/v1/models", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.headers["x-trace-id"] == trace_id


def test_request_id_is_echoed_or_made(client):
    r = client.get("/health", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and len(r.headers["x-trace-id"]) == 32
    r = client.get("/health", headers={"x-request-id": "bad id with spaces"})
    assert r.headers["x-request-id"].startswith("req_") and len(r.headers["x-request-id"]) == 36
    assert speech(client, {}).headers["x-request-id"].startswith("req_")


# --------------------------------------------------------------------------------------------
# Auth
# --------------------------------------------------------------------------------------------

def test_api_keys(tiny_checkpoint):
    app = create_app(_settings(tiny_checkpoint, api_keys=["k1", "secret-2"]))
    with TestClient(app) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer secret-2"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    with TestClient(create_app(_settings(tiny_checkpoint))) as c:     # keys off: any header ignored
        assert c.get("/v1/models", headers={"authorization": "Bearer EMPTY"}).status_code == 200


def test_metrics_auth_and_cors_are_opt_in(tiny_checkpoint):
    settings = _settings(tiny_checkpoint, api_keys=["k"], metrics_require_auth=True,
                         cors_origins=["https://app.example"])
    with TestClient(create_app(settings)) as c:
        assert c.get("/metrics").status_code == 401 and c.get("/ready").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer k"}).status_code == 200
        r = c.options("/v1/audio/speech", headers={"origin": "https://app.example",
                                                   "access-control-request-method": "POST"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
    with TestClient(create_app(_settings(tiny_checkpoint))) as c:
        r = c.get("/health", headers={"origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers


# --------------------------------------------------------------------------------------------
# Voices, models, takes, health, metrics
# --------------------------------------------------------------------------------------------

def upload(client, name, audio, **fields):
    data = {"name": name, "consent": "consent-ref-1", "ref_text": "A short tone.", **fields}
    return client.post("/v1/audio/voices", data=data, files={"audio_sample": ("clip.wav", audio, "audio/wav")})


def test_voices_list_has_builtins_sorted(client):
    body = client.get("/v1/audio/voices").json()
    ids = [v["id"] for v in body["voices"]]
    assert body["object"] == "list" and body["default_voice"] == "default"
    assert ids == sorted(ids) and {"default", *OPENAI_VOICES} <= set(ids)
    alloy = next(v for v in body["voices"] if v["id"] == "alloy")
    assert alloy["object"] == "audio.voice" and alloy["source"] == "builtin" and alloy["duration_s"] is None
    assert client.get("/v1/audio/voices?model=tts-1").status_code == 200
    assert client.get("/v1/audio/voices?model=nope").status_code == 404
    assert client.get("/v1/audio/voices?lang=en").status_code == 400


def test_voice_upload_get_delete(client):
    r = upload(client, "My-Voice", sine_wav(2.0), speaker_description="a steady tone")
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["id"] == "my-voice" and voice["name"] == "My-Voice" and voice["source"] == "uploaded"
    assert voice["has_transcript"] and abs(voice["duration_s"] - 2.0) < 0.01
    assert client.get("/v1/audio/voices/my-voice").json()["id"] == "my-voice"
    r = upload(client, "my-voice", sine_wav())
    assert r.status_code == 409 and error_of(r)["code"] == "voice_already_exists"
    assert r.headers["x-should-retry"] == "false"
    r = client.delete("/v1/audio/voices/my-voice")
    assert r.json() == {"object": "audio.voice.deleted", "id": "my-voice", "deleted": True}
    assert client.get("/v1/audio/voices/my-voice").status_code == 404
    assert client.delete("/v1/audio/voices/my-voice").status_code == 404
    r = client.delete("/v1/audio/voices/alloy")
    assert r.status_code == 400 and error_of(r)["code"] == "voice_not_deletable"


def test_voice_upload_errors(client):
    r = upload(client, "short", sine_wav(0.5))
    assert r.status_code == 400 and error_of(r)["code"] == "audio_too_short"
    r = upload(client, "long", sine_wav(31.0, rate=8000))
    assert r.status_code == 400 and error_of(r)["code"] == "audio_too_long"
    r = upload(client, "junk", b"not audio at all" * 100)
    assert r.status_code == 400 and error_of(r)["code"] == "audio_undecodable"
    r = upload(client, "x", sine_wav(), age=3)
    assert (r.status_code, error_of(r)["param"]) == (400, "age")
    r = client.post("/v1/audio/voices", data={"name": "nofile", "consent": "c", "ref_text": "t"})
    assert error_of(r)["code"] in ("missing_required_parameter", "unsupported_media_type")
    r = upload(client, "no_consent", sine_wav(), consent="")
    assert r.status_code == 400 and error_of(r)["param"] == "consent"


def test_uploaded_voice_survives_restart_and_is_usable(tiny_checkpoint, tmp_path):
    with TestClient(create_app(_settings(tiny_checkpoint, voice_store_dir=tmp_path))) as c:
        assert upload(c, "keeper", sine_wav()).status_code == 200
    with TestClient(create_app(_settings(tiny_checkpoint, voice_store_dir=tmp_path))) as c:
        assert c.get("/v1/audio/voices/keeper").json()["source"] == "uploaded"
        r = speech(c, {"input": "hi", "voice": "keeper"})      # resolves, then the codec is away
        assert r.status_code == 503


def test_preset_voices_are_loaded(tiny_checkpoint, tmp_path):
    (tmp_path / "narrator.wav").write_bytes(sine_wav())
    (tmp_path / "narrator.txt").write_text("Once upon a time.")
    (tmp_path / "narrator.json").write_text(json.dumps({"name": "The Narrator"}))
    with TestClient(create_app(_settings(tiny_checkpoint, voices_dir=tmp_path))) as c:
        voice = c.get("/v1/audio/voices/narrator").json()
        assert voice["source"] == "preset" and voice["name"] == "The Narrator" and voice["has_transcript"]
        assert c.delete("/v1/audio/voices/narrator").status_code == 400


def test_models(client):
    body = client.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["drama-3"]
    model = body["data"][0]
    assert model["sample_rate"] == 44100 and "wav" in model["response_formats"] and model["max_input_chars"] == 4096
    assert client.get("/v1/models/drama-3").json()["id"] == "drama-3"
    r = client.get("/v1/models/tts-1")
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"


def test_take_not_found(client):
    r = client.get("/v1/takes/take_missing")
    assert r.status_code == 404 and error_of(r)["code"] == "take_not_found"


def test_health_ready_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/health").json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "not_ready"
    assert r.json()["stages"] == {"backbone": "UNREACHABLE", "tower": "UNKNOWN", "codec": "UNREACHABLE"}
    text = client.get("/metrics").text
    assert "# TYPE drama_http_requests_total counter" in text
    assert 'drama_http_requests_total{route="/health",status="200"}' in text


# --------------------------------------------------------------------------------------------
# The official OpenAI client against a real port
# --------------------------------------------------------------------------------------------

class ServerThread:
    """uvicorn on a free port in a thread (the OpenAI client needs a real socket)."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def test_openai_client_sees_400s_and_creates_voices(tiny_checkpoint):
    openai = pytest.importorskip("openai")
    with ServerThread(create_app(_settings(tiny_checkpoint))) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice="alloy", input="hi", extra_body={"sped": 2})
        assert info.value.code == "unknown_parameter" and info.value.param == "sped"
        assert info.value.request_id.startswith("req_")
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice="nobody", input="hi")
        assert info.value.code == "voice_not_found"
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice="alloy", input="x" * 5000)
        assert info.value.code == "string_above_max_length"
        voice = client.audio.voices.create(name="Sdk-Voice", audio_sample=("clip.wav", sine_wav(), "audio/wav"),
                                           consent="consent-1", extra_body={"ref_text": "A tone."})
        assert (voice.id, voice.name, voice.object) == ("sdk-voice", "Sdk-Voice", "audio.voice")
        with pytest.raises(openai.InternalServerError) as info:      # 503: the stages are away
            client.audio.speech.create(model="tts-1", voice="alloy", input="hi")
        assert info.value.status_code == 503


def test_entry_point_serves_health(tiny_checkpoint):
    """`python -m gateway --checkpoint DIR --port P` starts and answers /health (stages absent)."""
    import os
    import subprocess
    import sys

    import httpx

    port = int(_closed_port().split(":")[1])
    env = dict(os.environ, DRAMA_BACKBONE_ADDR=_closed_port(), DRAMA_CODEC_ADDR=_closed_port())
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--checkpoint", str(tiny_checkpoint),
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "gateway did not answer"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r.json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503
    finally:
        proc.terminate()
        proc.wait(30)

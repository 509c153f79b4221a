"""Hostile files (issue #9): reference paths, oversize bodies and audio, decompression bombs, and a
codec.pth that would run code.

Two gateways share one set of stage processes (services.launcher.Stack): the stack's own, with
both allow-lists unset (the default), and a second one started with
DRAMA_ALLOWED_LOCAL_MEDIA_PATH=<a temp dir> and DRAMA_ALLOWED_MEDIA_DOMAINS=127.0.0.1. A local
HTTP server counts the requests it gets, and the files' access times (set to 1970 first, so any
read moves them under relatime) show whether a file was read.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from services.launcher import ManagedProcess, Stack, free_ports, wait_ready

REF_TEXT = "A short reference clip."
FLAC_STREAMINFO = 8         # offset of the STREAMINFO body after 'fLaC' and its block header


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


class CountingServer:
    """A loopback HTTP server that serves one WAV at /ref.wav, redirects /redirect there, and
    counts every request by path."""

    def __init__(self, wav: bytes):
        self.hits: dict[str, int] = {}
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits[self.path] = hits.get(self.path, 0) + 1
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/ref.wav")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "audio/wav")
                self.send_header("Content-Length", str(len(wav)))
                self.end_headers()
                self.wfile.write(wav)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """An allowed root with ref.wav and a symlink out of it; a secret.wav beside the root."""
    base = tmp_path_factory.mktemp("media")
    root = base / "allowed"
    root.mkdir()
    (root / "ref.wav").write_bytes(wav_bytes(1.5))
    (base / "secret.wav").write_bytes(wav_bytes(1.5, rate=22050))
    (root / "link.wav").symlink_to(base / "secret.wav")
    return root


def never_read(path: Path) -> None:
    """Set the access time to 1970: any later read moves it (relatime updates an atime older than
    the mtime)."""
    os.utime(path, (0, path.stat().st_mtime))


def was_read(path: Path) -> bool:
    return path.stat().st_atime > 0


@pytest.fixture(scope="module")
def web(media):
    server = CountingServer((media / "ref.wav").read_bytes())
    yield server
    server.close()


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, 0) as running:
        running.start()
        yield running


@pytest.fixture(scope="module")
def open_gateway(stack, media):
    """A second gateway on the same stages, with both allow-lists set; yields its URL."""
    gateway = next(p for p in stack.processes if p.name == "gateway")
    argv = list(gateway.argv)
    port = free_ports(1)[0]
    argv[argv.index("--port") + 1] = str(port)
    env = dict(os.environ, DRAMA_ALLOWED_LOCAL_MEDIA_PATH=str(media), DRAMA_ALLOWED_MEDIA_DOMAINS="127.0.0.1",
               PYTHONUNBUFFERED="1")
    process = ManagedProcess("gateway-open", argv, stack.log_dir / "gateway-open.log").start(env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [process], timeout_s=120)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.popen.wait(15)


def tts(url: str, reference: dict, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/tts", timeout=timeout_s, json={
        "text": "Hello.", "max_new_tokens": 2, "format": "pcm",
        "references": [{"text": REF_TEXT, **reference}]})


def assert_refused(response: httpx.Response, code: str, param: str | None = None) -> None:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


# --------------------------------------------------------------------------------------------
# Reference paths
# --------------------------------------------------------------------------------------------

def refused_paths(media: Path, web: CountingServer) -> list[str]:
    secret = media.parent / "secret.wav"
    return [f"file://{media}/ref.wav", f"file://{media}/../secret.wav", f"file://{secret}", str(secret),
            str(media / "ref.wav"), "../secret.wav", "secret.wav", f"http://127.0.0.1:{web.port}/ref.wav",
            f"https://127.0.0.1:{web.port}/ref.wav", f"ftp://127.0.0.1:{web.port}/ref.wav",
            f"file://localhost{secret}"]


def test_paths_and_urls_refused_by_default(stack, media, web):
    """No allow-list: file://, .., absolute and relative paths and http(s) URLs are all refused
    with invalid_value; no file is read and no request goes out."""
    files = [media / "ref.wav", media.parent / "secret.wav"]
    for path in files:
        never_read(path)
    hits_before = sum(web.hits.values())
    for audio_path in refused_paths(media, web):
        assert_refused(tts(stack.url, {"audio_path": audio_path}), "invalid_value", "references[0].audio_path")
    assert not any(was_read(path) for path in files)
    assert sum(web.hits.values()) == hits_before


def test_allowed_local_file_and_domain_work(open_gateway, media, web):
    """With the allow-lists set, a file under the root and a URL on the allowed host are used
    (which also shows the two detectors see a read and a request)."""
    never_read(media / "ref.wav")
    response = tts(open_gateway, {"audio_path": f"file://{media}/ref.wav"})
    assert response.status_code == 200 and len(response.content) > 0, response.text[:300]
    assert was_read(media / "ref.wav")

    before = web.hits.get("/ref.wav", 0)
    response = tts(open_gateway, {"audio_path": f"http://127.0.0.1:{web.port}/ref.wav"})
    assert response.status_code == 200 and len(response.content) > 0, response.text[:300]
    assert web.hits.get("/ref.wav", 0) == before + 1


def test_allow_lists_do_not_open_anything_else(open_gateway, media, web):
    """With the allow-lists set: .. out of the root, a symlink out of it, a plain path, another
    host name and a redirect off the allowed URL are still refused, and nothing outside is read."""
    secret = media.parent / "secret.wav"
    never_read(secret)
    for audio_path in (f"file://{media}/../secret.wav", f"file://{media}/link.wav", f"file://{secret}",
                       str(media / "ref.wav"), f"http://localhost:{web.port}/ref.wav"):
        assert_refused(tts(open_gateway, {"audio_path": audio_path}), "invalid_value", "references[0].audio_path")
    assert not was_read(secret)
    before = web.hits.get("/ref.wav", 0)
    response = tts(open_gateway, {"audio_path": f"http://127.0.0.1:{web.port}/redirect"})
    assert response.status_code == 400, response.text[:300]
    assert web.hits.get("/ref.wav", 0) == before           # the redirect was not followed


# --------------------------------------------------------------------------------------------
# Oversize bodies and audio
# --------------------------------------------------------------------------------------------

def test_oversize_body_is_413(stack):
    """Over 1 MiB on /v1/audio/speech: 413 request_too_large, by Content-Length and while reading
    a chunked body that declares none."""
    body = b'{"input": "' + b"a" * (1024 * 1024) + b'"}'
    response = httpx.post(f"{stack.url}/v1/audio/speech", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"input": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(f"{stack.url}/v1/audio/speech", content=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_declared_oversize_body_is_refused_before_it_is_sent(stack):
    """A Content-Length of 60 MB on /v1/tts (limit 48 MiB) is answered 413 without waiting for
    the body."""
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/tts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 60000000\r\n\r\n{")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_oversize_reference_audio_is_400(stack):
    """A clip over 10 MiB (decoded) or over 30 s: 400 audio_too_long."""
    big = base64.b64encode(b"\0" * (10 * 1024 * 1024 + 1)).decode()
    assert_refused(tts(stack.url, {"audio": big}), "audio_too_long")
    long_clip = base64.b64encode(wav_bytes(31.0, rate=8000)).decode()
    assert_refused(tts(stack.url, {"audio": long_clip}), "audio_too_long")


# --------------------------------------------------------------------------------------------
# Decompression bombs
# --------------------------------------------------------------------------------------------

def silent_flac(minutes: int, rate: int = 8000) -> bytearray:
    buffer = io.BytesIO()
    with sf.SoundFile(buffer, "w", samplerate=rate, channels=1, format="FLAC", subtype="PCM_16") as out:
        for _ in range(minutes):
            out.write(np.zeros(rate * 60, np.int16))
    return bytearray(buffer.getvalue())


def flac_declaring(total_samples: int, minutes: int = 20) -> bytes:
    """A small FLAC of silence whose STREAMINFO claims `total_samples` (36 bits; 0 = unknown)."""
    data = silent_flac(minutes)
    at = FLAC_STREAMINFO + 13
    data[at] = (data[at] & 0xF0) | (total_samples >> 32)
    data[at + 1:at + 5] = (total_samples & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


def wav_declaring_huge_length(seconds: float = 2.0) -> bytes:
    data = bytearray(wav_bytes(seconds))
    data[4:8] = (0xFFFFFFF0).to_bytes(4, "little")        # RIFF size
    data[40:44] = (0xFFFFFFE0).to_bytes(4, "little")      # data chunk size
    return bytes(data)


def silent_webm(minutes: int) -> bytes:
    """Opus in WebM (decoded by the gateway with FFmpeg, not by libsndfile): minutes of silence in
    a few hundred kB."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000, layout="mono")
        second = np.zeros((1, 48000), np.int16)
        for index in range(minutes * 60):
            frame = av.AudioFrame.from_ndarray(second, format="s16", layout="mono")
            frame.sample_rate, frame.pts = 48000, index * 48000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize("name, make", [
    ("flac declaring 2^36 samples", lambda: flac_declaring(2 ** 36 - 1)),
    ("flac of unknown length", lambda: flac_declaring(0)),
    ("flac of 20 min silence, honest", lambda: bytes(silent_flac(20))),
])
def test_audio_bombs_are_refused_quickly(stack, name, make):
    """Small files that decode to hours (or claim to): 400 audio_too_long within 5 s."""
    clip = base64.b64encode(make()).decode()
    started = time.monotonic()
    response = tts(stack.url, {"audio": clip})
    assert time.monotonic() - started < 5.0
    assert_refused(response, "audio_too_long")


def test_wav_header_claiming_gigabytes_is_not_trusted(stack):
    """A WAV whose RIFF and data sizes claim ~4 GiB but which holds 2 s: handled within 5 s as the
    2 s it holds (the header length is never used to allocate)."""
    started = time.monotonic()
    response = tts(stack.url, {"audio": base64.b64encode(wav_declaring_huge_length()).decode()})
    assert time.monotonic() - started < 5.0
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        assert response.json()["error"]["code"] in ("audio_undecodable", "audio_too_long")


def test_webm_bomb_is_refused_quickly(stack):
    clip = base64.b64encode(silent_webm(10)).decode()
    started = time.monotonic()
    response = tts(stack.url, {"audio": clip})
    assert time.monotonic() - started < 5.0
    assert_refused(response, "audio_too_long")


# --------------------------------------------------------------------------------------------
# A codec.pth that would run code
# --------------------------------------------------------------------------------------------

class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_hostile_codec_pth_refused_at_server_start(tiny_checkpoint, tmp_path):
    """`python -m services.codec` on a checkpoint whose codec.pth pickles os.system: the process
    refuses to serve (exits with the refusal in its log) and the command never runs.
    (test_safe_pickle.py covers the loader against many gadgets; this is the server's start.)"""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for item in Path(tiny_checkpoint).iterdir():
        if item.name != "codec.pth":
            (checkpoint / item.name).symlink_to(item)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Reduce(os.system, (f"touch {marker}",)), protocol=2)
    with zipfile.ZipFile(checkpoint / "codec.pth", "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")
    port = free_ports(1)[0]
    result = subprocess.run([sys.executable, "-m", "services.codec", "--checkpoint", str(checkpoint),
                             "--port", str(port), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "system" in (result.stdout + result.stderr) and "Unsafe" in (result.stdout + result.stderr)
    assert not marker.exists()

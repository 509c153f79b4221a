"""Security (issue #9): API keys, loopback binding, TLS and mutual TLS on the gRPC links.

One stack (services.launcher.Stack, separate OS processes) runs with DRAMA_API_KEYS set and every
gRPC link on mutual TLS (a CA, and one certificate for every process, made here with
`cryptography`): the gateway must present its certificate to the stages, the backbone to the
tower. Keys: a missing or wrong key is a 401 envelope with `WWW-Authenticate: Bearer`, a right key
works, no key is ever written to a log, and the comparison goes through a constant-time compare.
Binding: each entry point listens on 127.0.0.1 unless given --host. The compose file's published
ports are checked in test_deploy.py.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import ipaddress
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher import ManagedProcess, Stack, free_ports

try:        # certificates for the TLS stack; the tests that need none run without the package
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError:
    x509 = None

KEYS = ("sk-test-key-one-7f3a9c", "sk-test-key-two-b81e04")


# --------------------------------------------------------------------------------------------
# Certificates
# --------------------------------------------------------------------------------------------

def _name(common_name: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([
                       x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return obj.public_bytes(serialization.Encoding.PEM)


def make_pki(directory: Path, name: str) -> dict[str, Path]:
    """A CA and one leaf certificate (server and client use, SAN 127.0.0.1/localhost) signed by it."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate(f"{name} CA", ca_key, _name(f"{name} CA"), ca_key, ca=True)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf_cert = _certificate(f"{name} leaf", leaf_key, ca_cert.subject, ca_key, ca=False)
    files = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    files["ca"].write_bytes(_pem(ca_cert))
    files["cert"].write_bytes(_pem(leaf_cert))
    files["key"].write_bytes(_pem(leaf_key))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if x509 is None:
        pytest.skip("needs the cryptography package")
    base = tmp_path_factory.mktemp("pki")
    return {"ours": make_pki(base / "ours", "dramaturg"), "other": make_pki(base / "other", "stranger")}


def tls_env(files: dict[str, Path], *, mutual: bool = True) -> dict[str, str]:
    env = {"DRAMA_GRPC_TLS_CERT": str(files["cert"]), "DRAMA_GRPC_TLS_KEY": str(files["key"])}
    if mutual:
        env["DRAMA_GRPC_TLS_CA"] = str(files["ca"])
    return env


# --------------------------------------------------------------------------------------------
# The stack: API keys on, every gRPC link on mutual TLS
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tiny_checkpoint, pki):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DRAMA_API_KEYS", ",".join(KEYS))
        for name, value in tls_env(pki["ours"]).items():
            env.setenv(name, value)
        with Stack(tiny_checkpoint, 0) as running:
            running.start()       # ready = the gateway reached every stage over mutual TLS
            yield running


def stage_addr(stack: Stack, name: str) -> str:
    argv = next(p for p in stack.processes if p.name == name).argv
    return f"127.0.0.1:{argv[argv.index('--port') + 1]}"


def speech(stack: Stack, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/audio/speech", headers=headers, timeout=60,
                      json={"input": "Hello there.", "voice": "alloy", "max_new_tokens": 4, "response_format": "pcm"})


# --------------------------------------------------------------------------------------------
# API keys
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEYS[0][:-1]}"},
    {"Authorization": f"Bearer {KEYS[0]}x"}, {"Authorization": f"Basic {KEYS[0]}"},
    {"Authorization": KEYS[0]}, {"Authorization": "Bearer"},
], ids=["none", "wrong", "prefix", "longer", "basic", "no-scheme", "empty"])
def test_missing_or_wrong_key_is_401(stack, headers):
    for method, path in (("POST", "/v1/audio/speech"), ("GET", "/v1/models"), ("GET", "/v1/audio/voices")):
        response = httpx.request(method, f"{stack.url}{path}", headers=headers, timeout=30,
                                 json={"input": "hi"} if method == "POST" else None)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"error": {"message": response.json()["error"]["message"],
                                             "type": "invalid_request_error", "param": None,
                                             "code": "invalid_api_key"}}


def test_either_key_works_and_ops_routes_are_open(stack):
    for key in KEYS:
        response = speech(stack, {"Authorization": f"Bearer {key}"})
        assert response.status_code == 200 and len(response.content) > 0, response.text[:300]
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{stack.url}{path}", timeout=10).status_code == 200, path


def test_keys_never_reach_logs_or_metrics(stack):
    """After requests with right and wrong keys, no key (nor a wrong one) is in any process's log
    or in /metrics."""
    wrong = "sk-wrong-key-5d2c71"
    assert speech(stack, {"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    assert speech(stack, {"Authorization": f"Bearer {wrong}"}).status_code == 401
    time.sleep(0.5)                                  # let the log lines land
    texts = [p.log_path.read_text(errors="replace") for p in stack.processes]
    texts.append(httpx.get(f"{stack.url}/metrics", timeout=10).text)
    assert any("POST /v1/audio/speech" in text for text in texts)   # the gateway does log requests
    for secret in (*KEYS, wrong):
        assert not any(secret in text for text in texts), secret


def test_key_check_is_constant_time(monkeypatch):
    """Every configured key is compared with hmac.compare_digest (constant time), whichever
    matches, so timing tells nothing about which key or prefix was right."""
    from starlette.requests import Request

    from gateway import dependencies
    from gateway.errors import ApiError

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    if hasattr(dependencies, "compare_digest"):
        monkeypatch.setattr(dependencies, "compare_digest", spy)

    def request(header: str) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", header.encode())]})

    dependencies.check_api_key(request(f"Bearer {KEYS[0]}"), list(KEYS))
    assert len(calls) == len(KEYS)                  # the first key matched, the second was still compared
    calls.clear()
    with pytest.raises(ApiError):
        dependencies.check_api_key(request("Bearer nope"), list(KEYS))
    assert len(calls) == len(KEYS)


# --------------------------------------------------------------------------------------------
# TLS and mutual TLS
# --------------------------------------------------------------------------------------------

async def _health(addr: str, credentials: grpc.ChannelCredentials | None) -> str:
    channel = (grpc.aio.secure_channel(addr, credentials) if credentials
               else grpc.aio.insecure_channel(addr))
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    finally:
        await channel.close()


def credentials(files: dict[str, Path], *, ca_from: dict[str, Path] | None = None, with_cert: bool):
    ca = (ca_from or files)["ca"].read_bytes()
    if not with_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=files["key"].read_bytes(),
                                        certificate_chain=files["cert"].read_bytes())


@pytest.mark.parametrize("stage", ["codec", "tower", "backbone"])
def test_mutual_tls_stage_accepts_only_clients_with_our_certificate(stack, pki, stage):
    """A stage given DRAMA_GRPC_TLS_CA: plaintext fails, TLS without a client certificate fails,
    a client certificate from another CA fails, ours works (and the stack ran a request over it)."""
    addr = stage_addr(stack, stage)
    ours, other = pki["ours"], pki["other"]
    assert asyncio.run(_health(addr, None)) == "UNAVAILABLE"
    assert asyncio.run(_health(addr, credentials(ours, with_cert=False))) == "UNAVAILABLE"
    assert asyncio.run(_health(addr, credentials(other, ca_from=ours, with_cert=True))) == "UNAVAILABLE"
    assert asyncio.run(_health(addr, credentials(ours, with_cert=True))) == "SERVING"


def test_tls_without_client_auth(tiny_checkpoint, pki, tmp_path):
    """A stage given only a certificate and key: TLS clients verified by our CA connect without a
    certificate of their own; plaintext clients and clients trusting another CA fail."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAMA_GRPC_TLS")}
    env.update(tls_env(pki["ours"], mutual=False))
    process = ManagedProcess("codec", [sys.executable, "-m", "services.codec", "--checkpoint", str(tiny_checkpoint),
                                       "--port", str(port), "--device", "cpu"], tmp_path / "codec.log").start(env)
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while asyncio.run(_health(addr, credentials(pki["ours"], with_cert=False))) != "SERVING":
            assert process.alive() and time.monotonic() < deadline, process.log_tail()
            time.sleep(0.2)
        assert asyncio.run(_health(addr, None)) == "UNAVAILABLE"
        assert asyncio.run(_health(addr, credentials(pki["other"], with_cert=False))) == "UNAVAILABLE"
    finally:
        process.send_signal(signal.SIGKILL)
        process.popen.wait(10)


# --------------------------------------------------------------------------------------------
# Loopback by default
# --------------------------------------------------------------------------------------------

def listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address)
            if len(raw) == 4:
                found.add(str(ipaddress.IPv4Address(raw[::-1])))
            else:       # four little-endian 32-bit words; an IPv4-mapped address counts as IPv4
                v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add(str(v6.ipv4_mapped or v6))
    return found


def entry_point(name: str, checkpoint: Path, port: int, host: str | None, tower_port: int) -> list[str]:
    argv = [sys.executable, "-m", "gateway" if name == "gateway" else f"services.{name}",
            "--checkpoint", str(checkpoint), "--port", str(port)]
    if name == "backbone":
        argv += ["--tower", f"127.0.0.1:{tower_port}"]
    if name == "gateway":
        argv += ["--backbone", "127.0.0.1:1", "--codec", "127.0.0.1:1"]
    else:
        argv += ["--device", "cpu"]
    return argv + (["--host", host] if host else [])


def test_entry_points_bind_loopback_unless_told(tiny_checkpoint, tmp_path):
    """Each of the four entry points without --host listens on loopback only (gRPC's dual-stack
    socket shows 127.0.0.1 as ::ffff:127.0.0.1); with --host 0.0.0.0 on every interface."""
    names = ["codec", "tower", "backbone", "gateway"]
    ports = free_ports(2 * len(names) + 1)
    env = {k: v for k, v in os.environ.items() if k not in ("DRAMA_HOST", "DRAMA_API_KEYS")
           and not k.startswith("DRAMA_GRPC_TLS")}
    runs = []
    for index, (name, host) in enumerate([(n, h) for h in (None, "0.0.0.0") for n in names]):
        argv = entry_point(name, tiny_checkpoint, ports[index], host, ports[-1])
        process = ManagedProcess(f"{name}-{host}", argv, tmp_path / f"{name}-{index}.log").start(env)
        runs.append((name, host, ports[index], process))
    try:
        deadline = time.monotonic() + 120
        for name, host, port, process in runs:
            while not listening_addresses(port):
                assert process.alive(), process.describe_exit()
                assert time.monotonic() < deadline, f"{name} never listened on {port}"
                time.sleep(0.1)
            addresses = {ipaddress.ip_address(a) for a in listening_addresses(port)}
            if host is None:
                assert all(a.is_loopback for a in addresses), (name, addresses)
            else:
                assert any(a.is_unspecified for a in addresses), (name, addresses)
    finally:
        for *_, process in runs:
            process.send_signal(signal.SIGKILL)
        for *_, process in runs:
            process.popen.wait(10)

"""compose.yaml / compose.cpu.yaml and the collector config, checked statically (no Docker engine
runs here): the Compose specification's JSON schema (vendored in tests/data) plus our own
cross-checks against the code (entry-point modules, ports, env names, API.md §4's rules)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
APP_SERVICES = {"gateway": 8000, "backbone": 50051, "tower": 50052, "codec": 50053}
STAGES = ("backbone", "tower", "codec")


class _Tagged:
    def __init__(self, tag: str, value):
        self.tag, self.value = tag, value


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that keeps Compose's `!reset` / `!override` merge tags."""


def _construct_tagged(loader, tag_suffix, node):
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return _Tagged(tag_suffix, value)


_ComposeLoader.add_multi_constructor("!", _construct_tagged)


def _load(name: str) -> dict:
    with open(ROOT / name) as fh:
        return yaml.load(fh, Loader=_ComposeLoader)


def _merge(base, override):
    """Compose's merge rules, as far as our files use them: mappings merge recursively,
    sequences append (unique), scalars replace; `!reset` removes, `!override` replaces."""
    if isinstance(override, _Tagged):
        return None if override.tag == "reset" else copy.deepcopy(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            merged = _merge(base.get(key), value)
            if merged is None and isinstance(value, _Tagged):
                out.pop(key, None)
            else:
                out[key] = merged
        return out
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return copy.deepcopy(override)


def _plain(obj):
    """Drop the x- extension anchors' tags (none remain after merging) for schema validation."""
    return json.loads(json.dumps(obj))


@pytest.fixture(scope="module")
def schema():
    return json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())


@pytest.fixture(scope="module")
def gpu_compose():
    return _load("compose.yaml")


@pytest.fixture(scope="module")
def cpu_compose(gpu_compose):
    return _merge(gpu_compose, _load("compose.cpu.yaml"))


def test_compose_files_match_the_compose_schema(schema, gpu_compose, cpu_compose):
    jsonschema.validate(_plain(gpu_compose), schema)
    jsonschema.validate(_plain(cpu_compose), schema)


def test_mps_overlay_puts_the_stages_on_one_mps_daemon(schema, gpu_compose):
    """compose.mps.yaml over compose.yaml: a daemon service in the app image, and every stage in its
    IPC namespace with its pipe directory mounted, on the same (default) GPU; nothing else changes."""
    mps = _merge(gpu_compose, _load("compose.mps.yaml"))
    jsonschema.validate(_plain(mps), schema)
    services = mps["services"]
    daemon = services["mps"]
    assert daemon["command"] == ["nvidia-cuda-mps-control", "-f"]
    assert daemon["image"] == gpu_compose["x-app"]["image"]
    assert daemon["ipc"] == "shareable" and "ports" not in daemon and "expose" not in daemon
    pipe = daemon["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert f"mps-pipe:{pipe}" in daemon["volumes"] and "mps-pipe" in mps["volumes"]
    gpu = daemon["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["device_ids"] == ["${MPS_GPU:-0}"] and gpu["capabilities"] == ["gpu"]
    for stage in STAGES:
        service, base = services[stage], gpu_compose["services"][stage]
        assert service["ipc"] == "service:mps"
        assert service["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert f"mps-pipe:{pipe}" in service["volumes"]
        assert service["depends_on"]["mps"]["condition"] == "service_started"
        # the base file's settings survive the merge
        assert service["environment"] == {**base["environment"], **daemon["environment"]}
        assert all(v in service["volumes"] for v in base["volumes"])
        assert all(service["depends_on"][k] == v for k, v in base["depends_on"].items())
        assert service["deploy"] == base["deploy"]
        # by default on the daemon's GPU (both default to device 0)
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0].endswith(":-0}")
    for name in set(services) - {"mps", *STAGES}:
        assert services[name] == gpu_compose["services"][name]


def test_only_gateway_and_jaeger_are_published(gpu_compose, cpu_compose):
    for compose in (gpu_compose, cpu_compose):
        published = {name for name, svc in compose["services"].items() if svc.get("ports")}
        assert published == {"gateway", "jaeger"}
        assert gpu_compose["services"]["gateway"]["ports"] == ["8000:8000"]
        assert gpu_compose["services"]["jaeger"]["ports"] == ["16686:16686"]


def test_app_commands_are_real_modules_on_their_ports(gpu_compose):
    for name, port in APP_SERVICES.items():
        command = gpu_compose["services"][name]["command"]
        assert command[:2] == ["python", "-m"]
        module = command[2]
        assert module == ("gateway" if name == "gateway" else f"services.{name}")
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"python -m {module}" 
        assert command[command.index("--port") + 1] == str(port)
        assert command[command.index("--host") + 1] == "0.0.0.0"
        if name != "gateway":
            assert gpu_compose["services"][name]["expose"] == [str(port)]


def test_stage_gpu_reservations(gpu_compose, cpu_compose):
    for stage in STAGES:
        devices = gpu_compose["services"][stage]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1
        device = devices[0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert ("device_ids" in device) != ("count" in device), "device_ids and count are exclusive"
        assert device["device_ids"] == [f"${{{stage.upper()}_GPU:-0}}"]
        assert gpu_compose["services"][stage]["environment"]["DRAMA_DEVICE"] == "cuda"
        assert "deploy" not in cpu_compose["services"][stage]
        assert cpu_compose["services"][stage]["environment"]["DRAMA_DEVICE"] == "cpu"
    assert "deploy" not in gpu_compose["services"]["gateway"]


def test_health_checks_and_start_order(gpu_compose):
    services = gpu_compose["services"]
    for stage in STAGES:
        test = services[stage]["healthcheck"]["test"]
        port = APP_SERVICES[stage]
        assert test == ["CMD", "python", "-m", "services.common.healthprobe", "--addr", f"localhost:{port}"]
        assert importlib.util.find_spec("services.common.healthprobe") is not None
        hc = services[stage]["healthcheck"]
        assert (hc["interval"], hc["timeout"], hc["retries"], hc["start_period"]) == ("10s", "5s", 3, "900s")
    assert "/ready" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert services["backbone"]["depends_on"]["tower"]["condition"] == "service_healthy"
    for dep in ("backbone", "codec"):
        assert services["gateway"]["depends_on"][dep]["condition"] == "service_healthy"
    for name in APP_SERVICES:
        assert services[name]["depends_on"]["otel-collector"]["condition"] == "service_started"
        assert services[name]["restart"] == "unless-stopped"
        assert services[name]["stop_grace_period"] == "60s"
    assert "jaeger" in services["otel-collector"]["depends_on"]


def test_environment_names_exist_in_the_code(gpu_compose):
    code = "\n".join(p.read_text(errors="ignore") for d in ("services", "gateway")
                     for p in (ROOT / d).rglob("*.py"))
    services = gpu_compose["services"]
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_SERVICE_NAME"] == f"drama-{name}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["DRAMA_CHECKPOINT"] == "/models"
        for key in env:
            if key.startswith("DRAMA_"):
                assert re.search(rf"\b{key}\b", code), f"{name}: {key} is not read anywhere in the code"
    assert services["backbone"]["environment"]["DRAMA_TOWER_ADDR"] == "tower:50052"
    assert services["gateway"]["environment"]["DRAMA_BACKBONE_ADDR"] == "backbone:50051"
    assert services["gateway"]["environment"]["DRAMA_CODEC_ADDR"] == "codec:50053"


def test_tower_and_backbone_share_the_step_lane(gpu_compose, cpu_compose):
    """The tower's Step lane socket (DRAMA_TOWER_STEP_SOCKET) lies in a volume the backbone mounts
    at the same path: the path the tower names in TowerInfo.step_socket is the backbone's too."""
    mps = _merge(gpu_compose, _load("compose.mps.yaml"))
    for compose in (gpu_compose, cpu_compose, mps):
        services = compose["services"]
        socket = services["tower"]["environment"]["DRAMA_TOWER_STEP_SOCKET"]
        mounts = {stage: {v.split(":")[1]: v.split(":")[0] for v in services[stage]["volumes"]}
                  for stage in ("tower", "backbone")}
        directory = socket.rsplit("/", 1)[0]
        assert mounts["tower"][directory] == mounts["backbone"][directory] == "step-lane"
        assert "step-lane" in compose["volumes"]
        # the lane's shared memory (local_lane.Ring) lives beside the socket: in memory, not on disk
        assert compose["volumes"]["step-lane"]["driver_opts"]["type"] == "tmpfs"
        assert services["backbone"]["environment"].get("DRAMA_TOWER_LOCAL_LANE", "1") != "0"


def test_weights_are_mounted_read_only(gpu_compose):
    for name in APP_SERVICES:
        assert "./models:/models:ro" in gpu_compose["services"][name]["volumes"]


def test_collector_pipelines():
    cfg = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert cfg["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert cfg["exporters"]["prometheus"]["endpoint"].endswith(":8889")
    for pipeline in cfg["service"]["pipelines"].values():
        assert pipeline["processors"][0] == "memory_limiter" and "batch" in pipeline["processors"]
    assert cfg["service"]["extensions"] == ["health_check"]

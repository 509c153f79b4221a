"""deploy/k8s, checked statically (no cluster here): every manifest of the base and of each overlay
against the Kubernetes JSON schemas that `kubernetes-validate` bundles, plus our own cross-checks
against the code (entry-point modules, ports, env names, probes, grace periods) and compose.yaml.

The kustomizations are rendered by `render` below, which knows only what our files use:
`resources` (files and directories), a `configMapGenerator` from files without name hashes, and
strategic-merge `patches` (mappings merge, `null` deletes a key, lists of named items merge by
name with new items first, other lists are replaced, `$patch: delete` drops a resource). When
`kubectl` or `kustomize` is installed, a test checks that the real tool renders the same objects.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "cpu": K8S / "overlays" / "cpu"}
PORTS = {"backbone": 50051, "tower": 50052, "codec": 50053, "gateway": 8000}
STAGES = ("backbone", "tower", "codec")
DRAIN_S = 60                   # API.md §4: the longest expected stream drain
SCHEMA_VERSIONS = ("1.30", "1.37")   # native gRPC probes are GA from 1.27


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------

def _named_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def strategic_merge(base, patch):
    """Kubernetes' strategic merge, as far as our patches need it."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in base:
                merged[key] = strategic_merge(base[key], value)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if _named_list(base) and _named_list(patch):
        merged = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(merged)}
        added = []
        for item in patch:
            if item["name"] in index:
                merged[index[item["name"]]] = strategic_merge(merged[index[item["name"]]], item)
            else:
                added.append(copy.deepcopy(item))
        return added + merged          # kustomize puts new items first
    return copy.deepcopy(patch)


def _load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[dict]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "patches"}
    assert set(spec) <= known, f"{directory}: the test's renderer does not know {set(spec) - known}"
    resources: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else _load_documents(path)
    for generator in spec.get("configMapGenerator", []):
        assert spec["generatorOptions"]["disableNameSuffixHash"] is True
        data = {}
        for source in generator["files"]:
            key, _, file = source.rpartition("=")
            data[key or Path(file).name] = (directory / file).read_text()
        resources.append({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": generator["name"]}, "data": data})
    for patch_entry in spec.get("patches", []):
        assert set(patch_entry) == {"path"}, "only strategic-merge patch files"
        for patch in _load_documents(directory / patch_entry["path"]):
            target = find(resources, patch["kind"], patch["metadata"]["name"])
            position = resources.index(target)
            if patch.get("$patch") == "delete":
                del resources[position]
            else:
                resources[position] = strategic_merge(target, patch)
    return resources


def find(resources: list[dict], kind: str, name: str) -> dict:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def container(deployment: dict) -> dict:
    containers = pod_spec(deployment)["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=list(KUSTOMIZATIONS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(KUSTOMIZATIONS[request.param])


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(KUSTOMIZATIONS["base"])


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return render(KUSTOMIZATIONS["gpu"])


@pytest.fixture(scope="module")
def cpu() -> list[dict]:
    return render(KUSTOMIZATIONS["cpu"])


@pytest.fixture(scope="module")
def code_text() -> str:
    return "\n".join(p.read_text(errors="ignore") for d in ("services", "gateway")
                     for p in (ROOT / d).rglob("*.py"))


# --------------------------------------------------------------------------------------------
# the renderer and the schemas
# --------------------------------------------------------------------------------------------

def test_strategic_merge():
    base = {"a": 1, "gone": {"x": 1}, "items": [{"name": "c", "env": [{"name": "A", "value": "1"}]}],
            "args": ["--x"]}
    patch = {"gone": None, "items": [{"name": "c", "env": [{"name": "B", "value": "2"}]}, {"name": "d"}],
             "args": ["--y"]}
    assert strategic_merge(base, patch) == {
        "a": 1, "args": ["--y"],
        "items": [{"name": "d"},
                  {"name": "c", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]}]}


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_renderer_agrees_with_kustomize(name):
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    result = subprocess.run(command + [str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    def keyed(resources):
        return {(r["kind"], r["metadata"]["name"]): json.loads(json.dumps(r)) for r in resources}
    from_tool = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert keyed(from_tool) == keyed(render(KUSTOMIZATIONS[name]))


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(rendered, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    name, resources = rendered
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']}: {exc}")


def test_collector_config_is_the_compose_one():
    copy_ = (K8S / "base" / "otel-collector-config.yaml").read_text()
    assert copy_ == (ROOT / "deploy" / "otel-collector.yaml").read_text(), \
        "deploy/k8s/base/otel-collector-config.yaml must be a copy of deploy/otel-collector.yaml"


# --------------------------------------------------------------------------------------------
# cross-checks against the code and compose.yaml
# --------------------------------------------------------------------------------------------

def _module_command(command: list[str]) -> str:
    assert command[:2] == ["python", "-m"], command
    module = command[2]
    try:
        found = importlib.util.find_spec(f"{module}.__main__") is not None
    except ModuleNotFoundError:   # the package itself is missing
        found = False
    assert found, f"python -m {module}: no such module with a __main__"
    return module


def _check_inline_python(code: str) -> None:
    """`python -c` code compiles and everything it imports from our packages exists."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("services", "gateway"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def _console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_every_command_exists(rendered):
    _, resources = rendered
    for name, deployment in of_kind(resources, "Deployment").items():
        spec = pod_spec(deployment)
        for c in spec.get("initContainers", []):
            script = c["command"][-1].split("||")[-1].split()[0]
            assert script in _console_scripts(), f"{name}: init container runs {script!r}"
        if name not in PORTS:
            continue
        c = container(deployment)
        module = _module_command(c["command"])
        assert module == ("gateway" if name == "gateway" else f"services.{name}")
        probe = c["livenessProbe"].get("exec", {}).get("command")
        if probe:
            assert probe[:2] == ["python", "-c"]
            _check_inline_python(probe[2])


def _entry_point_port(name: str) -> int:
    if name == "gateway":
        from gateway.settings import Settings
        return Settings().port
    main = importlib.import_module(f"services.{name}.__main__")
    args = main.parse_args(["--checkpoint", "/models"])
    return args.port


@pytest.mark.parametrize("name", list(PORTS))
def test_ports_agree_with_code_and_compose(base, name):
    port = PORTS[name]
    assert _entry_point_port(name) == port
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"][name]
    assert compose["command"][compose["command"].index("--port") + 1] == str(port)

    deployment = find(base, "Deployment", name)
    c = container(deployment)
    assert c["command"][c["command"].index("--port") + 1] == str(port)
    assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
    assert [p["containerPort"] for p in c["ports"]] == [port]
    service = find(base, "Service", name)
    assert [p["port"] for p in service["spec"]["ports"]] == [port]
    if name == "gateway":
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert "clusterIP" not in service["spec"]
    else:
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert f"'localhost:{port}'" in c["livenessProbe"]["exec"]["command"][2]
        assert service["spec"]["clusterIP"] == "None", "stage Services are headless (client-side balancing)"


def _compose_otel_env() -> dict[str, str]:
    """compose.yaml's shared OTEL_* values with `${VAR:-default}` replaced by the default."""
    otel = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-otel-env"]
    return {key: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))
            for key, value in otel.items() if key.startswith("OTEL_")}


def test_environment_names_and_values(rendered, code_text):
    _, resources = rendered
    deployments = of_kind(resources, "Deployment")
    for name in PORTS:
        env = env_of(container(deployments[name]))
        for key in env:
            if key.startswith("DRAMA_"):
                assert re.search(rf"\b{key}\b", code_text), f"{name}: {key} is not read anywhere in the code"
        assert env["OTEL_SERVICE_NAME"] == f"drama-{name}"
        assert {k: v for k, v in env.items() if k.startswith("OTEL_") and k != "OTEL_SERVICE_NAME"} \
            == _compose_otel_env()
        assert env["DRAMA_CHECKPOINT"] == "/models"


def test_stage_addresses_reach_headless_services(rendered):
    """Every *_ADDR is dns:///<service>:<port>, a headless Service with that port in front of the
    Deployment serving it."""
    _, resources = rendered
    deployments, services = of_kind(resources, "Deployment"), of_kind(resources, "Service")
    expected = {("gateway", "DRAMA_BACKBONE_ADDR"): "backbone", ("gateway", "DRAMA_CODEC_ADDR"): "codec",
                ("backbone", "DRAMA_TOWER_ADDR"): "tower"}
    seen = set()
    for name, deployment in deployments.items():
        for key, value in env_of(container(deployment)).items():
            if not key.endswith("_ADDR"):
                continue
            match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", value)
            assert match, f"{name}: {key}={value} is not dns:///<service>:<port>"
            target, port = match.group(1), int(match.group(2))
            assert expected[(name, key)] == target and PORTS[target] == port
            service = services[target]
            assert service["spec"]["clusterIP"] == "None"
            assert port in [p["port"] for p in service["spec"]["ports"]]
            assert selects(service["spec"]["selector"], pod_labels(deployments[target]))
            seen.add((name, key))
    assert seen == set(expected)


def test_selectors_match_pods(rendered):
    _, resources = rendered
    deployments = of_kind(resources, "Deployment")
    for name, deployment in deployments.items():
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    for kind in ("Service", "PodDisruptionBudget"):
        for name, resource in of_kind(resources, kind).items():
            selector = resource["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [d for d, dep in deployments.items() if selects(selector, pod_labels(dep))]
            assert matched == [name], f"{kind}/{name} selects {matched}"


def test_every_app_deployment_has_a_disruption_budget(rendered):
    _, resources = rendered
    assert set(of_kind(resources, "PodDisruptionBudget")) == set(PORTS)


def test_only_the_gateway_is_exposed(rendered):
    _, resources = rendered
    ingresses = of_kind(resources, "Ingress")
    assert list(ingresses) == ["gateway"]
    backends = [path["backend"]["service"] for rule in ingresses["gateway"]["spec"]["rules"]
                for path in rule["http"]["paths"]]
    assert backends == [{"name": "gateway", "port": {"name": "http"}}]
    for service in of_kind(resources, "Service").values():
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_grace_periods_cover_the_drain(rendered):
    _, resources = rendered
    for name in PORTS:
        deployment = find(resources, "Deployment", name)
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        c = container(deployment)
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(env_of(c).get("DRAMA_GRACE_S", DRAIN_S))   # the gateway's uvicorn drains 60 s
        assert drain >= DRAIN_S
        assert grace >= pre_stop + drain, f"{name}: {grace} s < {pre_stop} s pre-stop + {drain} s drain"


def _models_volume(deployment: dict) -> dict:
    return next(v for v in pod_spec(deployment)["volumes"] if v["name"] == "models")


def test_weights_are_read_only(rendered):
    name, resources = rendered
    for app in PORTS:
        deployment = find(resources, "Deployment", app)
        mounts = [m for m in container(deployment)["volumeMounts"] if m["name"] == "models"]
        assert mounts == [{"name": "models", "mountPath": "/models", "readOnly": True}]
        volume = _models_volume(deployment)
        if name == "cpu":
            assert volume == {"name": "models", "emptyDir": {}}
            assert pod_spec(deployment)["initContainers"][0]["volumeMounts"][0]["mountPath"] == "/models"
        else:
            assert volume["persistentVolumeClaim"] == {"claimName": "dramaturg-models", "readOnly": True}
    claims = of_kind(resources, "PersistentVolumeClaim")
    if name == "cpu":
        assert "dramaturg-models" not in claims
    else:
        assert claims["dramaturg-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]


def _gpus(deployment: dict) -> int:
    return int(container(deployment).get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_gpu_overlay_gives_each_stage_one_gpu(base, gpu, cpu):
    for stage in STAGES:
        deployment = find(gpu, "Deployment", stage)
        assert _gpus(deployment) == 1
        assert env_of(container(deployment))["DRAMA_DEVICE"] == "cuda"
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        assert env_of(container(find(cpu, "Deployment", stage)))["DRAMA_DEVICE"] == "cpu"
    for resources in (base, cpu):
        assert not any(_gpus(d) for d in of_kind(resources, "Deployment").values())
    assert not any(_gpus(d) for name, d in of_kind(gpu, "Deployment").items() if name not in STAGES)
    # everything but the stages is the same as in the base
    for resource in gpu:
        if resource["metadata"]["name"] not in STAGES or resource["kind"] != "Deployment":
            assert resource == find(base, resource["kind"], resource["metadata"]["name"])


def test_collector_reads_its_config_map(base):
    collector = find(base, "Deployment", "otel-collector")
    c = container(collector)
    config_path = next(a for a in c["args"] if a.startswith("--config=")).removeprefix("--config=")
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec(collector)["volumes"] if v["name"] == mount["name"])
    config_map = find(base, "ConfigMap", volume["configMap"]["name"])
    item = volume["configMap"]["items"][0]
    assert mount["mountPath"] + "/" + item["path"] == config_path
    config = yaml.safe_load(config_map["data"][item["key"]])
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    jaeger = find(base, "Service", "jaeger")
    assert 4317 in [p["port"] for p in jaeger["spec"]["ports"]]
    collector_ports = [p["port"] for p in find(base, "Service", "otel-collector")["spec"]["ports"]]
    assert 4317 in collector_ports
    assert _compose_otel_env()["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"

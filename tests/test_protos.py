"""The generated gRPC stubs: they import, match the .proto services, and are not stale."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"backbone": "Backbone", "tower": "Tower", "codec": "Codec"}


@pytest.mark.parametrize("stage", list(STAGES))
def test_stubs_import_and_expose_the_service(stage):
    pb2 = importlib.import_module(f"drama.{stage}.v1.{stage}_pb2")
    grpc_mod = importlib.import_module(f"drama.{stage}.v1.{stage}_pb2_grpc")
    service = STAGES[stage]
    descriptor = pb2.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == f"drama.{stage}.v1.{service}"
    for attr in (f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"):
        assert hasattr(grpc_mod, attr), attr
    # Every rpc in the descriptor has a servicer method of the same name.
    servicer = getattr(grpc_mod, f"{service}Servicer")
    assert descriptor.methods and all(hasattr(servicer, m.name) for m in descriptor.methods)


def test_every_proto_has_committed_stubs():
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    for proto in protos:
        rel = proto.relative_to(ROOT / "protos").with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (ROOT / f"{rel}{suffix}").is_file(), f"{rel}{suffix}"


def test_generate_check_passes():
    """`python protos/generate.py --check` exits 0 when the committed stubs are current."""
    run = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_generate_check_detects_a_stale_stub(tmp_path):
    """Guards the test above: in a copy of the tree, an edited stub makes --check fail."""
    import shutil

    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "drama", tmp_path / "drama", ignore=shutil.ignore_patterns("__pycache__"))
    stub = tmp_path / "drama" / "codec" / "v1" / "codec_pb2.py"
    stub.write_text(stub.read_text() + "\n# hand edit\n")
    run = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "drama/codec/v1/codec_pb2.py" in run.stdout

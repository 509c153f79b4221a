"""bench/start_to_ready.py: its page-cache helpers, and a whole tiny run on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import start_to_ready as s2r


def test_drop_and_warm_report_what_they_did(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 3 * 2 ** 20)
    (tmp_path / "b.bin").write_bytes(b"y" * 1000)
    dropped = s2r.drop_from_page_cache(tmp_path)
    assert dropped["dropped"] is True and dropped["sync_s"] >= 0
    warmed = s2r.read_into_page_cache(tmp_path)
    assert warmed["read_gib"] == round((3 * 2 ** 20 + 1000) / 2 ** 30, 2)


def test_full_checkpoint_goes_where_there_is_room(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    free = {s2r.ROOT / "out": 5 * 2 ** 30, Path("/tmp"): 60 * 2 ** 30}
    monkeypatch.setattr(s2r.shutil, "disk_usage", lambda p: usage._replace(free=free.get(Path(p), 0)))
    directory, temporary = s2r.pick_directory("full", 40 * 2 ** 30)
    assert directory == Path("/tmp/ckpt-full") and not temporary
    with pytest.raises(SystemExit, match="no file system has"):
        s2r.pick_directory("full", 70 * 2 ** 30)


def test_tiny_cpu_run_times_every_stage(tmp_path, capsys):
    out = tmp_path / "s2r.json"
    logs = tmp_path / "stages.log"
    code = s2r.main(["--make", "--preset", "tiny", "--device", "cpu", "--cache", "cold", "--together",
                     "--max-rows", "4", "--max-context", "512", "--json", str(out), "--logs", str(logs)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, printed
    assert result["make_s"] > 0 and result["size_gb"] > 0 and result["inspect"]["ok"] is True
    (run,) = result["runs"]
    assert result["start_to_ready_s"] == run["start_to_ready_s"] and result["start_to_ready_run"] == "cold page cache, together"
    assert run["cache"] == "cold" and run["order"] == "together" and run["prepare"]["dropped"] is True
    assert set(run["start_to_ready_s"]) == {"codec", "tower", "backbone", "gateway"}
    assert all(0 < s < 120 for s in run["start_to_ready_s"].values())
    for stage, ready in run["start_to_ready_s"].items():
        assert 0 < run["listening_s"][stage] <= ready
    assert run["listening_s"]["backbone"] <= run["loaded_s"]["backbone"] <= run["start_to_ready_s"]["backbone"]
    # the backbone needs the tower to be SERVING, so it cannot be ready first
    assert run["start_to_ready_s"]["backbone"] >= run["start_to_ready_s"]["tower"] - 0.5
    assert "cold together" in printed and "backbone s" in printed
    assert "===== cold-together-backbone.log =====" in logs.read_text()
    assert not Path(result["checkpoint"]).exists()          # the temporary tiny checkpoint is gone

"""bench/ab.py on the CPU: an old tree made from git, both trees' tiny backbone runs alternating,
one table with every run's figures per row."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench import ab

ROOT = Path(__file__).resolve().parents[1]


def _has_git_head() -> bool:
    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_git_head(), reason="needs the repository's git history")
def test_two_trees_alternate_into_one_table(tmp_path, capsys):
    old = tmp_path / "old"
    ab.main(["--prepare", "HEAD", "--old", str(old)])
    assert (old / "bench" / "backbone.py").exists() and (old / "services" / "backbone" / "model.py").exists()
    assert not (old / "tests").exists()
    report = ab.main(["--old", str(old), "--runs", "2", "--json", str(tmp_path / "ab.json"), "--",
                      "--preset", "tiny", "--device", "cpu", "--prefill", "16", "--batch", "1",
                      "--context", "8", "--steps", "2", "--warmup", "1"])
    assert [r.get("error") for r in report["runs"]["new"] + report["runs"]["old"]] == [None] * 4
    rows = {entry["row"]: entry for entry in report["table"]}
    assert set(rows) == {"prefill 16", "decode b1 eager"}
    for entry in rows.values():
        assert all(v > 0 for v in entry["new"] + entry["old"]) and len(entry["new"]) == len(entry["old"]) == 2
        assert entry["new - old"] is not None
    out = capsys.readouterr().out
    assert "run 1 new" in out and "run 2 old" in out and "prefill 16" in out
    assert (tmp_path / "ab.json").exists()


def test_a_missing_old_tree_is_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit, match="--prepare"):
        ab.main(["--old", str(tmp_path / "nothing"), "--", "--preset", "tiny"])


def test_a_failed_run_is_reported_not_raised(tmp_path):
    result = ab.run_tree(ROOT, ["--preset", "no-such-preset"], timeout=60)
    assert "error" in result and "exit" in result["error"]


def test_new_env_reaches_the_new_processes_only(monkeypatch, tmp_path):
    """--old . --new-env VAR=VALUE: one tree against itself, the variable set in the new runs."""
    seen = []
    monkeypatch.setattr(ab, "run_tree", lambda tree, args, timeout, extra_env=None: seen.append(extra_env) or {})
    report = ab.main(["--old", str(ROOT), "--runs", "2", "--new-env", "DRAMA_DECODE_FROM_IDS=1", "--",
                      "--preset", "tiny"])
    assert seen == [{"DRAMA_DECODE_FROM_IDS": "1"}, None, None, {"DRAMA_DECODE_FROM_IDS": "1"}]
    assert report["new_env"] == {"DRAMA_DECODE_FROM_IDS": "1"}
    with pytest.raises(SystemExit):
        ab.main(["--old", str(ROOT), "--new-env", "NO_EQUALS", "--", "--preset", "tiny"])

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
    monkeypatch.setattr(ab, "run_tree", lambda tree, args, timeout, extra_env=None, bench="backbone":
                        seen.append(extra_env) or {})
    report = ab.main(["--old", str(ROOT), "--runs", "2", "--new-env", "DRAMA_DECODE_FROM_IDS=1", "--",
                      "--preset", "tiny"])
    assert seen == [{"DRAMA_DECODE_FROM_IDS": "1"}, None, None, {"DRAMA_DECODE_FROM_IDS": "1"}]
    assert report["new_env"] == {"DRAMA_DECODE_FROM_IDS": "1"}
    with pytest.raises(SystemExit):
        ab.main(["--old", str(ROOT), "--new-env", "NO_EQUALS", "--", "--preset", "tiny"])


def test_e2e_runs_whole_stacks_in_each_tree_and_tabulates_a_single_stream(monkeypatch, tmp_path):
    """--bench e2e: each run is `python -m bench.e2e ... --json` started in its tree; its rows are the
    20- and 200-word requests' ms per frame and TTFA (bench.e2e's JSON `requests`)."""
    calls = []

    def fake_e2e(tree, args, timeout, extra_env=None, bench="backbone"):
        calls.append((tree, bench, extra_env))
        frame = 5.0 if extra_env else 6.0
        return {"requests": {"short": {"steady_ms_per_frame": frame, "ttfa_ms": 40.0},
                             "long": {"steady_ms_per_frame": frame + 1, "ttfa_ms": 50.0},
                             "first": {"steady_ms_per_frame": 9.0, "ttfa_ms": 60.0}}}

    monkeypatch.setattr(ab, "run_tree", fake_e2e)
    report = ab.main(["--bench", "e2e", "--old", str(ROOT), "--runs", "2", "--new-env", "X=1", "--",
                      "--preset", "tiny", "--device", "cpu", "--skip-micro"])
    assert [c[1] for c in calls] == ["e2e"] * 4 and report["bench"] == "e2e"
    rows = {entry["row"]: entry for entry in report["table"]}
    assert set(rows) == {"20w ms/frame", "200w ms/frame", "20w TTFA ms", "200w TTFA ms"}
    assert rows["20w ms/frame"]["new"] == [5.0, 5.0] and rows["20w ms/frame"]["old"] == [6.0, 6.0]
    assert rows["20w ms/frame"]["new - old"] == -1.0 and rows["200w TTFA ms"]["new - old"] == 0.0
    # an old tree without bench/e2e.py is refused as for the backbone bench
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "backbone.py").write_text("")
    with pytest.raises(SystemExit, match="bench/e2e.py"):
        ab.main(["--bench", "e2e", "--old", str(tmp_path), "--", "--preset", "tiny"])


def test_e2e_command_runs_in_the_tree(tmp_path, monkeypatch):
    """run_tree(bench="e2e") starts `python -m bench.e2e ARGS --json OUT` with the tree as its working
    directory and first on PYTHONPATH (so the stack's stage processes import that tree too)."""
    seen = {}

    class Done:
        returncode, stdout, stderr = 3, "", "no stack here"

    def fake_run(command, cwd, env, **kwargs):
        seen.update(command=command, cwd=cwd, path=env["PYTHONPATH"].split(ab.os.pathsep)[0])
        return Done()

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    result = ab.run_tree(tmp_path, ["--preset", "tiny"], timeout=5, bench="e2e")
    assert seen["command"][1:5] == ["-m", "bench.e2e", "--preset", "tiny"] and seen["command"][5] == "--json"
    assert seen["cwd"] == tmp_path and seen["path"] == str(tmp_path)
    assert result["error"].startswith("exit 3")

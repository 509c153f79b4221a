"""bench/backbone.py on the CPU: the tiny preset end to end, with --host-phases (where a decode
step's wall time goes on the host)."""

from __future__ import annotations

from bench import backbone as bench_backbone


def test_host_phases_on_the_tiny_preset(capsys):
    result = bench_backbone.main(["--preset", "tiny", "--device", "cpu", "--prefill", "16", "--batch", "1",
                                  "--context", "8", "--steps", "3", "--warmup", "1", "--host-phases", "1", "2"])
    for batch in (1, 2):
        phases = result["host_phases"][batch]
        # no graph on the CPU: no replay call and no stream wait, the rest is there
        assert set(phases) == {"row check", "embed", "the whole step"}, phases
        assert 0 < phases["row check"] < phases["the whole step"] and 0 < phases["embed"] < phases["the whole step"]
    assert "host phases of a decode step, batch 2" in capsys.readouterr().out

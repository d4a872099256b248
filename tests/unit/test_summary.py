"""The benchmark summary's target checks on hand-made benchmark documents."""

from __future__ import annotations

import json
from pathlib import Path

from testbeds.bench import summary


def doc(topology: str, uniform: float, ddp: float, efficiency: float, losses: tuple[float, float]) -> dict:
    return {
        "topology": topology,
        "job_name": "gpt2-mini",
        "efficiency": efficiency,
        "speedup": {"uniform": uniform, "ddp": ddp, "pipelining": 1.0},
        "systems": {
            "fusion": {"samples_per_s": 50.0, "step_s": 0.3, "hosts_used": ["a-1"], "final_loss": losses[0]},
            "uniform": {"final_loss": losses[1]},
        },
    }


def test_targets_follow_the_topology() -> None:
    _, targets = summary.summarize([doc("two-sites", 1.6, 2.9, 0.85, (4.0, 4.1))])
    verdict = {what.split(" on ")[0]: ok for what, _, ok in targets}
    assert verdict == {
        "fusion >= 1.5x uniform": True,
        "fusion >= 3x ddp": False,  # two-sites has a 100 Mbps link, so the DDP target applies
        "efficiency >= 0.8": True,
        "final loss within 3 % of uniform": True,
    }
    _, targets = summary.summarize([doc("three-continents", 9.0, 30.0, 0.7, (4.0, 4.5))])
    assert [ok for _, _, ok in targets] == [True, False, False, False]  # ddp, efficiency, loss, then 9.4x uniform


def test_wide_uniform_target_is_met_on_either_topology() -> None:
    """The issue asks for >= 9.4x uniform "on three-continents or volunteers": one target
    per model, met when either reaches it, with both figures shown."""
    _, targets = summary.summarize(
        [doc("three-continents", 12.0, 30.0, 0.9, (4.0, 4.0)), doc("volunteers", 8.0, 30.0, 0.9, (4.0, 4.0))]
    )
    wide = [t for t in targets if "9.4x uniform" in t[0]]
    assert wide == [
        (
            "fusion >= 9.4x uniform on three-continents or volunteers (gpt2-mini)",
            "three-continents 12.00, volunteers 8.00",
            True,
        )
    ]
    _, targets = summary.summarize(
        [doc("three-continents", 9.0, 30.0, 0.9, (4.0, 4.0)), doc("volunteers", 8.0, 30.0, 0.9, (4.0, 4.0))]
    )
    assert [ok for what, _, ok in targets if "9.4x uniform" in what] == [False]


def test_lab_10g_has_no_ddp_or_uniform_target() -> None:
    _, targets = summary.summarize([doc("lab-10g", 1.0, 1.0, 0.9, (4.0, 4.0))])
    assert [what.split(" on ")[0] for what, _, _ in targets] == [
        "efficiency >= 0.8",
        "final loss within 3 % of uniform",
    ]


def test_main_writes_the_summary_with_notes(tmp_path: Path) -> None:
    (tmp_path / "bench-two-sites-gpt2.json").write_text(json.dumps(doc("two-sites", 2.0, 4.0, 0.9, (4.0, 4.0))))
    (tmp_path / "bench-notes.md").write_text("## What the numbers say\n\nhand-written\n")
    assert summary.main([str(tmp_path)]) == 0
    text = (tmp_path / "bench-summary.md").read_text()
    assert "4 of 4 targets met." in text and text.rstrip().endswith("hand-written")
    assert f"`python -m testbeds.bench.summary {tmp_path.as_posix()}`" in text  # the folder it was run on


def test_main_refuses_an_empty_folder(tmp_path: Path) -> None:
    assert summary.main([str(tmp_path)]) == 2

"""The emulation fidelity probe (:mod:`testbeds.emulation_fidelity`) on GPT-2 tiny: its rows,
its table, and its answers to bad options. A few seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fusion.config import JobSpec
from testbeds.emulation import MIN_PIECE_S
from testbeds.emulation_fidelity import main, measure_job

TINY = JobSpec.from_dict(
    {
        "name": "tiny",
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 1},
    }
)


def test_rows_compare_each_emulated_pass_with_factor_times_the_plain_one() -> None:
    rows = measure_job(TINY, [2.0], repeats=2)
    assert [r["min_piece_s"] for r in rows] == [0.0, MIN_PIECE_S]
    for r in rows:
        for key in ("plain_forward_s", "plain_backward_s", "emulated_forward_s", "emulated_backward_s"):
            assert r[key] > 0 and math.isfinite(r[key]), key
        # A factor of 2 sleeps as long again as each piece computed: the emulated pass takes
        # at least that (the ratio is what the machine adds on top; ~1 when faithful).
        assert r["emulated_forward_s"] > 1.2 * r["plain_forward_s"]
        assert r["forward_ratio"] == pytest.approx(r["emulated_forward_s"] / (2.0 * r["plain_forward_s"]))
        assert r["backward_ratio"] == pytest.approx(r["emulated_backward_s"] / (2.0 * r["plain_backward_s"]))


def test_the_cli_writes_the_table_and_the_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "tiny.toml"
    job.write_text(
        'name = "tiny"\n[model]\nname = "gpt2"\npreset = "tiny"\n[data]\nbatch_size = 4\nseq_len = 16\n'
        "[train]\nsteps = 1\nmicro_batches = 1\n"
    )
    assert main(["--jobs", str(job), "--factors", "1.5", "--repeats", "1", "--out", str(tmp_path / "fid")]) == 0
    table = capsys.readouterr().out
    assert "| tiny | 1.5 | per parameter |" in table and f"| tiny | 1.5 | {MIN_PIECE_S * 1e3:g} ms |" in table
    assert len(json.loads((tmp_path / "fid.json").read_text())["rows"]) == 2
    assert (tmp_path / "fid.md").read_text() == table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--factors", "fast"], "--factors takes numbers"),
        (["--factors", "0.5"], "every factor >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--jobs", "/nonexistent/job.toml"], "error:"),
    ],
)
def test_bad_options_get_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err

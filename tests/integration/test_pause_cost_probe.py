"""The machine probe of testbeds.bench.machine_probe, run for real: a busy child process for the
loaded curve, an executor process for the transfer path and the transfers sent out, an
executor service in this process and a sending child for the transfers received; every
process gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from testbeds.bench.machine_probe import main
from testbeds.sim.machine import PauseCost, interference_beside, transfer_path_beside


@pytest.mark.quiet
def test_measure_writes_both_curves_and_stops_its_processes(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "pause-cost.json"
    args = ["--trials", "3", "--transfer-rounds", "1", "--interference-seconds", "1", "--interference-rounds", "1"]
    assert main([*args, "--out", str(out)]) == 0
    cost = PauseCost.from_dict(json.loads(out.read_text()))
    assert len(cost.pauses_s) == len(cost.idle_s) == len(cost.loaded_s) >= 3
    path = transfer_path_beside(tmp_path)
    assert path is not None and all(0 < t < 1 for row in path.seconds for t in row)
    interference = interference_beside(tmp_path)
    assert interference is not None and len(interference.sizes_bytes) == 3
    assert all(0 <= c < 0.1 for c in (*interference.send_s, *interference.receive_s))
    assert "interference_round_range" in json.loads(out.read_text())
    assert {
        p.pid for p in psutil.Process().children(recursive=True)
    } == before  # the busy process, the executor and the sender are reaped
    assert not list(tmp_path.glob("*.tmp"))


def test_too_few_trials_is_refused_before_measuring(tmp_path: Path) -> None:
    assert main(["--trials", "1", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["--interference-seconds", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["--interference-rounds", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["--transfer-rounds", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert not list(tmp_path.iterdir())

"""Rough edges a new user met in the README's walk-through (issue 31), each fixed in the CLI."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fusion.cli import main as cli_main
from fusion.cli.demo import _plan_line, _strategy_note, demo_job
from fusion.cli.env import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, run_cli
from fusion.errors import RemoteError

REPO = Path(__file__).resolve().parents[2]


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    body = (
        "import sys\n"
        "from fusion.cli.env import run_cli\n"
        "def body():\n"
        "    for _ in range(200_000):\n"
        "        print('x' * 80)\n"
        "    return 0\n"
        "sys.exit(run_cli(body))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # what `| head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == EXIT_BROKEN_PIPE
    assert err == "", err  # no traceback


class RefusingClient:
    """A coordinator client whose coordinator refuses the job file (as for an unknown preset)."""

    def __enter__(self) -> RefusingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, spec: Any) -> str:
        raise RemoteError(
            "SubmitJob on 127.0.0.1:7077 failed with INVALID_ARGUMENT: ConfigError: unknown gpt2 preset 'huge'",
            code="INVALID_ARGUMENT",
            peer="127.0.0.1:7077",
        )


def test_the_coordinators_refusal_of_a_job_file_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "preset.toml"
    job.write_text('[model]\nname = "gpt2"\npreset = "huge"\n')
    monkeypatch.setattr(cli_main, "_client", lambda args: RefusingClient())
    args = argparse.Namespace(job=str(job))
    assert run_cli(lambda: cli_main.cmd_submit(args)) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: {job}: unknown gpt2 preset 'huge'\n"


def test_the_demo_says_which_strategy_it_plans_with_and_why(tmp_path: Path) -> None:
    built_in = demo_job(argparse.Namespace(job=None, steps=None, workers=3), tmp_path)
    assert _strategy_note(built_in, None).startswith("uniform, set by the demo's job to split the model")
    own = tmp_path / "own.toml"
    own.write_text('[model]\nname = "gpt2"\npreset = "tiny"\n')
    spec = demo_job(argparse.Namespace(job=str(own), steps=None, workers=2), tmp_path)
    assert _strategy_note(spec, str(own)) == "opfence, the default"


def test_the_demo_prints_where_the_plan_put_the_stages() -> None:
    plan = {"strategy": "opfence", "stages": [{"worker": "demo-worker-1", "nodes": 63}], "why": "1 stage on ..."}
    assert _plan_line(plan) == "1 stage on demo-worker-1 (opfence)"
    two = {"strategy": "uniform", "stages": [{"worker": "a", "nodes": 2}, {"worker": "b", "nodes": 1}]}
    assert _plan_line(two) == "2 stages on a, b (uniform)"
    assert _plan_line(None) == "-"


def test_status_counts_a_stages_nodes_in_words() -> None:
    status = {
        "id": "job-1",
        "name": "job",
        "state": "succeeded",
        "step": 100,
        "steps": 100,
        "loss": 0.01,
        "samples_per_s": 400.0,
        "workers": ["w2", "w1"],
        "output_dir": "/out/job-1",
        "plan": {"strategy": "uniform", "stages": [{"worker": "w2", "nodes": 2}, {"worker": "w1", "nodes": 1}]},
    }
    assert "  plan: uniform: w2 (2 nodes), w1 (1 node)" in cli_main._format_status(status).splitlines()

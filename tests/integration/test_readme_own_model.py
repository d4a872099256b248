"""README's "Bring your own model", followed step by step: it fails when the README's steps stop working.

The section's files (the blocks headed ``# path``) are written into a fresh folder, its
Python example is run, its job-file line for ``leaf_modules`` is checked against that
example, and the job is trained twice as the README says: with its "Try it" command, and
on a coordinator and workers started with the flags the README gives (the code on every
process's ``PYTHONPATH``, workers with ``--allow-code``), submitted with ``fusion submit``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion.config import JobSpec
from fusion.launch import Fleet, child_env
from fusion.training import capture_job_model
from tests.integration.test_coordinator import Cli

pytestmark = pytest.mark.timeout(900)

README = Path(__file__).resolve().parents[2] / "README.md"
TOKEN = "readme-own-model"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Bring your own model\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _blocks() -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block of the section, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", _section(), flags=re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder a reader would make: each block headed ``# PATH`` written to PATH."""
    root = tmp_path_factory.mktemp("byom")
    written = []
    for _, body in _blocks():
        header = re.fullmatch(r"# (\S+\.(?:py|toml))", body.splitlines()[0])
        if header:
            path = root / header.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            written.append(header.group(1))
    assert {"mymodels/mlp.py", "mymodels/data.py", "blobs.toml"} <= set(written), written
    return root


def _job_file(project: Path) -> Path:
    names = [p for p in project.glob("*.toml")]
    assert len(names) == 1, names
    return names[0]


def test_the_export_example_runs_and_its_job_key_captures_the_same_model(project: Path) -> None:
    examples = [body for lang, body in _blocks() if lang == "python" and "fusion.export(" in body]
    assert len(examples) == 1
    scope: dict[str, object] = {}
    exec(compile(examples[0], "README example", "exec"), scope)  # noqa: S102 - the README's own code
    model = scope["model"]
    assert isinstance(model, torch.nn.Module)
    line = re.search(r"In a job file: `(leaf_modules = [^`]+)` under `\[model\]`", _section())
    assert line is not None, "the section no longer shows the leaf_modules job key"
    spec = JobSpec.from_toml(_job_file(project).read_text().replace("[model]\n", f"[model]\n{line.group(1)}\n", 1))
    captured = capture_job_model(spec, model, torch.randn(8, 32))
    assert captured.dag.fingerprint == scope["dag"].fingerprint  # type: ignore[attr-defined]


def test_the_try_it_command_trains_the_model(project: Path) -> None:
    command = re.search(r"Try it on this machine: `([^`]+)`", _section())
    assert command is not None, "the section no longer has its 'Try it' command"
    words = shlex.split(command.group(1))
    env = child_env()
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        value = value.replace("$PWD", str(project))
        # The README's PYTHONPATH first; then this checkout (the README's reader installed it).
        env[key] = value + (os.pathsep + env[key] if key == "PYTHONPATH" else "")
    assert words[0] == "fusion", words
    r = subprocess.run(
        [sys.executable, "-m", "fusion.cli.main", *words[1:]],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    [summary] = (project / "fusion-demo").glob("job-*/summary.json")
    assert json.loads(summary.read_text())["state"] == "succeeded", r.stdout[-3000:]
    assert (summary.parent / "model.safetensors").exists()


def test_a_cluster_started_as_the_readme_says_trains_the_model(project: Path, tmp_path: Path) -> None:
    section = _section()
    assert "`--allow-code`" in section and "**coordinator**" in section and "**every\nworker**" in section
    job = tmp_path / "blobs.toml"
    job.write_text(_job_file(project).read_text() + f'\n[output]\ndir = "{tmp_path / "out"}"\n')
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(project)]) as fleet:
        fleet.start_coordinator(token=TOKEN, state_dir=tmp_path / "state")
        for name in ("w0", "w1"):
            fleet.start_worker(name, token=TOKEN, allow_code=True, wait=False)
        fleet.wait_workers(["w0", "w1"])
        # The job owner's own machine needs no copy of the code to submit.
        cli = Cli(fleet.coordinator_address, TOKEN, child_env())
        s = cli.wait(cli.submit(job), timeout=600)
        assert s["state"] == "succeeded", json.dumps(s, indent=1)
        assert (Path(s["output_dir"]) / "model.safetensors").exists()

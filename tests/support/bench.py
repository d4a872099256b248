"""Run ``python -m testbeds.bench`` as a user would, on the proxy backend, for the
integration tests that check what the benchmark reports."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    tmp_path: Path,
    *,
    topology: str,
    job: str,
    systems: Sequence[str],
    extra: Sequence[str] = (),
    python_path: Sequence[Path] = (),
    timeout_s: float = 380,
) -> subprocess.CompletedProcess[str]:
    """Write ``topology`` and ``job`` under ``tmp_path``, run the bench there with ``extra``
    arguments, and return the finished process; fails the test if it exits non-zero.

    ``python_path``: folders added after the repository to the bench's ``PYTHONPATH`` (an
    owner's own model); the bench runs in ``tmp_path`` so nothing else is on its path."""
    (tmp_path / "topology.toml").write_text(topology)
    (tmp_path / "job.toml").write_text(job)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (REPO_ROOT, *python_path))}
    command = [
        sys.executable,
        "-m",
        "testbeds.bench",
        "--backend",
        "proxy",
        "--topology",
        str(tmp_path / "topology.toml"),
        "--job",
        str(tmp_path / "job.toml"),
        "--systems",
        ",".join(systems),
        *extra,
    ]
    proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc

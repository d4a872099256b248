"""One system's run in the side-by-side benchmark (:mod:`testbeds.bench.harness`): the job
file it is given (:func:`job_toml`), and the per-step records it wrote and what it reported
(:class:`Run`), whichever system ran it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion.config import JobSpec
from fusion.errors import FusionError


@dataclass
class Run:
    """One system's run: its per-step records and what it reported."""

    system: str
    records: list[dict[str, Any]] = field(default_factory=list)
    final_loss: float | None = None
    predicted_step_s: float | None = None
    hosts_used: list[str] = field(default_factory=list)
    plan_stages: list[dict[str, Any]] = field(default_factory=list)
    """fusion/uniform: the plan it ran, ``[{"worker", "nodes"}]`` (to price it in the simulator)."""
    note: str = ""
    wall_s: float = 0.0
    measured: dict[str, Any] | None = None
    """fusion/uniform: the job's ``measured.json`` (what its coordinator planned from)."""
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    """Each host's measured peak (:mod:`testbeds.bench.split_metrics`)."""
    memory_cap_bytes: dict[str, int] = field(default_factory=dict)
    """What each host lent, where the run reported it."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_records(path: Path) -> list[dict[str, Any]]:
    """The per-step records of a fusion job's ``metrics.jsonl``: the job's events written
    between them (``{"event": ...}``: checkpoints, re-plans, compression changes) are left
    out, so every record has its ``step``."""
    return [r for r in read_jsonl(path) if "event" not in r]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise FusionError(f"cannot write {v!r} to a job file")


def job_toml(spec: JobSpec) -> str:
    """A job file for ``spec`` (its sections as TOML tables)."""
    doc = spec.to_dict()
    lines = []
    for key, value in doc.items():
        if not isinstance(value, dict) and value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None)
    return "\n".join(lines) + "\n"

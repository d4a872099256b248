"""A job's output directory: model, metrics, loss curve, plan, measurements and summary.

Whole files (``model.safetensors``, ``loss.png``, ``plan.json``, ``measured.json``,
``summary.json``) are written to a temporary file in the same directory and renamed into
place, so a crash leaves either the previous file or the new one — never half of one. ``metrics.jsonl``
grows one flushed line per step, so a crash leaves a valid prefix.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from executor.driver import StepStats
from fusion.config import JobSpec
from fusion.errors import FusionError
from scheduler.convergence import convergence_cost

logger = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"
PLAN_FILE = "plan.json"
MEASURED_FILE = "measured.json"
SUMMARY_FILE = "summary.json"

# Read once at import (os.umask can only be read by setting it, which is not thread-safe).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def job_summary(
    job_id: str,
    spec: JobSpec,
    state: str,
    reason: str | None,
    losses: Sequence[float],
    *,
    wall_s: float,
    workers: Sequence[str],
    recoveries: int,
    compression_note: str | None = None,
) -> dict[str, Any]:
    """``summary.json``: how the job ended, its losses' ends and what it ran on (and, when
    its compression settings compress no cut, why: ``compression_note``)."""
    return {
        "job_id": job_id,
        "name": spec.name,
        "state": state,
        "reason": reason,
        "steps_done": len(losses),
        "steps": spec.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "wall_s": round(wall_s, 3),
        "workers": list(workers),
        "recoveries": recoveries,
        "compression_note": compression_note,
        "spec": spec.to_dict(),
    }


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual mode
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, doc: Any) -> None:
    """Write JSON atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))


class JobOutputs:
    """Writer for one job's output directory."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / METRICS_FILE
        torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self._metrics = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if torn:  # a crash cut the last line short: start a fresh line rather than extend it
            self._metrics.write("\n")
        self._measured: dict[str, Any] = {}
        self._memory: dict[str, Any] | None = None

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """One JSON line per step, flushed at once."""
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def write_plan(self, plan: Mapping[str, Any]) -> None:
        write_json(self.dir / PLAN_FILE, plan)

    def write_measured(
        self, measured: Mapping[str, Any] | None = None, *, memory: Mapping[str, Any] | None = None
    ) -> None:
        """What planning measured: the topology (speeds, machines, link fits, the driver's
        links) and the calibrated costs, so a plan can be checked against its inputs; and,
        under ``memory``, each stage's measured peak against its worker's cap
        (:class:`~fusion.coordinator.memory_ledger.MemoryLedger`). Either part may be given
        alone: the other keeps what was last written."""
        if measured is not None:
            self._measured = dict(measured)
        if memory is not None:
            self._memory = dict(memory)
        doc = dict(self._measured)
        if self._memory is not None:
            doc["memory"] = self._memory
        write_json(self.dir / MEASURED_FILE, doc)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        write_json(self.dir / SUMMARY_FILE, summary)

    def write_model(self, state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Path:
        """``model.safetensors`` under the original ``state_dict`` names."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
        path = self.dir / MODEL_FILE
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=dict(metadata or {})))
        return path

    def write_loss_plot(
        self, steps: list[int], losses: list[float], title: str, *, records: Iterable[Mapping[str, Any]] = ()
    ) -> None:
        """``loss.png``: the raw and smoothed loss against steps done, with the events among
        ``records`` (``metrics.jsonl``'s lines in order) marked (:mod:`fusion.coordinator.loss_plot`).
        Drawn in a short-lived child process, so this process never imports matplotlib; when
        that process fails the previous ``loss.png`` (if any) stays and a warning says why."""
        if not steps:
            return
        from fusion.coordinator.loss_plot import draw_in_child, loss_plot_data

        data = loss_plot_data(steps, losses, records)
        try:
            atomic_write(self.dir / LOSS_PLOT_FILE, lambda tmp: draw_in_child(data, title, tmp))
        except FusionError as e:  # the plot is a view of metrics.jsonl: losing it does not fail the job
            logger.warning("%s not drawn in %s: %s; metrics.jsonl has every loss", LOSS_PLOT_FILE, self.dir, e)

    def close(self) -> None:
        self._metrics.close()


def metrics_record(
    stats: StepStats,
    x: torch.Tensor,
    names: list[str],
    bandwidth: Callable[[int, int], float | None],
    predicted_step_s: float | None,
) -> dict[str, Any]:
    """One line of ``metrics.jsonl`` for a finished step: loss, speed (tokens too when the
    input ``x`` is token ids), bytes and the current bandwidth estimate per link (by
    ``"SRC->DST"``, ``names`` being each stage's worker), compute per worker, and the plan's
    predicted step time. Each link that encodes gets ``compression``: its codec, keep ratio
    and bits, bytes before and after, and the relative error of what it sent; the step gets
    the convergence cost ``m`` those errors predict (:mod:`scheduler.convergence`); a step the
    codec trial ran dense is marked ``dense_trial``."""
    per_s = (lambda n: n / stats.step_s) if stats.step_s > 0 else (lambda n: 0.0)
    record: dict[str, Any] = {
        "step": stats.step,
        "loss": stats.loss,
        "step_s": round(stats.step_s, 6),
        "samples_per_s": per_s(int(x.shape[0])),
    }
    if x.dim() == 2 and not x.is_floating_point():  # token ids (B, T)
        record["tokens_per_s"] = per_s(x.numel())
    record["bytes_per_link"] = {f"{names[s]}->{names[d]}": size for (s, d), size in sorted(stats.sent_bytes.items())}
    record["compute_s"] = {names[s]: round(c, 6) for s, c in sorted(stats.compute_s.items())}
    links = {}
    for s, d in sorted(stats.sent_bytes):
        bw = bandwidth(s, d)
        if bw is not None:
            links[f"{names[s]}->{names[d]}"] = round(bw, 1)
    record["link_bandwidth_bytes_per_s"] = links
    if stats.link_codecs:
        record["compression"] = {
            f"{names[s]}->{names[d]}": {
                **codec,
                "dense_bytes": stats.dense_bytes.get((s, d), 0),
                "sent_bytes": stats.sent_bytes.get((s, d), 0),
                "rel_error": round(stats.compression_error.get((s, d), 0.0), 6),
            }
            for (s, d), codec in sorted(stats.link_codecs.items())
        }
        streams = ((stats.link_codecs.get(link, {}).get("codec", ""), e) for link, e in stats.compression_error.items())
        record["convergence_cost"] = round(convergence_cost(streams), 6)
    if stats.dense_trial:
        record["dense_trial"] = True  # every cut dense, against the planned codecs (executor.codec_trial)
    if predicted_step_s is not None:
        record["predicted_step_s"] = round(predicted_step_s, 6)
    return record


def read_history(path: Path, before: int) -> list[tuple[int, float]]:
    """(step, loss) of the steps before ``before`` from an earlier run's ``metrics.jsonl``
    (a resumed job's loss curve starts where that run's did): each step's last record, or
    the ``loss_from_snapshot`` event that gave its loss; unreadable lines are skipped."""
    out: dict[int, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(rec, dict)
            and "loss" in rec
            and "step" in rec
            and rec.get("event", "loss_from_snapshot") == "loss_from_snapshot"
            and int(rec["step"]) < before
        ):
            out[int(rec["step"])] = float(rec["loss"])
    return sorted(out.items())

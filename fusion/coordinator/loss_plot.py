"""``loss.png``: the raw loss (faint), a smoothed line, and the job's events marked on it.

The data is prepared by a pure function (:func:`loss_plot_data`) and drawn by
:func:`draw_loss_plot`. The x axis counts steps done, as ``fusion status`` does: the loss
of ``metrics.jsonl``'s ``"step": 0`` is drawn at step 1. The smoothed line is an
exponential moving average (EMA) whose span grows with the run (a tenth of it, 2 to 50
steps); the legend names the span. Events (a worker lost or excluded, a re-plan, a stage
replaced, a restore, …) are vertical lines at the number of steps done when they
happened, each with a short label.

The coordinator is a long-lived server: it never imports matplotlib itself (tens of MiB
it would keep for as long as it runs). :func:`draw_in_child` draws in a short-lived
``python -m fusion.coordinator.loss_plot`` process that reads the data as JSON on stdin
and writes the PNG to the path it is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion.errors import FusionError

logger = logging.getLogger(__name__)

#: How long the plotting process may take (importing matplotlib on a busy machine is slow).
DRAW_TIMEOUT_S = 120.0

#: Events worth a marker, and their short labels.
EVENT_LABELS = {
    "worker_lost": "lost",
    "worker_excluded": "excluded",
    "worker_leaving": "leaving",
    "worker_joined": "joined",
    "replanned": "re-plan",
    "replaced": "replaced",
    "restored_from": "restored",
    "resumed_at_step": "resumed",
    "checkpoint_corrupt": "bad checkpoint",
    "waiting_for_workers": "waiting",
}


@dataclass(frozen=True)
class LossPlotData:
    """What ``loss.png`` shows."""

    steps: list[int]
    """Steps done (1-based), one per loss."""
    losses: list[float]
    """The raw loss of each step."""
    smoothed: list[float]
    """The EMA of ``losses``."""
    smoothing: str
    """The smoothing, as the legend names it."""
    markers: list[tuple[int, str]] = field(default_factory=list)
    """(steps done, label) of each event, in the order they happened."""


def ema_span(num_steps: int) -> int:
    """The EMA span for a run of ``num_steps`` steps: a tenth of it, within [2, 50]."""
    return min(50, max(2, num_steps // 10))


def ema(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average with ``alpha = 2 / (span + 1)``, started at the first
    value (so it has no warm-up bias towards zero)."""
    alpha = 2.0 / (span + 1)
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def event_markers(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(steps done, label) for each marked event among ``records`` (``metrics.jsonl``'s
    lines in file order): an event sits after the last step recorded before it."""
    done = 0
    out: list[tuple[int, str]] = []
    for rec in records:
        if "event" not in rec:
            if "step" in rec:
                done = int(rec["step"]) + 1
            continue
        label = EVENT_LABELS.get(str(rec["event"]))
        if label is None:
            continue
        if rec.get("worker"):
            label = f"{label} {rec['worker']}"
        if not out or out[-1] != (done, label):
            out.append((done, label))
    return out


def loss_plot_data(
    steps: Sequence[int], losses: Sequence[float], records: Iterable[Mapping[str, Any]] = ()
) -> LossPlotData:
    """The curve of ``(steps[i], losses[i])`` (0-based step indices, as in ``metrics.jsonl``)
    and the markers of ``records``' events."""
    span = ema_span(len(losses))
    return LossPlotData(
        steps=[int(s) + 1 for s in steps],
        losses=[float(x) for x in losses],
        smoothed=ema([float(x) for x in losses], span),
        smoothing=f"EMA, span {span} steps",
        markers=event_markers(records),
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` file in order; unreadable lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        logger.warning("cannot read %s for the loss plot's events: %s", path, e)
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def draw_loss_plot(data: LossPlotData, title: str, save: Callable[[Callable[[Path], None]], None]) -> None:
    """Draw ``data`` and hand the figure's PNG writer to ``save`` (``save(write)``, where
    ``write(path)`` writes the PNG), so the caller controls where and how atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(data.steps, data.losses, linewidth=0.8, alpha=0.3, color="tab:blue", label="loss")
    ax.plot(data.steps, data.smoothed, linewidth=1.8, color="tab:blue", label=data.smoothing)
    per_step: dict[int, int] = {}
    for step, label in data.markers:
        row = per_step.get(step, 0)
        per_step[step] = row + 1
        ax.axvline(step, color="tab:red", linewidth=0.8, alpha=0.6, linestyle="--")
        ax.annotate(
            label,
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -4 - 11 * row),
            textcoords="offset points",
            fontsize=7,
            color="tab:red",
            va="top",
        )
    ax.set_xlabel("steps done")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    try:
        save(lambda path: fig.savefig(path, format="png"))
    finally:
        plt.close(fig)


def to_json(data: LossPlotData, title: str) -> str:
    """What :func:`draw_in_child` sends the plotting process."""
    return json.dumps(
        {
            "title": title,
            "steps": data.steps,
            "losses": data.losses,
            "smoothed": data.smoothed,
            "smoothing": data.smoothing,
            "markers": data.markers,
        }
    )


def from_json(text: str) -> tuple[LossPlotData, str]:
    """The inverse of :func:`to_json`: the data and the title."""
    doc = json.loads(text)
    data = LossPlotData(
        steps=[int(s) for s in doc["steps"]],
        losses=[float(x) for x in doc["losses"]],
        smoothed=[float(x) for x in doc["smoothed"]],
        smoothing=str(doc["smoothing"]),
        markers=[(int(step), str(label)) for step, label in doc["markers"]],
    )
    return data, str(doc["title"])


def draw_in_child(data: LossPlotData, title: str, path: Path, *, timeout_s: float = DRAW_TIMEOUT_S) -> None:
    """Draw ``data`` into the PNG file ``path`` in a separate, short-lived Python process
    (so the caller never imports matplotlib). Raises :class:`FusionError` naming what went
    wrong when that process fails, times out or cannot start."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds the fusion package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "fusion.coordinator.loss_plot", "--out", str(path)]
    try:
        done = subprocess.run(
            argv, input=to_json(data, title), env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise FusionError(f"the plotting process took longer than {timeout_s:.0f}s and was stopped") from None
    except OSError as e:
        raise FusionError(f"the plotting process could not start ({e})") from e
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        raise FusionError(f"the plotting process exited with status {done.returncode}: {' | '.join(tail)}")


def main(argv: list[str] | None = None) -> int:
    """``python -m fusion.coordinator.loss_plot --out PATH``: draw the JSON of
    :func:`to_json` read from stdin into the PNG file ``PATH``."""
    parser = argparse.ArgumentParser(prog="python -m fusion.coordinator.loss_plot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the PNG file to write")
    args = parser.parse_args(argv)
    data, title = from_json(sys.stdin.read())
    draw_loss_plot(data, title, lambda write: write(args.out))
    return 0


__all__ = [
    "EVENT_LABELS",
    "LossPlotData",
    "draw_in_child",
    "draw_loss_plot",
    "ema",
    "ema_span",
    "event_markers",
    "from_json",
    "loss_plot_data",
    "read_records",
    "to_json",
]


if __name__ == "__main__":
    sys.exit(main())

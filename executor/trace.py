"""An executor timeline for diagnosis: what each stage and the driver did, and when.

The simulator's replay (:mod:`testbeds.sim.replay`) prices a step event by event; where it and
a testbed run disagree, the question is which event the real executor took longer over:
the driver's ``RunStep``, a feed, a forward on a busy core, one transfer over one link.
With ``FUSION_TRACE_DIR`` set, every executor process (workers and the coordinator's
driver) appends one JSON object per event to ``$FUSION_TRACE_DIR/trace-<pid>.jsonl``:

- the driver: ``step`` (the step starts), ``run_step`` (every stage has answered
  ``RunStep``), ``forward_backward`` (every stage is done), ``applied`` (every stage ran
  the optimizer);
- a stage: ``start`` (with the ``thread`` that computes it) and ``done`` of its step,
  ``F0``/``F1`` and ``B0``/``B1`` around each micro-batch's forward and backward (what a
  compute hook adds included, :mod:`executor.hooks`), ``send`` when a transfer is handed
  to the sender, ``leave`` when the sender starts it (after pacing, :mod:`executor.sender`), ``answered`` when the
  receiver's answer is in, ``arrive`` when a transfer from another stage (or the
  driver: ``src`` -1) has been received and checked.

Each event carries ``t`` (``time.time()``: the processes of one testbed host share its
clock), the job id, the step, and the stage, micro-batch, peer and transfer kind where
they apply. ``python -m testbeds.bench.timeline DIR`` lines the events up per step and link.

Off by default and then free (one attribute test per event). The trace is written only,
never read back by an executor; a line is flushed when written, so a killed process
leaves a complete prefix. A file that cannot be opened turns tracing off with a warning:
a diagnosis must not stop a training run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger(__name__)

#: The environment variable that turns tracing on: a directory for the trace files.
TRACE_DIR_ENV = "FUSION_TRACE_DIR"


class Tracer:
    """Appends events to one JSON-lines file per process (``None`` directory: off)."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self.path: Path | None = None
        if directory:
            path = Path(directory) / f"trace-{os.getpid()}.jsonl"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept for the process's life
                self.path = path
            except OSError as e:
                logger.warning("tracing off: cannot open %s (%s)", path, e)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def event(self, ev: str, **fields: Any) -> None:
        """Record ``ev`` now, with ``fields`` (JSON scalars)."""
        if self._file is None:
            return
        line = json.dumps({"t": time.time(), "ev": ev, **fields}, separators=(",", ":"))
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # a full disk or a closed file: stop tracing, keep training
                logger.warning("tracing off: writing %s failed (%s)", self.path, e)
                self._file = None


_tracer: Tracer | None = None
_tracer_lock = threading.Lock()


def tracer() -> Tracer:
    """This process's tracer, from ``FUSION_TRACE_DIR`` when first asked for."""
    global _tracer
    if _tracer is None:
        with _tracer_lock:
            if _tracer is None:
                _tracer = Tracer(os.environ.get(TRACE_DIR_ENV) or None)
    return _tracer


def use_tracer(replacement: Tracer) -> Tracer:
    """Make ``replacement`` this process's tracer (tests, or a tool that traces one run of
    several); returns the one it replaces."""
    global _tracer
    with _tracer_lock:
        previous, _tracer = _tracer if _tracer is not None else Tracer(None), replacement
    return previous

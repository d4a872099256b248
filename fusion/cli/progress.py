"""A running job's progress for a person: a ``tqdm`` bar on a terminal, plain lines otherwise.

Used by ``fusion demo`` and ``fusion logs --follow``. Steps are counted as the coordinator
counts them: ``step 5/100`` means five steps are done. On a terminal the bar shows the
steps, their rate, the time left (ETA), the loss and the samples per second; before the
first step it shows what the job waits for (``waiting``) or which planning phase it is in
(``phase``). When the stream is not a terminal (a log file, a pipe) nothing is rewritten:
a plain line, prefixed with the time since the display started, is written when the
state or phase changes and at most every ``every_s`` seconds in between, so a log holds
no carriage returns.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


def describe(status: dict[str, Any]) -> str:
    """What the job is doing, in a few words: its state, and while it is pending or
    planning what it waits for or its planning phase (when the coordinator says)."""
    state = str(status.get("state", "?"))
    detail = status.get("phase") if state == "planning" else status.get("waiting") if state == "pending" else None
    return f"{state}: {detail}" if detail else state


def progress_line(status: dict[str, Any], rate_steps_per_s: float | None) -> str:
    """One plain line: ``step 5/100, loss 3.2100, 4.0 samples/s, 1.25 steps/s, ETA 01:16 (running)``."""
    step, steps = int(status.get("step") or 0), int(status.get("steps") or 0)
    parts = [f"step {step}/{steps}"]
    if status.get("loss") is not None:
        parts.append(f"loss {float(status['loss']):.4f}")
    if status.get("samples_per_s"):
        parts.append(f"{float(status['samples_per_s']):.1f} samples/s")
    if rate_steps_per_s:
        parts.append(f"{rate_steps_per_s:.2f} steps/s")
        if steps > step:
            parts.append(f"ETA {tqdm.format_interval((steps - step) / rate_steps_per_s)}")
    return f"{', '.join(parts)} ({describe(status)})"


def _columns(stream: TextIO) -> int:
    """The width of the terminal behind ``stream``; 0 when unknown."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class JobProgress:
    """Shows successive status documents of one job (``CoordinatorClient.status``).

    Args:
        total: the job's step count.
        stream: where to write (default: stderr).
        tty: whether ``stream`` is a terminal (default: ask it).
        every_s: without a terminal, the most often a line is written while nothing but the
            step changes.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, tty: bool | None = None, every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total = max(int(total), 1)
        self.every_s = every_s
        self._bar: tqdm | None = None
        self._first: tuple[float, int] | None = None  # (time, step) when steps were first seen running
        self._last_print = float("-inf")
        self._last_what = ""
        self._t0 = time.monotonic()
        self._trained = False  # the bar has shown a running job

    def _rate(self, step: int) -> float | None:
        now = time.monotonic()
        if self._first is None or step < self._first[1]:  # first sight, or rewound by a restore
            self._first = (now, step)
            return None
        t0, s0 = self._first
        return (step - s0) / (now - t0) if step > s0 and now > t0 else None

    def update(self, status: dict[str, Any]) -> None:
        """Show ``status`` (a job's status document)."""
        step = int(status.get("step") or 0)
        running = status.get("state") == "running"
        rate = self._rate(step) if running else None
        if self.tty:
            self._show_bar(status, step)
            return
        what = describe(status)
        now = time.monotonic()
        if what != self._last_what or now - self._last_print >= self.every_s:
            elapsed = tqdm.format_interval(now - self._t0)
            print(f"[{elapsed}] {progress_line(status, rate)}", file=self.stream, flush=True)
            self._last_print, self._last_what = now, what

    def _show_bar(self, status: dict[str, Any], step: int) -> None:
        if self._bar is None:
            sized = _columns(self.stream) > 0  # a terminal of unknown size (0x0) gets 100x24
            self._bar = tqdm(
                total=self.total,
                initial=step,
                desc=describe(status),
                unit="step",
                file=self.stream,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,
            )
        bar = self._bar
        postfix: dict[str, str] = {}
        if status.get("loss") is not None:
            postfix["loss"] = f"{float(status['loss']):.4f}"
        if status.get("samples_per_s"):
            postfix["samples/s"] = f"{float(status['samples_per_s']):.1f}"
        bar.set_description_str(describe(status), refresh=False)
        bar.set_postfix(postfix, refresh=False)
        running = status.get("state") == "running"
        if running and (not self._trained or step < bar.n):
            # Training starts (or restarts after a restore): time and rate count from here.
            bar.reset(total=self.total)
            bar.initial = step
            self._trained = True
        bar.n = step  # set, not added: the rate is the mean since training started, and so is the ETA
        bar.refresh()

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print a line (an event) to ``file`` (default: stdout) without breaking the bar."""
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["JobProgress", "describe", "progress_line"]

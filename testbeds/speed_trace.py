"""How steady this machine's speed is: one job's model timed back to back for a while.

The simulator prices a run from profiles taken in a few seconds at its start; a run lasts
minutes. If the machine's speed moves between the two, no model priced from the profile
alone can make up for it: the benchmark therefore probes the speed before and after each
run with :class:`ModelProbe`, for the simulator's ``probed`` prediction. This traces it: one micro-batch's forward and backward of the job's model, on one
thread as the testbed's workers run, over and over for ``--seconds``, reported per window
of ``--window`` seconds as that window's median step over the whole trace's median.

``python -m testbeds.speed_trace --job testbeds/results/bench-job-resnet.toml --seconds 60 --out testbeds/results/speed-trace``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fusion.config import JobSpec, load_job


class ModelProbe:
    """One micro-batch's forward and backward of a job's model on one thread, as the
    testbed's workers compute: timed back to back, it measures this machine's speed now.

    The benchmark probes before and after each system's run (:mod:`testbeds.bench`), so that
    the simulator can price a run at the speed the machine had while it ran, relative to
    its speed when fusion's coordinator profiled the model (``machine_probe`` in a result)."""

    def __init__(self, spec: JobSpec) -> None:
        from fusion.losses import get_loss
        from fusion.training import (
            build_job_dataset,
            build_job_model,
            example_micro_batch,
        )

        with _one_thread():
            self.model = build_job_model(spec)
            self.model.train()
            self.x, self.y = example_micro_batch(spec, build_job_dataset(spec))
            self.loss = get_loss(spec.train.loss)
            for _ in range(3):  # warm-up
                self._step()

    def _step(self) -> None:
        self.loss(self.model(self.x), self.y).backward()
        self.model.zero_grad(set_to_none=True)

    def samples(self, seconds: float) -> list[tuple[float, float]]:
        """``(start, seconds)`` of each step, back to back for ``seconds`` (at least three steps)."""
        out: list[tuple[float, float]] = []
        with _one_thread():
            start = time.perf_counter()
            while (now := time.perf_counter()) - start < seconds or len(out) < 3:
                self._step()
                out.append((now - start, time.perf_counter() - now))
        return out

    def median_step_s(self, seconds: float = 1.0) -> float:
        """The median step over ``seconds`` of steps: this machine's speed now, in seconds."""
        return statistics.median(s for _, s in self.samples(seconds))


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def trace(spec: JobSpec, *, seconds: float, window_s: float) -> dict[str, Any]:
    """Per window: its start (s from the trace's start), steps timed and median step."""
    samples = ModelProbe(spec).samples(seconds)
    windows: list[dict[str, float]] = []
    for k in range(int(seconds / window_s)):
        steps = [s for t, s in samples if k * window_s <= t < (k + 1) * window_s]
        if steps:
            windows.append({"start_s": k * window_s, "steps": len(steps), "median_step_s": statistics.median(steps)})
    overall = statistics.median(s for _, s in samples)
    for w in windows:
        w["relative"] = w["median_step_s"] / overall
    rel = sorted(w["relative"] for w in windows)
    return {
        "job": spec.name,
        "seconds": seconds,
        "window_s": window_s,
        "median_step_s": overall,
        "windows": windows,
        "slowest_over_fastest_window": rel[-1] / rel[0] if rel else None,
        "share_of_windows_over_1_25x_the_fastest": sum(r > 1.25 * rel[0] for r in rel) / len(rel) if rel else None,
    }


def markdown(doc: dict[str, Any], command: str) -> str:
    lines = [
        "# How steady the machine's speed is",
        "",
        f"`{command}`",
        "",
        f"{doc['job']}: one micro-batch's forward and backward, one thread, back to back for {doc['seconds']:.0f} s; "
        f"median step {doc['median_step_s'] * 1e3:.2f} ms. Slowest window over fastest: "
        f"{doc['slowest_over_fastest_window']:.2f}x; windows over 1.25x the fastest: "
        f"{doc['share_of_windows_over_1_25x_the_fastest']:.0%}.",
        "",
        "| window start s | steps | median step ms | over the trace's median |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {w['start_s']:.0f} | {w['steps']} | {w['median_step_s'] * 1e3:.2f} | {w['relative']:.2f} |"
        for w in doc["windows"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(prog="python -m testbeds.speed_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job TOML (as bench --job takes it)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=1.0, help="seconds per reported window")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.window <= 0 or args.window > args.seconds:
        parser.error("--seconds and --window must be positive, the window no longer than the trace")
    doc = trace(load_job(args.job), seconds=args.seconds, window_s=args.window)
    text = markdown(doc, "python -m testbeds.speed_trace " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(doc, indent=2) + "\n")
        Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

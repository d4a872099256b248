"""This machine's speed now: one micro-batch of a job's model, timed back to back.

The simulator prices a run from profiles taken in a few seconds at its start; a run lasts
minutes, and on a shared machine the speed moves between the two. The benchmark therefore
probes the speed before and after each system's run with :class:`ModelProbe`, and once just
before fusion's coordinator profiles; the simulator's ``probed`` prediction
(:func:`testbeds.sim.validation.machine_drift`) prices each system at the speed its probes saw.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fusion.config import JobSpec


class ModelProbe:
    """One micro-batch's forward and backward of a job's model on one thread, as the
    testbed's workers compute: timed back to back, it measures this machine's speed now.

    The benchmark probes before and after each system's run (:mod:`testbeds.bench.harness`), so that
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

"""Compression must pay in measured time: AdaTopK's choice checked against dense on the job.

The planner picks each cut's codec for the smallest *predicted* time to loss,
``step_s × m`` (:mod:`scheduler.compression`), where ``m >= 1`` is the convergence cost of
the chosen errors. The prediction prices the bytes a codec saves but not the codec's own
compute, nor anything else the estimator cannot see (cores a machine's processes share, a
link slower than probed). So once training runs, the driver measures both: after
:data:`SKIP_STEPS` steps (start-up, the first 1F1B fill) it runs :data:`PAIRS` pairs of
steps, one with every cut dense and one with the planned settings, interleaved so that a
drift of the machine falls on both alike, and keeps the planned settings only when

    median(compressed step_s) × m < median(dense step_s),

i.e. when compression still reaches the loss sooner on the measured step times. Otherwise
every cut runs dense from then on. Dense steps cost nothing in accuracy, so the trial
never makes the model worse; compressed steps in it are what the plan would have run
anyway.

A trial belongs to one placement: a re-plan (a worker lost or joined) builds a new driver
and a new trial. Fixed codecs an owner names (``topk``, ``quant``) are the owner's choice
and are not put on trial.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

#: Steps run as planned before the trial (the first is start-up, the next fills the pipeline).
SKIP_STEPS = 2
#: Dense/compressed pairs of steps the verdict is taken on (medians of each).
PAIRS = 3

Verdict = Literal["compressed", "dense"]


@dataclass
class CodecTrial:
    """The trial of one placement's compression (module docstring).

    Args:
        convergence_cost: ``m`` of the planned settings (their steps-to-loss multiplier).
        skip_steps: steps before the trial starts.
        pairs: dense/compressed pairs of steps in the trial.
    """

    convergence_cost: float
    skip_steps: int = SKIP_STEPS
    pairs: int = PAIRS
    dense_s: list[float] = field(default_factory=list)
    compressed_s: list[float] = field(default_factory=list)
    verdict: Verdict | None = None
    """None while the trial runs (or before it starts)."""
    _steps_seen: int = 0

    def __post_init__(self) -> None:
        if not self.convergence_cost >= 1.0:
            raise ValueError(f"convergence_cost must be >= 1, got {self.convergence_cost!r}")
        if self.skip_steps < 0 or self.pairs < 1:
            raise ValueError(f"need skip_steps >= 0 and pairs >= 1, got {self.skip_steps} and {self.pairs}")

    def dense_next(self) -> bool:
        """Whether the next step runs every cut dense."""
        if self.verdict is not None:
            return self.verdict == "dense"
        trial_step = self._steps_seen - self.skip_steps
        return trial_step >= 0 and trial_step % 2 == 0

    def observe(self, step_s: float) -> Verdict | None:
        """Record the step just run (its kind as :meth:`dense_next` said before it); returns
        the verdict on the step that decides it, else None."""
        if self.verdict is not None:
            return None
        dense = self.dense_next()
        in_trial = self._steps_seen >= self.skip_steps
        self._steps_seen += 1
        if not in_trial:
            return None
        (self.dense_s if dense else self.compressed_s).append(float(step_s))
        if len(self.compressed_s) < self.pairs:
            return None
        self.verdict = "compressed" if self.compressed_time_to_loss() < self.dense_time_to_loss() else "dense"
        return self.verdict

    def dense_time_to_loss(self) -> float:
        """Median dense step: the time to loss per dense step (``m = 1``)."""
        return statistics.median(self.dense_s)

    def compressed_time_to_loss(self) -> float:
        """Median compressed step times ``m``: the same time measured in dense steps."""
        return statistics.median(self.compressed_s) * self.convergence_cost

    def describe(self) -> str:
        """One line on the verdict and the figures behind it."""
        if self.verdict is None:
            return f"compression on trial against dense ({len(self.compressed_s)} of {self.pairs} pairs run)"
        compressed = statistics.median(self.compressed_s)
        dense = self.dense_time_to_loss()
        keep = "keeping the planned codecs" if self.verdict == "compressed" else "running every cut dense"
        return (
            f"measured {compressed:.3f}s/step compressed x convergence cost {self.convergence_cost:.3f} = "
            f"{compressed * self.convergence_cost:.3f}s against {dense:.3f}s/step dense "
            f"(medians of {len(self.compressed_s)} interleaved pairs): {keep}"
        )

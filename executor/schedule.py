"""Pipeline schedules as data: the ordered forward/backward actions one stage runs per step.

A stage runs its action list in order, blocking on each action until its inputs have
arrived. Deadlock freedom follows from the order: every stage runs forwards in
micro-batch order and backwards in micro-batch order, and a stage at depth ``d`` (longest
path, in stages, to a sink) runs at most ``d`` forwards ahead of its backwards. The
backward of micro-batch ``m`` on a stage needs the backward of ``m`` on every consumer,
which sits at a smaller depth and so needs only forwards up to ``m + d - 1`` — all
already sent by then.

- **GPipe**: all forwards, then all backwards. Stashes ``M`` micro-batches of activations.
- **1F1B** (PipeDream-flush): ``min(d, M)`` warm-up forwards, then alternate one forward and
  one backward, then drain the backwards. Stashes at most ``d + 1`` micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fusion.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One unit of stage work: ``F`` (forward) or ``B`` (backward) of a micro-batch."""

    kind: Literal["F", "B"]
    micro_batch_idx: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch_idx}"


def stage_actions(schedule: str, *, num_micro_batches: int, depth: int) -> list[Action]:
    """The actions a stage at ``depth`` runs for one step.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        num_micro_batches: ``M``, micro-batches per step.
        depth: longest path from the stage to a sink of the stage graph (0 for the loss stage).
    """
    if num_micro_batches < 1:
        raise ConfigError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    m = num_micro_batches
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(depth, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        return actions
    raise ConfigError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


def max_stashed(actions: list[Action]) -> int:
    """Most micro-batches whose activations are kept at once under ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak

"""A job's memory as it ran: each stage's measured peak against its worker's cap.

Workers lend capped memory (``fusion-worker --memory-gb``). The planner keeps every stage's
predicted peak within its worker's cap; the executor measures the real peak of every step
(:mod:`executor.runtime`) and fails a step that outgrows the cap. Then the coordinator plans
again with the figure it measured: every predicted peak is scaled by ``measured / predicted``
of the stage that outgrew its plan (times :data:`MARGIN`), so the estimator's error is paid
once, not at every step. :class:`MemoryLedger` keeps that factor and what each placement
measured, for the job's ``measured.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fusion.errors import MemoryCapError

logger = logging.getLogger(__name__)

#: Head-room on top of measured / predicted when a stage outgrew its plan: the next plan
#: should not land exactly on the edge the last one fell over.
MARGIN = 1.05


def lent_bytes(resources: Mapping[str, Any]) -> int | None:
    """What a registered worker lends (its reported device memory), if it said."""
    value = resources.get("device_memory_bytes")
    return int(value) if value else None


class MemoryLedger:
    """The factor on predicted peaks, and each placement's planned and measured peaks."""

    def __init__(self) -> None:
        self.scale = 1.0
        """Factor on every predicted peak (>= 1; ``PlanRequest.memory_scale``)."""
        self._placements: list[list[dict[str, Any]]] = []
        self._exceeded: list[dict[str, Any]] = []

    def placed(self, planned_bytes: Sequence[int | None], workers: Sequence[tuple[str, int | None]]) -> None:
        """A new placement: each stage's planned peak and its worker's ``(name, cap)``."""
        self._placements.append(
            [
                {
                    "stage": i,
                    "worker": name,
                    "cap_bytes": cap,
                    "planned_peak_bytes": planned,
                    "measured_peak_bytes": None,
                }
                for i, (planned, (name, cap)) in enumerate(zip(planned_bytes, workers, strict=True))
            ]
        )

    def observe(self, peaks: Mapping[int, int]) -> None:
        """A step's measured peak per stage (0: not measured)."""
        if not self._placements:
            return
        stages = self._placements[-1]
        for s, peak in peaks.items():
            if peak and 0 <= s < len(stages):
                stages[s]["measured_peak_bytes"] = max(stages[s]["measured_peak_bytes"] or 0, int(peak))

    def outgrown(self, error: MemoryCapError) -> float:
        """A stage's step peaked over its cap: scale predicted peaks by what it measured over
        what was planned (never down); returns the new factor."""
        planned = error.planned_bytes or error.cap_bytes
        ratio = error.needed_bytes / planned if planned > 0 else 1.0
        self.scale = max(self.scale * 1.01, self.scale * ratio * MARGIN)
        self._exceeded.append(
            {
                "stage": error.stage_idx,
                "worker": error.worker,
                "measured_peak_bytes": error.needed_bytes,
                "planned_peak_bytes": error.planned_bytes,
                "cap_bytes": error.cap_bytes,
                "scale": self.scale,
            }
        )
        self.observe({error.stage_idx: error.needed_bytes})
        logger.info("job memory: %s; predicted peaks now scaled by %.3f", error, self.scale)
        return self.scale

    def to_dict(self) -> dict[str, Any]:
        """The ``memory`` section of ``measured.json``: ``{"scale", "stages": [{"stage",
        "worker", "cap_bytes", "planned_peak_bytes", "measured_peak_bytes"}] (the last
        placement), "earlier": [...] (the placements before it), "exceeded": [...]}``."""
        return {
            "scale": self.scale,
            "stages": self._placements[-1] if self._placements else [],
            "earlier": self._placements[:-1],
            "exceeded": self._exceeded,
        }

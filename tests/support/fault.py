"""Injected faults for tests: a worker that corrupts what its stages send.

:class:`Fault` names what is corrupted and from which step; :class:`FaultyStages` is the
executor compute hook (:class:`executor.hooks.StageHooks`) that applies it to every
outgoing activation or gradient set. ``python -m tests.support.fault_worker`` and
``python -m tests.support.hooked_executor`` start a worker or a bare executor with it
(``--fault KIND[@STEP]``), so tests can prove poisoned-update detection end to end.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from executor.hooks import FORWARD, StageHooks, StageInfo
from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

#: ``nan-*``: every floating-point value NaN; ``scaled-*``: every value times :data:`SCALE`.
FAULTS = ("nan-gradients", "nan-activations", "scaled-gradients", "scaled-activations")
#: What a ``scaled-*`` fault multiplies by: far beyond the guard's norm bound
#: (:data:`executor.guard.MAX_NORM_RATIO`).
SCALE = 1.0e6

FAULT_HELP = (
    "corrupt what this worker sends: nan-gradients, nan-activations, scaled-gradients or scaled-activations, "
    "optionally @STEP (first corrupted step)"
)


@dataclass(frozen=True)
class Fault:
    """Corrupt what a worker sends, from ``from_step`` on."""

    kind: str
    """One of :data:`FAULTS`."""
    from_step: int = 0
    """First training step (0-based) that is corrupted."""

    @classmethod
    def parse(cls, text: str | None) -> Fault | None:
        """``KIND`` or ``KIND@STEP``; ``None`` for none."""
        if not text:
            return None
        kind, at, step = text.partition("@")
        if kind not in FAULTS or (at and not step.isdigit()):
            raise ConfigError(f"--fault takes one of {', '.join(FAULTS)}, optionally @STEP; got {text!r}")
        return cls(kind=kind, from_step=int(step or 0))

    def corrupt(self, kind: str, step: int, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``tensors`` (``kind``: ``activations`` or ``gradients``) corrupted when this fault
        applies, else the same mapping."""
        how, _, what = self.kind.partition("-")
        if what != kind or step < self.from_step:
            return tensors
        logger.warning("test fault %s: sending %s %s at step %d", self.kind, how, kind, step)
        if how == "nan":
            return {n: torch.full_like(t, float("nan")) if t.is_floating_point() else t for n, t in tensors.items()}
        return {n: t * SCALE if t.is_floating_point() else t for n, t in tensors.items()}


class FaultyStages(StageHooks):
    """Every stage of the worker sends what ``fault`` makes of its tensors."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def outgoing(
        self, stage: StageInfo, kind: str, step: int, dst_stage_idx: int, tensors: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        return self.fault.corrupt("activations" if kind == FORWARD else "gradients", step, tensors)

"""Why a plan leaves workers out, in one line, from the estimator's own numbers.

A planner that puts a job on fewer workers than it was given compared that plan with
others that used more; the user sees only the winner. :func:`why_left_out` states the
comparison: the chosen plan's modelled step time against the fastest plan over more workers
that the search priced, and what the extra stages would have traded.

The trade, per training step of ``M`` micro-batches (estimator terms, :class:`Estimate`):

- *compute saved* ``C = M · (max_s c_s − max_s c'_s)``, with ``c_s`` the compute seconds
  per micro-batch of stage ``s`` in the chosen plan and ``c'_s`` in the wider one: a
  pipeline's period follows its slowest stage, so spreading the model gains about this much;
- *transfers added* ``T = Δ + C``, with ``Δ = step' − step`` the difference of the modelled
  step times: everything else the extra stages cost (bytes on the cuts, their latencies and
  answers, the pipeline's fill and drain), so that ``T − C = Δ`` exactly (``C`` taken as 0
  where the wider plan's slowest stage is no faster).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from scheduler.estimator import Estimate

logger = logging.getLogger(__name__)


def _s(seconds: float) -> str:
    if abs(seconds) >= 0.01:
        return f"{seconds:.3g} s"
    if abs(seconds) >= 1e-5:
        return f"{seconds * 1e3:.2g} ms"
    return f"{seconds * 1e6:.2g} µs"


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def why_left_out(
    chosen: Estimate,
    chosen_workers: Sequence[str],
    left_out: Sequence[str],
    *,
    micro_batches: int,
    wider: Estimate | None = None,
    wider_workers: Sequence[str] = (),
    no_wider: str = "",
) -> str:
    """One line saying why the plan on ``chosen_workers`` leaves ``left_out`` unused.

    ``wider``: the estimate of the fastest plan over more workers (on ``wider_workers``);
    without it, ``no_wider`` says why there was none. E.g. ``1 stage on w1: splitting over
    2 workers would add 0.21 s of transfers per step for 0.01 s of compute saved (modelled
    0.26 s/step against 0.05 s/step)``; small times in ms or µs.
    """
    stages = len(chosen_workers)
    head = f"{stages} stage{'s' if stages != 1 else ''} on {_names(chosen_workers)}"
    head += ":" if stages == 1 else f"; left out {_names(left_out)}:"
    if wider is None:
        return f"{head} {no_wider or 'no plan over more workers was found'}"
    compute_saved_s = micro_batches * (max(chosen.stage_compute_s) - max(wider.stage_compute_s))
    transfers_s = wider.step_s - chosen.step_s + max(compute_saved_s, 0.0)
    verb = "splitting over" if stages == 1 else "using"
    trade = (
        f"would add {_s(transfers_s)} of transfers per step" if transfers_s > 0 else "would move no more data per step"
    )
    trade += f" for {_s(compute_saved_s)} of compute saved" if compute_saved_s > 0 else " and save no compute"
    return (
        f"{head} {verb} {len(wider_workers)} workers ({_names(wider_workers)}) {trade} "
        f"(modelled {_s(wider.step_s)}/step against {_s(chosen.step_s)}/step)"
    )

"""Replicas of the stages' state: which worker holds each stage's copy, and when it is sent.

Every ``checkpoint.replicate_every`` steps each stage snapshots its state and streams it to
a **buddy**: the worker on the fastest link from the stage's own, so that losing one worker
loses no state that another does not hold (:mod:`fusion.coordinator.restore` reads them back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from executor.driver import SnapshotRequest
from fusion.config import JobSpec

logger = logging.getLogger(__name__)


def choose_buddies(
    stage_addresses: Sequence[str], addresses: Sequence[str], link: Callable[[str, str], tuple[float, float] | None]
) -> dict[int, str]:
    """Each stage's replica holder: the other worker (of ``addresses``, the job's held
    workers) on the fastest link from the stage's worker, by ``link(a, b)`` (a fit of
    ``(latency, bandwidth)``, ``None`` when unknown).

    Links within a factor of two count as equal; ties go round the ring of stages (and
    spares), so replicas spread out instead of piling on one worker.
    """
    ring = list(dict.fromkeys([*stage_addresses, *addresses]))
    if len(ring) < 2:
        return {}
    out: dict[int, str] = {}
    for i, address in enumerate(stage_addresses):
        start = ring.index(address)
        order = [ring[(start + k) % len(ring)] for k in range(1, len(ring))]

        def bandwidth(b: str, a: str = address) -> float:
            fit = link(a, b)
            return fit[1] if fit is not None else 0.0

        best = max(bandwidth(b) for b in order)
        out[i] = next(b for b in order if bandwidth(b) * 2 >= best)
    return out


def snapshot_request(
    spec: JobSpec,
    step: int,
    buddies: Mapping[int, str],
    stage_addresses: Sequence[str],
    link: Callable[[str, str], tuple[float, float] | None],
) -> SnapshotRequest | None:
    """What to snapshot after ``step``: nothing between checkpoints; replicas to ``buddies``
    every ``replicate_every`` steps, paced at ``replicate_share`` of the slowest known
    buddy link (so replication does not starve training traffic)."""
    done = step + 1
    ck = spec.checkpoint
    if done >= spec.train.steps or (done % ck.replicate_every and done % ck.durable_every):
        return None
    fits = [link(stage_addresses[i], b) for i, b in buddies.items()]
    known = [f[1] for f in fits if f is not None]
    rate = ck.replicate_share * min(known) if known else 0.0
    return SnapshotRequest(buddies=dict(buddies) if done % ck.replicate_every == 0 else {}, rate_bytes_per_s=rate)

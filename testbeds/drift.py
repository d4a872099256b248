"""The machine's speed while a benchmark runs, probed between its runs.

Every host of a testbed computes on one shared VM, and the VM's speed drifts: the same
ResNet micro-batch took 1.3-1.7x longer at the start of a benchmark than a few minutes later
(2026-12-01: the node profile taken at the start priced uniform's volunteers ResNet run 27 %
slow, while the compute that run measured was on the profile's level to 4 %). The
simulator prices every system from profiles taken once, so its prediction for a run made
minutes later carries that drift.

So the benchmark probes the machine: one micro-batch's forward and backward of the job's
own model, on one thread, just before every system's run and right after each profile it
takes. :func:`speed_drift` is then the machine's speed during a system's runs relative to
its speed when that system's costs were profiled (the node profile for fusion, uniform and
DDP; the GPipe program's stage profile for pipelining), and the validation prices each
system at that speed. The probe is taken by the benchmark, not by the systems: nothing of a
run's own timing enters its prediction.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from fusion.config import JobSpec

#: The probe repeats after its warm-up until it has measured this long (a ResNet-18 w16
#: micro-batch is ~5 ms on the testbed VM: about 60 repeats).
PROBE_MIN_S = 0.3
PROBE_WARMUP = 2


class SpeedProbe:
    """Times the job's model on one micro-batch, as the testbed's workers run it (one thread)."""

    def __init__(self, spec: JobSpec) -> None:
        from fusion.losses import get_loss
        from fusion.training import (
            build_job_dataset,
            build_job_model,
            example_micro_batch,
        )

        self.model = build_job_model(spec)
        self.model.train()
        self.x, self.y = example_micro_batch(spec, build_job_dataset(spec))
        self.loss = get_loss(spec.train.loss)

    def __call__(self) -> float:
        """Median seconds of one forward and backward."""
        threads = torch.get_num_threads()
        rng = torch.random.get_rng_state()
        torch.set_num_threads(1)
        times: list[float] = []
        try:
            i = 0
            while i < PROBE_WARMUP + 3 or sum(times) < PROBE_MIN_S:
                t0 = time.perf_counter()
                self.loss(self.model(self.x), self.y).backward()
                elapsed = time.perf_counter() - t0
                self.model.zero_grad(set_to_none=True)
                if i >= PROBE_WARMUP:
                    times.append(elapsed)
                i += 1
        finally:
            torch.set_num_threads(threads)
            torch.random.set_rng_state(rng)
        return statistics.median(times)


def speed_drift(doc: dict[str, Any], system: str) -> float | None:
    """How many times faster the machine was during ``system``'s runs than when its costs
    were profiled, from a benchmark result's probes; None where it recorded none."""
    probes = doc.get("speed_probe") or {}
    row = doc.get("systems", {}).get(system) or {}
    during = row.get("speed_probe_s")
    staged = system == "pipelining" and doc.get("pipelining_stages")
    reference = probes.get("stage_profile_s" if staged else "node_profile_s")
    if not during or not reference:
        return None
    return float(reference) / statistics.mean(during)

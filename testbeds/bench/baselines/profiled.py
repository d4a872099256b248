"""What a baseline rank emulating a slower device by the profile stretches by.

With ``--emulation profile`` (:mod:`testbeds.emulation`) an emulated rank sleeps ``factor
- 1`` times its computations' profiled seconds instead of times their wall time. The
seconds come from the node profile the fusion coordinator measured and calibrated in the
same benchmark (fusion's workers sum theirs from the coordinator's ``GetProfile``), priced as the simulator
prices them: a micro-batch's forward and backward at the profile's speed.

- DDP: the whole model's forward and backward per micro-batch, and when in the backward
  each parameter's gradient is ready (once the backward has passed the first node that
  reads it), so that its gradient buckets get ready when they would on the slower device.
  A rank scales them by its samples over a micro-batch's.
- GPipe: each stage's forward and backward per micro-batch, under the even block split.

The benchmark writes one JSON document (:func:`reference_document`) that every rank reads
(``--profiled FILE``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import ConfigError
from scheduler.estimator import unit_param_names
from testbeds.sim.costs import JobCosts


def reference_document(job: JobCosts, gpipe_stages: int) -> dict[str, Any]:
    """``{"micro_batch_samples", "ddp": {"forward_s", "backward_s", "ready_s"}, "gpipe":
    [[forward_s, backward_s], ...]}`` for ``job`` (seconds per micro-batch)."""
    from testbeds.sim.baselines import gpipe_stages as split

    wl = job.workload()
    after = np.cumsum(wl.bwd_s[::-1])[::-1]  # backward seconds until it has passed unit u
    ready: dict[str, float] = {}
    for u, unit in enumerate(unit_param_names(job.dag)):
        for name, _ in unit:
            ready.setdefault(name, float(after[u]))
    doc: dict[str, Any] = {
        "micro_batch_samples": job.spec.micro_batch_size,
        "ddp": {"forward_s": float(wl.fwd_s.sum()), "backward_s": float(wl.bwd_s.sum()), "ready_s": ready},
    }
    if gpipe_stages >= 2:
        fwd, bwd = wl.stage_seconds(split(job, gpipe_stages), gpipe_stages)
        doc["gpipe"] = [[float(f), float(b)] for f, b in zip(fwd, bwd, strict=True)]
    return doc


def read_reference(path: str | Path) -> dict[str, Any]:
    """The document :func:`reference_document` wrote, or ``ConfigError`` naming the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the profiled seconds in {path}: {e}") from e
    if not isinstance(doc, dict) or "ddp" not in doc or "micro_batch_samples" not in doc:
        raise ConfigError(f"{path} is not a profiled-seconds document (needs micro_batch_samples and ddp)")
    return doc


def ddp_attach_args(doc: dict[str, Any], samples: int) -> dict[str, Any]:
    """:meth:`~testbeds.emulation.Slowdown.attach`'s profile for a DDP rank computing
    ``samples`` samples a step."""
    k = samples / float(doc["micro_batch_samples"])
    d = doc["ddp"]
    return {
        "forward_s": k * d["forward_s"],
        "backward_s": k * d["backward_s"],
        "ready_s": {n: k * s for n, s in d["ready_s"].items()},
    }


def gpipe_attach_args(doc: dict[str, Any], stage: int) -> dict[str, Any]:
    """:meth:`~testbeds.emulation.Slowdown.attach`'s profile for GPipe stage ``stage``."""
    stages = doc.get("gpipe") or []
    if not 0 <= stage < len(stages):
        raise ConfigError(f"the profiled seconds have {len(stages)} GPipe stage(s), not stage {stage}")
    forward_s, backward_s = stages[stage]
    return {"forward_s": float(forward_s), "backward_s": float(backward_s)}

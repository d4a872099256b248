"""The benchmark's probe of the machine's speed (``testbeds.drift``)."""

from __future__ import annotations

import pytest
import torch

from fusion.config import JobSpec
from testbeds import drift

GPT2_TINY = """
name = "drift-gpt2-tiny"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 32
[train]
steps = 1
micro_batches = 2
"""


def test_drift_is_the_profiles_probe_over_the_runs() -> None:
    doc = {
        "speed_probe": {"node_profile_s": 0.012, "stage_profile_s": 0.006},
        "pipelining_stages": [{"fwd_time_s": 1.0, "bwd_time_s": 1.0}] * 2,
        "systems": {"uniform": {"speed_probe_s": [0.006, 0.010]}, "pipelining": {"speed_probe_s": [0.012]}, "ddp": {}},
    }
    assert drift.speed_drift(doc, "uniform") == pytest.approx(1.5)  # 0.012 / 0.008: faster
    # pipelining is priced from the stage profile, so its probe is the reference.
    assert drift.speed_drift(doc, "pipelining") == pytest.approx(0.5)
    assert drift.speed_drift(doc, "ddp") is None
    assert drift.speed_drift({"systems": {"uniform": {"speed_probe_s": [0.01]}}}, "uniform") is None
    # Without the stage profile pipelining is priced from the node profile.
    assert drift.speed_drift({**doc, "pipelining_stages": None}, "pipelining") == pytest.approx(1.0)


def test_probe_times_the_model_and_keeps_the_callers_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drift, "PROBE_MIN_S", 0.0)
    probe = drift.SpeedProbe(JobSpec.from_toml(GPT2_TINY))
    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    seconds = probe()
    assert 0 < seconds < 1
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(p.grad is None for p in probe.model.parameters())

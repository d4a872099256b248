"""The benchmark's machine probe (``testbeds.bench.speed_probe``) on a tiny model."""

from __future__ import annotations

import torch

from fusion.config import JobSpec
from testbeds.bench.speed_probe import ModelProbe

GPT2_TINY = """
name = "probe-gpt2-tiny"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 16
[train]
steps = 1
micro_batches = 2
"""


def test_the_probe_times_steps_back_to_back_on_one_thread_and_restores_the_threads() -> None:
    threads = torch.get_num_threads()
    probe = ModelProbe(JobSpec.from_toml(GPT2_TINY))
    samples = probe.samples(0.05)
    assert len(samples) >= 3
    assert [t for t, _ in samples] == sorted(t for t, _ in samples)
    assert all(s > 0 for _, s in samples)
    assert probe.median_step_s(0.05) > 0
    assert torch.get_num_threads() == threads

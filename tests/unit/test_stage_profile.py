"""The pipelining baseline's stage profile (``testbeds.stage_profile``): one forward and
backward time per stage of the program ``torch.distributed.pipelining`` builds."""

from __future__ import annotations

import pytest
import torch

from fusion.config import JobSpec
from testbeds import stage_profile

GPT2_TINY = """
name = "stage-gpt2-tiny"
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


def test_one_time_per_stage_and_the_callers_state_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_profile, "MIN_TIME_S", 0.0)
    threads = torch.get_num_threads()
    before = torch.random.get_rng_state()
    stages = stage_profile.profile_pipeline_stages(JobSpec.from_toml(GPT2_TINY), 2)
    assert len(stages) == 2
    for s in stages:
        assert set(s) == {"fwd_time_s", "bwd_time_s"}
        assert 0 < s["fwd_time_s"] < 1 and 0 < s["bwd_time_s"] < 1
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), before)


def test_more_stages_than_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 blocks cannot make 3 stages"):
        stage_profile.profile_pipeline_stages(JobSpec.from_toml(GPT2_TINY), 3)


def test_cli_prints_each_stage(capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_profile, "MIN_TIME_S", 0.0)
    job = tmp_path / "job.toml"
    job.write_text(GPT2_TINY)
    assert stage_profile.main(["--job", str(job), "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: forward" in out and "stage 1: forward" in out

"""The codec trial (executor.codec_trial): interleaved dense and compressed steps, and a
verdict on the measured time to loss; and a stage's per-step settings
(``CutCompression.set_step``) that the trial's dense steps travel on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.codec_trial import CodecTrial
from executor.compression import CutCompression, CutSetting, dense_settings
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2 as pb


def run(trial: CodecTrial, dense_s: float, compressed_s: float, steps: int) -> list[bool]:
    """Feed ``steps`` steps of the given durations; returns which ran dense."""
    kinds = []
    for _ in range(steps):
        dense = trial.dense_next()
        kinds.append(dense)
        trial.observe(dense_s if dense else compressed_s)
    return kinds


def test_the_trial_interleaves_after_the_skipped_steps_and_keeps_a_setting_that_pays() -> None:
    trial = CodecTrial(convergence_cost=1.1, skip_steps=2, pairs=3)
    kinds = run(trial, dense_s=1.0, compressed_s=0.5, steps=10)
    assert kinds == [False, False, True, False, True, False, True, False, False, False]
    assert trial.verdict == "compressed" and trial.dense_s == [1.0] * 3 and trial.compressed_s == [0.5] * 3
    assert "0.500s/step compressed x convergence cost 1.100 = 0.550s against 1.000s/step dense" in trial.describe()
    assert trial.describe().endswith("keeping the planned codecs")


def test_a_faster_step_that_costs_more_steps_is_refused() -> None:
    # 10 % faster steps, but the errors cost 20 % more steps: dense reaches the loss sooner.
    trial = CodecTrial(convergence_cost=1.2, skip_steps=0, pairs=2)
    kinds = run(trial, dense_s=1.0, compressed_s=0.9, steps=7)
    assert kinds == [True, False, True, False, True, True, True]
    assert trial.verdict == "dense" and trial.describe().endswith("running every cut dense")


def test_the_verdict_is_taken_on_medians_and_announced_once() -> None:
    trial = CodecTrial(convergence_cost=1.0, skip_steps=0, pairs=3)
    verdicts = []
    for dense_s, compressed_s in [(1.0, 0.8), (1.0, 5.0), (1.0, 0.8), (1.0, 0.8)]:  # one outlier
        verdicts.append(trial.observe(dense_s))
        verdicts.append(trial.observe(compressed_s))
    assert verdicts == [None, None, None, None, None, "compressed", None, None]
    assert trial.describe().startswith("measured 0.800s/step compressed")


def test_a_trial_under_way_says_so_and_bad_arguments_are_refused() -> None:
    trial = CodecTrial(convergence_cost=1.0, skip_steps=1, pairs=2)
    assert not trial.dense_next()  # the skipped step runs as planned
    trial.observe(1.0)
    assert trial.dense_next() and trial.verdict is None
    assert trial.describe() == "compression on trial against dense (0 of 2 pairs run)"
    with pytest.raises(ValueError, match="convergence_cost"):
        CodecTrial(convergence_cost=0.5)
    with pytest.raises(ValueError, match="pairs >= 1"):
        CodecTrial(convergence_cost=1.0, pairs=0)


SETTING = CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.1, gradient_codec=pb.CODEC_QUANT, gradient_bits=4)


def test_dense_settings_send_both_ways_dense_and_keep_ratios_and_bits() -> None:
    dense = dense_settings({(0, 1): SETTING})[(0, 1)]
    assert not dense.active and not dense.for_gradients().active
    assert (dense.keep_ratio, dense.gradient_bits) == (0.1, 4)
    assert SETTING.codec == pb.CODEC_TOPK  # the planned setting is untouched


def test_a_step_sent_dense_travels_dense_and_hands_over_the_residual() -> None:
    consumer = CutCompression(1, {(0, 1): SETTING})
    g = {"h": torch.randn(8, 64)}
    _, encoded, _ = consumer.encode_gradients(0, 0, g)
    assert encoded  # quantized, with a residual left over
    owed = consumer.feedback.residual((0, 1, "h", 0)).clone()
    assert owed.abs().sum() > 0
    consumer.set_step(dense_settings({(0, 1): SETTING}))
    raw, encoded, _ = consumer.encode_gradients(0, 0, g)
    assert not encoded
    torch.testing.assert_close(raw["h"], g["h"] + owed)  # what feedback owed goes out with it
    assert consumer.feedback.residual((0, 1, "h", 0)).abs().sum() == 0  # and is owed no more
    consumer.set_step({(0, 1): SETTING})
    assert consumer.encode_gradients(0, 0, g)[1]  # compressed again


def test_a_refused_step_setting_changes_nothing() -> None:
    stage = CutCompression(0, {(0, 1): SETTING, (0, 2): SETTING})
    bad = CutSetting(codec=77)
    with pytest.raises(CompressionError, match="unknown codec"):
        stage.set_step({(0, 1): CutSetting(codec=pb.CODEC_NONE), (0, 2): bad})
    with pytest.raises(CompressionError, match=r"keep ratio 1.5 for cut \(0, 1\)"):
        stage.set_step({(0, 1): CutSetting(codec=pb.CODEC_TOPK, keep_ratio=1.5)})
    assert stage.settings == {(0, 1): SETTING, (0, 2): SETTING}
    stage.set_step({(5, 6): CutSetting(codec=pb.CODEC_QUANT)})  # a cut the stage was not loaded with
    assert stage.settings == {(0, 1): SETTING, (0, 2): SETTING}


def test_the_coordinator_puts_only_adatopks_own_choice_on_trial() -> None:
    from types import SimpleNamespace

    from fusion.config import JobSpec
    from fusion.coordinator.runner import codec_trial_for

    def job(compression: str) -> JobSpec:
        return JobSpec.from_toml(f'name = "t"\n[model]\nname = "gpt2"\npreset = "tiny"\n[compression]\n{compression}\n')

    plan = SimpleNamespace(extra={"compression": {"convergence_cost": 1.04}})
    trial = codec_trial_for(job('mode = "adatopk"'), plan, True)
    assert trial is not None and trial.convergence_cost == 1.04 and trial.verdict is None
    assert codec_trial_for(job('mode = "adatopk"'), plan, False) is None  # it chose dense everywhere
    assert codec_trial_for(job('mode = "quant"\nbits = 4'), plan, True) is None  # the owner's own choice holds


def test_the_bench_notes_what_a_job_said_of_its_compression(tmp_path) -> None:
    import json

    from testbeds.bench.fusion_fleet import compression_said

    metrics = tmp_path / "metrics.jsonl"
    steps = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.9}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert compression_said({}, metrics) is None
    nothing = "compression: mode quant on no cut: no cut is slower than the slowest stage's compute"
    assert compression_said({"compression_note": nothing}, metrics) == nothing
    kept = {"event": "codec_trial", "message": "step 7: measured ...: keeping the planned codecs"}
    metrics.write_text(metrics.read_text() + json.dumps(kept) + "\n")
    assert compression_said({}, metrics) == "codec trial at step 7: measured ...: keeping the planned codecs"
    dense = "compression: every cut dense from step 8 on: measured ...: running every cut dense"
    assert compression_said({"compression_note": dense}, metrics) == dense  # said once, not twice


def test_a_placement_adatopk_left_dense_everywhere_is_not_put_on_trial() -> None:
    """Top-k at ratio 1 on every cut sends every tensor dense, so there is nothing to try."""
    from executor.compression import encodes_any

    dense = CutSetting(codec=pb.CODEC_TOPK, keep_ratio=1.0)
    assert not encodes_any({(0, 1): dense, (1, 2): dense})
    assert not encodes_any({})
    assert encodes_any({(0, 1): dense, (1, 2): CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.5)})
    assert encodes_any({(0, 1): CutSetting(codec=pb.CODEC_TOPK_QUANT, keep_ratio=1.0)})  # it still quantizes
    gradients_only = CutSetting(codec=pb.CODEC_TOPK, keep_ratio=1.0, gradient_codec=pb.CODEC_QUANT)
    assert encodes_any({(0, 1): gradients_only})
    assert not encodes_any({(0, 1): dataclasses.replace(gradients_only, gradients=False)})
    assert not encodes_any({(0, 1): CutSetting(codec=pb.CODEC_QUANT, activations=False, gradients=False)})

"""Calibration on a tiny GPT-2 (compress/calibration.py): the codecs' relative errors on the
job's own activations and gradients are in [0, 1], 8-bit quantization beats 4-bit, top-k's
error falls as it keeps more, and the model is left as it was."""

from __future__ import annotations

import math

import pytest
import torch

from compress.calibration import CANDIDATES, Calibration, job_calibrator, relative_error
from fusion.config import JobSpec
from fusion.training import build_job_dataset, build_job_model, capture_job_model, example_micro_batch

pytestmark = pytest.mark.timeout(300)

JOB = {
    "model": {"name": "gpt2", "preset": "tiny"},
    "data": {"batch_size": 4, "seq_len": 16},
    "train": {"steps": 1, "micro_batches": 2},
    "compression": {"mode": "adatopk"},
}


@pytest.fixture(scope="module")
def calibrated() -> tuple[Calibration, dict[str, torch.Tensor], object]:
    job = JobSpec.from_dict(JOB)
    torch.manual_seed(job.train.seed)
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    x, _ = example_micro_batch(job, dataset)
    captured = capture_job_model(job, model, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Three values a cut inside the transformer would carry: the residual stream after the
    # first block's attention and MLP, and the final layer norm's output.
    float_nodes = [
        n.name for n in captured.dag.compute_nodes() if n.value.kind == "tensor" and n.value.dtype == "float32"
    ]
    nodes = [float_nodes[len(float_nodes) // 3], float_nodes[len(float_nodes) // 2], float_nodes[-2]]
    calibrator = job_calibrator(job, captured, dataset)
    table = Calibration.from_dict(calibrator.table(nodes))
    assert calibrator.table(nodes[:1]) == table.to_dict()  # measured once
    return table, before, model


def test_errors_are_relative_and_ordered(calibrated: tuple) -> None:
    table, _, _ = calibrated
    assert table.settings == list(CANDIDATES) and len(table.nodes) == 3
    idx = {s: i for i, s in enumerate(table.settings)}
    for name, entry in table.nodes.items():
        assert "gradient_error" in entry, name  # every chosen value is on the loss's path
        for key in ("activation_error", "gradient_error"):
            errs = entry[key]
            assert all(0.0 <= e <= 1.0 for e in errs), (name, key, errs)
            assert errs[idx[("none", 1.0, 0)]] == 0.0
            assert errs[idx[("quant", 1.0, 8)]] < errs[idx[("quant", 1.0, 4)]] < 0.5, (name, key)
            topk = [errs[idx[("topk", r, 0)]] for r in (0.01, 0.03, 0.1, 0.25, 0.5)]
            assert topk == sorted(topk, reverse=True) and topk[0] > topk[-1], (name, key, topk)
        sizes = entry["activation_bytes_ratio"]
        assert sizes[idx[("quant", 1.0, 4)]] < sizes[idx[("quant", 1.0, 8)]] < 0.3
        assert sizes[idx[("topk", 0.01, 0)]] < sizes[idx[("topk", 0.5, 0)]] < 1.0
        for key in ("activation_codec_s_per_byte", "gradient_codec_s_per_byte"):
            seconds = entry[key]
            assert len(seconds) == len(table.settings) and seconds[idx[("none", 1.0, 0)]] == 0.0, (name, key)
            # Every other codec takes some time (how much is a benchmark's business, not a test's).
            assert all(v > 0 and math.isfinite(v) for i, v in enumerate(seconds) if i != idx[("none", 1.0, 0)]), (
                name,
                seconds,
            )


def test_calibration_leaves_the_model_as_it_was(calibrated: tuple) -> None:
    _, before, model = calibrated
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_relative_error_of_a_known_tensor() -> None:
    x = torch.tensor([3.0, 4.0] + [0.0] * 98)
    assert relative_error(x, "topk", 0.01, 0)[0] == pytest.approx(0.6, abs=1e-3)  # keeps 4: |3| / 5 lost
    zero_error, zero_ratio = relative_error(torch.zeros(10), "quant", 1.0, 8)
    assert zero_error == 0.0 and 0.0 < zero_ratio  # the ratio counts the header and the scale
    assert relative_error(x, "none", 1.0, 0) == (0.0, 1.0)

"""The chaos harness's model comparison (:mod:`testbeds.chaos.compare`) on real safetensors
files: the exact contract without compression, the loss contract with it, and a missing
model reported as not compared. The harness run itself is ``tests/testbed/test_chaos.py``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from testbeds.chaos.compare import LOSS_TOLERANCE, compare_models


def _save(path: Path, **tensors: torch.Tensor) -> Path:
    save_file(tensors, str(path))
    return path


def test_equal_models_are_equal_bit_for_bit(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    a = _save(tmp_path / "a.safetensors", w=w, b=torch.zeros(2))
    b = _save(tmp_path / "b.safetensors", w=w.clone(), b=torch.zeros(2))
    got = compare_models(a, b, compressed=False, loss=1.0, reference_loss=1.0)
    assert got["equal"] is True and got["why"] == "bit for bit" and got["num_differ"] == 0


def test_one_ulp_apart_is_not_equal_and_names_the_tensor(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    nudged = w.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(float("inf")))
    a = _save(tmp_path / "a.safetensors", w=w, b=torch.zeros(2))
    b = _save(tmp_path / "b.safetensors", w=nudged, b=torch.zeros(2))
    got = compare_models(a, b, compressed=False, loss=1.0, reference_loss=1.0)
    assert got["equal"] is False and got["differ"] == ["w"] and 0 < got["max_abs_diff"] < 1e-5
    assert got["why"] == "1 tensor(s) differ"


def test_different_tensor_names_are_not_equal(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.safetensors", w=torch.zeros(2))
    b = _save(tmp_path / "b.safetensors", v=torch.zeros(2))
    got = compare_models(a, b, compressed=False, loss=None, reference_loss=None)
    assert got["equal"] is False and "different tensors" in got["why"]


def test_compressed_runs_compare_the_final_loss(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.safetensors", w=torch.ones(2))
    b = _save(tmp_path / "b.safetensors", w=torch.zeros(2))
    near = compare_models(a, b, compressed=True, loss=1.0 + LOSS_TOLERANCE / 2, reference_loss=1.0)
    far = compare_models(a, b, compressed=True, loss=1.0 + 2 * LOSS_TOLERANCE, reference_loss=1.0)
    assert near["equal"] is True and far["equal"] is False and far["why"] == "final loss differs"


def test_a_missing_model_is_not_compared(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.safetensors", w=torch.ones(2))
    got = compare_models(a, tmp_path / "absent.safetensors", compressed=False, loss=1.0, reference_loss=None)
    assert got["equal"] is None and "missing" in got["why"]

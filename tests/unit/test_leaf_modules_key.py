"""``[model] leaf_modules``: parsed and validated by the job spec, checked against the model,
kept away from the factory, and honoured by capture."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fusion.config import JobSpec
from fusion.errors import ConfigError, GraphExportError
from fusion.graph.export import capture
from fusion.training import build_job_model, capture_job_model

GATED = """
import torch
from torch import nn


class Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # a branch on a value: neither tracer captures it


def make(hidden: int = 8) -> nn.Module:  # no **kwargs: an unexpected keyword would fail the call
    return nn.Sequential(nn.Linear(4, hidden), Gate(), nn.Linear(hidden, 2))
"""


def _job(model_lines: str) -> JobSpec:
    return JobSpec.from_toml(
        textwrap.dedent(
            f"""
            [model]
            name = "gated_models:make"
            {model_lines}
            [data]
            name = "shapes"
            """
        )
    )


@pytest.fixture
def gated_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gated_models.py").write_text(GATED)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_leaf_modules_is_a_field_not_a_factory_keyword() -> None:
    spec = _job('leaf_modules = ["1", "blocks.0.attn"]\nhidden = 8')
    assert spec.model.leaf_modules == ("1", "blocks.0.attn")
    assert spec.model.kwargs == {"hidden": 8}
    assert JobSpec.from_json(spec.to_json()) == spec
    assert "leaf_modules" not in _job("hidden = 8").model.to_dict()


@pytest.mark.parametrize(
    "value",
    ['"1"', "[1]", '["a b"]', '["a..b"]', '[["a"]]', "true"],
)
def test_leaf_modules_must_be_an_array_of_module_names(value: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.leaf_modules must be an array of dotted submodule names"):
        _job(f"leaf_modules = {value}")


def test_leaf_modules_is_not_passed_to_the_factory(gated_models: None) -> None:
    model = build_job_model(_job('leaf_modules = ["1"]\nhidden = 8'))  # make() takes no leaf_modules
    assert isinstance(model[1], torch.nn.Module)


def test_untraceable_model_captures_with_the_key_and_not_without(gated_models: None) -> None:
    x = torch.randn(2, 4)
    plain = _job("")
    with pytest.raises(GraphExportError, match=r'add `leaf_modules = \["1"\]` under \[model\] in the job file'):
        capture_job_model(plain, build_job_model(plain), x)
    spec = _job('leaf_modules = ["1"]')
    model = build_job_model(spec)
    captured = capture_job_model(spec, model, x)
    assert [n.target for n in captured.dag.nodes if n.module_path == "1"] == ["1"]
    assert captured.dag.fingerprint == capture(model, (x,), leaf_modules=["1"]).dag.fingerprint
    with torch.no_grad():
        torch.testing.assert_close(captured.graph_module(x), model(x))


def test_unknown_leaf_module_is_a_config_error_naming_the_key(gated_models: None) -> None:
    spec = _job('leaf_modules = ["gate"]')
    with pytest.raises(ConfigError, match=r"model\.leaf_modules names \['gate'\], not submodules of Sequential"):
        capture_job_model(spec, build_job_model(spec), torch.randn(2, 4))

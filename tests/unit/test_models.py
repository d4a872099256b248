"""Bundled models, the model factory and the loss registry."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from fusion.errors import ConfigError
from fusion.losses import cross_entropy, get_loss
from fusion.models import build_model, default_dataset
from fusion.models.gpt2 import GPT2, GPT2Config
from fusion.models.resnet import ResNetConfig

_module_counter = itertools.count()


def _tiny_gpt2() -> GPT2:
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny")
    assert isinstance(model, GPT2)
    return model


def test_gpt2_tiny_forward_shape() -> None:
    model = _tiny_gpt2()
    idx = torch.randint(0, 256, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32


def test_gpt2_is_causal() -> None:
    model = _tiny_gpt2().eval()
    idx = torch.randint(0, 256, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :8], model(changed)[:, :8])


def test_gpt2_ties_embedding_and_head() -> None:
    model = _tiny_gpt2()
    assert model.transformer.wte.weight is model.lm_head.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names or "transformer.wte.weight" not in names
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_gpt2_symbolic_trace_matches_eager() -> None:
    model = _tiny_gpt2().eval()
    traced = torch.fx.symbolic_trace(model)
    idx = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(traced(idx), model(idx))
    # The tie survives tracing: both names resolve to one Parameter.
    assert traced.get_submodule("transformer.wte").weight is traced.get_submodule("lm_head").weight
    targets = {node.target for node in traced.graph.nodes if node.op == "call_function"}
    assert torch.nn.functional.scaled_dot_product_attention in targets


def test_gpt2_residual_projection_init_is_scaled() -> None:
    torch.manual_seed(0)
    model = build_model("gpt2", "mini")
    c_proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    c_fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert c_fc_std == pytest.approx(0.02, rel=0.05)
    assert c_proj_std == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.05)


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("small", 123e6, 125e6), ("medium", 350e6, 360e6), ("large", 770e6, 780e6), ("xl", 1.55e9, 1.56e9)],
)
def test_gpt2_preset_parameter_counts(preset: str, low: float, high: float) -> None:
    # The meta device allocates nothing, so the 1.5B model costs nothing to count.
    with torch.device("meta"):
        model = build_model("gpt2", preset)
    assert low <= model.num_parameters() <= high


def test_gpt2_small_builds_on_cpu() -> None:
    model = build_model("gpt2", "small")
    assert 123e6 <= model.num_parameters() <= 125e6
    assert model.transformer.wte.weight is model.lm_head.weight


def test_gpt2_free_config_and_overrides() -> None:
    model = build_model("gpt2", vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert model(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)
    overridden = build_model("gpt2", "tiny", n_layer=3, dropout=0.1)
    assert overridden.config == GPT2Config(vocab_size=256, block_size=64, n_layer=3, n_head=2, n_embd=32, dropout=0.1)


def test_resnet_tiny_forward_shape_and_trace() -> None:
    torch.manual_seed(0)
    model = build_model("resnet", "tiny", num_classes=5).eval()
    images = torch.randn(4, 3, 16, 16)
    logits = model(images)
    assert logits.shape == (4, 5)
    traced = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(traced(images), logits)


def test_resnet_bottleneck_and_large_image_stem_trace() -> None:
    model = build_model("resnet", "50", width=8, image_size=96, num_classes=3).eval()
    assert isinstance(model.maxpool, nn.MaxPool2d)
    traced = torch.fx.symbolic_trace(model)
    images = torch.randn(2, 3, 96, 96)
    torch.testing.assert_close(traced(images), model(images))
    assert traced(images).shape == (2, 3)


@pytest.mark.parametrize(
    ("preset", "expected"),
    # torchvision's parameter counts for the ImageNet models.
    [("18", 11_689_512), ("resnet34", 21_797_672), ("50", 25_557_032), ("resnet101", 44_549_160), ("152", 60_192_808)],
)
def test_resnet_matches_torchvision_parameter_counts(preset: str, expected: int) -> None:
    with torch.device("meta"):
        model = build_model("resnet", preset, num_classes=1000, image_size=224)
    assert model.num_parameters() == expected


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(name="gpt2", preset="huge"), "'huge'"),
        (dict(name="resnet", preset="resnet19"), "'resnet19'"),
        (dict(name="gpt2", preset="tiny", n_layers=3), "n_layers"),
        (dict(name="resnet", preset="tiny", classes=3), "classes"),
        (dict(name="vgg"), "'vgg'"),
        (dict(name="gpt2"), "vocab_size"),
        (dict(name="gpt2", preset="tiny", n_embd=33), "n_embd"),
        (dict(name="resnet", depth=20), "depth"),
    ],
)
def test_bad_model_spec_raises_config_error(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_model(**kwargs)  # type: ignore[arg-type]


def test_unknown_preset_message_lists_choices() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("gpt2", "huge")
    for preset in ("tiny", "mini", "small", "medium", "large", "xl"):
        assert preset in str(info.value)


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        GPT2Config(vocab_size=0, block_size=8, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ConfigError):
        GPT2Config(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=1.0)
    with pytest.raises(ConfigError):
        ResNetConfig(stage_blocks=(1, 1, 1))
    assert ResNetConfig(stage_blocks=[1, 2, 1, 1]).stage_blocks == (1, 2, 1, 1)  # type: ignore[arg-type]


def _write_module(directory: Path, source: str) -> str:
    name = f"fusion_test_user_models_{next(_module_counter)}"
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_model_factory_from_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module_name = _write_module(
        tmp_path,
        """
        import torch

        def make(hidden=4, preset=None):
            width = 2 if preset == "narrow" else hidden
            return torch.nn.Linear(3, width)

        def not_a_model():
            return 42
        """,
    )
    try:
        assert build_model(f"{module_name}:make", hidden=7).out_features == 7
        assert build_model(f"{module_name}:make", "narrow").out_features == 2
        with pytest.raises(ConfigError, match="not a torch.nn.Module"):
            build_model(f"{module_name}:not_a_model")
        with pytest.raises(ConfigError, match="depth"):
            build_model(f"{module_name}:make", depth=3)
        with pytest.raises(ConfigError, match="missing"):
            build_model(f"{module_name}:missing")
    finally:
        sys.modules.pop(module_name, None)
    with pytest.raises(ConfigError, match="cannot import"):
        build_model("fusion_no_such_module_anywhere:make")


def test_default_dataset() -> None:
    assert default_dataset("gpt2") == "pysource"
    assert default_dataset("resnet") == "shapes"
    assert default_dataset("pkg.mod:factory") is None


def test_cross_entropy_flattens_sequence_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    torch.testing.assert_close(cross_entropy(logits, targets), expected)
    assert get_loss("cross_entropy") is cross_entropy
    with pytest.raises(ConfigError, match="cross_entropy"):
        get_loss("mse")


def test_sequence_longer_than_the_context_is_refused_by_name() -> None:
    from fusion.config import JobSpec
    from fusion.models import context_length
    from fusion.training import build_job_dataset

    assert context_length("gpt2", "tiny") == 64
    assert context_length("gpt2", "tiny", block_size=128) == 128
    assert context_length("resnet", "tiny") is None
    job = {"model": {"name": "gpt2", "preset": "tiny"}, "data": {"batch_size": 2, "seq_len": 128}}
    with pytest.raises(ConfigError, match="seq_len 128 .* block_size is 64"):
        build_job_dataset(JobSpec.from_dict(job))
    job["model"]["block_size"] = 128  # type: ignore[index]
    x, _ = build_job_dataset(JobSpec.from_dict(job))[0]
    assert x.shape == (128,)

"""``fusion.optim.build_optimizer``: the job's ``[train]`` optimizer, exactly as plain
PyTorch builds it (defaults, given hyperparameters, a step, state round trips)."""

from __future__ import annotations

import pytest
import torch

from fusion.config import TrainSpec
from fusion.optim import build_optimizer


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


def test_adamw_keeps_pytorch_defaults_when_not_given() -> None:
    reference = torch.optim.AdamW(_params())
    optimizer = build_optimizer(TrainSpec(), _params())
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01
    for key in ("weight_decay", "betas", "eps", "amsgrad"):
        assert group[key] == reference.param_groups[0][key]
    assert group["lr"] == 1e-3


def test_adamw_uses_given_hyperparameters() -> None:
    train = TrainSpec(lr=3e-4, weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6)
    params = _params()
    optimizer = build_optimizer(train, params)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["lr"] == 3e-4
    assert group["weight_decay"] == 0.0
    assert tuple(group["betas"]) == (0.8, 0.95)
    assert group["eps"] == 1e-6
    assert group["params"] == params


def test_sgd_hyperparameters() -> None:
    optimizer = build_optimizer(TrainSpec(optimizer="sgd", lr=0.5), _params())
    assert type(optimizer) is torch.optim.SGD
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.5, 0.0, 0.0)
    train = TrainSpec(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
    group = build_optimizer(train, iter(_params())).param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 1e-4)
    assert len(group["params"]) == 2


def test_built_optimizer_matches_plain_pytorch_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    train = TrainSpec(lr=0.01, betas=(0.85, 0.99))
    ours = build_optimizer(train, model.parameters())
    theirs = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.85, 0.99))
    x = torch.randn(5, 4)
    for m, opt in ((model, ours), (reference, theirs)):
        for _ in range(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_empty_parameter_list_gives_a_working_no_op_optimizer(optimizer: str) -> None:
    opt = build_optimizer(TrainSpec(optimizer=optimizer), [])
    assert type(opt) is {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    opt.zero_grad()
    opt.step()
    state = opt.state_dict()
    assert state["state"] == {}
    opt.load_state_dict(state)

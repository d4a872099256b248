"""executor/guard.py with compressed tensors: a tiny model trained across one compressed cut,
every codec and setting (and switches between them, as a ratio controller makes), gives the
guard no false positive, and the guard still catches NaN and a millionfold norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from compress import get_compressor
from executor.compression import CutCompression, CutSetting
from executor.guard import MAX_ALLOWANCE, MAX_NORM_RATIO, CodecSetting, InputGuard
from fusion.errors import PoisonedInputError
from fusion.wire import tensor_pb2 as pb

ACT, GRAD = pb.TRANSFER_KIND_ACTIVATION, pb.TRANSFER_KIND_GRADIENT
SCALE = 1.0e6  # what tests/support/fault.py's scaled-* faults multiply by

SETTINGS = {
    "none": CutSetting(pb.CODEC_NONE),
    "fp16": CutSetting(pb.CODEC_FP16),
    "quant8": CutSetting(pb.CODEC_QUANT, bits=8),
    "quant4": CutSetting(pb.CODEC_QUANT, bits=4),
    "topk0.1": CutSetting(pb.CODEC_TOPK, keep_ratio=0.1),
    "topk0.01": CutSetting(pb.CODEC_TOPK, keep_ratio=0.01),
    "topk-quant0.05": CutSetting(pb.CODEC_TOPK_QUANT, keep_ratio=0.05, bits=8),
}


def _decode(encoded: dict, raw: dict) -> dict[str, torch.Tensor]:
    out = dict(raw)
    for name, (meta, data) in encoded.items():
        out[name] = get_compressor(meta.codec).decode(data, dtype=torch.float32, shape=tuple(meta.shape))
    return out


class SplitRun:
    """A two-stage MLP trained across one compressed cut, with a guard on each side."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.front = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.back = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.opt = torch.optim.Adam([*self.front.parameters(), *self.back.parameters()], lr=3e-2)
        self.sender = CutCompression(0, {})
        self.receiver = CutCompression(1, {})
        self.guard_back = InputGuard()  # stage 1 receives activations
        self.guard_front = InputGuard()  # stage 0 receives gradients
        self.target = torch.randn(16, 4)

    def step(self, setting: CutSetting, *, poison: tuple[str, str] | None = None) -> float:
        for cc in (self.sender, self.receiver):
            cc.settings = {(0, 1): setting}
            cc.reset_step()
        x = torch.randn(32, 16)
        h = self.front(x)
        raw, enc, _ = self.sender.encode_activations(1, 0, {"h": h})
        got = _decode(enc, raw)
        if poison and poison[0] == "activations":
            got = {"h": got["h"] * SCALE if poison[1] == "scaled" else torch.full_like(got["h"], math.nan)}
        self.guard_back.check(ACT, 0, got, self.receiver.guard_settings(ACT, 0, _metas(enc, raw)))
        h_in = got["h"].detach().requires_grad_(True)
        loss = nn.functional.mse_loss(self.back(h_in), x[:, :4] @ self.target[:4] * 3)
        self.opt.zero_grad()
        loss.backward()
        raw_g, enc_g, _ = self.receiver.encode_gradients(0, 0, {"h": h_in.grad})
        got_g = _decode(enc_g, raw_g)
        if poison and poison[0] == "gradients":
            got_g = {"h": got_g["h"] * SCALE if poison[1] == "scaled" else torch.full_like(got_g["h"], math.nan)}
        self.guard_front.check(GRAD, 1, got_g, self.sender.guard_settings(GRAD, 1, _metas(enc_g, raw_g)))
        h.backward(self.sender.mask_gradient(1, 0, "h", got_g["h"]))
        self.opt.step()
        return loss.item()


def _metas(encoded: dict, raw: dict) -> list[pb.TensorMeta]:
    return [meta for meta, _ in encoded.values()] + [pb.TensorMeta(name=n, codec=pb.CODEC_NONE) for n in raw]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_training_with_each_codec_raises_no_false_positive(name: str) -> None:
    run = SplitRun()
    losses = [run.step(SETTINGS[name]) for _ in range(40)]
    assert run.guard_back.num_rejected == run.guard_front.num_rejected == 0
    assert losses[-1] < losses[0]


@pytest.mark.timeout(120)
def test_switching_codecs_and_ratios_raises_no_false_positive() -> None:
    """A controller's moves: dense, then ratios down to 1 %, quantization, back to dense."""
    run = SplitRun(seed=1)
    order = ["none", "topk0.1", "topk0.01", "topk-quant0.05", "quant4", "quant8", "topk0.01", "fp16", "none"]
    for name in order:
        for _ in range(6):
            run.step(SETTINGS[name])
    assert run.guard_back.num_rejected == run.guard_front.num_rejected == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direction", ["activations", "gradients"])
@pytest.mark.parametrize("how", ["nan", "scaled"])
@pytest.mark.parametrize("name", ["none", "quant4", "topk0.01", "topk-quant0.05"])
def test_poison_is_still_caught_on_compressed_cuts(name: str, how: str, direction: str) -> None:
    run = SplitRun(seed=2)
    for _ in range(10):
        run.step(SETTINGS[name])
    with pytest.raises(PoisonedInputError, match="NaN/Inf" if how == "nan" else "norm"):
        run.step(SETTINGS[name], poison=(direction, how))


@pytest.mark.timeout(60)
def test_poison_right_after_a_codec_switch_is_caught() -> None:
    """A new setting has no statistics of its own yet; the link's judge it."""
    run = SplitRun(seed=3)
    for _ in range(10):
        run.step(SETTINGS["none"])
    with pytest.raises(PoisonedInputError, match="norm"):
        run.step(SETTINGS["topk0.01"], poison=("gradients", "scaled"))


def test_allowances_are_capped_below_a_millionfold() -> None:
    assert MAX_NORM_RATIO * MAX_ALLOWANCE < SCALE
    tiny = CodecSetting(codec="topk-quant", bits=4, keep_ratio=1e-6)
    assert 0 < tiny.retained <= 1e-3
    assert CodecSetting(codec="quant", bits=8).retained > 0.99
    assert CodecSetting(codec="quant", bits=4).retained > 0.3
    assert CodecSetting(codec="topk", keep_ratio=0.3).key == CodecSetting(codec="topk", keep_ratio=0.35).key
    assert CodecSetting(codec="topk", keep_ratio=0.3).key != CodecSetting(codec="topk", keep_ratio=0.01).key


def test_error_feedback_growth_is_not_flagged_but_bounded() -> None:
    """A compressed gradient's norm may grow by error feedback's factor over its running
    norm; beyond the capped allowance it is rejected."""
    guard = InputGuard()
    setting = {"g": CodecSetting(codec="topk", keep_ratio=0.01)}
    g = torch.randn(1000) * 1e-2
    for _ in range(5):
        guard.check(GRAD, 1, {"g": g}, setting)
    guard.check(GRAD, 1, {"g": g * MAX_NORM_RATIO * 50}, setting)  # within 1000x * min(2/0.01, 100)
    with pytest.raises(PoisonedInputError):
        guard.check(GRAD, 1, {"g": g * MAX_NORM_RATIO * MAX_ALLOWANCE * 10}, setting)

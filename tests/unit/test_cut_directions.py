"""Per-direction codecs on a cut and the relative error each link reports
(executor/compression.py): the wire round trip, the plan's tuples, gradients encoded with
their own codec, the guard told which codec each direction used, the error of what was
sent, and AdaTopK's runtime ratio held at the plan's choice."""

from __future__ import annotations

import pytest
import torch

from compress import AdaTopK
from executor.compression import (
    CutCompression,
    CutSetting,
    RatioController,
    cut_settings,
    link_codecs,
    setting_from_wire,
    setting_to_wire,
)
from executor.driver import StepStats
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2 as pb

BOTH = ("activations", "gradients")


def test_wire_round_trip_keeps_each_directions_setting() -> None:
    own = CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.1, gradient_codec=pb.CODEC_QUANT, gradient_bits=4)
    back = setting_from_wire(setting_to_wire((0, 1), own))
    assert back == own and back.for_gradients().codec == pb.CODEC_QUANT and back.for_gradients().bits == 4
    same = CutSetting(codec=pb.CODEC_QUANT, bits=4)
    wire = setting_to_wire((2, 3), same)
    assert wire.gradient_codec == pb.CODEC_UNSPECIFIED  # an older peer reads one setting for both
    assert setting_from_wire(wire) == same and setting_from_wire(wire).for_gradients() is not None


def test_plan_cuts_with_a_gradient_codec() -> None:
    got = cut_settings(
        [(0, 1, "none", 1.0, 0, "quant", 1.0, 8), (1, 2, "topk", 0.2, 0, None, None, None), (2, 3, "none", 1.0, 0)],
        directions=BOTH,
    )
    assert set(got) == {(0, 1), (1, 2)}
    assert not got[(0, 1)].active and got[(0, 1)].for_gradients().active
    assert got[(1, 2)].for_gradients() is got[(1, 2)]
    with pytest.raises(CompressionError, match="unknown codec 'lz4'"):
        cut_settings([(0, 1, "none", 1.0, 0, "lz4", 1.0, 0)], directions=BOTH)
    codecs = link_codecs(got)
    assert codecs == {
        (1, 0): {"codec": "quant", "keep_ratio": 1.0, "bits": 8},
        (1, 2): {"codec": "topk", "keep_ratio": 0.2, "bits": 0},
        (2, 1): {"codec": "topk", "keep_ratio": 0.2, "bits": 0},
    }


def test_gradients_use_their_own_codec_and_errors_are_reported() -> None:
    torch.manual_seed(0)
    setting = CutSetting(codec=pb.CODEC_NONE, gradient_codec=pb.CODEC_QUANT, gradient_bits=4)
    sender = CutCompression(0, {(0, 1): setting})  # the producer: sends activations
    consumer = CutCompression(1, {(0, 1): setting})  # sends gradients back
    x = {"h": torch.randn(8, 64)}
    raw, encoded, _ = sender.encode_activations(1, 0, x)
    assert raw.keys() == {"h"} and not encoded and sender.relative_errors() == {}
    raw, encoded, dense = consumer.encode_gradients(0, 0, x)
    assert not raw and encoded["h"][0].codec == pb.CODEC_QUANT and dense == 8 * 64 * 4
    err = consumer.relative_errors()
    assert set(err) == {0} and 0.02 < err[0] < 0.3  # 4-bit block quantization of Gaussian values
    guard = sender.guard_settings(pb.TRANSFER_KIND_GRADIENT, 1, [encoded["h"][0]])
    assert guard["h"].codec == "quant" and guard["h"].bits == 4
    consumer.reset_step()
    assert consumer.relative_errors() == {}


def test_runtime_adatopk_never_goes_below_the_plans_ratio() -> None:
    stats = StepStats(
        step=0,
        loss=1.0,
        step_s=1.0,
        compute_s={0: 0.01, 1: 0.01},
        dense_bytes={(0, 1): 4_000_000},
        keep_ratios={(0, 1): 0.25},
    )
    slow = (0.0, 1.0e5)  # a link on which AdaTopK alone would go to its minimum
    free = RatioController(AdaTopK(min_keep_ratio=0.01), link_of=lambda a, b: slow)
    held = RatioController(AdaTopK(min_keep_ratio=0.01), link_of=lambda a, b: slow, floors={(0, 1): 0.25})
    assert free.update(stats, 1)[(0, 1)] == pytest.approx(0.01)
    assert held.update(stats, 1)[(0, 1)] == 0.25
    fast = RatioController(AdaTopK(min_keep_ratio=0.01), link_of=lambda a, b: (0.0, 1e12), floors={(0, 1): 0.25})
    assert fast.update(stats, 1)[(0, 1)] == 1.0  # a faster link than planned may keep more

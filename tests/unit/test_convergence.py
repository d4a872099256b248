"""The convergence cost model and AdaTopK's choice for time to loss (scheduler/convergence.py,
scheduler/compression.py): dense wins on a fast link or where errors cost much, a compressed
setting wins on a slow link with small errors, per direction, and an owner's fixed choice holds."""

from __future__ import annotations

import pytest

from scheduler.compression import compression_marks, compression_note, compression_summary
from scheduler.convergence import (
    COST_PER_ERROR2,
    DEFAULT_CANDIDATES,
    QUANT_COST_PER_ERROR2,
    CutValue,
    ErrorModel,
    convergence_cost,
    cost_per_error2,
    prior_bytes_ratio,
    prior_error2,
)
from scheduler.estimator import Estimate
from scheduler.planner import PlanRequest

SETTINGS = [("none", 1.0, 0), ("topk", 0.1, 0), ("quant", 1.0, 8), ("quant", 1.0, 4)]
VALUES = {(0, 1): [CutValue("h", 4000, True)]}


def calibration(act: list[float], grad: list[float], act_bytes: list[float] | None = None) -> dict:
    """One node ``h`` with the given errors per setting of :data:`SETTINGS`."""
    sizes = act_bytes or [1.0, 0.06, 0.26, 0.13]
    return {
        "settings": [list(s) for s in SETTINGS],
        "nodes": {
            "h": {
                "activation_error": act,
                "gradient_error": grad,
                "activation_bytes_ratio": sizes,
                "gradient_bytes_ratio": sizes,
            }
        },
    }


LOW = calibration([0.0, 0.75, 0.006, 0.11], [0.0, 0.6, 0.007, 0.12])
HIGH = calibration([0.0, 0.99, 0.99, 0.99], [0.0, 0.99, 0.99, 0.99])


def estimate(link_s: float, compute_s: float = 0.1, micro_batches: int = 4) -> Estimate:
    """Two stages, one cut whose transfer takes ``link_s`` per micro-batch."""
    period = max(link_s, compute_s)
    return Estimate(
        step_s=2 * compute_s + link_s + (micro_batches - 1) * period,
        stage_compute_s=(compute_s, compute_s),
        link_s={(0, 1): link_s},
        link_bytes={(0, 1): 4000},
        peak_memory_bytes={},
        bottleneck_s=period,
        depth=(1, 0),
    )


def request(**kwargs: object) -> PlanRequest:
    return PlanRequest(**{"compression": "adatopk", "micro_batches": 4, **kwargs})


def test_the_cost_model_is_one_for_dense_and_grows_with_the_error() -> None:
    assert convergence_cost([]) == 1.0 and convergence_cost([("topk", 0.0), ("quant", 0.0)]) == 1.0
    assert convergence_cost([("topk", 0.5)]) == pytest.approx(1 + COST_PER_ERROR2 * 0.25)
    assert convergence_cost([("quant", 0.5)]) == pytest.approx(1 + QUANT_COST_PER_ERROR2 * 0.25)
    assert convergence_cost([("topk", 0.5)] * 2) > convergence_cost([("topk", 0.5)]) > convergence_cost([("topk", 0.1)])
    assert cost_per_error2("topk-quant") == COST_PER_ERROR2 and cost_per_error2("quant") == QUANT_COST_PER_ERROR2
    # The prior: quantization at 8 bits costs less than at 4, top-k less the more it keeps.
    assert prior_error2(("none", 1.0, 0)) == 0.0
    assert prior_error2(("quant", 1.0, 8)) < prior_error2(("quant", 1.0, 4)) < prior_error2(("topk", 0.5, 0))
    assert prior_error2(("topk", 0.5, 0)) < prior_error2(("topk", 0.1, 0)) < prior_error2(("topk", 0.01, 0)) <= 1
    assert prior_bytes_ratio(("quant", 1.0, 8)) == pytest.approx(0.2578, abs=1e-3)
    assert prior_bytes_ratio(("topk", 0.01, 0)) < prior_bytes_ratio(("topk", 0.1, 0)) < 1.0


def test_the_error_model_weights_values_by_bytes_and_falls_back_to_the_prior() -> None:
    model = ErrorModel(LOW)
    assert model.calibrated and model.settings[0] == ("none", 1.0, 0)
    values = [CutValue("h", 3000, True), CutValue("unmeasured", 1000, True), CutValue("ids", 1000, False)]
    e2, ratio = model.cut(values, "activations", ("quant", 1.0, 4))
    expected = (3000 * 0.11**2 + 1000 * prior_error2(("quant", 1.0, 4))) / 4000
    assert e2 == pytest.approx(expected)
    # Integer values travel dense: their bytes count whole.
    assert ratio == pytest.approx((3000 * 0.13 + 1000 * prior_bytes_ratio(("quant", 1.0, 4)) + 1000) / 5000)
    assert model.cut(values, "gradients", ("none", 1.0, 0)) == (0.0, 1.0)
    assert ErrorModel(None).settings == DEFAULT_CANDIDATES and not ErrorModel(None).calibrated


def test_dense_wins_on_a_fast_link() -> None:
    fast = estimate(link_s=0.001)
    req = request(calibration=LOW, compression_cuts="all")
    assert compression_marks(fast, req, values=VALUES) == {}
    note = compression_note(fast, req, {})
    assert note is not None and "dense has the shortest predicted time to loss" in note


def test_dense_wins_where_every_setting_costs_too_many_steps() -> None:
    slow = estimate(link_s=0.2)
    assert compression_marks(slow, request(calibration=HIGH), values=VALUES) == {}


def test_a_compressed_setting_wins_on_a_slow_link_with_small_errors() -> None:
    slow = estimate(link_s=1.0)
    marks = compression_marks(slow, request(calibration=LOW), values=VALUES)
    choice = marks[(0, 1)]
    # Quantization makes the link 4-8x faster at an error of 1-12%; top-k would send less but
    # cost about 1 + 3.2 * (0.56 + 0.36) times the steps.
    assert choice.setting("activations")[0] == "quant" and choice.setting("gradients")[0] == "quant"
    assert 1.0 < choice.convergence_cost < 1.1
    assert choice.time_to_loss_vs_dense < 0.5
    summary = compression_summary(marks, request(calibration=LOW), values=VALUES, step_s_of=lambda s: 1.0)
    assert summary["calibrated"] is True and summary["convergence_cost"] == pytest.approx(choice.convergence_cost)
    # Where the errors cost more, the same link keeps more bits.
    costly = calibration([0.0, 0.75, 0.006, 0.9], [0.0, 0.6, 0.007, 0.9])
    assert compression_marks(slow, request(calibration=costly), values=VALUES)[(0, 1)][:3] == ("quant", 1.0, 8)


def timed(cal: dict, seconds_per_byte: list[float]) -> dict:
    """``cal`` with the codecs' measured seconds per dense byte, per setting of :data:`SETTINGS`."""
    node = {**cal["nodes"]["h"], "activation_codec_s_per_byte": seconds_per_byte}
    node["gradient_codec_s_per_byte"] = seconds_per_byte
    return {**cal, "nodes": {"h": node}}


def test_the_codecs_own_seconds_are_priced() -> None:
    slow = estimate(link_s=1.0)
    # 4000 bytes a micro-batch each way: 8-bit at 1e-5 s a byte costs 0.04 s, 4-bit at 1e-4 s 0.4 s.
    cal = timed(LOW, [0.0, 0.0, 1e-5, 1e-4])
    assert ErrorModel(cal).codec_s(VALUES[(0, 1)], "gradients", ("quant", 1.0, 4)) == pytest.approx(0.4)
    assert ErrorModel(cal).codec_s(VALUES[(0, 1)], "gradients", ("none", 1.0, 0)) == 0.0
    assert ErrorModel(LOW).codec_s(VALUES[(0, 1)], "activations", ("quant", 1.0, 4)) == 0.0  # not timed: unpriced
    untimed = compression_marks(slow, request(calibration=LOW), values=VALUES)[(0, 1)]
    priced = compression_marks(slow, request(calibration=cal), values=VALUES)[(0, 1)]
    assert untimed.setting("activations") == ("quant", 1.0, 4)  # the fewest bytes at a small error
    assert priced.setting("activations") == ("quant", 1.0, 8)  # 4 bits' codec costs more than it saves
    assert priced.time_to_loss_vs_dense > untimed.time_to_loss_vs_dense
    summary = compression_summary({(0, 1): priced}, request(calibration=cal), values=VALUES, step_s_of=lambda s: 1.0)
    assert summary["step_s"] == pytest.approx(1.0 + 4 * 2 * 0.04)  # M codec passes each way on top of the step
    # A codec slower than the link it relieves is never chosen.
    assert compression_marks(slow, request(calibration=timed(LOW, [0.0, 1.0, 1.0, 1.0])), values=VALUES) == {}


def half_duplex(scales: dict) -> float:
    """A link both directions share: its time is the sum of their bytes."""
    a, g = scales.get((0, 1), (1.0, 1.0))
    return 2.0 + (a + g)


def test_each_direction_gets_its_own_setting() -> None:
    # Activations lose a lot under every codec, gradients little: only the gradients are compressed.
    split = calibration([0.0, 0.99, 0.9, 0.95], [0.0, 0.6, 0.007, 0.12])
    marks = compression_marks(estimate(link_s=1.0), request(calibration=split), values=VALUES, step_s_of=half_duplex)
    choice = marks[(0, 1)]
    assert choice.setting("activations") == ("none", 1.0, 0)
    assert choice.setting("gradients")[0] == "quant" and choice.gradient_codec == "quant"
    # A job that compresses only activations leaves the gradients dense.
    only = compression_marks(
        estimate(link_s=1.0),
        request(calibration=LOW, compression_directions=("activations",)),
        values=VALUES,
        step_s_of=half_duplex,
    )
    assert only[(0, 1)].setting("gradients") == ("none", 1.0, 0)


@pytest.mark.parametrize("link_s", [0.001, 0.12, 0.5, 2.0, 20.0])
def test_adatopk_is_never_predicted_slower_to_the_loss_than_dense(link_s: float) -> None:
    for cal in (LOW, HIGH, None):
        marks = compression_marks(estimate(link_s=link_s), request(calibration=cal), values=VALUES)
        assert all(c.time_to_loss_vs_dense <= 1.0 for c in marks.values()), (link_s, marks)


def test_the_owners_fixed_choice_holds_whatever_it_costs() -> None:
    slow = estimate(link_s=1.0)
    marks = compression_marks(slow, request(compression="topk", keep_ratio=0.1, calibration=HIGH), values=VALUES)
    choice = marks[(0, 1)]
    assert choice[:3] == ("topk", 0.1, 0) and choice.gradient_codec is None
    assert choice.convergence_cost == pytest.approx(1 + COST_PER_ERROR2 * 2 * 0.99**2)
    quant = compression_marks(slow, request(compression="quant", bits=4, calibration=LOW), values=VALUES)
    assert quant[(0, 1)][:3] == ("quant", 1.0, 4)


def test_adatopk_keeps_at_least_min_keep_ratio() -> None:
    # Only top-k is cheap in error here, and the link is very slow: it keeps as little as allowed.
    topk_only = calibration([0.0, 0.05, 0.99, 0.99], [0.0, 0.05, 0.99, 0.99])
    slow = estimate(link_s=50.0)
    assert compression_marks(slow, request(calibration=topk_only), values=VALUES)[(0, 1)][:3] == ("topk", 0.1, 0)
    held = compression_marks(slow, request(calibration=topk_only, min_keep_ratio=0.2), values=VALUES)
    assert all(c.setting(d)[0] != "topk" for c in held.values() for d in ("activations", "gradients")), held


def test_a_fixed_setting_on_gradients_only_stays_the_cuts_codec() -> None:
    only = request(compression="quant", bits=4, calibration=LOW, compression_directions=("gradients",))
    choice = compression_marks(estimate(link_s=1.0), only, values=VALUES)[(0, 1)]
    assert choice[:3] == ("quant", 1.0, 4) and choice.gradient_codec is None  # the executor's flags pick the direction
    assert choice.activation_error == 0.0 and choice.gradient_error == pytest.approx(0.12)

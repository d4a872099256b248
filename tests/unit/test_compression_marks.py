"""scheduler/compression.py: which cuts a job's compression settings mark, with which codec,
ratio and bits; the note a job that compresses nothing gets; the plan's bits field; and the
``[compression]`` keys ``bits`` and ``cuts``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusion.errors import ConfigError, PlanError
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.job_sections import CompressionSpec
from scheduler.baselines import uniform_assignment
from scheduler.compression import compression_marks, compression_note
from scheduler.estimator import Estimate
from scheduler.plan import CutPlan, Plan, StagePlan, plan_from_stages, validate_plan
from scheduler.planner import PlanRequest

#: Stage compute 0.1 s per micro-batch at most; cut 0->1 slow (0.5 s), 1->2 fast (0.01 s).
EST = Estimate(
    step_s=1.0,
    stage_compute_s=(0.05, 0.1, 0.08),
    link_s={(0, 1): 0.5, (1, 2): 0.01},
    link_bytes={(0, 1): 4000, (1, 2): 4000},
    peak_memory_bytes={},
    bottleneck_s=0.5,
    depth=(0, 1, 2),
)


def marks(**kwargs: object) -> dict:
    """The chosen activations' setting per cut, ``(codec, keep ratio, bits)``."""
    return {cut: tuple(choice[:3]) for cut, choice in compression_marks(EST, PlanRequest(**kwargs)).items()}


def test_slow_cuts_only_by_default() -> None:
    assert marks(compression="topk", keep_ratio=0.2) == {(0, 1): ("topk", 0.2, 0)}
    assert marks(compression="quant", bits=4) == {(0, 1): ("quant", 1.0, 4)}
    assert marks(compression="topk-quant", keep_ratio=0.1) == {(0, 1): ("topk-quant", 0.1, 8)}
    assert marks(compression="none", compression_cuts="all") == {}


@pytest.mark.parametrize("mode", ["topk", "quant", "topk-quant"])
def test_cuts_all_applies_the_owners_setting_to_every_cut(mode: str) -> None:
    got = marks(compression=mode, keep_ratio=0.3, bits=4, compression_cuts="all")
    assert set(got) == {(0, 1), (1, 2)} and got[(0, 1)] == got[(1, 2)]
    assert got[(0, 1)][0] == mode


def test_a_job_that_compresses_nothing_gets_a_note() -> None:
    fast = Estimate(
        step_s=1.0,
        stage_compute_s=(0.1, 0.1),
        link_s={(0, 1): 0.01},
        link_bytes={(0, 1): 1},
        peak_memory_bytes={},
        bottleneck_s=0.1,
        depth=(0, 1),
    )
    request = PlanRequest(compression="topk")
    note = compression_note(fast, request, compression_marks(fast, request))
    assert note is not None and note.startswith("compression: mode topk on no cut: no cut is slower than")
    assert 'set [compression] cuts = "all" to compress every cut' in note
    all_cuts = PlanRequest(compression="topk", compression_cuts="all")
    assert compression_note(fast, all_cuts, compression_marks(fast, all_cuts)) is None
    assert compression_note(fast, PlanRequest(), {}) is None
    single = Estimate(
        step_s=1.0, stage_compute_s=(0.1,), link_s={}, link_bytes={}, peak_memory_bytes={}, bottleneck_s=0.1, depth=(0,)
    )
    assert "single stage" in (compression_note(single, request, {}) or "")


def test_plan_carries_and_checks_bits() -> None:
    stages = (StagePlan(worker="a", nodes=("x",)), StagePlan(worker="b", nodes=("y",)))
    plan = Plan(
        strategy="uniform", stages=stages, cuts=(CutPlan(src_stage=0, dst_stage=1, bytes=8, codec="quant", bits=4),)
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert "quant" in plan.table() and " 4" in plan.table()


@pytest.mark.parametrize(("codec", "bits"), [("quant", 0), ("quant", 3), ("topk", 8), ("topk-quant", 16)])
def test_plan_rejects_bits_that_do_not_fit_the_codec(codec: str, bits: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    dag = capture(model, (torch.randn(2, 4),)).dag
    specs = split_stages(dag, uniform_assignment(dag, 2))
    plan = plan_from_stages(dag, specs, ("a", "b"), strategy="uniform", micro_batches=1, schedule="1f1b")
    validate_plan(plan, dag)
    cuts = tuple(replace(c, codec=codec, bits=bits) for c in plan.cuts)
    with pytest.raises(PlanError, match="bits"):
        validate_plan(replace(plan, cuts=cuts), dag)
    ok = tuple(replace(c, codec=codec, bits=4 if codec in ("quant", "topk-quant") else 0) for c in plan.cuts)
    validate_plan(replace(plan, cuts=ok), dag)


def test_compression_spec_keys() -> None:
    spec = CompressionSpec(mode="quant", bits=4, cuts="all")
    assert (spec.bits, spec.cuts) == (4, "all")
    assert CompressionSpec().cuts == "slow" and CompressionSpec().bits == 8
    for bad in ({"bits": 3}, {"bits": True}, {"cuts": "some"}, {"mode": "quant8"}):
        with pytest.raises(ConfigError):
            CompressionSpec(**bad)

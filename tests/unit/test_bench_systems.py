"""The split regime's systems and metrics: pipelining-best's placement, time to target,
ddp's infeasible note and the ``--json`` row keys (:mod:`testbeds.bench.systems`,
:mod:`testbeds.bench.split_metrics`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fusion.config import JobSpec
from fusion.errors import FusionError
from scheduler.partition import memory_advice
from scheduler.topology import Topology
from testbeds.bench.fusion_fleet import FusionFleet, planned_step_s
from testbeds.bench.harness import run_steps, summarize
from testbeds.bench.runs import Run
from testbeds.bench.split_metrics import add_split_metrics, fleet_peak_memory, target_system, time_to_target
from testbeds.bench.systems import (
    EXTRA_SYSTEMS,
    SYSTEMS,
    best_pipeline_hosts,
    cluster_chain,
    ddp_infeasible,
    system_job,
)
from testbeds.net.testbed import TOPOLOGY_DIR

MIB = 1 << 20


def _slow_crossings(topology: Topology, hosts: list[str]) -> dict[frozenset[str], int]:
    """How often a chain of hosts crosses each pair of clusters."""
    cluster = {w.name: w.cluster for w in topology.workers}
    out: dict[frozenset[str], int] = {}
    for a, b in itertools.pairwise(hosts):
        if cluster[a] != cluster[b]:
            key = frozenset((cluster[a], cluster[b]))
            out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("name", ["two-sites-split", "three-continents-split"])
def test_pipelining_best_crosses_each_slow_link_once(name: str) -> None:
    t = Topology.load(TOPOLOGY_DIR / f"{name}.toml")
    chain = cluster_chain(t)
    assert sorted(chain) == sorted(t.names()) and chain[0] == t.names()[0]
    crossings = _slow_crossings(t, chain)
    assert crossings and all(n == 1 for n in crossings.values()), crossings
    assert len(crossings) == len(t.clusters()) - 1


def test_three_continents_chain_avoids_the_slowest_links() -> None:
    t = Topology.load(TOPOLOGY_DIR / "three-continents-split.toml")
    # us-eu is 100 Mbps, eu-asia and us-asia 8 Mbps: asia comes last, after eu.
    assert [n.split("-")[0] for n in cluster_chain(t)] == ["us", "us", "eu", "eu", "asia", "asia"]


def test_pipelining_best_takes_the_fewest_hosts_that_hold_the_model() -> None:
    t = Topology.load(TOPOLOGY_DIR / "two-sites-split.toml")  # 9.4 MiB a host
    assert best_pipeline_hosts(t, 4 * MIB, 4) == ["a-1", "a-2"]
    assert best_pipeline_hosts(t, 16 * MIB, 4) == ["a-1", "a-2", "b-1"]
    assert best_pipeline_hosts(t, 1000 * MIB, 4) == ["a-1", "a-2", "b-1", "b-2"]
    assert best_pipeline_hosts(t, 4 * MIB, 4, min_stages=3) == ["a-1", "a-2", "b-1"]


def test_time_to_target_is_the_first_step_reaching_it_times_the_step() -> None:
    assert time_to_target([3.0, 2.5, 2.0, 1.5], 0.5, 2.0) == pytest.approx(1.5)
    assert time_to_target([3.0, 1.0, 3.0], 2.0, 1.0) == pytest.approx(4.0)  # raw loss reaches it
    assert time_to_target([3.0, 2.6, 2.5], 1.0, 2.4) is None
    assert time_to_target([1.0], None, 2.0) is None and time_to_target([1.0], 1.0, None) is None


def test_a_run_equal_to_the_target_up_to_float_rounding_reaches_it() -> None:
    """The two-sites ResNet cell: fusion's curve equal to pipelining-best's step for step,
    its last loss 1.5e-8 above the target (another summation order)."""
    target = 0.19778195023536682
    losses = [0.38795606791973114, 0.24050863087177277, 0.19778196513652802]
    assert time_to_target(losses, 0.5, target) == pytest.approx(1.5)
    assert time_to_target(losses[:-1] + [target * (1 + 1e-4)], 0.5, target) is None  # a real miss stays one


def test_a_run_cut_elsewhere_reaches_the_target_despite_its_summation_order() -> None:
    """Three-continents GPT-2 mini, 10 steps: fusion's curve equals GPipe's to 3e-6 relative
    from the first forward pass on, and ends 3.3e-6 above it."""
    target = 4.368067741394043
    losses = [5.4901769161224365, 4.739420115947723, 4.368082344532013]
    assert time_to_target(losses, 1.0, target) == pytest.approx(3.0)


def test_ddp_is_infeasible_when_a_replica_exceeds_a_hosts_cap() -> None:
    t = Topology.load(TOPOLOGY_DIR / "two-sites-split.toml")
    note = ddp_infeasible(40 * MIB, t)
    assert note is not None and note.startswith("infeasible: needs 40.00 MiB per host") and "hosts lend" in note
    assert ddp_infeasible(1 * MIB, t) is None


def test_fleet_peak_memory_sums_a_workers_stages() -> None:
    measured = {
        "memory": {
            "stages": [
                {"stage": 0, "worker": "a", "cap_bytes": 100, "measured_peak_bytes": 40},
                {"stage": 1, "worker": "b", "cap_bytes": 100, "measured_peak_bytes": None},
                {"stage": 2, "worker": "a", "cap_bytes": 100, "measured_peak_bytes": 30},
            ]
        }
    }
    assert fleet_peak_memory(measured) == ({"a": 70}, {"a": 100, "b": 100})
    assert fleet_peak_memory(None) == ({}, {})


def test_the_json_rows_carry_the_contract_keys() -> None:
    from testbeds.bench.harness import Run

    t = Topology.load(TOPOLOGY_DIR / "two-sites-split.toml")
    records = [
        {"step": i, "loss": 3.0 - i, "step_s": 0.5, "samples_per_s": 32.0, "bytes_per_link": {"a-1->b-1": 100}}
        for i in range(3)
    ]
    runs = {
        "pipelining-best": [Run(system="pipelining-best", records=records, final_loss=1.0, hosts_used=["a-1", "b-1"])],
        "ddp": [Run(system="ddp", note="infeasible: needs ...", hosts_used=["a-1"], peak_memory_bytes={"a-1": 9})],
    }
    rows = {s: summarize(r, t, warmup=0) for s, r in runs.items()}
    assert add_split_metrics(rows, {w.name: w.memory_bytes for w in t.workers}) == ("pipelining-best", 1.0)
    for row in rows.values():
        for key in ("samples_per_s", "step_s", "final_loss", "losses", "hosts_used", "slowest_link_bytes", "note"):
            assert key in row
        assert "time_to_target_s" in row and "peak_memory_bytes" in row and "memory_cap_bytes" in row
    assert rows["pipelining-best"]["time_to_target_s"] == pytest.approx(1.5)
    assert rows["ddp"]["time_to_target_s"] is None and rows["ddp"]["peak_memory_bytes"] == {"a-1": 9}
    assert set(SYSTEMS) >= {"fusion", "fusion-dense", "uniform", "compute", "pipelining", "pipelining-best", "fsdp"}


def test_each_system_runs_the_job_with_its_own_compression(tmp_path: Path) -> None:
    """``fusion`` keeps the job's ``[compression]``; the dense systems drop it; each codec
    system sets its one fixed setting; the rest of the job is left as it was."""
    from fusion.config import load_job

    spec = load_job(Path(__file__).resolve().parents[2] / "testbeds" / "jobs" / "bench-gpt2-split-adatopk.toml")

    def compression(system: str) -> tuple[str, float, int]:
        c = system_job(spec, system, steps=5, num_hosts=3, out_dir=tmp_path).compression
        return c.mode, c.keep_ratio, c.bits

    assert compression("fusion") == ("adatopk", 0.1, 8) == compression("fusion-adatopk")
    assert compression("fusion-dense")[0] == compression("uniform")[0] == compression("pipelining-best")[0] == "none"
    assert compression("fusion-quant4") == ("quant", 0.1, 4)
    assert compression("fusion-topk-quant") == ("topk-quant", 0.1, 4)
    assert compression("fusion-topk")[:2] == ("topk", 0.1)
    job = system_job(spec, "fusion-quant8", steps=5, num_hosts=3, out_dir=tmp_path)
    assert (job.train.steps, job.train.lr, job.model, job.cluster.min_workers) == (5, spec.train.lr, spec.model, 3)
    assert {"fusion-grpc", "fusion-quant8", "fusion-adatopk"} <= set(EXTRA_SYSTEMS)


def test_the_target_is_gpipes_loss_else_fusion_denses() -> None:
    """A compression cell run without GPipe is judged against fusion's own dense run."""
    assert target_system(["fusion", "fusion-dense", "pipelining-best"]) == "pipelining-best"
    assert target_system(["fusion", "fusion-dense"]) == "fusion-dense"
    assert target_system(["fusion", "uniform"]) is None
    rows = {
        "fusion": {"losses": [3.0, 2.0, 1.0], "step_s": 0.5},
        "fusion-dense": {"final_loss": 2.0, "losses": [3.0, 2.0], "step_s": 1.0},
    }
    assert add_split_metrics(rows, {}) == ("fusion-dense", 2.0)
    assert rows["fusion"]["time_to_target_s"] == pytest.approx(1.0)


def test_a_long_runs_target_is_its_last_twentieth_averaged() -> None:
    """Over 1,000 noisy steps the target is the mean of the dense run's last 50 losses, and a
    run reaches it when its 50-step mean does: one lucky batch early on does not count."""
    dense = [2.0 + (0.5 if i % 2 else -0.5) for i in range(1000)]  # mean 2.0, swings +-0.5
    lucky = [3.0] * 100 + [1.0] + [3.0] * 399 + [1.0] * 500  # a dip at 100; at 1.0 from step 500
    rows = {"fusion-dense": {"losses": dense, "step_s": 1.0}, "fusion": {"losses": lucky, "step_s": 0.5}}
    assert add_split_metrics(rows, {}) == ("fusion-dense", pytest.approx(2.0))
    # Step 524: its last 50 losses are 25 at 3.0 and 25 at 1.0, a mean of 2.0.
    assert rows["fusion"]["time_to_target_s"] == pytest.approx(0.5 * 525)
    assert rows["fusion-dense"]["time_to_target_s"] == pytest.approx(50.0)  # its mean is 2.0 from step 49


@pytest.mark.parametrize("steps", [40, 59, 60, 1000])
def test_a_dense_run_reaches_its_own_target_at_its_last_step_at_the_latest(steps: int) -> None:
    """A falling loss's final loss is the mean of its last ``steps // 20``; the run reaches it
    over that same window (a 3-step mean over 40 steps, whose target is a 2-step mean, never
    did)."""
    falling = [3.0 - i / steps for i in range(steps)]
    rows = {"fusion-dense": {"losses": falling, "step_s": 1.0}}
    add_split_metrics(rows, {})
    assert rows["fusion-dense"]["time_to_target_s"] == pytest.approx(steps)


def test_an_overrun_lets_a_trailing_run_reach_the_target_after_its_last_step() -> None:
    """With ``--overrun`` the compressed systems run past the target's steps: one whose loss
    trails dense's at step 1,000 is timed at the step it reaches dense's final loss, and its
    loss at the target's steps stays the like-for-like comparison."""
    assert run_steps(["fusion-dense", "fusion", "fusion-quant4"], 1000, 0.3) == {
        "fusion-dense": 1000,
        "fusion": 1300,
        "fusion-quant4": 1300,
    }
    assert run_steps(["fusion", "fusion-dense"], 8, 0.0) == {"fusion": 8, "fusion-dense": 8}
    with pytest.raises(FusionError, match="--overrun"):
        run_steps(["fusion"], 8, -0.1)
    dense = [3.0 - i / 1000 for i in range(1000)]  # its last 50 average 3 - 0.9745 = 2.0255
    trailing = [3.0 - i / 1100 for i in range(1300)]  # 10 % slower to learn
    rows = {"fusion-dense": {"losses": dense, "step_s": 1.0}, "fusion": {"losses": trailing, "step_s": 0.5}}
    _, target = add_split_metrics(rows, {})
    assert target == pytest.approx(2.0255)
    assert rows["fusion"]["loss_at_target_steps"] == pytest.approx(sum(trailing[950:1000]) / 50)
    assert rows["fusion"]["loss_at_target_steps"] > target
    # Its 50-step mean ending at step i is 3 - (i - 24.5) / 1100: at most 2.0255 from i = 1,097.
    assert rows["fusion"]["time_to_target_s"] == pytest.approx(0.5 * 1098)
    assert rows["fusion"]["time_to_target_s"] < 1000 * 1.0
    assert (
        rows["fusion"]["time_to_target_s"] is not None
        and time_to_target(trailing[:1000], 0.5, target, window=50) is None
    )


def test_a_fusion_runs_step_records_leave_its_events_out(tmp_path: Path) -> None:
    """A compressed job's metrics.jsonl holds events between its steps, some without a step
    (the bench once failed with ``KeyError: 'step'`` after a 9-minute run)."""
    import json

    from testbeds.bench.runs import step_records

    lines = [
        {"step": 0, "loss": 3.0, "step_s": 0.5},
        {"event": "compression", "message": "adatopk on the slow cut"},
        {"step": 1, "loss": 2.5, "step_s": 0.5},
        {"event": "checkpoint", "message": "durable checkpoint at step 2", "step": 2},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["step"] for r in step_records(path)] == [0, 1]
    assert step_records(tmp_path / "missing.jsonl") == []


def test_efficiency_sets_each_round_against_its_own_plan() -> None:
    """Every round of fusion plans afresh and may run another plan: a round's prediction
    is divided by that round's measured step, and the rounds' median is reported."""
    from testbeds.bench.harness import Run, report

    t = Topology.load(TOPOLOGY_DIR / "two-sites-split.toml")

    def run(step_s: float, predicted_s: float) -> Run:
        records = [{"step": i, "loss": 1.0, "step_s": step_s, "samples_per_s": 8.0} for i in range(3)]
        return Run(system="fusion", records=records, final_loss=1.0, hosts_used=["a-1"], predicted_step_s=predicted_s)

    row = summarize([run(1.0, 0.9), run(2.0, 1.0), run(1.0, 0.8)], t, warmup=0)
    assert row["efficiency"] == pytest.approx(0.8)  # median of 0.9, 0.5, 0.8
    assert row["predicted_step_s_rounds"] == [0.9, 1.0, 0.8]
    assert report({"fusion": row}, {})["efficiency"] == pytest.approx(0.8)


def test_a_compressing_plan_is_held_to_its_compressed_prediction() -> None:
    """fusion's efficiency sets the measured step against the step its plan predicted with
    the codecs AdaTopK chose, not against the plan's dense prediction."""
    dense = {"predicted_step_s": 0.60, "extra": {"clusters": []}}
    assert planned_step_s(dense) == 0.60
    compressed = {"predicted_step_s": 0.60, "extra": {"compression": {"dense_step_s": 0.60, "step_s": 0.41}}}
    assert planned_step_s(compressed) == 0.41
    assert planned_step_s({}) is None


class _CappedFleet(FusionFleet):
    """A fleet whose coordinator refuses a plan with fewer than ``fits`` micro-batches, with
    the planner's own advice (the refusal itself: tests/unit/test_memory_cap.py)."""

    def __init__(self, fits: int) -> None:  # no testbed: only the advised re-runs are under test
        self.fits, self.tried, self.advised_micro_batches = fits, [], {}

    def run(self, spec: JobSpec, system: str, *, timeout_s: float) -> Run:
        self.tried.append(spec.train.micro_batches)
        if spec.train.micro_batches < self.fits:
            return Run(system=system, note=f"failed: the uniform plan needs more; {memory_advice('1f1b')}")
        return Run(system=system)


def test_a_plan_refused_for_memory_runs_again_with_the_micro_batches_it_advises() -> None:
    job = JobSpec.from_dict(
        {"model": {"name": "gpt2", "preset": "tiny"}, "data": {"batch_size": 16}, "train": {"micro_batches": 4}}
    )
    fleet = _CappedFleet(fits=16)
    run = fleet.run_as_advised(job, "uniform", timeout_s=1.0)
    assert fleet.tried == [4, 8, 16] and run.note == "16 micro-batches (the job's 4 did not fit the caps)"
    fleet.tried.clear()
    fleet.run_as_advised(job, "uniform", timeout_s=1.0)  # the next round starts where this one fitted
    assert fleet.tried == [16]
    fleet = _CappedFleet(fits=32)  # no more micro-batches than samples: the refusal stands
    run = fleet.run_as_advised(job, "uniform", timeout_s=1.0)
    assert fleet.tried == [4, 8, 16] and run.note.startswith("16 micro-batches") and "failed: " in run.note
    fleet = _CappedFleet(fits=1)
    assert fleet.run_as_advised(job, "fusion", timeout_s=1.0).note == "" and fleet.tried == [4]

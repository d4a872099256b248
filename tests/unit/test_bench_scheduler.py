"""Smoke test of the scheduler benchmark: every part runs with tiny settings and the JSON
document has the documented shape (the numbers themselves are the benchmark's business)."""

from __future__ import annotations

import json
import math

import pytest

from testbeds.bench import scheduler as bench

TINY_JOB = ("gpt2-tiny", "tiny", 2, 16)


@pytest.fixture(scope="module")
def doc() -> dict:
    return bench.run(instances=3, seed=0, jobs=(TINY_JOB,), planning_job=TINY_JOB, planning_sizes=(8, 24))


def test_the_document_is_json_and_has_three_parts(doc: dict) -> None:
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # strict JSON: no Infinity or NaN
    assert set(doc) == {"optimality", "topologies", "planning_time"}


def test_optimality_part(doc: dict) -> None:
    a = doc["optimality"]
    assert {
        "instances",
        "seed",
        "ratios",
        "median",
        "p90",
        "worst",
        "num_optimal",
        "num_no_plan",
        "worst_instances",
        "opfence_s_median",
        "targets",
    } <= set(a)
    assert a["instances"] == len(a["ratios"]) == 3
    assert all(r is None or r >= 1.0 - 1e-9 for r in a["ratios"])  # nothing beats the exhaustive optimum
    assert a["worst"] is None or a["median"] <= a["p90"] <= a["worst"]
    assert 0 <= a["num_optimal"] <= 3
    assert a["targets"] == {"median": 1.01, "worst": 1.05}


def test_topologies_part(doc: dict) -> None:
    b = doc["topologies"]
    rows = b["rows"]
    assert {r["topology"] for r in rows} >= {"lab-10g", "two-sites", "three-continents", "volunteers"}
    for r in rows:
        assert r["model"] == "gpt2-tiny"
        assert set(r["step_s"]) == set(r["stages"]) == set(r["fits_memory"]) == set(bench.STRATEGIES)
        assert set(r["speedup"]) == {"uniform", "compute"}
        ours = r["step_s"]["opfence"]
        assert ours is not None and ours > 0
        for baseline, speedup in r["speedup"].items():
            assert speedup == pytest.approx(r["step_s"][baseline] / ours)


def test_planning_part(doc: dict) -> None:
    c = doc["planning_time"]
    assert c["model"] == "gpt2-tiny"
    assert [r["workers"] for r in c["rows"]] == [8, 24]
    for r in c["rows"]:
        assert {
            "topology_s",
            "planning_s",
            "target_s",
            "predicted_step_s",
            "stages",
            "clusters_planted",
            "clusters_found",
            "evaluations",
        } <= set(r)
        assert r["planning_s"] > 0 and math.isfinite(r["predicted_step_s"]) and r["stages"] >= 1


def test_report_prints_every_part(doc: dict) -> None:
    text = bench.format_report(doc)
    assert "a. OP-Fence / exhaustive optimum" in text
    assert "b. predicted step time" in text and "volunteers" in text
    assert "c. OP-Fence planning time" in text


def test_the_command_prints_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "JOBS", (TINY_JOB,))
    assert bench.main(["--instances", "2", "--seed", "1", "--skip-xl", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["planning_time"] is None
    assert out["optimality"]["instances"] == 2 and out["optimality"]["seed"] == 1


def test_random_instances_are_seeded() -> None:
    import numpy as np

    a = bench.random_instance(np.random.default_rng(5))
    b = bench.random_instance(np.random.default_rng(5))
    assert a.workload.names == b.workload.names and a.workload.edges == b.workload.edges
    assert a.topology == b.topology and (a.micro_batches, a.schedule) == (b.micro_batches, b.schedule)

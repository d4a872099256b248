"""The Plan as data (JSON, contract keys, costs, validation) and the uniform baseline planner."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch

from fusion.errors import PlanError
from fusion.graph.export import capture
from fusion.graph.ir import OpDag, OpEdge, OpNode, ValueMeta
from fusion.graph.split import split_stages
from fusion.models import build_model
from scheduler.baselines import uniform_assignment
from scheduler.plan import CutPlan, Plan, StagePlan, plan_from_stages, validate_plan

WORKERS = ("alpha-1", "beta-2", "gamma-3")


@dataclass
class Planned:
    model: torch.nn.Module
    dag: OpDag
    plan: Plan


def make_plan(dag: OpDag, workers: tuple[str, ...]) -> Plan:
    """The uniform baseline: one stage per worker, equal node counts."""
    specs = split_stages(dag, uniform_assignment(dag, len(workers)))
    return plan_from_stages(dag, specs, workers, strategy="uniform", micro_batches=4, schedule="1f1b", planning_s=0.25)


@pytest.fixture(scope="module")
def gpt2() -> Planned:
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny")
    x = torch.randint(0, 256, (2, 16))  # (B, T)
    dag = capture(model, (x,)).dag
    return Planned(model, dag, make_plan(dag, WORKERS))


def param_nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


# ----------------------------------------------------------------- JSON and contract


def test_json_round_trip(gpt2: Planned) -> None:
    assert Plan.from_json(gpt2.plan.to_json()) == gpt2.plan
    assert Plan.from_json(gpt2.plan.to_json(indent=None)) == gpt2.plan


def test_json_round_trip_with_every_field_set(gpt2: Planned) -> None:
    plan = replace(
        gpt2.plan,
        stages=tuple(
            replace(s, compute_s=0.01 * (i + 1), peak_memory_bytes=1000 * (i + 1))
            for i, s in enumerate(gpt2.plan.stages)
        ),
        cuts=tuple(replace(c, codec="topk", keep_ratio=0.1) for c in gpt2.plan.cuts),
        predicted_step_s=0.123,
        extra={"clusters": [["alpha-1"], ["beta-2", "gamma-3"]]},
    )
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.extra == plan.extra  # not part of ==, so checked on its own
    assert back != gpt2.plan


def test_plan_json_contract_keys(gpt2: Planned) -> None:
    doc = json.loads(gpt2.plan.to_json())
    for key in ("strategy", "predicted_step_s", "planning_s", "stages", "cuts"):
        assert key in doc, key
    assert doc["strategy"] == "uniform" and doc["planning_s"] == 0.25
    assert len(doc["stages"]) == 3
    for stage in doc["stages"]:
        for key in ("worker", "nodes", "compute_s", "peak_memory_bytes"):
            assert key in stage, key
        assert isinstance(stage["nodes"], list) and all(isinstance(n, str) for n in stage["nodes"])
    assert [s["worker"] for s in doc["stages"]] == list(WORKERS)
    assert doc["cuts"], "a 3-stage GPT-2 plan has cuts"
    for cut in doc["cuts"]:
        for key in ("src_stage", "dst_stage", "bytes", "codec", "keep_ratio"):
            assert key in cut, key
        assert cut["codec"] == "none" and cut["keep_ratio"] == 1.0


def test_plan_is_printable_and_names_every_worker(gpt2: Planned) -> None:
    table = gpt2.plan.table()
    for worker in WORKERS:
        assert worker in table
    assert "uniform" in table


# ----------------------------------------------------------------- costs


def test_stages_follow_the_assignment(gpt2: Planned) -> None:
    compute = [n.name for n in gpt2.dag.compute_nodes()]
    assert [n for s in gpt2.plan.stages for n in s.nodes] == compute  # contiguous ranges, in order
    assert gpt2.plan.assignment() == uniform_assignment(gpt2.dag, 3)


def test_cut_bytes_are_the_values_crossing(gpt2: Planned) -> None:
    """Each cut carries every value produced on ``src`` and read on ``dst``, once per value."""
    dag, plan = gpt2.dag, gpt2.plan
    stage_of = plan.assignment()
    crossing: dict[tuple[int, int], set[str]] = {}
    for e in dag.edges:
        if e.src in stage_of and e.dst in stage_of and stage_of[e.src] != stage_of[e.dst]:
            crossing.setdefault((stage_of[e.src], stage_of[e.dst]), set()).add(e.src)
    expected = {pair: sum(dag.node(v).out_bytes for v in values) for pair, values in crossing.items()}
    got = {(c.src_stage, c.dst_stage): c.bytes for c in plan.cuts}
    assert len(got) == len(plan.cuts)  # one cut per stage pair
    assert got == expected
    assert set(got) == {(0, 1), (1, 2)}
    assert all(b > 0 for b in got.values())
    assert [(c.src_stage, c.dst_stage) for c in plan.cuts] == sorted(got)


def test_stage_flops_sum_to_the_model(gpt2: Planned) -> None:
    total = sum(n.flops_fwd + n.flops_bwd for n in gpt2.dag.compute_nodes())
    assert total > 0
    assert sum(s.flops for s in gpt2.plan.stages) == total
    assert total == 3 * gpt2.dag.total_flops_fwd  # backward estimated as 2 x forward
    assert all(s.flops > 0 for s in gpt2.plan.stages)


def test_stage_param_bytes_count_the_tied_weight_on_each_stage_that_holds_it(gpt2: Planned) -> None:
    """GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``. Uniform over 3 stages puts the
    embedding on stage 0 and the head on stage 2, and each stage keeps its own copy (the
    executor sums their gradients), so the stages together hold the model's parameters plus
    one extra copy of the tied weight."""
    model, dag, plan = gpt2.model, gpt2.dag, gpt2.plan
    assert dag.tied_params == {"lm_head.weight": "transformer.wte.weight"}
    stage_of = plan.assignment()
    assert stage_of["transformer_wte"] == 0 and stage_of["lm_head"] == 2
    model_bytes = sum(param_nbytes(p) for p in model.parameters())  # unique tensors: tied once
    assert model_bytes == dag.total_param_bytes
    tied_bytes = param_nbytes(model.transformer.wte.weight)
    assert sum(s.param_bytes for s in plan.stages) == model_bytes + tied_bytes
    # per stage: the bytes of the distinct parameters its nodes own
    for i, stage in enumerate(plan.stages):
        names = {dag.tied_params.get(p, p): size for n in stage.nodes for p, size in dag.node(n).params.items()}
        assert stage.param_bytes == sum(names.values()), f"stage {i}"


def test_tied_weight_on_one_stage_counts_once(gpt2: Planned) -> None:
    plan = make_plan(gpt2.dag, ("solo",))
    assert plan.cuts == ()
    assert plan.stages[0].param_bytes == sum(param_nbytes(p) for p in gpt2.model.parameters())


def test_plan_from_stages_needs_one_worker_per_stage(gpt2: Planned) -> None:
    specs = split_stages(gpt2.dag, uniform_assignment(gpt2.dag, 3))
    with pytest.raises(PlanError, match="3 stages but 2 workers"):
        plan_from_stages(gpt2.dag, specs, ["a", "b"], strategy="uniform", micro_batches=1, schedule="gpipe")


# ----------------------------------------------------------------- validation


def with_stage_nodes(plan: Plan, idx: int, nodes: tuple[str, ...]) -> Plan:
    stages = list(plan.stages)
    stages[idx] = replace(stages[idx], nodes=nodes)
    return replace(plan, stages=tuple(stages))


def test_valid_plan_passes(gpt2: Planned) -> None:
    validate_plan(gpt2.plan, gpt2.dag)


def test_rejects_a_node_placed_twice(gpt2: Planned) -> None:
    plan = gpt2.plan
    dup = plan.stages[0].nodes[0]
    bad = with_stage_nodes(plan, 1, (*plan.stages[1].nodes, dup))
    with pytest.raises(PlanError, match=rf"{dup!r} is on stages 0 and 1"):
        validate_plan(bad, gpt2.dag)


def test_rejects_a_missing_node(gpt2: Planned) -> None:
    plan = gpt2.plan
    dropped = plan.stages[2].nodes[-1]
    bad = with_stage_nodes(plan, 2, plan.stages[2].nodes[:-1])
    with pytest.raises(PlanError, match="unplaced") as info:
        validate_plan(bad, gpt2.dag)
    assert dropped in str(info.value)


@pytest.mark.parametrize("kind", ["placeholder", "get_attr_or_output", "unknown"])
def test_rejects_a_non_compute_node(gpt2: Planned, kind: str) -> None:
    dag = gpt2.dag
    if kind == "placeholder":
        name = dag.input_names()[0]
    elif kind == "get_attr_or_output":
        name = next(n.name for n in dag.nodes if n.op in ("get_attr", "output"))
    else:
        name = "no_such_node"
    bad = with_stage_nodes(gpt2.plan, 1, (*gpt2.plan.stages[1].nodes, name))
    with pytest.raises(PlanError, match=rf"{name!r}, which is not a compute node"):
        validate_plan(bad, dag)


def test_rejects_an_empty_stage(gpt2: Planned) -> None:
    bad = replace(gpt2.plan, stages=(*gpt2.plan.stages, StagePlan(worker="idle", nodes=())))
    with pytest.raises(PlanError, match="stage 3 has no nodes"):
        validate_plan(bad, gpt2.dag)


@pytest.mark.parametrize(("src", "dst"), [(0, 3), (-1, 1), (2, 7), (1, 1)])
def test_rejects_a_cut_outside_the_plan(gpt2: Planned, src: int, dst: int) -> None:
    bad = replace(gpt2.plan, cuts=(*gpt2.plan.cuts, CutPlan(src_stage=src, dst_stage=dst, bytes=8)))
    with pytest.raises(PlanError, match=rf"cut {src}->{dst} does not join two different stages"):
        validate_plan(bad, gpt2.dag)


@pytest.mark.parametrize("keep_ratio", [0.0, -0.5, 1.5, float("nan")])
def test_rejects_a_bad_keep_ratio(gpt2: Planned, keep_ratio: float) -> None:
    cuts = list(gpt2.plan.cuts)
    cuts[0] = replace(cuts[0], codec="topk", keep_ratio=keep_ratio)
    with pytest.raises(PlanError, match="keep_ratio"):
        validate_plan(replace(gpt2.plan, cuts=tuple(cuts)), gpt2.dag)


def test_accepts_keep_ratio_one_and_small(gpt2: Planned) -> None:
    for keep_ratio in (1.0, 1e-4):
        cuts = (replace(gpt2.plan.cuts[0], codec="topk", keep_ratio=keep_ratio), *gpt2.plan.cuts[1:])
        validate_plan(replace(gpt2.plan, cuts=cuts), gpt2.dag)


def test_rejects_an_unknown_codec(gpt2: Planned) -> None:
    cuts = (replace(gpt2.plan.cuts[0], codec="gzip"), *gpt2.plan.cuts[1:])
    with pytest.raises(PlanError, match="gzip"):
        validate_plan(replace(gpt2.plan, cuts=cuts), gpt2.dag)


def test_rejects_zero_micro_batches(gpt2: Planned) -> None:
    with pytest.raises(PlanError, match="micro_batches"):
        validate_plan(replace(gpt2.plan, micro_batches=0), gpt2.dag)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "{",
        "null",
        "[]",
        '"a string"',
        "{}",
        '{"stages": []}',
        '{"strategy": "uniform", "stages": 5}',
        '{"strategy": "uniform", "stages": ["abc"]}',
        '{"strategy": "uniform", "stages": [{"worker": "a"}]}',
        '{"strategy": "uniform", "stages": [{"worker": "a", "nodes": ["x"], "colour": "red"}]}',
        '{"strategy": "uniform", "stages": [{"worker": "a", "nodes": 3}]}',
        '{"strategy": "uniform", "stages": [], "cuts": [{"src_stage": 0}]}',
        '{"strategy": "uniform", "stages": [], "planning_s": "soon"}',
        '{"strategy": "uniform", "stages": [], "micro_batches": "many"}',
    ],
)
def test_from_json_rejects_garbage(text: str) -> None:
    with pytest.raises(PlanError, match="plan"):
        Plan.from_json(text)


# ----------------------------------------------------------------- uniform baseline


def chain_dag(num_compute: int) -> OpDag:
    """x -> f0 -> f1 -> ... -> output: a pure-data DAG for planner tests."""
    t = ValueMeta(kind="tensor", dtype="float32", shape=(2, 4), size_bytes=32)
    nodes = [OpNode(name="x", op="placeholder", target="x", value=t)]
    edges = []
    prev = "x"
    for i in range(num_compute):
        nodes.append(
            OpNode(
                name=f"f{i}",
                op="call_function",
                target="torch.relu",
                inputs=[prev],
                value=t,
                flops_fwd=10,
                flops_bwd=20,
            )
        )
        edges.append(OpEdge(src=prev, dst=f"f{i}", bytes=32))
        prev = f"f{i}"
    nodes.append(OpNode(name="output", op="output", target="output", inputs=[prev], value=t))
    edges.append(OpEdge(src=prev, dst="output", bytes=32))
    return OpDag(nodes=nodes, edges=edges, output=prev)


def check_uniform(dag: OpDag, num_stages: int) -> None:
    compute = [n.name for n in dag.compute_nodes()]
    assignment = uniform_assignment(dag, num_stages)
    assert sorted(assignment) == sorted(compute)
    stages = [assignment[n] for n in compute]
    assert stages == sorted(stages), "stages must be contiguous runs of the topological order"
    assert set(stages) == set(range(num_stages))
    sizes = [stages.count(s) for s in range(num_stages)]
    assert max(sizes) - min(sizes) <= 1, sizes


@pytest.mark.parametrize("num_compute", [1, 2, 5, 7, 10, 16])
def test_uniform_assignment_on_chains(num_compute: int) -> None:
    dag = chain_dag(num_compute)
    for num_stages in range(1, num_compute + 1):
        check_uniform(dag, num_stages)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 7])
def test_uniform_assignment_on_gpt2(gpt2: Planned, num_stages: int) -> None:
    check_uniform(gpt2.dag, num_stages)


def test_uniform_assignment_too_many_stages(gpt2: Planned) -> None:
    n = len(gpt2.dag.compute_nodes())
    check_uniform(gpt2.dag, n)  # one node per stage is still fine
    with pytest.raises(PlanError, match=f"{n} compute nodes into {n + 1}"):
        uniform_assignment(gpt2.dag, n + 1)
    with pytest.raises(PlanError, match="into 3 non-empty stages"):
        uniform_assignment(chain_dag(2), 3)


@pytest.mark.parametrize("num_stages", [0, -1])
def test_uniform_assignment_needs_a_stage(num_stages: int) -> None:
    with pytest.raises(PlanError, match="at least one stage"):
        uniform_assignment(chain_dag(3), num_stages)

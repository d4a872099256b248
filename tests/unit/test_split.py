"""Stage cuts: boundaries derived from assignments, stage sub-graphs run in-process, refusals."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch

from fusion.errors import SplitError
from fusion.graph.export import capture
from fusion.graph.ir import OpDag
from fusion.graph.split import (
    DRIVER,
    StageSpec,
    build_stage_module,
    normalize_assignment,
    split_stages,
)
from tests.support.graph_models import (
    Captured,
    captured_gpt2_tiny,
    captured_resnet_tiny,
)
from tests.support.models import ControlFlowNet


@pytest.fixture(scope="module")
def gpt2() -> Captured:
    return captured_gpt2_tiny()


@pytest.fixture(scope="module")
def resnet() -> Captured:
    return captured_resnet_tiny(train=False)


@pytest.fixture(scope="module")
def resnet_train() -> Captured:
    return captured_resnet_tiny(train=True)


@pytest.fixture(scope="module", params=["gpt2", "resnet", "resnet_train"])
def model(request: pytest.FixtureRequest) -> Captured:
    return request.getfixturevalue(request.param)


def even_assignment(compute: list[str], num_stages: int) -> dict[str, int]:
    """Contiguous, equally sized ranges of the topological order."""
    return {name: i * num_stages // len(compute) for i, name in enumerate(compute)}


def ranges_assignment(compute: list[str], firsts: list[str]) -> dict[str, int]:
    """Stage ``k`` starts at compute node ``firsts[k-1]`` (a contiguous chain split)."""
    starts = [compute.index(f) for f in firsts]
    return {name: sum(i >= s for s in starts) for i, name in enumerate(compute)}


def gpt2_skip_assignment(compute: list[str]) -> dict[str, int]:
    """Embeddings | block 0 attention branch | the rest: the embedding output goes to stages 1 and 2."""
    assignment = {}
    for i, name in enumerate(compute):
        if i <= compute.index("transformer_drop"):
            assignment[name] = 0
        elif i <= compute.index("transformer_h_0_attn_resid_dropout"):
            assignment[name] = 1
        else:
            assignment[name] = 2
    return assignment


def resnet_diamond_assignment(compute: list[str]) -> dict[str, int]:
    """Stem | layer1.0 main branch | layer1.0 shortcut | the rest: ``maxpool`` feeds stages 1 and 2."""
    fork, join = compute.index("maxpool"), compute.index("add")
    assignment = {}
    for i, name in enumerate(compute):
        if i <= fork:
            assignment[name] = 0
        elif i < join:
            assignment[name] = 2 if name == "layer1_0_downsample" else 1
        else:
            assignment[name] = 3
    return assignment


def run_stages(captured: Captured, specs: list[StageSpec]) -> torch.Tensor:
    """Build every stage and run them in a topological order, passing values by name."""
    dag, gm = captured.dag, captured.captured.graph_module
    env: dict[str, object] = dict(zip(dag.input_names(), [captured.example], strict=True))
    result = None
    # A link a -> b implies depth[a] > depth[b], so decreasing depth is a topological order.
    for spec in sorted(specs, key=lambda s: -s.depth):
        stage = build_stage_module(gm, spec)
        args = []
        for name, src in spec.inputs:
            if src != DRIVER:
                assert (name, src) in [
                    (v, s.stage_idx) for s in specs for v, dsts in s.outputs if spec.stage_idx in dsts
                ]
            args.append(env[name])
        with torch.no_grad():
            out = stage(*args)
        assert isinstance(out, tuple)
        assert len(out) == len(spec.outputs) + spec.is_loss_stage
        for (name, _), value in zip(spec.outputs, out, strict=False):
            env[name] = value
        if spec.is_loss_stage:
            result = out[-1]
    assert result is not None
    return result


def check_runs_like_model(captured: Captured, assignment: Mapping[str, int]) -> list[StageSpec]:
    specs = split_stages(captured.dag, assignment)
    got = run_stages(captured, specs)
    with torch.no_grad():
        expected = captured.model(captured.example)
    torch.testing.assert_close(got, expected)
    return specs


# ---------------------------------------------------------------- running the split
def test_even_three_stage_split_runs_like_the_model(model: Captured) -> None:
    specs = check_runs_like_model(model, even_assignment(model.compute, 3))
    assert [s.stage_idx for s in specs] == [0, 1, 2]
    assert [s.is_loss_stage for s in specs] == [False, False, True]
    assert [s.depth for s in specs] == [2, 1, 0]
    for a, b in zip(specs, specs[1:], strict=False):
        assert b.producers == (a.stage_idx,)
        assert a.consumers == (b.stage_idx,)


def test_gpt2_skip_split_sends_one_value_to_two_stages(gpt2: Captured) -> None:
    specs = check_runs_like_model(gpt2, gpt2_skip_assignment(gpt2.compute))
    assert ("transformer_drop", (1, 2)) in specs[0].outputs
    assert ("transformer_drop", 0) in specs[2].inputs
    assert specs[0].consumers == (1, 2)
    assert specs[2].producers == (0, 1)
    assert [s.depth for s in specs] == [2, 1, 0]


def test_resnet_diamond_split(resnet: Captured, resnet_train: Captured) -> None:
    for captured in (resnet, resnet_train):
        specs = check_runs_like_model(captured, resnet_diamond_assignment(captured.compute))
        assert ("maxpool", (1, 2)) in specs[0].outputs
        assert specs[1].producers == specs[2].producers == (0,)
        assert specs[3].producers == (1, 2)
        assert [s.depth for s in specs] == [2, 1, 1, 0]
        assert specs[3].is_loss_stage and not any(s.is_loss_stage for s in specs[:3])


def test_single_stage_is_the_whole_model(gpt2: Captured) -> None:
    (spec,) = check_runs_like_model(gpt2, dict.fromkeys(gpt2.compute, 0))
    assert spec.outputs == () and spec.depth == 0 and spec.is_loss_stage
    assert spec.inputs == (("idx", DRIVER),)


def test_placeholders_come_from_the_driver(model: Captured) -> None:
    dag = model.dag
    for assignment in (even_assignment(model.compute, 3), dict.fromkeys(model.compute, 0)):
        for spec in split_stages(dag, assignment):
            for name, src in spec.inputs:
                assert (src == DRIVER) == (dag.node(name).op == "placeholder"), (spec.stage_idx, name)
    spec0 = split_stages(dag, even_assignment(model.compute, 3))[0]
    assert (dag.input_names()[0], DRIVER) in spec0.inputs


def test_a_placeholder_read_on_two_stages_comes_from_the_driver_twice(gpt2: Captured) -> None:
    # ``size`` reads the token ids; so does the embedding. Put them on different stages.
    compute = gpt2.compute
    assignment = ranges_assignment(compute, ["transformer_wte"])
    assert assignment["size"] == 0 and assignment["transformer_wte"] == 1
    specs = check_runs_like_model(gpt2, assignment)
    assert ("idx", DRIVER) in specs[0].inputs and ("idx", DRIVER) in specs[1].inputs


def test_unsendable_tuple_pulls_its_consumers_onto_its_stage(gpt2: Captured) -> None:
    compute = gpt2.compute
    # Cut right after ``split`` (a tuple of q, k, v): its getitems would land on stage 1.
    assignment = ranges_assignment(compute, [compute[compute.index("split") + 1]])
    assert assignment["getitem"] == 1
    normalized = normalize_assignment(gpt2.dag, assignment)
    assert [normalized[n] for n in ("split", "getitem", "getitem_1", "getitem_2")] == [0, 0, 0, 0]
    assert assignment["getitem"] == 1, "the caller's assignment is not modified"
    specs = check_runs_like_model(gpt2, assignment)
    assert all(name != "split" for s in specs for name, _ in s.inputs)


# ---------------------------------------------------------------- parameters per stage
def _canonical(dag: OpDag, names: tuple[str, ...]) -> set[str]:
    return {dag.tied_params.get(n, n) for n in names}


@pytest.mark.parametrize(
    "make_assignment",
    [lambda c: even_assignment(c.compute, 3), lambda c: even_assignment(c.compute, 5)],
    ids=["3", "5"],
)
def test_params_and_buffers_are_disjoint_except_tied(
    model: Captured, make_assignment: Callable[[Captured], dict[str, int]]
) -> None:
    dag = model.dag
    specs = split_stages(dag, make_assignment(model))
    tied_canonical = set(dag.tied_params.values())
    for i, a in enumerate(specs):
        for b in specs[i + 1 :]:
            assert not set(a.params) & set(b.params)
            assert not set(a.buffers) & set(b.buffers)
            assert _canonical(dag, a.params) & _canonical(dag, b.params) <= tied_canonical
    all_params = [p for s in specs for p in s.params]
    assert sorted(all_params) == sorted(name for name, _ in model.model.named_parameters(remove_duplicate=False))
    assert sorted(b for s in specs for b in s.buffers) == sorted(name for name, _ in model.model.named_buffers())


def test_gpt2_tied_embedding_lands_on_first_and_last_stage(gpt2: Captured) -> None:
    specs = split_stages(gpt2.dag, even_assignment(gpt2.compute, 3))
    assert "transformer.wte.weight" in specs[0].params
    assert "lm_head.weight" in specs[2].params
    assert _canonical(gpt2.dag, specs[0].params) & _canonical(gpt2.dag, specs[2].params) == {"transformer.wte.weight"}


def test_stage_module_holds_exactly_its_state_as_copies(model: Captured) -> None:
    gm = model.captured.graph_module
    originals = {k: v.data_ptr() for k, v in gm.state_dict().items()}
    for spec in split_stages(model.dag, even_assignment(model.compute, 3)):
        stage = build_stage_module(gm, spec)
        state = stage.state_dict()
        assert set(state) == set(spec.params) | set(spec.buffers)
        for k, v in state.items():
            assert v.data_ptr() != originals[k], f"stage {spec.stage_idx} shares {k} with the captured model"


@pytest.fixture(scope="module")
def control_flow() -> Captured:
    torch.manual_seed(0)
    net = ControlFlowNet().eval()
    x = torch.randn(2, 3, 8, 8)
    return Captured(net, x, capture(net, (x,)))


def test_export_captured_model_splits_with_replicated_attrs(control_flow: Captured) -> None:
    captured, net = control_flow, control_flow.model
    assert captured.dag.capture == "export"
    specs = check_runs_like_model(captured, even_assignment(captured.compute, 3))
    for spec in specs:
        assert set(spec.attrs) <= {n.name for n in captured.dag.nodes if n.op == "get_attr"}
    assert sorted(p for s in specs for p in s.params) == sorted(dict(net.named_parameters()))


# ---------------------------------------------------------------- refusals
def _chain(resnet: Captured) -> list[str]:
    # conv1 -> bn1 -> relu -> maxpool -> ... : the ResNet stem is a plain chain.
    compute = resnet.compute
    assert compute[:4] == ["conv1", "bn1", "relu", "maxpool"]
    return compute


def test_cyclic_assignment_is_refused(resnet: Captured) -> None:
    compute = _chain(resnet)
    assignment = {name: 0 for name in compute}
    assignment["bn1"] = 1  # stage 0 -> 1 -> 0 along the chain
    with pytest.raises(SplitError, match="cyclic") as info:
        split_stages(resnet.dag, assignment)
    assert "stage 0 -> stage 1" in str(info.value) and "stage 1 -> stage 0" in str(info.value)


def test_cycle_with_a_stage_downstream_is_refused(resnet: Captured) -> None:
    compute = _chain(resnet)
    # conv1 on 1, bn1 on 2, relu back on 1, the rest on 0: stages 1 <-> 2 form a cycle
    # and stage 0 hangs below it.
    assignment = {name: 0 for name in compute}
    assignment.update(conv1=1, bn1=2, relu=1)
    with pytest.raises(SplitError, match="cyclic"):
        split_stages(resnet.dag, assignment)


def test_missing_nodes_are_refused(resnet: Captured) -> None:
    assignment = even_assignment(resnet.compute, 2)
    del assignment["fc"]
    with pytest.raises(SplitError, match="misses 1 compute node.*'fc'"):
        split_stages(resnet.dag, assignment)


def test_gap_in_stage_indices_is_refused(resnet: Captured) -> None:
    assignment = {name: 2 * s for name, s in even_assignment(resnet.compute, 2).items()}  # stages 0 and 2
    with pytest.raises(SplitError, match=r"stage\(s\) \[1\] have no nodes"):
        split_stages(resnet.dag, assignment)


@pytest.mark.parametrize("name", ["x", "output", "no_such_node"])
def test_non_compute_nodes_are_refused(resnet: Captured, name: str) -> None:
    assignment = {**dict.fromkeys(resnet.compute, 0), name: 0}
    with pytest.raises(SplitError, match="not compute nodes"):
        split_stages(resnet.dag, assignment)


@pytest.mark.parametrize("index", [-1, 1.0, True])
def test_bad_stage_indices_are_refused(resnet: Captured, index: object) -> None:
    assignment: dict[str, object] = dict.fromkeys(resnet.compute, 0)
    assignment["fc"] = index
    with pytest.raises(SplitError, match="non-negative ints"):
        split_stages(resnet.dag, assignment)  # type: ignore[arg-type]


def test_export_get_attr_in_assignment_is_refused(control_flow: Captured) -> None:
    dag = control_flow.dag
    attr = next(n.name for n in dag.nodes if n.op == "get_attr")
    assignment = {**{n.name: 0 for n in dag.compute_nodes()}, attr: 0}
    with pytest.raises(SplitError, match="not compute nodes"):
        split_stages(dag, assignment)

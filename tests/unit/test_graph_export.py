"""Capture of models as OP-DAGs: structure, costs, JSON, side effects and failure messages."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fusion.errors import GraphExportError, SplitError
from fusion.graph.export import capture, describe_value, export, tied_parameter_names
from fusion.graph.ir import OpDag, ValueMeta
from fusion.graph.split import normalize_assignment, split_stages
from fusion.models import build_model
from tests.support.graph_models import (
    Captured,
    GatedNet,
    TupleOutputNet,
    captured_gpt2_tiny,
    captured_resnet_tiny,
)
from tests.support.models import ControlFlowNet


@pytest.fixture(scope="module")
def gpt2() -> Captured:
    return captured_gpt2_tiny()


@pytest.fixture(scope="module")
def resnet() -> Captured:
    return captured_resnet_tiny()


@pytest.fixture(scope="module", params=["gpt2", "resnet"])
def captured(request: pytest.FixtureRequest) -> Captured:
    return request.getfixturevalue(request.param)


def _param_bytes_once(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups ties


# ---------------------------------------------------------------- structure
def test_fx_capture_is_used_for_traceable_models(captured: Captured) -> None:
    assert captured.dag.capture == "fx"
    assert captured.dag.fingerprint


def test_nodes_are_in_topological_order(captured: Captured) -> None:
    dag = captured.dag
    pos = {n.name: i for i, n in enumerate(dag.nodes)}
    assert dag.edges
    for e in dag.edges:
        assert pos[e.src] < pos[e.dst], f"edge {e.src}->{e.dst} goes backwards"
    for n in dag.nodes:
        assert all(pos[i] < pos[n.name] for i in n.inputs)
    assert dag.nodes[-1].op == "output"
    assert dag.input_names() == [n.name for n in dag.nodes if n.op == "placeholder"] != []


def test_edges_are_exactly_the_node_inputs(captured: Captured) -> None:
    dag = captured.dag
    from_inputs = {(src, n.name) for n in dag.nodes for src in n.inputs}
    from_edges = [(e.src, e.dst) for e in dag.edges]
    assert len(from_edges) == len(set(from_edges)), "one edge per (producer, consumer) pair"
    assert set(from_edges) == from_inputs


def test_edge_bytes_equal_producer_out_bytes(captured: Captured) -> None:
    dag = captured.dag
    for e in dag.edges:
        assert e.bytes == dag.node(e.src).out_bytes, f"{e.src}->{e.dst}"


def test_tensor_out_bytes_are_numel_times_element_size(captured: Captured) -> None:
    for n in captured.dag.nodes:
        if n.value.kind == "tensor":
            assert n.value.shape is not None and n.value.dtype is not None
            itemsize = torch.empty((), dtype=getattr(torch, n.value.dtype)).element_size()
            assert n.out_bytes == math.prod(n.value.shape) * itemsize, n.name


# ---------------------------------------------------------------- JSON
def test_json_round_trip(captured: Captured) -> None:
    dag = captured.dag
    assert OpDag.from_json(dag.to_json()) == dag
    assert OpDag.from_json(dag.to_json(indent=2)) == dag


def test_json_has_contract_keys(captured: Captured) -> None:
    doc = json.loads(captured.dag.to_json())
    assert {"nodes", "edges", "output", "capture", "fingerprint", "tied_params"} <= doc.keys()
    for node in doc["nodes"]:
        assert {"name", "op", "target", "params", "out_bytes", "flops_fwd", "flops_bwd"} <= node.keys()
        assert isinstance(node["params"], dict)
    for edge in doc["edges"]:
        assert set(edge) == {"src", "dst", "bytes"}
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert doc["output"] in by_name


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(GraphExportError):
        OpDag.from_json("{}")
    with pytest.raises(GraphExportError):
        OpDag.from_json("not json")


def test_from_json_rejects_edges_out_of_order(gpt2: Captured) -> None:
    doc = json.loads(gpt2.dag.to_json())
    edge = doc["edges"][0]
    doc["edges"].append({"src": edge["dst"], "dst": edge["src"], "bytes": 0})
    with pytest.raises(GraphExportError, match="topological"):
        OpDag.from_json(json.dumps(doc))


# ---------------------------------------------------------------- parameters
def test_param_and_buffer_names_are_state_dict_names(captured: Captured) -> None:
    dag, model = captured.dag, captured.model
    params = {k: v for n in dag.nodes for k, v in n.params.items()}
    buffers = {k: v for n in dag.nodes for k, v in n.buffers.items()}
    expected_params = {k: p.numel() * p.element_size() for k, p in model.named_parameters(remove_duplicate=False)}
    expected_buffers = {k: b.numel() * b.element_size() for k, b in model.named_buffers(remove_duplicate=False)}
    assert params == expected_params
    assert buffers == expected_buffers
    assert set(params) | set(buffers) == set(model.state_dict(keep_vars=True))


def test_each_parameter_has_one_owner(captured: Captured) -> None:
    owners: dict[str, str] = {}
    for n in captured.dag.nodes:
        for name in n.params:
            assert name not in owners, f"{name} owned by {owners.get(name)} and {n.name}"
            owners[name] = n.name


def test_total_param_bytes_counts_each_parameter_once(captured: Captured) -> None:
    assert captured.dag.total_param_bytes == _param_bytes_once(captured.model)


def test_gpt2_tied_embedding_is_counted_once(gpt2: Captured) -> None:
    dag, model = gpt2.dag, gpt2.model
    # wte is registered first, so it is the canonical name and lm_head.weight the alias.
    assert dag.tied_params == {"lm_head.weight": "transformer.wte.weight"}
    assert dag.tied_params == tied_parameter_names(model)
    owned = {k for n in dag.nodes for k in n.params}
    for alias, canonical in dag.tied_params.items():
        assert model.get_parameter(alias) is model.get_parameter(canonical)
        assert alias in owned and canonical in owned
        assert canonical not in dag.tied_params, "a canonical name is never an alias itself"
    all_names_bytes = sum(p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False))
    wte_bytes = model.get_parameter("transformer.wte.weight").numel() * 4
    assert dag.total_param_bytes == all_names_bytes - wte_bytes
    assert sorted(name for name, _ in dag.iter_params()) == sorted(name for name, _ in model.named_parameters())


def test_resnet_has_no_tied_params(resnet: Captured) -> None:
    assert resnet.dag.tied_params == {}


# ---------------------------------------------------------------- values and costs
def test_output_value_matches_real_forward(captured: Captured) -> None:
    with torch.no_grad():
        y = captured.model(captured.example)
    out = captured.dag.node(captured.dag.output)
    assert out.is_compute
    assert out.value == describe_value(y)
    assert captured.dag.nodes[-1].value == out.value


def test_module_output_shapes_match_real_forward(captured: Captured) -> None:
    model = captured.model
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str) -> object:
        def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
            shapes[name] = tuple(out.shape)

        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(captured.example)
    finally:
        for h in handles:
            h.remove()
    modules = [n for n in captured.dag.nodes if n.op == "call_module"]
    assert modules
    for n in modules:
        assert n.value.shape == shapes[n.target], n.name


def test_graph_module_computes_the_model(captured: Captured) -> None:
    with torch.no_grad():
        torch.testing.assert_close(captured.captured.graph_module(captured.example), captured.model(captured.example))


def test_one_linear_flops_exactly(gpt2: Captured) -> None:
    b, t = gpt2.example.shape
    fc = gpt2.dag.node("transformer_h_0_mlp_c_fc")  # Linear(32 -> 128) on (B, T, 32)
    assert fc.value.shape == (b, t, 128)
    assert fc.flops_fwd == 2 * (b * t) * 128 * 32
    assert fc.flops_bwd == 2 * fc.flops_fwd


def test_matmul_flops_are_2mnk(captured: Captured) -> None:
    model, checked = captured.model, 0
    for n in captured.dag.nodes:
        if n.op != "call_module":
            continue
        m = model.get_submodule(n.target)
        numel_out = math.prod(n.value.shape or ())
        if isinstance(m, nn.Linear):
            expected = 2 * numel_out * m.in_features  # M = rows, N = out_features, K = in_features
        elif isinstance(m, nn.Conv2d):
            kh, kw = m.kernel_size
            expected = 2 * numel_out * (m.in_channels // m.groups) * kh * kw
        else:
            continue
        assert n.flops_fwd == expected, n.name
        checked += 1
    assert checked >= 4


def test_backward_flops_are_twice_forward(captured: Captured) -> None:
    for n in captured.dag.nodes:
        assert n.flops_bwd == 2 * n.flops_fwd, n.name
    assert captured.dag.total_flops_fwd == sum(n.flops_fwd for n in captured.dag.nodes) > 0


@pytest.mark.parametrize(
    ("value", "kind", "size_bytes"),
    [
        (torch.zeros(2, 3, dtype=torch.float16), "tensor", 12),
        (3, "int", 8),
        (True, "bool", 8),
        (0.5, "float", 8),
        (None, "none", 0),
        (torch.float32, "dtype", 8),
        (torch.device("cpu"), "device", 8),
        (torch.Size([2, 3]), "ints", 16),
        ((torch.zeros(2), torch.zeros(3)), "tuple", 20),
        (object(), "other", 0),
    ],
)
def test_describe_value(value: object, kind: str, size_bytes: int) -> None:
    meta = describe_value(value)
    assert (meta.kind, meta.size_bytes) == (kind, size_bytes)
    assert meta.sendable == (kind not in ("tuple", "other"))


# ---------------------------------------------------------------- side effects
def test_capture_keeps_buffers_and_rng_state() -> None:
    torch.manual_seed(1)
    model = build_model("resnet", "tiny", num_classes=4).train()  # train mode: BN updates running stats
    x = torch.randn(4, 3, 16, 16)
    before = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    capture(model, (x,))
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


def test_capture_keeps_rng_state_with_dropout() -> None:
    torch.manual_seed(2)
    model = build_model("gpt2", "tiny", dropout=0.1).train()  # dropout draws from the global RNG
    idx = torch.randint(0, 256, (2, 8))
    rng = torch.get_rng_state()
    captured = capture(model, (idx,))
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(3)
    expected = model(idx)
    torch.manual_seed(3)
    torch.testing.assert_close(captured.graph_module(idx), expected)


def test_capture_is_deterministic(gpt2: Captured) -> None:
    torch.manual_seed(5)  # different weights, same structure
    other = export(build_model("gpt2", "tiny").eval(), (torch.randint(0, 256, (2, 8)),))
    assert other.fingerprint == gpt2.dag.fingerprint
    assert [(n.name, n.op, n.target) for n in other.nodes] == [(n.name, n.op, n.target) for n in gpt2.dag.nodes]


# ---------------------------------------------------------------- fallbacks and failures
def test_control_flow_falls_back_to_torch_export() -> None:
    model = ControlFlowNet().eval()
    x = torch.randn(2, 3, 8, 8)
    captured = capture(model, (x,))
    dag = captured.dag
    assert dag.capture == "export"
    with torch.no_grad():
        y = model(x)
        torch.testing.assert_close(captured.graph_module(x), y)
    assert dag.node(dag.output).value.shape == tuple(y.shape)
    assert dag.total_param_bytes == _param_bytes_once(model)
    assert {k for n in dag.nodes for k in n.params} == set(dict(model.named_parameters()))
    assert OpDag.from_json(dag.to_json()) == dag


def test_data_dependent_submodule_names_the_module_and_leaf_modules() -> None:
    with pytest.raises(GraphExportError) as info:
        capture(GatedNet(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "'gate'" in message
    assert '`leaf_modules = ["gate"]` under [model] in the job file' in message
    assert "fusion.export(..., leaf_modules=['gate'])" in message


def test_leaf_module_is_kept_whole() -> None:
    model = GatedNet()
    x = torch.randn(2, 4)
    captured = capture(model, (x,), leaf_modules=["gate"])
    dag = captured.dag
    assert dag.capture == "fx"
    gate_nodes = [n for n in dag.nodes if n.module_path == "gate" or n.module_path.startswith("gate.")]
    assert len(gate_nodes) == 1
    assert (gate_nodes[0].op, gate_nodes[0].target) == ("call_module", "gate")
    with torch.no_grad():
        torch.testing.assert_close(captured.graph_module(x), model(x))
        torch.testing.assert_close(captured.graph_module(-x), model(-x))  # both branches stay live


def test_unknown_leaf_module_is_refused() -> None:
    with pytest.raises(GraphExportError, match="no_such_module"):
        capture(GatedNet(), (torch.randn(2, 4),), leaf_modules=["no_such_module"])


def test_tuple_output_is_refused() -> None:
    with pytest.raises(GraphExportError, match="single tensor"):
        capture(TupleOutputNet(), (torch.randn(2, 4),))


# ---------------------------------------------------------------- coarsening
def test_coarsen_groups_gpt2_into_at_most_six_nodes(gpt2: Captured) -> None:
    dag = gpt2.dag
    coarse = dag.coarsen(6)
    compute = coarse.compute_nodes()
    assert 1 < len(compute) <= 6
    assert all(n.op == "group" for n in compute)
    members = [m for g in compute for m in g.members]
    assert members == [n.name for n in dag.compute_nodes()], "groups partition the compute nodes in order"
    # The coarse graph is a valid DAG (OpDag checks topological order on construction).
    assert OpDag.from_json(coarse.to_json()) == coarse
    pos = {n.name: i for i, n in enumerate(coarse.nodes)}
    assert all(pos[e.src] < pos[e.dst] for e in coarse.edges)
    assert coarse.input_names() == dag.input_names()
    assert coarse.total_flops_fwd == dag.total_flops_fwd
    assert coarse.total_param_bytes == dag.total_param_bytes
    assert dag.node(dag.output).name in coarse.node(coarse.output).members


def test_cut_points_are_the_boundaries_a_split_keeps(gpt2: Captured) -> None:
    """A boundary ``cut_points`` allows is one ``normalize_assignment`` leaves where it is;
    one it forbids would pull nodes across it (attention splits qkv into a tuple)."""
    dag = gpt2.dag
    names = [n.name for n in dag.compute_nodes()]
    allowed = dag.cut_points()
    assert len(allowed) == len(names) + 1 and allowed[0] and allowed[-1]
    assert not all(allowed)
    for k in range(1, len(names)):
        two = {name: int(i >= k) for i, name in enumerate(names)}
        assert (normalize_assignment(dag, two) == two) == allowed[k], names[k]


@pytest.mark.parametrize("max_nodes", [4, 6, 12, 24])
def test_coarse_groups_begin_only_where_a_stage_may(gpt2: Captured, max_nodes: int) -> None:
    dag = gpt2.dag
    allowed = dag.cut_points()
    coarse = dag.coarsen(max_nodes)
    assert coarse is not dag and len(coarse.compute_nodes()) <= max_nodes
    assert all(coarse.cut_points())
    start = 0
    for group in coarse.compute_nodes():
        assert allowed[start], group.name
        start += len(group.members)


def test_coarsen_is_a_no_op_when_small_enough(resnet: Captured) -> None:
    dag = resnet.dag
    assert dag.coarsen(len(dag.compute_nodes())) is dag
    with pytest.raises(ValueError):
        dag.coarsen(0)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_expanded_even_split_of_groups_is_accepted(gpt2: Captured, num_stages: int) -> None:
    dag = gpt2.dag
    coarse = dag.coarsen(6)
    groups = [g.name for g in coarse.compute_nodes()]
    coarse_assignment = {g: i * num_stages // len(groups) for i, g in enumerate(groups)}
    assignment = coarse.expand_assignment(coarse_assignment)
    assert set(assignment) == {n.name for n in dag.compute_nodes()}
    specs = split_stages(dag, assignment)
    assert len(specs) == num_stages
    assert [s.depth for s in specs] == list(range(num_stages - 1, -1, -1))
    assert specs[-1].is_loss_stage


def test_coarse_node_inputs_match_coarse_edges(gpt2: Captured) -> None:
    coarse = gpt2.dag.coarsen(6)
    from_inputs = {(src, n.name) for n in coarse.nodes for src in n.inputs}
    assert from_inputs == {(e.src, e.dst) for e in coarse.edges}


def test_split_of_the_coarse_dag_is_refused_with_the_way_out(gpt2: Captured) -> None:
    coarse = gpt2.dag.coarsen(6)
    groups = [g.name for g in coarse.compute_nodes()]
    with pytest.raises(SplitError, match="expand_assignment"):
        split_stages(coarse, {g: i * 3 // len(groups) for i, g in enumerate(groups)})


def test_value_meta_round_trips_through_dict() -> None:
    meta = ValueMeta(kind="tensor", dtype="float32", shape=(2, 3), size_bytes=24)
    assert ValueMeta.from_dict({**meta.__dict__, "shape": [2, 3]}) == meta

"""``fusion plan`` (offline, no weights) and the live coordinator (a worker's profile) estimate
a stage's memory alike: the activations each node saves for backward are counted by one rule
(:mod:`fusion.saved_activations`), on fake CPU tensors offline and on zeros in the profile."""

from __future__ import annotations

import dataclasses
import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch

import fusion
from fusion.cli.main import main
from fusion.config import load_job
from fusion.models import build_model
from fusion.profiling import profile_graph
from fusion.saved_activations import static_saved_bytes, with_static_saved_bytes
from fusion.training import build_job_dataset, build_job_model, capture_job_model, example_micro_batch
from scheduler.estimator import workload_from_dag
from scheduler.planner import make_plan, request_for_job
from scheduler.topology import Topology

pytestmark = pytest.mark.timeout(120)

JOBS = {
    "gpt2": """
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 8
        seq_len = 32
        [train]
        micro_batches = 2
        optimizer = "adamw"
    """,
    "resnet": """
        [model]
        name = "resnet"
        preset = "tiny"
        [data]
        batch_size = 8
        [train]
        micro_batches = 2
        optimizer = "sgd"
        momentum = 0.9
    """,
}

TOPOLOGY = """
[[hosts]]
name = "a"
memory_gb = {gb}
[[hosts]]
name = "b"
memory_gb = {gb}
[[links]]
from = "a"
to = "b"
bandwidth_mbps = 1000
latency_ms = 1
"""


def _job(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.toml"
    path.write_text(textwrap.dedent(JOBS[kind]))
    return path


def _offline_and_profiled(path: Path):
    """The DAG as ``fusion plan`` costs it (meta capture) and as the coordinator does (profile)."""
    spec = load_job(path)
    x, _ = example_micro_batch(spec, build_job_dataset(spec))
    torch.manual_seed(spec.train.seed)
    with torch.device("meta"):
        meta_model = build_model(spec.model.name, spec.model.preset, **spec.model.kwargs)
    offline = capture_job_model(spec, meta_model, x.to("meta"))
    live = capture_job_model(spec, build_job_model(spec), x)
    profile = profile_graph(live.graph_module, (torch.zeros_like(x),), repeats=1, warmup=0, min_time_s=0.0)
    profiled = live.dag.with_profile(profile, reference_flops=1e12)
    return spec, offline, with_static_saved_bytes(offline.dag, offline.graph_module, (x.to("meta"),)), profiled


@pytest.mark.parametrize("kind", ["gpt2", "resnet"])
def test_offline_and_profiled_saved_bytes_agree_node_by_node(tmp_path: Path, kind: str) -> None:
    spec, offline, offline_dag, profiled = _offline_and_profiled(_job(tmp_path, kind))
    ours = {n.name: n.saved_bytes for n in offline_dag.compute_nodes()}
    theirs = {n.name: n.saved_bytes for n in profiled.compute_nodes()}
    assert ours == theirs
    assert sum(ours.values()) > 0
    # Output bytes, the estimator's fallback, are not what autograd keeps.
    assert sum(ours.values()) != sum(n.out_bytes for n in offline.dag.compute_nodes())
    w_off = workload_from_dag(offline_dag, optimizer=spec.train.optimizer, momentum=spec.train.momentum)
    w_live = workload_from_dag(profiled, optimizer=spec.train.optimizer, momentum=spec.train.momentum)
    assert w_off.saved_bytes.tolist() == w_live.saved_bytes.tolist()


def test_fusion_plan_offline_plans_the_peaks_the_coordinator_plans(tmp_path: Path, capsys) -> None:
    path = _job(tmp_path, "gpt2")
    spec, offline, _, profiled = _offline_and_profiled(path)
    topo_path = tmp_path / "two.toml"
    topo_path.write_text(TOPOLOGY.format(gb=0.001))  # 1 MiB a host: the model needs both
    # The coordinator's memory figures on the offline node times (which differ: no worker
    # timed the nodes), so both plans face the same choice.
    with_profiled_memory = dataclasses.replace(
        offline.dag,
        nodes=[
            dataclasses.replace(n, saved_bytes=profiled.node(n.name).saved_bytes) if n.name in profiled else n
            for n in offline.dag.nodes
        ],
    )
    live = make_plan(with_profiled_memory, Topology.load(topo_path), request_for_job(spec))
    assert main(["plan", str(path), "--topology", str(topo_path), "--json", "--no-calibrate"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert len(planned["stages"]) == len(live.stages) == 2
    assert [s["nodes"] for s in planned["stages"]] == [list(s.nodes) for s in live.stages]
    assert [s["peak_memory_bytes"] for s in planned["stages"]] == [s.peak_memory_bytes for s in live.stages]


def test_a_graph_whose_shapes_depend_on_data_keeps_the_output_bytes_estimate(caplog) -> None:
    class Routed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x[x[:, 0] > 0]).sum() + x.sum()

    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), Routed()))
    x = torch.zeros(3, 4, device="meta")
    with pytest.raises(RuntimeError):
        static_saved_bytes(gm, (x,))
    static = fusion.export(torch.nn.Linear(4, 4), (torch.zeros(3, 4),))
    with caplog.at_level(logging.WARNING):
        dag = with_static_saved_bytes(static, gm, (x,))
    assert dag is static
    assert "estimating each node's as its output bytes" in caplog.text

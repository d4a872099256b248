"""Workers that compute on one machine (``WorkerSpec.machine``): the estimator lets their
stages take turns on it, so the planner keeps a model whole there; what workers report
(:func:`fusion.profiling.machine_id`) and how it reaches the coordinator's topology.

Expected step times follow the estimator's formula ``T = P + (M - 1) · B`` (its module
docstring), with ``B`` at least the compute per micro-batch of each machine's stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fusion.coordinator.planning import Endpoint, measured_topology
from fusion.errors import PlanError
from fusion.profiling import machine_id, measure_device
from fusion.worker import resources_message
from scheduler.estimator import estimate
from scheduler.partition import opfence_placement
from scheduler.topology import Topology, WorkerSpec
from tests.unit.test_opfence import chain_workload, make_topology


def _on_machines(topology: Topology, machines: list[str | None]) -> Topology:
    workers = tuple(dataclasses.replace(w, machine=m) for w, m in zip(topology.workers, machines, strict=True))
    return dataclasses.replace(topology, workers=workers)


def test_machine_of_groups_workers_by_label() -> None:
    topo = _on_machines(make_topology(np.full((4, 4), 1e9)), ["box", None, "box", "other"])
    assert topo.machine_of == (0, 1, 0, 2)
    assert make_topology(np.full((3, 3), 1e9)).machine_of == (0, 1, 2)  # none named: each its own


def test_two_stages_on_one_machine_take_turns() -> None:
    # Two units of 1 s forward + 2 s backward each, a free link: on two machines the
    # pipeline's period is one stage's 3 s; on one machine it is both stages' 6 s.
    wl = chain_workload([1.0, 1.0], edge_bytes=[0])
    apart = make_topology(np.full((2, 2), 1e12))
    together = _on_machines(apart, ["box", "box"])
    m = 4
    e_apart = estimate(wl, [0, 1], [0, 1], apart, micro_batches=m)
    e_together = estimate(wl, [0, 1], [0, 1], together, micro_batches=m)
    assert e_apart.bottleneck_s == pytest.approx(3.0)
    assert e_together.bottleneck_s == pytest.approx(6.0)
    critical = 1 + 1 + 2 + 2  # forward through both stages, then backward
    assert e_apart.step_s == pytest.approx(critical + (m - 1) * 3.0)
    assert e_together.step_s == pytest.approx(critical + (m - 1) * 6.0)
    # Two stages on the same worker share it too, without any label.
    assert estimate(wl, [0, 1], [0, 0], apart, micro_batches=m).bottleneck_s == pytest.approx(6.0)


def test_opfence_keeps_the_model_whole_on_one_machine() -> None:
    wl = chain_workload([0.1] * 8, edge_bytes=[1000] * 7)
    apart = make_topology(np.full((2, 2), 1.25e8), latency_s=0.001)
    placement, _ = opfence_placement(wl, apart, micro_batches=4, schedule="1f1b", time_budget_s=2.0)
    assert placement.num_stages == 2  # two machines: a pipeline halves the period
    together = _on_machines(apart, ["box", "box"])
    placement, _ = opfence_placement(wl, together, micro_batches=4, schedule="1f1b", time_budget_s=2.0)
    assert placement.num_stages == 1  # one machine: splitting only adds transfers


def test_machine_survives_toml_and_json() -> None:
    text = """
    [[hosts]]
    name = "a"
    machine = "rack-1"
    [[hosts]]
    name = "b"
    machine = "rack-1"
    [[hosts]]
    name = "c"
    [[links]]
    from = "a"
    to = "b"
    bandwidth_mbps = 1000
    latency_ms = 1
    [[links]]
    from = "a"
    to = "c"
    bandwidth_mbps = 1000
    latency_ms = 1
    [[links]]
    from = "b"
    to = "c"
    bandwidth_mbps = 1000
    latency_ms = 1
    """
    topo = Topology.from_toml(text)
    assert [w.machine for w in topo.workers] == ["rack-1", "rack-1", None]
    assert topo.machine_of == (0, 0, 1)
    back = Topology.from_json(topo.to_json())
    assert back == topo and back.machine_of == topo.machine_of
    assert "machine" not in Topology.from_toml(text.replace('machine = "rack-1"', "")).to_dict()["workers"][0]


@pytest.mark.parametrize("bad", ["", 3])
def test_bad_machine_is_refused(bad: object) -> None:
    with pytest.raises(PlanError, match="machine must be a non-empty string"):
        WorkerSpec(name="w", cluster="c", machine=bad)  # type: ignore[arg-type]


def test_machine_id_is_the_boot_id_and_the_device(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("0f1e2d3c-aaaa-bbbb-cccc-000000000001\n")
    assert machine_id("cpu", boot_id_path=str(boot)) == "0f1e2d3c-aaaa-bbbb-cccc-000000000001/cpu"
    assert machine_id("cpu", boot_id_path=str(tmp_path / "missing")).startswith("host:")
    assert machine_id("cpu").endswith("/cpu") and machine_id("cpu") == machine_id("cpu")
    if torch.cuda.is_available():  # two GPUs in one box are two devices
        assert machine_id("cuda:0") != machine_id("cpu")


def test_reported_machine_reaches_the_planners_topology() -> None:
    profile = measure_device("cpu", machine="lab-box-7")
    message = resources_message(profile)
    assert message.machine == "lab-box-7"
    from google.protobuf.json_format import MessageToDict

    resources = MessageToDict(message, preserving_proto_field_name=True)  # as the coordinator stores it
    a = Endpoint.from_registration("a", "10.0.0.1:5000", resources)
    b = Endpoint.from_registration("b", "10.0.0.2:5000", resources | {"machine": "other-box"})
    old = Endpoint.from_registration("c", "10.0.0.3:5000", {k: v for k, v in resources.items() if k != "machine"})
    assert (a.machine, b.machine, old.machine) == ("lab-box-7", "other-box", None)
    assert a.matmul_flops == pytest.approx(profile.matmul_flops)
    lat = [[0.0] * 3 for _ in range(3)]
    bw = [[1e9] * 3 for _ in range(3)]
    topo = measured_topology([a, b, old], lat, bw)
    assert [w.machine for w in topo.workers] == ["lab-box-7", "other-box", None]
    assert topo.machine_of == (0, 1, 2)

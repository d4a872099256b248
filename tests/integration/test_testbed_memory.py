"""Testbeds honour memory and run job owners' models: ``testbeds.bench --allow-code`` on loopback.

The command lines both launchers build (``python -m testbeds run`` and ``testbeds.bench``)
carry each host's ``memory_gb`` as ``--memory-gb`` and ``--allow-code``, and parse as
``testbeds.worker``'s flags. Then the bench itself, on the proxy backend (loopback, no root),
runs a job owner's own ``module:factory`` model that lives outside the repository, found
through the ``PYTHONPATH`` the bench was started with; each host lends 2 MiB, less than the
model's 2.9 MB of parameters and AdamW state, so the model must span both hosts.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from fusion.cli.worker import build_parser
from fusion.memory import gb_to_bytes
from scheduler.topology import Topology
from testbeds.net.launch import host_memory_gb, worker_command
from testbeds.net.testbed import TOPOLOGY_DIR
from testbeds.worker import add_emulation_args
from tests.support.bench import run_bench

OWNER_MODEL = """
import torch.nn as nn


def build(hidden: int = 256, num_classes: int = 4, in_features: int = 192) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden), nn.GELU(),
        nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, num_classes),
    )
"""

TOPOLOGY = """
[[hosts]]
name = "h1"
memory_gb = 0.002

[[hosts]]
name = "h2"
memory_gb = 0.002

[[links]]
from = "h1"
to = "h2"
bandwidth_mbps = 1000
latency_ms = 1
"""

JOB = """
name = "owner-model"
[model]
name = "owner_mlp_{tag}:build"
[data]
name = "shapes"
batch_size = 8
image_size = 8
num_classes = 4
num_samples = 64
[train]
steps = 3
micro_batches = 2
optimizer = "adamw"
lr = 0.001
"""


def test_each_hosts_memory_gb_is_shared_by_its_workers() -> None:
    t = Topology.load(TOPOLOGY_DIR / "two-sites.toml")
    assert host_memory_gb(t, "b-1") == pytest.approx(6.0)
    assert host_memory_gb(t, "a-1", workers_per_host=2) == pytest.approx(8.0)
    uncapped = Topology.from_toml(TOPOLOGY.replace("memory_gb = 0.002\n", ""))
    assert host_memory_gb(uncapped, "h1") is None


@pytest.mark.parametrize(("memory_gb", "allow_code"), [(6.0, True), (None, False)])
def test_a_testbed_workers_command_line_lends_the_hosts_memory(memory_gb: float | None, allow_code: bool) -> None:
    argv = worker_command(
        coordinator="127.0.0.1:5000",
        token_file=Path("/tmp/token"),
        name="b-1",
        listen="127.0.0.1:0",
        torch_threads=1,
        machine_flops=1e11,
        slowdown=2.0,
        memory_gb=memory_gb,
        allow_code=allow_code,
    )
    assert argv[:2] == ["-m", "testbeds.worker"]
    assert ("--allow-code" in argv) == allow_code
    parser = build_parser(prog="python -m testbeds.worker")
    add_emulation_args(parser)
    args = parser.parse_args(argv[2:])
    assert args.memory_gb == memory_gb and args.allow_code == allow_code and args.emulate_slowdown == 2.0
    if memory_gb is not None:
        assert gb_to_bytes(args.memory_gb) == 6 << 30


@pytest.mark.timeout(400)
def test_bench_runs_an_owners_model_split_by_the_hosts_memory(tmp_path: Path) -> None:
    tag = os.urandom(4).hex()  # a module name no other process could have cached
    owner = tmp_path / "owner"
    owner.mkdir()
    (owner / f"owner_mlp_{tag}.py").write_text(textwrap.dedent(OWNER_MODEL))
    proc = run_bench(  # the owner's module is found through PYTHONPATH only
        tmp_path,
        topology=TOPOLOGY,
        job=JOB.format(tag=tag),
        systems=["fusion"],
        extra=["--steps", "3", "--warmup", "0", "--allow-code", "--timeout", "240", "--json"],
        python_path=[owner],
    )
    fusion = json.loads(proc.stdout)["systems"]["fusion"]
    print(json.dumps({k: fusion[k] for k in ("hosts_used", "losses", "note")}))
    assert fusion["note"] == "", fusion["note"]
    assert len(fusion["losses"]) == 3 and fusion["final_loss"] is not None
    # 2 MiB a host: no host holds the model's 2.9 MB of state, so it spans both.
    assert sorted(fusion["hosts_used"]) == ["h1", "h2"], fusion

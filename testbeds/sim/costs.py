"""What the simulator prices a job and reports a system with: the job's costed DAG and fixed
step costs (:class:`JobCosts`, from a profile here, a benchmark's recorded profile or FLOPs)
and one system's predicted step (:class:`SystemResult`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fusion.config import JobSpec
from fusion.errors import FusionError
from fusion.graph.ir import OpDag
from scheduler.estimator import StepCosts, Workload, workload_from_dag
from scheduler.topology import Topology
from testbeds.sim.block_split import block_names
from testbeds.sim.topologies import MBPS

SYSTEMS = ("fusion", "uniform", "ddp", "pipelining")

#: Executor overheads when none are given: the calibration of ``fusion profile`` on this
#: 2-core machine (GPT-2 tiny, loopback) measured about 6 ms of driver round trips per step
#: and 1.5 ms of mailbox/hand-off work per micro-batch and stage.
DEFAULT_CONTROL_S = 6e-3
DEFAULT_MICRO_BATCH_S = 1.5e-3


# ---------------------------------------------------------------- job costs
@dataclass
class JobCosts:
    """A job's model as the simulator sees it: the costed DAG and the fixed step costs."""

    spec: JobSpec
    dag: OpDag
    """Compute nodes with per-micro-batch times at ``dag.reference_flops``."""
    step: StepCosts
    blocks: list[str]
    """The model's repeated blocks (for the pipelining split)."""
    tokens_per_sample: int
    """Tokens in one sample (sequence length) for language models, else 0."""
    costs: str
    """``profile`` or ``flops``."""
    buffer_bytes: int = 0
    """The model's buffers (BatchNorm's running statistics): DDP broadcasts them from rank 0
    before every forward."""

    @property
    def target_bytes(self) -> int:
        """Bytes of one micro-batch's targets (the driver sends them to the loss stage)."""
        return self.step.target_bytes

    @property
    def reference_flops(self) -> float:
        return float(self.dag.reference_flops or 1.0e12)

    def workload(self) -> Workload:
        return workload_from_dag(
            self.dag, optimizer=self.spec.train.optimizer, momentum=self.spec.train.momentum, step=self.step
        )


def job_costs(
    spec: JobSpec,
    *,
    costs: str = "profile",
    step: StepCosts | None = None,
    repeats: int = 3,
    profile: dict[str, Any] | None = None,
) -> JobCosts:
    """Capture the job's model and cost every node: profiled here, taken from ``profile``
    (``{"nodes", "matmul_flops", "optimizer_s_per_byte", "compute_factor"}`` as the
    coordinator measured and calibrated them during a benchmark), or from FLOPs."""
    import torch

    from fusion.graph.export import capture
    from fusion.models import build_model
    from fusion.profiling import (
        measure_matmul_flops,
        measure_optimizer_s_per_byte,
        profile_graph,
        scale_node_times,
    )
    from fusion.training import build_job_dataset, build_job_model, example_micro_batch

    if costs not in ("profile", "flops"):
        raise FusionError(f"unknown costs {costs!r}: use profile or flops")
    x, y = example_micro_batch(spec, build_job_dataset(spec))
    tokens = int(x.shape[1]) if x.dim() == 2 and not x.is_floating_point() else 0
    if costs == "profile":
        model = build_job_model(spec)
        captured = capture(model, (x,))
        if profile is None:
            torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one thread per worker, as the testbeds run them
            try:
                profile = {
                    "nodes": profile_graph(captured.graph_module, (x,), repeats=repeats),
                    "matmul_flops": measure_matmul_flops(torch.device("cpu")),
                    "optimizer_s_per_byte": measure_optimizer_s_per_byte(spec.train.optimizer, numel=1 << 22),
                }
            finally:
                torch.set_num_threads(torch_threads)
        nodes = scale_node_times(
            profile["nodes"], profile.get("compute_factor") or 1.0
        )  # as the coordinator calibrated them
        dag = captured.dag.with_profile(nodes, reference_flops=float(profile["matmul_flops"]))
        opt_s = float(profile["optimizer_s_per_byte"])
    else:
        torch.manual_seed(spec.train.seed)
        with torch.device("meta"):
            model = build_model(spec.model.name, spec.model.preset, **spec.model.kwargs)
        dag = capture(model, (x.to("meta"),)).dag
        opt_s = 0.0
    base = step or StepCosts(control_s=DEFAULT_CONTROL_S, micro_batch_s=DEFAULT_MICRO_BATCH_S)
    if base.optimizer_s_per_byte == 0.0:
        base = dataclasses.replace(base, optimizer_s_per_byte=opt_s)
    base = dataclasses.replace(base, target_bytes=y.numel() * y.element_size())
    return JobCosts(
        spec=spec,
        dag=dag,
        step=base,
        blocks=block_names(model),
        tokens_per_sample=tokens,
        costs=costs,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
    )


# ---------------------------------------------------------------- systems
@dataclass
class SystemResult:
    """One system's predicted step."""

    name: str
    step_s: float | None
    """Predicted seconds per step; ``None`` when the system does not apply (see ``note``)."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    slowest_link_bytes: int = 0
    """Bytes per step (both directions) over the slowest link (lowest bandwidth) the system
    sends over; the busiest one if several are as slow."""
    slowest_link_mbps: float | None = None
    """That link's bandwidth in Mbit/s (``None``: the system uses no link)."""
    hosts_used: int = 0
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def with_throughput(result: SystemResult, job: JobCosts) -> SystemResult:
    """``result`` with samples (and tokens) per second from its step time."""
    if result.step_s is not None and result.step_s > 0:
        batch = job.spec.data.batch_size
        result.samples_per_s = batch / result.step_s
        if job.tokens_per_sample:
            result.tokens_per_s = batch * job.tokens_per_sample / result.step_s
    return result


def slowest_link(topology: Topology, link_bytes: dict[tuple[int, int], float]) -> tuple[int, float | None]:
    """(bytes per step, both directions, on the busiest of the lowest-bandwidth host pairs in
    ``link_bytes``; that bandwidth in Mbit/s)."""
    pairs: dict[frozenset[int], float] = {}
    bw: dict[frozenset[int], float] = {}
    for (a, b), size in link_bytes.items():
        if a == b or size <= 0:
            continue
        pair = frozenset((a, b))
        pairs[pair] = pairs.get(pair, 0.0) + size
        bw[pair] = min(topology.bandwidth_bytes_per_s[a][b], topology.bandwidth_bytes_per_s[b][a])
    if not pairs:
        return 0, None
    slowest = min(bw.values())
    return int(max(v for p, v in pairs.items() if bw[p] == slowest)), slowest / MBPS

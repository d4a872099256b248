"""The benchmark's systems: what each one is, the job it runs, the hosts it runs on.

- Fleet systems run a real coordinator and workers (:class:`testbeds.bench.fusion_fleet.FusionFleet`),
  with the job's ``[plan]`` and ``[compression]`` set by :func:`system_job`:
  ``fusion`` (OP-Fence + the job's own compression), ``fusion-dense`` (OP-Fence, no
  compression), ``uniform`` (even split in join order, dense; blind to the caps, so a plan
  refused for memory runs again with the micro-batches the refusal advises,
  :meth:`~testbeds.bench.fusion_fleet.FusionFleet.run_as_advised`) and ``compute``
  (compute-balanced, blind to links, dense). ``fusion-grpc`` is ``fusion`` on a second
  fleet whose workers run ``--no-data-plane``: tensors over the gRPC port only, the data
  plane's before and after in one run. ``fusion-quant8``, ``fusion-quant4``, ``fusion-topk``,
  ``fusion-topk-quant`` and ``fusion-adatopk`` run OP-Fence with one fixed compression
  setting each (:data:`CODEC_SYSTEMS`). These are not in the default list.
- Rank systems start one torch process per host over gloo (:mod:`testbeds.bench.baselines`):
  ``ddp``, ``pipelining`` (GPipe, even split over the first hosts in join order),
  ``pipelining-best`` (GPipe over :func:`best_pipeline_hosts`) and ``fsdp`` (FSDP2, one
  rank per host, each holding 1/N of the state).

``pipelining-best`` is the placement a skilled user makes by hand. The hosts are grouped by
the topology file's ``cluster`` (a host without one is its own cluster); the clusters are
chained, starting at the first host's (where the job owner and the data are), in the order
whose consecutive cluster-to-cluster links have the least total ``1 / bandwidth`` (every
order is tried up to :data:`MAX_EXHAUSTIVE` clusters, nearest-fastest-neighbour beyond), so
the chain crosses each slow link it needs once and takes the slowest ones last or never.
Each cluster's hosts follow one another in file order. The pipeline takes the first ``k``
hosts of that chain, ``k`` the fewest (at least 2) whose smallest ``memory_gb`` holds an
even share of the model's training state with :data:`STAGE_HEADROOM` for activations; a
topology without caps gets every host the model has blocks for. The estimate leaves out
GPipe's stash of every micro-batch's activations, so the benchmark, as a user would, runs
it again on one more host of the chain while a rank's measured peak exceeds its host's cap.

``ddp`` keeps a whole replica on every host: when the model's parameters, gradients and
optimizer state (:func:`state_bytes`) exceed the smallest cap, it does not run and says
:func:`ddp_infeasible`'s note, with the bytes it would need per host.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch

from fusion.config import JobSpec
from fusion.memory import format_bytes
from scheduler.topology import Topology

logger = logging.getLogger(__name__)

#: The systems run by default, in the order the table lists them.
SYSTEMS = ("fusion", "fusion-dense", "uniform", "compute", "pipelining", "pipelining-best", "fsdp", "ddp")
#: Fixed compression settings run as ``fusion-NAME`` systems (OP-Fence with the job's
#: ``[compression]`` replaced by these keys), to set every codec beside AdaTopK and dense in
#: one run (issue 28): 8- and 4-bit quantization, top-k at 10 %, top-k at 10 % with 4-bit values.
CODEC_SYSTEMS: dict[str, dict[str, object]] = {
    "quant8": {"mode": "quant", "bits": 8},
    "quant4": {"mode": "quant", "bits": 4},
    "topk": {"mode": "topk", "keep_ratio": 0.1},
    "topk-quant": {"mode": "topk-quant", "keep_ratio": 0.1, "bits": 4},
    "adatopk": {"mode": "adatopk"},
}
#: Systems run only when named.
EXTRA_SYSTEMS = ("fusion-grpc", *(f"fusion-{name}" for name in CODEC_SYSTEMS))
#: Fleet systems whose workers move tensors over gRPC only (``fusion-worker --no-data-plane``).
GRPC_ONLY_SYSTEMS = frozenset({"fusion-grpc"})
#: Systems run by the coordinator and workers: ``system -> (plan strategy, [compression]
#: keys)``; ``None`` keeps the job's own compression.
_DENSE = {"mode": "none"}
FLEET_SYSTEMS: dict[str, tuple[str, dict[str, object] | None]] = {
    "fusion": ("opfence", None),
    "fusion-dense": ("opfence", _DENSE),
    "uniform": ("uniform", _DENSE),
    "compute": ("compute", _DENSE),
    "fusion-grpc": ("opfence", None),
    **{f"fusion-{name}": ("opfence", keys) for name, keys in CODEC_SYSTEMS.items()},
}
#: Rank systems and the module each rank runs.
RANK_MODULES = {
    "ddp": "testbeds.bench.baselines.ddp",
    "pipelining": "testbeds.bench.baselines.pipelining",
    "pipelining-best": "testbeds.bench.baselines.pipelining",
    "fsdp": "testbeds.bench.baselines.fsdp",
}
#: The dense systems whose final loss is every system's target loss (``time_to_target_s``):
#: the first of these the run has (GPipe placed by hand; else fusion's own dense run, the
#: baseline a compression cell is judged against).
TARGET_SYSTEMS = ("pipelining-best", "fusion-dense")
#: Clusters up to this many are chained by trying every order.
MAX_EXHAUSTIVE = 8
#: A stage's memory over its share of the training state (activations, buffers).
STAGE_HEADROOM = 1.5
#: Optimizer state per parameter, in parameter copies.
_OPTIMIZER_SLOTS = {"adamw": 2, "adam": 2, "sgd": 1}


def system_job(spec: JobSpec, system: str, *, steps: int, num_hosts: int, out_dir: object) -> JobSpec:
    """The job as ``system`` runs it: a fleet system's plan strategy and compression
    (:data:`FLEET_SYSTEMS`); a rank system's job is dense, its plan untouched."""
    plan, compression = FLEET_SYSTEMS.get(system, ("opfence", _DENSE))
    return spec.replace(
        train={"steps": steps},
        plan={"strategy": plan},
        compression=compression or {},
        cluster={"min_workers": num_hosts},
        output={"dir": str(out_dir)},
    )


def state_bytes(spec: JobSpec, model: torch.nn.Module | None = None) -> int:
    """Bytes of the job's parameters, their gradients and its optimizer's state: what a
    whole replica holds between steps (activations not counted)."""
    if model is None:
        from fusion.training import build_job_model

        model = build_job_model(spec)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    slots = _OPTIMIZER_SLOTS.get(str(spec.train.optimizer).lower(), 2)
    return int(params * (2 + slots))


def host_caps(topology: Topology) -> dict[str, int | None]:
    """Each host's ``memory_gb`` in bytes (``None``: uncapped)."""
    return {w.name: w.memory_bytes for w in topology.workers}


def ddp_infeasible(needed_bytes: int, topology: Topology) -> str | None:
    """The note when a whole replica (``needed_bytes``) does not fit every host's cap, else ``None``."""
    caps = [c for c in host_caps(topology).values() if c is not None]
    if not caps or needed_bytes <= min(caps):
        return None
    return (
        f"infeasible: needs {format_bytes(needed_bytes)} per host (parameters, gradients, optimizer state), "
        f"hosts lend {format_bytes(min(caps))}" + (f" to {format_bytes(max(caps))}" if max(caps) != min(caps) else "")
    )


def _cluster_bandwidth(topology: Topology, a: list[int], b: list[int]) -> float:
    bw = topology.bandwidth_bytes_per_s
    return min(min(bw[i][j], bw[j][i]) for i in a for j in b)


def cluster_chain(topology: Topology) -> list[str]:
    """Hosts ordered so each cluster's hosts are consecutive and the cluster chain, from the
    first host's cluster, crosses the fastest inter-cluster links it can (module docstring)."""
    clusters = topology.clusters()
    labels = list(clusters)
    first, rest = labels[0], labels[1:]

    def cost(order: tuple[str, ...]) -> float:
        return sum(1.0 / _cluster_bandwidth(topology, clusters[x], clusters[y]) for x, y in itertools.pairwise(order))

    if len(labels) <= MAX_EXHAUSTIVE:
        order = min(((first, *p) for p in itertools.permutations(rest)), key=cost)
    else:
        chain, left = [first], set(rest)
        while left:
            nxt = max(sorted(left), key=lambda c: _cluster_bandwidth(topology, clusters[chain[-1]], clusters[c]))
            chain.append(nxt)
            left.remove(nxt)
        order = tuple(chain)
    names = topology.names()
    return [names[i] for label in order for i in clusters[label]]


def best_pipeline_hosts(topology: Topology, needed_bytes: int, max_stages: int, *, min_stages: int = 2) -> list[str]:
    """``pipelining-best``'s hosts, stage 0 first: the fewest hosts of :func:`cluster_chain`
    (``min_stages`` to ``max_stages``) whose smallest cap holds an even share of
    ``needed_bytes`` with :data:`STAGE_HEADROOM`; all ``max_stages`` when none does or no
    host is capped."""
    chain = cluster_chain(topology)
    caps = host_caps(topology)
    top = max(2, min(max_stages, len(chain)))
    for k in range(max(2, min_stages), top + 1):
        lent = [caps[h] for h in chain[:k]]
        if all(c is not None for c in lent) and math.ceil(needed_bytes * STAGE_HEADROOM / k) <= min(lent):
            return chain[:k]
    return chain[:top]

"""OP-Fence steps 3–5: cut the DAG, place the parts on workers, refine by local search.

A *placement* is a contiguous segmentation of the DAG's compute units (in topological
order) into stages, plus the worker of each stage. Contiguous ranges of one topological
order can never make the stage graph cyclic, and they still allow general DAG cuts: a
value produced on stage 0 and read on stage 3 is sent there directly.

Construction (:func:`opfence_placement`):

1. The worker sequence follows the cluster chain (fast clusters first, workers inside a
   cluster fastest first). Prefixes of the chain are candidates: leaving a cluster behind
   a slow link out is often the best use of it.
2. For each candidate sequence, a bisection on the pipeline period ``B`` finds the
   smallest ``B`` for which a greedy pass can cover the DAG: each worker in turn takes the
   longest run of units whose compute fits in ``B`` on that worker and its memory, ending
   at a cut whose transfer to the next worker also fits in ``B``. Cuts therefore land
   where the crossing tensors are small, and slow links get only small tensors.
3. The best candidates (by the full estimator) are refined by local search on the
   predicted step time: shift a boundary, swap two stages' workers, move a stage to an
   unused worker, merge two neighbours, split a stage onto an unused worker. Best move
   first, until none improves or the time budget ends.

Infeasible inputs (the model does not fit in the workers' memory) raise ``PlanError``
naming the binding constraint.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fusion.errors import PlanError
from scheduler.estimator import OPTIMIZER_STATE_FACTOR, Estimate, Workload, estimate
from scheduler.fence import cluster_workers, order_clusters
from scheduler.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Stages as unit ranges ``[bounds[s], bounds[s+1])`` and the worker of each stage."""

    bounds: tuple[int, ...]
    """``0 = b_0 < b_1 < … < b_S = num_units``."""
    workers: tuple[int, ...]
    """Topology index of each stage's worker (distinct)."""

    @property
    def num_stages(self) -> int:
        return len(self.workers)

    def unit_stage(self, num_units: int) -> np.ndarray:
        out = np.empty(num_units, dtype=np.int64)
        for s in range(self.num_stages):
            out[self.bounds[s] : self.bounds[s + 1]] = s
        return out


class Objective:
    """Predicted step time of placements (memory violations are infinitely bad), memoised."""

    def __init__(self, workload: Workload, topology: Topology, *, micro_batches: int, schedule: str) -> None:
        self.workload = workload
        self.topology = topology
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.evaluations = 0
        self._cache: dict[Placement, float] = {}

    def estimate(self, p: Placement) -> Estimate:
        return estimate(
            self.workload, p.unit_stage(len(self.workload)), p.workers, self.topology,
            micro_batches=self.micro_batches, schedule=self.schedule,
        )

    def __call__(self, p: Placement) -> float:
        cached = self._cache.get(p)
        if cached is not None:
            return cached
        self.evaluations += 1
        est = self.estimate(p)
        value = est.step_s
        for w, need in est.peak_memory_bytes.items():
            cap = self.topology.workers[w].memory_bytes
            if cap is not None and need > cap:
                value = math.inf
                break
        self._cache[p] = value
        return value


# ---------------------------------------------------------------- greedy cover
class _Prefix:
    """Prefix sums over units for O(1) segment costs in the greedy pass."""

    def __init__(self, workload: Workload, micro_batches: int, schedule: str, num_workers: int) -> None:
        n = len(workload)
        self.n = n
        self.time = np.concatenate([[0.0], np.cumsum(workload.fwd_s + workload.bwd_s)])
        unit_params = np.array([sum(size for _, size in u) for u in workload.params], dtype=np.float64)
        self.params = np.concatenate([[0.0], np.cumsum(unit_params)])
        self.saved = np.concatenate([[0.0], np.cumsum(workload.saved_bytes + workload.input_bytes)])
        self.cut = cut_bytes(workload)
        self.grad_cut = cut_bytes(workload, grad=True)
        self.factor = 2.0 + OPTIMIZER_STATE_FACTOR[workload.optimizer]
        self.inflight = micro_batches if schedule == "gpipe" else min(micro_batches, num_workers)
        self.ref = workload.reference_flops

    def seconds(self, start: int, end: int, flops: float) -> float:
        return float(self.time[end] - self.time[start]) * self.ref / flops

    def memory(self, start: int, end: int) -> float:
        return self.factor * float(self.params[end] - self.params[start]) + self.inflight * (
            float(self.saved[end] - self.saved[start]) + float(self.cut[start])
        )


def cut_bytes(workload: Workload, *, grad: bool = False) -> np.ndarray:
    """Bytes crossing a cut placed before unit ``k`` (values made before ``k``, read at or after it)."""
    n = len(workload)
    last_use: dict[int, int] = {}
    size_of: dict[int, int] = {}
    for src, dst, size, gsize in workload.edges:
        last_use[src] = max(last_use.get(src, src), dst)
        size_of[src] = gsize if grad else size
    delta = np.zeros(n + 1)
    for src, last in last_use.items():
        delta[src + 1] += size_of[src]
        delta[last + 1] -= size_of[src]
    return np.cumsum(delta)


def greedy_cover(prefix: _Prefix, workers: Sequence[int], topology: Topology, period: float, *, use_links: bool = True) -> Placement | None:
    """Cover all units with stages on ``workers`` (in order, skipping any that cannot help)
    so that every stage's compute and every cut's transfer fits in ``period``."""
    pos = 0
    bounds = [0]
    chosen: list[int] = []
    for i, w in enumerate(workers):
        if pos == prefix.n:
            break
        spec = topology.workers[w]
        nxt = workers[i + 1] if i + 1 < len(workers) else None
        end = pos
        best = -1
        while end < prefix.n:
            end += 1
            if prefix.seconds(pos, end, spec.effective_flops) > period:
                break
            if spec.memory_bytes is not None and prefix.memory(pos, end) > spec.memory_bytes:
                break
            if end == prefix.n:
                best = end
                break
            if nxt is None:
                continue
            if use_links:
                t = max(topology.transfer_s(w, nxt, prefix.cut[end]), topology.transfer_s(nxt, w, prefix.grad_cut[end]))
                if t > period:
                    continue
            best = end
        if best <= pos:
            continue  # this worker cannot take the next unit within the period: skip it
        bounds.append(best)
        chosen.append(w)
        pos = best
    if pos != prefix.n:
        return None
    return Placement(tuple(bounds), tuple(chosen))


def bisect_period(prefix: _Prefix, workers: Sequence[int], topology: Topology, *, use_links: bool = True, iterations: int = 40) -> Placement | None:
    """The greedy cover with the smallest period found by bisection (log scale)."""
    fastest = max(topology.workers[w].effective_flops for w in workers)
    hi = prefix.seconds(0, prefix.n, min(topology.workers[w].effective_flops for w in workers)) * 2 + 1e-6
    if use_links:
        hi += max((topology.transfer_s(a, b, float(prefix.cut.max())) for a in workers for b in workers if a != b), default=0.0)
    lo = max(prefix.seconds(k, k + 1, fastest) for k in range(prefix.n)) * 0.999
    best = greedy_cover(prefix, workers, topology, hi, use_links=use_links)
    if best is None:
        return None
    lo = max(lo, 1e-12)
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        got = greedy_cover(prefix, workers, topology, mid, use_links=use_links)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi / lo < 1.001:
            break
    return best


# ---------------------------------------------------------------- local search
def neighbours(p: Placement, num_units: int, unused: Sequence[int]) -> list[Placement]:
    """Every placement one move away."""
    out: list[Placement] = []
    b, w = list(p.bounds), list(p.workers)
    s_count = len(w)
    for i in range(1, s_count):  # shift a boundary
        for d in (-1, 1):
            nb = b[i] + d
            if b[i - 1] < nb < b[i + 1]:
                out.append(Placement(tuple(b[:i] + [nb] + b[i + 1 :]), p.workers))
    for i in range(s_count):  # swap two stages' workers
        for j in range(i + 1, s_count):
            nw = w.copy()
            nw[i], nw[j] = nw[j], nw[i]
            out.append(Placement(p.bounds, tuple(nw)))
    for i in range(s_count):  # move a stage to an unused worker
        for u in unused:
            nw = w.copy()
            nw[i] = u
            out.append(Placement(p.bounds, tuple(nw)))
    for i in range(1, s_count):  # merge stage i-1 and i, keeping either worker
        nb = tuple(b[:i] + b[i + 1 :])
        out.append(Placement(nb, tuple(w[:i] + w[i + 1 :])))
        out.append(Placement(nb, tuple(w[: i - 1] + w[i:])))
    for i in range(s_count):  # split a stage onto an unused worker (either side)
        if b[i + 1] - b[i] >= 2 and unused:
            mid = (b[i] + b[i + 1]) // 2
            nb = tuple(b[: i + 1] + [mid] + b[i + 1 :])
            for u in unused[:4]:
                out.append(Placement(nb, tuple(w[: i + 1] + [u] + w[i + 1 :])))
                out.append(Placement(nb, tuple(w[:i] + [u] + w[i:])))
    return out


def local_search(start: Placement, objective: Objective, all_workers: Sequence[int], *, deadline: float) -> Placement:
    """Best-improvement descent on the predicted step time until no move helps (or time is up)."""
    current, value = start, objective(start)
    n = len(objective.workload)
    while time.monotonic() < deadline:
        unused = [x for x in all_workers if x not in set(current.workers)]
        best, best_value = current, value
        for cand in neighbours(current, n, unused):
            v = objective(cand)
            if v < best_value - 1e-12:
                best, best_value = cand, v
            if time.monotonic() > deadline:
                break
        if best is current:
            break
        current, value = best, best_value
    return current


# ---------------------------------------------------------------- planners
def worker_chain(topology: Topology, candidates: Sequence[int] | None = None) -> tuple[list[int], list[list[int]]]:
    """Workers in OP-Fence order (cluster chain, fastest first inside a cluster), and the clusters."""
    clusters = cluster_workers(topology)
    order = order_clusters(topology, clusters)
    chain: list[int] = []
    for c in order:
        chain += sorted(clusters[c], key=lambda w: -topology.workers[w].effective_flops)
    if candidates is not None:
        allowed = set(candidates)
        chain = [w for w in chain if w in allowed]
    return chain, [clusters[c] for c in order]


def opfence_placement(
    workload: Workload,
    topology: Topology,
    *,
    micro_batches: int,
    schedule: str,
    time_budget_s: float = 10.0,
) -> tuple[Placement, dict[str, object]]:
    """OP-Fence: fence, order, cut, place, refine. Returns the placement and planner details."""
    deadline = time.monotonic() + time_budget_s
    objective = Objective(workload, topology, micro_batches=micro_batches, schedule=schedule)
    chain, clusters = worker_chain(topology)
    prefix = _Prefix(workload, micro_batches, schedule, len(chain))
    candidates: list[Placement] = []
    cluster_prefixes = [sum(len(c) for c in clusters[: k + 1]) for k in range(len(clusters))]
    for size in sorted(set(cluster_prefixes)):
        p = bisect_period(prefix, chain[:size], topology)
        if p is not None:
            candidates.append(p)
    # A single stage on the fastest worker that fits is always a candidate too.
    for w in sorted(range(len(topology)), key=lambda w: -topology.workers[w].effective_flops)[:1]:
        candidates.append(Placement((0, len(workload)), (w,)))
    feasible = [c for c in candidates if math.isfinite(objective(c))]
    if not feasible:
        raise PlanError(infeasibility_reason(workload, topology, micro_batches, schedule))
    feasible.sort(key=objective)
    best = feasible[0]
    for cand in feasible[:3]:
        refined = local_search(cand, objective, chain, deadline=deadline)
        if objective(refined) < objective(best):
            best = refined
    details = {
        "clusters": [[topology.workers[w].name for w in c] for c in clusters],
        "evaluations": objective.evaluations,
        "candidates": len(candidates),
    }
    return best, details


def compute_placement(workload: Workload, topology: Topology, *, micro_batches: int, schedule: str) -> Placement:
    """The ``compute`` baseline: balance compute over all workers in join order, ignore links."""
    workers = list(range(len(topology)))
    prefix = _Prefix(workload, micro_batches, schedule, len(workers))
    best = bisect_period(prefix, workers, topology, use_links=False)
    if best is None or not math.isfinite(Objective(workload, topology, micro_batches=micro_batches, schedule=schedule)(best)):
        raise PlanError(infeasibility_reason(workload, topology, micro_batches, schedule))
    return best


def exhaustive_placement(
    workload: Workload, topology: Topology, *, micro_batches: int, schedule: str, max_evaluations: int = 2_000_000
) -> Placement:
    """The optimum under the estimator over all contiguous segmentations and worker mappings.

    Only for small instances: the space has ``Σ_k C(n-1, k-1)·P(W, k)`` placements.
    """
    n, num_workers = len(workload), len(topology)
    size = sum(math.comb(n - 1, k - 1) * math.perm(num_workers, k) for k in range(1, min(n, num_workers) + 1))
    if size > max_evaluations:
        raise PlanError(f"exhaustive search over {size} placements is too large (limit {max_evaluations}); use opfence")
    objective = Objective(workload, topology, micro_batches=micro_batches, schedule=schedule)
    best: Placement | None = None
    best_value = math.inf
    for k in range(1, min(n, num_workers) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for workers in itertools.permutations(range(num_workers), k):
                p = Placement(bounds, workers)
                v = objective(p)
                if v < best_value:
                    best, best_value = p, v
    if best is None or not math.isfinite(best_value):
        raise PlanError(infeasibility_reason(workload, topology, micro_batches, schedule))
    return best


def infeasibility_reason(workload: Workload, topology: Topology, micro_batches: int, schedule: str) -> str:
    """Why no placement fits: the binding memory constraint, in numbers."""
    factor = 2.0 + OPTIMIZER_STATE_FACTOR[workload.optimizer]
    caps = [w.memory_bytes for w in topology.workers]
    if any(c is None for c in caps):
        return "no placement satisfies the constraints (a worker has no memory cap, so this is unexpected)"
    total_cap = sum(c for c in caps if c is not None)
    state = factor * workload.total_param_bytes
    biggest = max(caps, key=lambda c: c or 0) or 0
    unit_need = [factor * sum(size for _, size in u) + workload.saved_bytes[i] for i, u in enumerate(workload.params)]
    worst = int(np.argmax(unit_need))
    gib = 2**30
    if unit_need[worst] > biggest:
        return (
            f"the model cannot fit: unit {workload.names[worst]!r} alone needs {unit_need[worst] / gib:.2f} GiB "
            f"(parameters, gradients, optimizer state and activations) but the largest worker has {biggest / gib:.2f} GiB"
        )
    return (
        f"the model cannot fit: parameters, gradients and {workload.optimizer} state need {state / gib:.2f} GiB "
        f"plus activations for {micro_batches} micro-batches ({schedule}), but the {len(caps)} workers have "
        f"{total_cap / gib:.2f} GiB in total; add workers, use fewer micro-batches or a smaller model"
    )


PlacementFn = Callable[..., Placement]

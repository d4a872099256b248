"""OP-Fence steps 3–5: cut the DAG, place the parts on workers, refine by local search.

A *placement* is a contiguous segmentation of the DAG's compute units (in topological
order) into stages, plus the worker of each stage. Contiguous ranges of one topological
order can never make the stage graph cyclic, and they still allow general DAG cuts: a
value produced on stage 0 and read on stage 3 is sent there directly.

Construction (:func:`opfence_placement`):

1. The worker sequence follows the cluster chain (from the driver's cluster when its links
   are known, workers inside a cluster fastest first). Prefixes of the chain are
   candidates: leaving a cluster behind a slow link out is often the best use of it. So is
   each distinct cluster on its own, and one stage on a single worker.
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

from fusion.errors import InsufficientMemoryError, PlanError
from fusion.memory import format_bytes
from scheduler.estimator import OPTIMIZER_STATE_FACTOR, Estimate, Workload, estimate
from scheduler.fence import cluster_workers, order_clusters
from scheduler.topology import Topology

logger = logging.getLogger(__name__)


#: Up to this many workers, a one-stage plan on each of them is a candidate.
SMALL_SINGLES = 64

#: Seconds of penalty per fraction of a memory cap a placement exceeds.
MEMORY_PENALTY_S = 1.0e6


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
        self._feasible: dict[Placement, bool] = {}

    def estimate(self, p: Placement) -> Estimate:
        return estimate(
            self.workload,
            p.unit_stage(len(self.workload)),
            p.workers,
            self.topology,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
        )

    def __call__(self, p: Placement) -> float:
        """Predicted step seconds, plus a penalty far above any step time per fraction of a
        memory cap exceeded (so the search can walk out of infeasible placements)."""
        cached = self._cache.get(p)
        if cached is not None:
            return cached
        self.evaluations += 1
        est = self.estimate(p)
        over = 0.0
        for w, need in est.peak_memory_bytes.items():
            cap = self.topology.workers[w].memory_bytes
            if cap is not None and need > cap:
                over += (need - cap) / cap
        value = est.step_s + MEMORY_PENALTY_S * over
        self._cache[p] = value
        self._feasible[p] = over == 0.0
        return value

    def feasible(self, p: Placement) -> bool:
        """Whether every worker's predicted peak fits its memory cap."""
        self(p)
        return self._feasible[p]

    def best_wider(self, chosen: Placement) -> tuple[Placement | None, bool]:
        """The fastest feasible placement evaluated so far with more stages than ``chosen``
        (``None`` if there is none), and whether any placement with more stages was tried."""
        wider = [p for p in self._cache if p.num_stages > chosen.num_stages]
        fits = [p for p in wider if self._feasible[p]]
        return (min(fits, key=self._cache.__getitem__) if fits else None), bool(wider)


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
        self.output_unit = workload.output_unit if workload.output_unit >= 0 else n - 1
        self.cuttable = workload.cuttable
        self.output_bytes = workload.output_bytes

    def seconds(self, start: int, end: int, flops: float) -> float:
        return float(self.time[end] - self.time[start]) * self.ref / flops

    def memory(self, start: int, end: int) -> float:
        """Parameters with gradients and optimizer state, plus per micro-batch in flight the
        saved activations, the received inputs, the sent outputs and (loss stage) the model
        output with the loss's own saved tensors — as :func:`scheduler.estimator.estimate`."""
        stash = float(self.saved[end] - self.saved[start]) + float(self.cut[start]) + float(self.cut[end])
        if start <= self.output_unit < end:
            stash += 2 * self.output_bytes
        return self.factor * float(self.params[end] - self.params[start]) + self.inflight * stash


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


def greedy_cover(
    prefix: _Prefix, workers: Sequence[int], topology: Topology, period: float, *, use_links: bool = True
) -> Placement | None:
    """Cover all units with stages on ``workers`` (in order, skipping any that cannot help)
    so that every stage's compute and every cut's transfer fits in ``period``, cutting only
    where a stage may begin (``Workload.cuttable``).

    Each step is a binary search on the prefix sums (compute and memory grow with the
    segment) plus one vectorised scan for the farthest cut whose transfer fits.
    """
    pos = 0
    bounds = [0]
    chosen: list[int] = []
    n = prefix.n
    for i, w in enumerate(workers):
        if pos == n:
            break
        spec = topology.workers[w]
        # Farthest end with compute <= period: time[end] <= time[pos] + period * flops / ref.
        budget = prefix.time[pos] + period * spec.effective_flops / prefix.ref
        end = int(np.searchsorted(prefix.time, budget, side="right")) - 1
        if spec.memory_bytes is not None:
            end = min(end, _memory_end(prefix, pos, spec.memory_bytes))
        end = min(end, n)
        if end <= pos:
            continue  # this worker cannot take the next unit within the period: skip it
        if end < n:
            nxt = workers[i + 1] if i + 1 < len(workers) else None
            if nxt is None:
                return None
            ok = prefix.cuttable[pos + 1 : end + 1]
            if use_links:
                fwd_cap = _bytes_within(topology, w, nxt, period)
                bwd_cap = _bytes_within(topology, nxt, w, period)
                ok = ok & (prefix.cut[pos + 1 : end + 1] <= fwd_cap) & (prefix.grad_cut[pos + 1 : end + 1] <= bwd_cap)
            hits = np.nonzero(ok)[0]
            if len(hits) == 0:
                continue
            end = pos + 1 + int(hits[-1])
        bounds.append(end)
        chosen.append(w)
        pos = end
    if pos != n:
        return None
    return Placement(tuple(bounds), tuple(chosen))


def _memory_end(prefix: _Prefix, pos: int, cap: float) -> int:
    """Farthest end whose segment [pos, end) fits in ``cap`` bytes (memory grows with end)."""
    lo, hi = pos, prefix.n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix.memory(pos, mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _bytes_within(topology: Topology, i: int, j: int, period: float) -> float:
    """Most bytes link ``i -> j`` moves within ``period`` seconds."""
    lat = topology.latency_s[i][j]
    return max(period - lat, 0.0) * topology.bandwidth_bytes_per_s[i][j] if period > lat else -1.0


def bisect_period(
    prefix: _Prefix, workers: Sequence[int], topology: Topology, *, use_links: bool = True, iterations: int = 40
) -> Placement | None:
    """The greedy cover with the smallest period found by bisection (log scale)."""
    fastest = max(topology.workers[w].effective_flops for w in workers)
    hi = prefix.seconds(0, prefix.n, min(topology.workers[w].effective_flops for w in workers)) * 2 + 1e-6
    if use_links:
        hi += max(
            (topology.transfer_s(a, b, float(prefix.cut.max())) for a in workers for b in workers if a != b),
            default=0.0,
        )
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
        if hi / lo < 1.002:
            break
    return best


# ---------------------------------------------------------------- local search
#: Above this many stages, only neighbouring stages swap workers (keeps a round linear).
ALL_PAIRS_SWAP_LIMIT = 12
#: Unused workers tried per move (the fastest ones).
UNUSED_TRIED = 4
#: A boundary with at most this many positions between its neighbours tries them all.
BOUNDARY_SCAN_LIMIT = 32


def boundary_moves(p: Placement, cuttable: np.ndarray) -> list[Placement]:
    """Placements with one boundary moved (anywhere between its neighbours, or log-spaced)
    to a position where a stage may begin."""
    out: list[Placement] = []
    b = list(p.bounds)
    for i in range(1, len(p.workers)):
        lo, hi = b[i - 1] + 1, b[i + 1] - 1
        if hi - lo <= BOUNDARY_SCAN_LIMIT:
            positions: Sequence[int] = range(lo, hi + 1)
        else:  # far apart: ±1, ±2, ±4, … so a round stays cheap
            steps = [2**k for k in range(int(math.log2(hi - lo)) + 1)]
            positions = sorted({min(hi, max(lo, b[i] + d)) for k in steps for d in (k, -k)})
        for nb in positions:
            if nb != b[i] and cuttable[nb]:
                out.append(Placement(tuple(b[:i] + [nb] + b[i + 1 :]), p.workers))
    return out


def worker_moves(p: Placement, unused: Sequence[int], cuttable: np.ndarray) -> list[Placement]:
    """Placements with the workers changed: swap two stages' workers, move a stage to a spare
    worker, merge two neighbouring stages, split a stage onto a spare worker (at the position
    nearest its middle where a stage may begin)."""
    out: list[Placement] = []
    b, w = list(p.bounds), list(p.workers)
    s_count = len(w)
    unused = list(unused)[:UNUSED_TRIED]
    for i in range(s_count):
        for j in range(i + 1, s_count if s_count <= ALL_PAIRS_SWAP_LIMIT else min(i + 2, s_count)):
            nw = w.copy()
            nw[i], nw[j] = nw[j], nw[i]
            out.append(Placement(p.bounds, tuple(nw)))
    for i in range(s_count):
        for u in unused:
            nw = w.copy()
            nw[i] = u
            out.append(Placement(p.bounds, tuple(nw)))
    for i in range(1, s_count):
        nb = tuple(b[:i] + b[i + 1 :])
        out.append(Placement(nb, tuple(w[:i] + w[i + 1 :])))
        out.append(Placement(nb, tuple(w[: i - 1] + w[i:])))
    for i in range(s_count if unused else 0):
        inside = np.nonzero(cuttable[b[i] + 1 : b[i + 1]])[0] + b[i] + 1
        if len(inside):
            mid = int(inside[np.argmin(np.abs(inside - (b[i] + b[i + 1]) / 2))])
            nb = tuple(b[: i + 1] + [mid] + b[i + 1 :])
            for u in unused:
                out.append(Placement(nb, tuple(w[: i + 1] + [u] + w[i + 1 :])))
                out.append(Placement(nb, tuple(w[:i] + [u] + w[i:])))
    return out


def _descend(
    start: Placement, objective: Objective, moves: Callable[[Placement], list[Placement]], deadline: float
) -> Placement:
    current, value = start, objective(start)
    while time.monotonic() < deadline:
        best, best_value = current, value
        for cand in moves(current):
            v = objective(cand)
            if v < best_value - 1e-12:
                best, best_value = cand, v
        if best is current:
            return current
        current, value = best, best_value
    return current


def local_search(start: Placement, objective: Objective, all_workers: Sequence[int], *, deadline: float) -> Placement:
    """Iterated descent on the predicted step time.

    Descend with every move; when stuck, try each worker move *followed by* a descent over
    boundary moves (a swap often only pays once the cuts follow it) and continue from the
    first that improves. Stops when nothing improves or the time is up.
    """

    cuttable = objective.workload.cuttable

    def spare(p: Placement) -> list[int]:
        used = set(p.workers)
        return [x for x in all_workers if x not in used]

    def boundaries(p: Placement) -> list[Placement]:
        return boundary_moves(p, cuttable)

    def every_move(p: Placement) -> list[Placement]:
        return boundary_moves(p, cuttable) + worker_moves(p, spare(p), cuttable)

    current = _descend(start, objective, every_move, deadline)
    while time.monotonic() < deadline:
        value = objective(current)
        improved = False
        for cand in worker_moves(current, spare(current), cuttable):
            if time.monotonic() > deadline:
                break
            settled = _descend(cand, objective, boundaries, deadline)
            if objective(settled) < value - 1e-12:
                current = _descend(settled, objective, every_move, deadline)
                improved = True
                break
        if not improved:
            break
    return current


# ---------------------------------------------------------------- planners
def _cluster_signature(topology: Topology, sequence: Sequence[int]) -> tuple:
    """What makes two clusters interchangeable for planning: speeds, memory, the links
    inside and the driver's links (so 32 identical A100 racks are tried once)."""
    workers = tuple(
        (topology.workers[w].effective_flops, topology.workers[w].memory_bytes, topology.driver_link(w))
        for w in sequence
    )
    links = tuple(
        sorted(
            (topology.bandwidth_bytes_per_s[a][b], topology.latency_s[a][b])
            for a in sequence
            for b in sequence
            if a != b
        )
    )
    return workers, links


def worker_chain(topology: Topology, candidates: Sequence[int] | None = None) -> tuple[list[int], list[list[int]]]:
    """Workers in OP-Fence order (cluster chain, fastest first inside a cluster), and the clusters."""
    clusters = cluster_workers(topology)
    # The chain starts where the driver is: the first stage reads its inputs from there.
    nearest = topology.nearest_to_driver()
    start = next((k for k, c in enumerate(clusters) if nearest in c), None) if nearest is not None else None
    order = order_clusters(topology, clusters, start=start)
    chain: list[int] = []
    for c in order:
        chain += sorted(clusters[c], key=lambda w: (-topology.workers[w].effective_flops, topology.driver_link(w)[0]))
    if candidates is not None:
        allowed = set(candidates)
        chain = [w for w in chain if w in allowed]
    return chain, [clusters[c] for c in order]


def _reversed_clusters(sequence: list[int], clusters: Sequence[Sequence[int]]) -> list[int]:
    """The same workers with the cluster chain walked the other way (fast-first inside each)."""
    member = set(sequence)
    out: list[int] = []
    for c in reversed(clusters):
        out += [w for w in sequence if w in set(c) and w in member]
    return out


def candidate_sizes(clusters: Sequence[Sequence[int]], num_units: int) -> list[int]:
    """How many workers of the chain to offer the greedy cut: whole-cluster prefixes.

    Up to 16 clusters every prefix is tried; beyond, prefixes whose worker count at least
    doubles (plus the whole chain), so the number of candidates grows logarithmically.
    """
    sizes = [sum(len(c) for c in clusters[: k + 1]) for k in range(len(clusters))]
    if len(sizes) > 16:
        picked, last = [], 0
        for size in sizes:
            if size >= 2 * last or size == sizes[-1]:
                picked.append(size)
                last = size
        sizes = picked
    # Also powers of two: a big first cluster is worth trying with fewer of its workers.
    total = sizes[-1] if sizes else 0
    sizes += [2**i for i in range(1, int(math.log2(max(total, 1))) + 1)]
    # The greedy skips workers it cannot use, so offering more workers than units still helps
    # (it may pick faster ones), but long tails beyond that only cost time.
    return sorted({min(s, total, max(num_units * 2, 1)) for s in sizes})


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
    candidates: list[Placement] = []
    for size in candidate_sizes(clusters, len(workload)):
        # Under 1F1B a stage keeps at most as many micro-batches in flight as there are
        # stages: price memory for this many workers, not the whole chain's (which would
        # refuse a split over 8 GPUs because 48 micro-batches could not fit).
        prefix = _Prefix(workload, micro_batches, schedule, size)
        for sequence in (chain[:size], _reversed_clusters(chain[:size], clusters)):
            p = bisect_period(prefix, sequence, topology)
            if p is not None:
                candidates.append(p)
    # Each cluster on its own as well (one of each kind): the best island for a model that
    # fits a few workers need not be the head of the chain (8 A100s on 10 Gbps behind a
    # big 1 Gbps cluster with more total compute).
    seen: set[tuple] = set()
    for members in map(set, clusters[1:]):
        sequence = [w for w in chain if w in members]
        signature = _cluster_signature(topology, sequence)
        if len(sequence) < 2 or signature in seen:
            continue
        seen.add(signature)
        for size in sorted({min(2**i, len(sequence)) for i in range(1, int(math.log2(len(sequence))) + 2)}):
            p = bisect_period(_Prefix(workload, micro_batches, schedule, size), sequence[:size], topology)
            if p is not None:
                candidates.append(p)
    # A single stage is always a candidate too: on the fastest worker, and on the one next
    # to the driver (on small topologies, on every worker).
    singles = sorted(range(len(topology)), key=lambda w: -topology.workers[w].effective_flops)
    singles = singles if len(singles) <= SMALL_SINGLES else singles[:1]
    nearest = topology.nearest_to_driver()
    for w in dict.fromkeys(singles + ([nearest] if nearest is not None else [])):
        candidates.append(Placement((0, len(workload)), (w,)))
    candidates.sort(key=objective)
    best = candidates[0]
    for cand in candidates[: 3 if len(workload) * len(topology) > SMALL_REFINE_ALL else len(candidates)]:
        refined = local_search(cand, objective, chain, deadline=deadline)
        if objective(refined) < objective(best):
            best = refined
    if not objective.feasible(best) and exhaustive_size(len(workload), len(topology)) <= SMALL_INSTANCE:
        try:  # small enough to settle exactly whether anything fits
            best = exhaustive_placement(workload, topology, micro_batches=micro_batches, schedule=schedule)
        except PlanError:
            pass
    if not objective.feasible(best):
        raise infeasible(workload, topology, micro_batches, schedule)
    details: dict[str, object] = {
        "clusters": [[topology.workers[w].name for w in c] for c in clusters],
        "evaluations": objective.evaluations,
        "candidates": len(candidates),
    }
    if best.num_stages < len(topology):
        wider, tried = objective.best_wider(best)
        # The runner-up with more workers, for saying why the plan leaves some out.
        details["wider"] = (
            {"bounds": list(wider.bounds), "workers": list(wider.workers)} if wider is not None else {"tried": tried}
        )
    return best, details


def compute_placement(workload: Workload, topology: Topology, *, micro_batches: int, schedule: str) -> Placement:
    """The ``compute`` baseline: balance compute over all workers in join order, ignore links."""
    workers = list(range(len(topology)))
    prefix = _Prefix(workload, micro_batches, schedule, len(workers))
    best = bisect_period(prefix, workers, topology, use_links=False)
    if best is None or not Objective(workload, topology, micro_batches=micro_batches, schedule=schedule).feasible(best):
        raise infeasible(workload, topology, micro_batches, schedule)
    return best


def exhaustive_placement(
    workload: Workload, topology: Topology, *, micro_batches: int, schedule: str, max_evaluations: int = 2_000_000
) -> Placement:
    """The optimum under the estimator over all contiguous segmentations (cut where a stage
    may begin) and worker mappings.

    Only for small instances: the space has ``Σ_k C(n-1, k-1)·P(W, k)`` placements.
    """
    n, num_workers = len(workload), len(topology)
    size = exhaustive_size(n, num_workers)
    if size > max_evaluations:
        raise PlanError(f"exhaustive search over {size} placements is too large (limit {max_evaluations}); use opfence")
    objective = Objective(workload, topology, micro_batches=micro_batches, schedule=schedule)
    best: Placement | None = None
    best_value = math.inf
    positions = [k for k in range(1, n) if workload.cuttable[k]]
    for k in range(1, min(n, num_workers) + 1):
        for cuts in itertools.combinations(positions, k - 1):
            bounds = (0, *cuts, n)
            for workers in itertools.permutations(range(num_workers), k):
                p = Placement(bounds, workers)
                v = objective(p)
                if v < best_value:
                    best, best_value = p, v
    if best is None or not objective.feasible(best):
        raise infeasible(workload, topology, micro_batches, schedule)
    return best


#: Below this many (units × workers), local search starts from every candidate, not the best 3.
SMALL_REFINE_ALL = 200

#: Up to this many placements, OP-Fence settles an infeasible search exactly.
SMALL_INSTANCE = 200_000


def exhaustive_size(num_units: int, num_workers: int) -> int:
    """Placements the exhaustive planner enumerates: ``Σ_k C(n-1, k-1)·P(W, k)``."""
    return sum(
        math.comb(num_units - 1, k - 1) * math.perm(num_workers, k) for k in range(1, min(num_units, num_workers) + 1)
    )


#: The advice :func:`memory_advice` gives under 1F1B (``testbeds.bench`` follows it, as a user would).
MORE_MICRO_BATCHES = "use more micro-batches"


def memory_advice(schedule: str) -> str:
    """What lowers a plan's activation memory, for the errors that say a plan does not fit.

    Under 1F1B a stage of depth ``d`` holds at most ``min(d + 1, m)`` of the ``m``
    micro-batches at once (:func:`scheduler.estimator.estimate`), each ``1/m`` of the batch:
    its activations are ``min(d + 1, m) / m`` of the batch's, which more micro-batches lower
    and fewer never do. GPipe stashes all ``m``: the whole batch whatever ``m`` is.
    """
    if schedule == "gpipe":
        return "use a smaller batch (GPipe stashes every micro-batch, however many) or the 1f1b schedule"
    return f"{MORE_MICRO_BATCHES} (1F1B holds only a few at once, so smaller ones need less memory)"


def infeasibility_reason(workload: Workload, topology: Topology, micro_batches: int, schedule: str) -> str:
    """Why no placement fits: the binding memory constraint, in numbers."""
    return str(infeasible(workload, topology, micro_batches, schedule))


def infeasible(workload: Workload, topology: Topology, micro_batches: int, schedule: str) -> PlanError:
    """The error for a job no placement fits: an :class:`InsufficientMemoryError` naming the
    memory the job needs against what the workers lend (a plain :class:`PlanError` when a
    worker has no cap, which no memory shortfall explains)."""
    factor = 2.0 + OPTIMIZER_STATE_FACTOR[workload.optimizer]
    caps = [w.memory_bytes for w in topology.workers]
    if any(c is None for c in caps):
        return PlanError("no placement satisfies the constraints (a worker has no memory cap, so this is unexpected)")
    lent = [int(c) for c in caps if c is not None]
    total_cap = sum(lent)
    state = factor * workload.total_param_bytes
    biggest = max(lent, default=0)
    unit_need = [factor * sum(size for _, size in u) + workload.saved_bytes[i] for i, u in enumerate(workload.params)]
    worst = int(np.argmax(unit_need))
    activations = float(np.sum(workload.saved_bytes)) * (micro_batches if schedule == "gpipe" else 1)
    needed = int(max(state + activations, total_cap + 1))

    def error(message: str, needed_bytes: float) -> InsufficientMemoryError:
        lent_text = f"{len(lent)} worker{'s' if len(lent) != 1 else ''} lend {format_bytes(total_cap)}"
        return InsufficientMemoryError(
            f"{message} (needed: {format_bytes(needed_bytes)}; lent: {lent_text})",
            needed_bytes=int(needed_bytes),
            lent_bytes=total_cap,
            num_workers=len(lent),
        )

    if unit_need[worst] > biggest:
        return error(
            f"the model cannot fit: unit {workload.names[worst]!r} alone needs {format_bytes(unit_need[worst])} "
            "(parameters, gradients, optimizer state and activations) "
            f"but the largest worker has {format_bytes(biggest)}; add a worker with more memory "
            "(fusion-worker --memory-gb) or use a smaller model",
            max(needed, total_cap - biggest + unit_need[worst]),
        )
    if state + activations > total_cap:
        return error(
            f"the model cannot fit: parameters, gradients and {workload.optimizer} state need {format_bytes(state)} "
            f"plus at least {format_bytes(activations)} of activations ({micro_batches} micro-batches, {schedule}), "
            f"but the {len(lent)} workers have {format_bytes(total_cap)} in total; add workers, "
            f"{memory_advice(schedule)}, or use a smaller model",
            state + activations,
        )
    return error(
        f"no placement found that fits every worker's memory: the model needs {format_bytes(state)} for parameters, "
        f"gradients and {workload.optimizer} state plus activations and stashed transfers per micro-batch in flight; "
        f"the {len(lent)} workers have {format_bytes(total_cap)} in total (largest {format_bytes(biggest)}), too "
        f"fragmented for the cuts; add workers with more memory or {memory_advice(schedule)}",
        needed,
    )

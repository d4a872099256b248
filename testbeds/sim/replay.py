"""An event replay of one training step as fusion's executor runs it.

The estimator's closed form (``T = P + (M - 1)·B``) assumes a pipeline in steady state.
A short pipeline over links with latency never reaches one, and three things of the real
executor decide its step instead (each seen in a traced two-sites run):

- **the schedule's fixed order**: a stage runs its action list (``executor.schedule``)
  strictly in order, so under 1F1B a backward whose gradient has arrived still waits for
  the forward before it, whose input may be on the slow link;
- **paced sends per destination**: a stage's transfers to one stage start in order, each
  once the bytes of the one before it have left at the link's bandwidth
  (``executor.sender.PeerSender``), without waiting for answers; the data arrives after the
  executors' path, the one-way latency and the bytes, and the stage is done once its last
  send is answered (with :attr:`~scheduler.topology.Topology.paced_sends` false, as runs
  before pacing sent, each transfer waits for the answer of the one before it);
- **the driver's path**: ``RunStep`` and the feed leave together (a stage holds a feed
  that comes before its ``RunStep``), the feed to each stage is paced as a stage's sends are (one synchronous
  send after another where sends are not paced), each stage exchanges its tied gradients
  and runs its optimizer step on its own once its schedule is done (priced after the
  slowest stage), and the driver hears a stage is done half a round trip after it is (and
  after its last send was answered).

Compute is list-scheduled: a stage's action starts when its inputs are in and its machine
has a free core (``cores`` per machine; stages on one machine take turns beyond that). A
worker with an emulated ``slowdown`` (:mod:`testbeds.emulation`) holds its core for
``1 / slowdown`` of its compute and sleeps the rest, leaving the core to the others.
Everything else is priced as :mod:`scheduler.estimator` prices it, from the same
:class:`~scheduler.estimator.StageGraph`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from executor.schedule import stage_actions
from scheduler.estimator import (
    StageGraph,
    Workload,
    answer_s,
    link_busy_s,
    optimizer_s,
    stage_graph,
    tied_sync_s,
)
from scheduler.topology import Topology
from testbeds.sim.machine import TransferInterference, overlap_share


@dataclass(frozen=True)
class Replay:
    """One replayed step."""

    step_s: float
    """Seconds from the driver's ``RunStep`` until it has heard that every stage finished
    the step (its schedule, tied-gradient exchange and optimizer update)."""
    stages_done_s: tuple[float, ...]
    """When the driver heard each stage had finished (its compute and its sends)."""
    tied_s: float
    apply_s: float
    compute_s: tuple[float, ...] = ()
    """Each stage's forward and backward seconds over the step (emulated stretch and pause
    costs included): what its executor would report as ``compute_s``."""
    finished_s: tuple[float, ...] = ()
    """When each stage had computed and its sends were answered (before the driver hears)."""
    run_step_s: float = 0.0
    """When every stage had answered the driver's ``RunStep`` (the feed does not wait for it)."""
    fed_s: dict[int, float] = field(default_factory=dict)
    """Per stage the driver feeds: when the last of its inputs and targets arrived."""


class _SendQueue:
    """One sender's transfers to one destination, in order: each starts once the one before
    it has released the link (paced: its bytes have left; else: its answer is back) or, as
    :class:`executor.sender.PeerSender` does, its answer is back if that is sooner (only
    when a link is slower than its bytes: not with the topology's own bandwidths)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        """When the last transfer started releases the link."""
        self.last_answer_at = 0.0
        """When the answer to the last transfer started is back."""
        self.answered_at = 0.0
        """When the last answer of the transfers so far is back."""

    def send(self, ready: float, one_way_s: float, busy_s: float, back_s: float) -> float:
        """Start a transfer no earlier than ``ready``; ``one_way_s`` until its data arrives
        (its bytes included), ``busy_s`` holding the link, ``back_s`` more for its answer;
        returns when it arrives."""
        start = max(ready, min(self.free_at, self.last_answer_at))
        self.free_at = start + busy_s
        self.last_answer_at = start + one_way_s + back_s
        self.answered_at = max(self.answered_at, self.last_answer_at)
        return start + one_way_s


def replay_step(
    workload: Workload,
    unit_stage: Sequence[int],
    stage_workers: Sequence[int],
    topology: Topology,
    *,
    micro_batches: int,
    schedule: str = "1f1b",
    cores: int = 1,
    pause_cost: Callable[[float, bool], float] | None = None,
    transfer_cost: Callable[[float, float], float] | None = None,
    interference: TransferInterference | None = None,
    emulation: str = "wall",
) -> Replay:
    """Replay one step of a placement (the arguments are :func:`scheduler.estimator.estimate`'s).

    ``cores``: stages whose workers share a machine compute at once on up to this many
    cores (1: one at a time, as the estimator assumes). ``pause_cost(pause_s, others_busy)``:
    seconds a computation takes beyond its profiled time when its worker has been off the
    core that long, with another core of its machine computing or not
    (:class:`testbeds.sim.machine.PauseCost`); an emulated device stretches that too.
    ``transfer_cost(bytes, pause_s)``: seconds the sending and receiving executors spend on
    a transfer beyond the wire, by how long the pair has been quiet before it.
    ``interference``: what a transfer costs a computation of its sender or receiver that it
    overlaps (:class:`testbeds.sim.machine.TransferInterference`). The sender works on it
    for the first half of its path time, the receiver for the second; a computation pays the
    share of that work that falls while it is on the core (stretched on an emulated
    device). Where that work falls depends on the placement it changes, so the replay runs
    again with the spans the last pass placed until they no longer move (``MAX_PASSES`` at
    most; in the benchmark runs 2-9 passes).

    ``emulation``: how the run's emulated devices stretched (:mod:`testbeds.emulation`).
    ``wall``: a computation takes ``slowdown`` times what it takes here, pause cost and
    interference included. ``profile``: it takes what it takes here (on the core, with those
    costs), then ``slowdown - 1`` times its profiled seconds asleep.

    Pauses are counted per stage (since its process last computed, a wait for a busy core
    included) and per sending pair (since its last answer); the probe cannot tell whether it
    is the idle core or the process's cold data that costs, and this is the reading that
    matches it (one process sleeping, then timed). A step starts just after every stage ran
    the previous step's optimizer update, so the pause before a stage's first action, and
    the quiet before a pair's first transfer, is the time since the step began.
    """
    sg = stage_graph(workload, unit_stage, stage_workers, topology)
    slept = profiled_sleep_s(workload, sg, stage_workers, topology) if emulation == "profile" else None
    spans: list[list[_Span]] | None = None
    replay = None
    for _ in range(MAX_PASSES if interference is not None else 1):
        replay, found = _replay_pass(
            sg,
            workload,
            stage_workers,
            topology,
            micro_batches,
            schedule,
            cores,
            pause_cost,
            transfer_cost,
            interference,
            spans,
            slept,
        )
        if spans is not None and found == spans:
            break
        spans = found
    assert replay is not None
    return replay


def profiled_sleep_s(
    workload: Workload, sg: StageGraph, stage_workers: Sequence[int], topology: Topology
) -> list[tuple[float, float] | None]:
    """Per stage, the (forward, backward) seconds a ``profile``-emulated worker sleeps after
    each micro-batch's computation: ``slowdown - 1`` times the stage's profiled seconds
    (``None`` for a worker not emulated)."""
    fwd, bwd = workload.stage_seconds(sg.stage_of, sg.num_stages)
    out: list[tuple[float, float] | None] = []
    for s, x in enumerate(stage_workers):
        k = topology.workers[x].slowdown - 1.0
        out.append((k * float(fwd[s]), k * float(bwd[s])) if k > 0 else None)
    return out


_Span = tuple[float, float, float]
"""(from, to, seconds): a transfer's work in a stage's process, and what it costs a
computation of that stage it lies wholly inside."""

#: Passes of the replay with transfer interference: each charges the computations with the
#: transfers the last one placed, until the placement no longer moves.
MAX_PASSES = 12


def _replay_pass(
    sg: StageGraph,
    workload: Workload,
    stage_workers: Sequence[int],
    topology: Topology,
    micro_batches: int,
    schedule: str,
    cores: int,
    pause_cost: Callable[[float, bool], float] | None,
    transfer_cost: Callable[[float, float], float] | None,
    interference: TransferInterference | None,
    spans: list[list[_Span]] | None,
    slept: list[tuple[float, float] | None] | None = None,
) -> tuple[Replay, list[list[_Span]]]:
    """One pass of :func:`replay_step`; ``spans``: per stage, the transfer work the last pass
    placed there, which the computations it overlaps now pay; ``slept``: what a ``profile``
    emulation sleeps after each (:func:`profiled_sleep_s`). Returns the replay and this
    pass's spans."""
    n, m = sg.num_stages, micro_batches
    w = list(stage_workers)
    found: list[list[_Span]] = [[] for _ in range(n)]
    rtt = [topology.driver_link(x)[0] if topology.driver_links is not None else 0.0 for x in w]
    # RunStep reaches each stage after half its round trip; the feed leaves with it.
    feed_in = _feed(sg, w, topology, workload.step.target_bytes, m, start=0.0)
    actions = [stage_actions(schedule, num_micro_batches=m, depth=sg.depth[s]) for s in range(n)]
    producers = {s: [a for (a, c) in sg.act if c == s] for s in range(n)}
    consumers = {s: [c for (a, c) in sg.act if a == s] for s in range(n)}
    arrived: dict[tuple[str, int, int, int], float] = {}  # (kind, src, dst, micro-batch) -> time
    queues = {(a, c): _SendQueue() for a in range(n) for c in range(n) if a != c}
    machine = [topology.machine_of[x] for x in w]
    on_core = [1.0 / topology.workers[x].slowdown for x in w]  # the rest of an emulated device's compute is a sleep
    cores_free = {k: [0.0] * max(1, cores) for k in set(machine)}
    free = [r / 2 for r in rtt]
    last_on_core = [0.0] * n  # when each stage's process last stopped computing
    computed = [0.0] * n
    nxt = [0] * n

    def inputs_at(s: int) -> float | None:
        act = actions[s][nxt[s]]
        mb = act.micro_batch_idx
        if act.kind == "F":
            keys = [("act", a, s, mb) for a in producers[s]]
            base = feed_in[s][mb]
        else:
            keys = [("grad", c, s, mb) for c in consumers[s] if sg.grad[(s, c)]]
            base = 0.0
        if any(k not in arrived for k in keys):
            return None
        return max([free[s], base, *(arrived[k] for k in keys)])

    for _ in range(sum(len(a) for a in actions)):
        ready = [(t, s) for s in range(n) if nxt[s] < len(actions[s]) and (t := inputs_at(s)) is not None]
        t, s = min(ready)  # the earliest startable action: nothing unscheduled can start before it
        act = actions[s][nxt[s]]
        pool = cores_free[machine[s]]
        start = max(t, heapq.heappop(pool))
        compute = sg.fwd_s[s] if act.kind == "F" else sg.bwd_s[s]
        sleep_for = slept[s] if slept is not None else None
        if sleep_for is not None:  # profile emulation: on the core as here, then the profile's sleep
            overhead = workload.step.micro_batch_s / 2
            oncore, stretch = (compute - overhead) * on_core[s] + overhead, 0.0
            asleep = sleep_for[0] if act.kind == "F" else sleep_for[1]
        else:  # wall emulation: what it costs here is stretched too
            oncore, stretch = compute * on_core[s], 1.0 / on_core[s] - 1.0
            asleep = compute - oncore
        if pause_cost is not None:
            others_busy = any(busy_until > start for busy_until in pool)
            extra = pause_cost(start - last_on_core[s], others_busy)
            oncore, asleep = oncore + extra, asleep + extra * stretch
        if spans is not None:  # the transfer work the last pass placed in this process while it is on the core
            extra = sum(cost * overlap_share(start, start + oncore, t0, t1) for t0, t1, cost in spans[s])
            oncore, asleep = oncore + extra, asleep + extra * stretch
        compute = oncore + asleep
        end = start + compute
        computed[s] += compute
        last_on_core[s] = start + oncore
        heapq.heappush(pool, last_on_core[s])
        free[s] = end
        nxt[s] += 1
        mb = act.micro_batch_idx
        if act.kind == "F":
            sends = [(("act", s, c, mb), c, sg.act[(s, c)]) for c in consumers[s]]
        else:
            sends = [(("grad", s, a, mb), a, sg.grad[(a, s)]) for a in producers[s] if sg.grad[(a, s)]]
        for key, dst, size in sends:
            left, path_s, arrived[key] = _send(queues[(s, dst)], end, topology, w[s], w[dst], size, transfer_cost)
            if interference is not None and w[s] != w[dst]:  # the sender's half of the path, then the receiver's
                found[s].append((left, left + path_s / 2, interference.send(size)))
                found[dst].append((arrived[key] - path_s / 2, arrived[key], interference.receive(size)))
    # A stage answers the driver's wait once its compute is done and its sends are answered.
    finished = tuple(max([free[s], *(q.answered_at for (a, _), q in queues.items() if a == s)]) for s in range(n))
    done = tuple(f + rtt[s] / 2 for s, f in enumerate(finished))
    tied = tied_sync_s(sg, w, topology)
    # The optimizer step is not emulated (testbeds.emulation stretches forward and backward only).
    unemulated = dataclasses.replace(sg, scale=sg.scale / np.array([topology.workers[x].slowdown for x in w]))
    apply = optimizer_s(workload, unemulated)  # on the stages, before they answer the wait
    step = max(done, default=0.0) + tied + apply + workload.step.control_s
    fed = {
        s: max(feed_in[s])
        for s in range(n)
        if sg.feed_bytes(s, workload.step.target_bytes) and topology.driver_links is not None
    }
    replay = Replay(
        step_s=float(step),
        stages_done_s=done,
        tied_s=tied,
        apply_s=apply,
        compute_s=tuple(computed),
        finished_s=finished,
        run_step_s=max(rtt, default=0.0),
        fed_s=fed,
    )
    return replay, found


def _send(
    queue: _SendQueue,
    ready: float,
    topology: Topology,
    src: int,
    dst: int,
    size: float,
    path_cost: Callable[[float, float], float] | None,
) -> tuple[float, float, float]:
    """One transfer through ``queue``; ``path_cost(size, pause)``: the executors' own work
    on it, by how long the pair has been quiet (:class:`testbeds.sim.machine.TransferPathCost`).
    Returns when it leaves, that path time, and when its data arrives."""
    if src == dst:
        return ready, 0.0, ready
    path_s = path_cost(size, max(ready - queue.answered_at, 0.0)) if path_cost is not None else 0.0
    left = max(ready, queue.free_at)
    one_way, back = path_s + topology.transfer_s(src, dst, size), answer_s(topology, dst, src)
    # Paced: the link is held for the bytes; one at a time: until the answer is back.
    busy = link_busy_s(topology, src, dst, size) if topology.paced_sends else one_way + back
    return left, path_s, queue.send(ready, one_way, busy, back)


def _feed(
    sg: StageGraph, workers: list[int], topology: Topology, target_bytes: int, m: int, *, start: float
) -> list[list[float]]:
    """Per stage and micro-batch, when the driver's inputs and targets for it have arrived
    (the stages fed in parallel; to each, paced sends where the topology's are, each
    starting as the bytes of the one before have left, else one synchronous send after
    another)."""
    out = []
    for s, w in enumerate(workers):
        sends = sg.feed_bytes(s, target_bytes)
        if not sends or topology.driver_links is None:
            out.append([0.0] * m)
            continue
        rtt, bw = topology.driver_link(w)
        t, arrivals = start, []
        for _ in range(m):
            last = t
            for size in sends:
                last = t + rtt / 2 + size / bw
                t += size / bw if topology.paced_sends else rtt + size / bw
            arrivals.append(last)
        out.append(arrivals)
    return out

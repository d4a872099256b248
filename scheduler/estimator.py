"""The workload estimator: what a placement costs in step time and memory.

Inputs are numbers only — a costed OP-DAG (:class:`Workload`), a topology (worker speeds,
memory, the latency/bandwidth matrix) and an assignment of DAG units to stages and stages
to workers — so planners can call it thousands of times per second.

**Step time.** For stage ``s`` on worker ``w`` let ``f_s``, ``b_s`` be its forward and
backward seconds per micro-batch (profiled node times scaled by
``reference_flops / flops_w``, or FLOPs / ``flops_w`` where unprofiled). For a cut
``a → b`` let ``x_ab = lat_ab + act_bytes_ab / bw_ab`` (activations forward) and
``g_ab = lat_ba + grad_bytes_ab / bw_ba`` (gradients back). One micro-batch alone takes
the critical path ``P`` of the stage graph: forward along the longest path of
``f`` and ``x``, backward along the longest path of ``b`` and ``g``. With ``M``
micro-batches the pipeline then emits one micro-batch per bottleneck period
``B = max(max_s (f_s + b_s), max_ab max(act_bytes_ab / bw_ab, grad_bytes_ab / bw_ba))``
(every stage does one forward and one backward per micro-batch; each link carries one
activation each way per micro-batch and is full duplex; and a stage paces its sends to a
destination at the link's bandwidth, :mod:`executor.sender`, so the link is busy for the
bytes while the latencies overlap; where a stage sends one transfer at a time instead,
each until its answer, :attr:`~scheduler.topology.Topology.paced_sends` false, a link is
busy a round trip plus the bytes per transfer: :func:`link_busy_s`). The window bounds
it too: a micro-batch stays in flight on stage ``s`` from its forward there until its
backward there, at least ``loop_s`` (the time one micro-batch alone takes for that
round: ``s``'s forward, everything downstream, ``s``'s backward), and 1F1B lets ``s``
hold at most ``min(M, depth_s + 1)`` micro-batches at once (:mod:`executor.schedule`;
GPipe holds ``M``), so ``B >= loop_s / (depth_s + 1)`` wherever ``depth_s + 1 < M``.
Over slow links this is the bound that binds: a stage two hops before the loss, over
50 ms links, with 5-10 ms of compute a stage, loops in about 0.25 s and holds three
micro-batches, a period of 0.08 s where the compute alone would allow 0.015 s. Hence

    T = P + (M - 1) * B + t_step,

which is DESIGN.md's ``Σ c_i + Σ t_j + (M − 1)·max(max c_i, max t_j)`` for a chain, with
the per-step fixed costs ``t_step`` (control round trips and the optimizer update, both
measured by the profiler) added. The form is fast enough for planners to call thousands of
times; it assumes a steady state a short pipeline over latency never reaches, and the
simulator replays the executor's schedule event by event instead (``testbeds.sim.replay``,
from the same :class:`StageGraph`).

**The driver's path.** When the topology knows the driver's link to each worker
(round trip ``r_w``, bandwidth ``β_w``), every step also pays the start, half of a stage's
round trip before it can begin, and ``0.5 · max r`` to hear that the stages are done
(they sync tied gradients and run the optimizer on their own before they answer), and
the feed: per micro-batch the driver sends its inputs to the stages that read them and
its targets to the loss stage. The coordinator's driver paces them at the link's bandwidth
as stages pace theirs (:attr:`~scheduler.topology.Topology.paced_sends`): the link is held
``Σ_sends bytes / β_w`` per micro-batch and the first micro-batch's feed has arrived
``r_w / 2`` after its bytes left; sent one synchronous send after the other instead, each
holds the link ``r_w + bytes / β_w`` and arrives no sooner. The feed is one more element of
the pipeline: the first micro-batch cannot start on stage ``s`` before its feed has
arrived and the period is at least the time the feed holds the link. The control round
trips (and an unpaced feed) are what keep a one-stage plan off a worker 150 ms from the
coordinator.

**Shared machines.** Stages whose workers compute on the same machine
(:attr:`scheduler.topology.WorkerSpec.machine`; two stages on one worker, or two worker
processes on one host's CPU) do not add compute: the machine does their forward and
backward passes one after another, so the period is also at least ``Σ_s (f_s + b_s)`` over
the stages on each machine. Splitting a model over processes on one box thus buys nothing
but transfers, and the planner keeps it in one piece there. (Measured on the testbeds:
two stages in two processes on one 2-core host ran no faster than one stage, 0.215 s
against 0.212 s for GPT-2 mini, and slower for ResNet-18/16, 0.159 s against 0.142 s.)

**Peak memory** of a worker (the stages it hosts): parameters ``P``, their gradients
``P``, optimizer state (``0``, ``P`` for SGD with momentum, ``2P`` for AdamW), and the
stash: each micro-batch in flight keeps its received inputs and the activations autograd
saved for backward (profiled per node); GPipe keeps ``M`` in flight, 1F1B at most
``depth + 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fusion.errors import PlanError
from fusion.graph.ir import OpDag
from scheduler.topology import Topology

#: Optimizer state held per parameter byte.
OPTIMIZER_STATE_FACTOR = {"sgd": 0.0, "sgd-momentum": 1.0, "adamw": 2.0}


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Executor overheads measured by the profiler (zero when unknown)."""

    control_s: float = 0.0
    """Fixed seconds per step: the driver's start/feed/wait/apply round trips."""
    micro_batch_s: float = 0.0
    """Executor bookkeeping per micro-batch on a stage (mailbox, leaves, hand-offs), seconds."""
    optimizer_s_per_byte: float = 0.0
    """Optimizer update seconds per parameter byte on the reference device."""
    driver_round_trip_s: float = 0.0
    """One control round trip from the driver to a worker (where the links to each are not
    measured). No step cost depends on it since the stages finish a step on their own
    (:data:`DRIVER_CONTROL_ROUND_TRIPS`); measured step costs still carry it."""
    target_bytes: int = 0
    """Bytes of one micro-batch's targets, which the driver sends to the loss stage."""


#: Driver round trips per step outside the feed: the answer of the long-poll that waits
#: for the step (half a round trip: the worker answers as soon as it is done). ``RunStep``
#: and the feed leave together, so starting costs a stage half its round trip before its
#: first forward (:func:`_driver_path`), not a round trip before the feed; the stages
#: exchange tied gradients and run the optimizer on their own before they answer
#: (``RunStep``'s ``finish``, :mod:`executor.driver`), without a call each.
DRIVER_CONTROL_ROUND_TRIPS = 0.5


@dataclass
class Workload:
    """A DAG's compute units in topological order, with per-unit cost arrays.

    Built once per planning run by :func:`workload_from_dag`; planners work with unit
    indices ``0 .. n-1``.
    """

    names: list[str]
    fwd_s: np.ndarray
    """Forward seconds per micro-batch at ``reference_flops``."""
    bwd_s: np.ndarray
    flops: np.ndarray
    """Forward + backward FLOPs per micro-batch."""
    saved_bytes: np.ndarray
    """Activation bytes kept for backward per micro-batch."""
    params: list[list[tuple[int, int]]]
    """Per unit: (parameter id, bytes); ids are shared by tied parameters."""
    edges: list[tuple[int, int, int, int]]
    """(src unit, dst unit, bytes, grad bytes) between units; src -1 for model inputs."""
    reference_flops: float
    """Speed the times were measured at (FLOP/s)."""
    step: StepCosts = field(default_factory=StepCosts)
    optimizer: str = "adamw"
    """``sgd``, ``sgd-momentum`` or ``adamw`` (sets the optimizer-state factor)."""
    input_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per unit: bytes of model inputs it reads (kept in its stash)."""
    output_unit: int = -1
    """Unit that produces the model output (its stage computes the loss)."""
    output_bytes: int = 0
    """Bytes of the model output per micro-batch; the loss stage keeps it and the loss's own
    saved tensors (about as large, e.g. cross-entropy's log-probabilities) until backward."""
    cuttable: np.ndarray = field(default_factory=lambda: np.ones(0, dtype=bool))
    """Per position ``k`` in ``0 .. n``: whether a stage may begin at unit ``k``
    (:meth:`fusion.graph.ir.OpDag.cut_points`); all true when not given."""
    _edge_arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _param_lists: tuple[np.ndarray, list[int], list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def stage_seconds(self, stage_of: np.ndarray, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
        """Each stage's (forward, backward) seconds per micro-batch at the reference speed:
        the sums over the units ``stage_of`` puts in it."""
        return (
            np.bincount(stage_of, weights=self.fwd_s, minlength=num_stages),
            np.bincount(stage_of, weights=self.bwd_s, minlength=num_stages),
        )

    def __post_init__(self) -> None:
        if len(self.input_bytes) != len(self.names):
            self.input_bytes = np.zeros(len(self.names))
        if len(self.cuttable) != len(self.names) + 1:
            self.cuttable = np.ones(len(self.names) + 1, dtype=bool)

    def param_lists(self) -> tuple[np.ndarray, list[int], list[int]]:
        """Every (unit, parameter id, bytes) of :attr:`params`, flattened: the units as an
        index array, ids and bytes as lists; cached."""
        if self._param_lists is None:
            flat = [(u, pid, size) for u, unit in enumerate(self.params) for pid, size in unit]
            self._param_lists = (
                np.array([u for u, _, _ in flat], dtype=np.int64),
                [pid for _, pid, _ in flat],
                [size for _, _, size in flat],
            )
        return self._param_lists

    def edge_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """(src, dst, bytes, grad bytes) as arrays, cached."""
        if not self.edges:
            return None
        if self._edge_arrays is None:
            e = np.array(self.edges, dtype=np.int64)
            self._edge_arrays = (e[:, 0], e[:, 1], e[:, 2].astype(np.float64), e[:, 3].astype(np.float64))
        return self._edge_arrays

    @property
    def total_param_bytes(self) -> int:
        seen: dict[int, int] = {}
        for unit in self.params:
            for pid, size in unit:
                seen[pid] = size
        return sum(seen.values())


def unit_param_names(dag: OpDag) -> list[list[tuple[str, int]]]:
    """Per compute node of ``dag``: the (canonical name, bytes) of every parameter it reads,
    its own and those read through ``get_attr`` nodes (which belong to their readers)."""
    attr_params: dict[str, dict[str, int]] = {n.name: n.params for n in dag.nodes if n.op == "get_attr"}
    out = []
    for n in dag.compute_nodes():
        owned = dict(n.params)
        for src in n.inputs:
            owned.update(attr_params.get(src, {}))
        out.append([(dag.tied_params.get(name, name), size) for name, size in owned.items()])
    return out


def workload_from_dag(
    dag: OpDag, *, optimizer: str = "adamw", momentum: float = 0.0, step: StepCosts | None = None
) -> Workload:
    """Cost arrays for the compute nodes of ``dag`` (coarsened or not).

    Unprofiled nodes are timed as FLOPs / ``reference_flops`` (with ``reference_flops``
    the DAG's own, else 1 TFLOP/s); unprofiled activation memory is estimated as the
    node's output bytes.
    """
    units = dag.compute_nodes()
    if not units:
        raise PlanError("the DAG has no compute nodes to place")
    index = {n.name: i for i, n in enumerate(units)}
    ref = dag.reference_flops or 1.0e12
    fwd = np.array([n.fwd_time_s if n.fwd_time_s is not None else (n.flops_fwd / ref) for n in units], dtype=np.float64)
    bwd = np.array([n.bwd_time_s if n.bwd_time_s is not None else (n.flops_bwd / ref) for n in units], dtype=np.float64)
    flops = np.array([n.flops_fwd + n.flops_bwd for n in units], dtype=np.float64)
    saved = np.array([n.saved_bytes if n.saved_bytes is not None else n.out_bytes for n in units], dtype=np.float64)
    param_ids: dict[str, int] = {}
    params = [
        [(param_ids.setdefault(name, len(param_ids)), size) for name, size in unit] for unit in unit_param_names(dag)
    ]
    edges: list[tuple[int, int, int, int]] = []
    input_bytes = np.zeros(len(units))
    for e in dag.edges:
        if e.dst not in index:
            continue
        src = dag.node(e.src)
        if src.op == "placeholder":
            input_bytes[index[e.dst]] += e.bytes
            continue
        if e.src not in index:
            continue
        edges.append((index[e.src], index[e.dst], e.bytes, e.grad_bytes))
    opt = optimizer
    if optimizer == "sgd" and momentum > 0:
        opt = "sgd-momentum"
    if opt not in OPTIMIZER_STATE_FACTOR:
        raise PlanError(f"unknown optimizer {optimizer!r} for memory estimation")
    out_node = dag.node(dag.output)
    return Workload(
        output_unit=index.get(dag.output, len(units) - 1),
        output_bytes=out_node.out_bytes,
        names=[n.name for n in units],
        fwd_s=fwd,
        bwd_s=bwd,
        flops=flops,
        saved_bytes=saved,
        params=params,
        edges=edges,
        reference_flops=ref,
        step=step or StepCosts(),
        optimizer=opt,
        input_bytes=input_bytes,
        cuttable=np.array(dag.cut_points(), dtype=bool),
    )


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one placement."""

    step_s: float
    """Predicted seconds per training step."""
    stage_compute_s: tuple[float, ...]
    """Forward + backward seconds per micro-batch, per stage."""
    link_s: dict[tuple[int, int], float]
    """Seconds per micro-batch each cut is busy (the slower direction, the answer included), by
    (src stage, dst stage)."""
    link_bytes: dict[tuple[int, int], int]
    """Activation bytes per micro-batch on each cut."""
    peak_memory_bytes: dict[int, int]
    """Predicted peak memory per worker index."""
    bottleneck_s: float
    """The pipeline period ``B``."""
    depth: tuple[int, ...]
    """Longest path, in stages, from each stage to a sink."""


@dataclass(frozen=True)
class StageGraph:
    """A placement reduced to its stages: what each computes per micro-batch and what
    crosses each cut. Shared by :func:`estimate`'s closed form and by event replays of the
    executor's schedule (``testbeds.sim.replay``)."""

    num_stages: int
    stage_of: np.ndarray
    """Stage of every unit."""
    fwd_s: np.ndarray
    """Forward seconds per micro-batch per stage on its worker, bookkeeping included."""
    bwd_s: np.ndarray
    act: dict[tuple[int, int], int]
    """Activation bytes per micro-batch per cut (src stage, dst stage)."""
    grad: dict[tuple[int, int], int]
    """Gradient bytes per micro-batch sent back over each cut."""
    order: list[int]
    """Stages in topological order."""
    depth: list[int]
    """Longest path, in stages, from each stage to a sink."""
    model_input_bytes: np.ndarray
    """Per stage: bytes of model inputs it reads per micro-batch (fed by the driver)."""
    received_bytes: np.ndarray
    """Per stage: activation bytes it receives per micro-batch."""
    loss_stage: int
    stage_params: list[dict[int, int]]
    """Per stage: parameter id -> bytes."""
    scale: np.ndarray
    """Per stage: seconds on its worker per profiled second."""

    def feed_bytes(self, stage: int, target_bytes: int) -> list[float]:
        """The driver's sends to ``stage`` per micro-batch, in order: its model inputs, then
        the loss stage's targets."""
        inputs = [float(self.model_input_bytes[stage])] if self.model_input_bytes[stage] > 0 else []
        return inputs + ([float(target_bytes)] if stage == self.loss_stage else [])


def stage_graph(
    workload: Workload, unit_stage: Sequence[int], stage_workers: Sequence[int], topology: Topology
) -> StageGraph:
    """Reduce a placement to its :class:`StageGraph`.

    Raises:
        PlanError: an index is out of range or the stage graph is cyclic.
    """
    num_stages = len(stage_workers)
    stage_of = np.asarray(unit_stage, dtype=np.int64)
    if len(stage_of) != len(workload) or (num_stages and (stage_of.min() < 0 or stage_of.max() >= num_stages)):
        raise PlanError("unit_stage must give every unit a stage in range")
    speed = np.array([topology.workers[w].effective_flops for w in stage_workers])
    scale = workload.reference_flops / speed  # seconds multiplier per stage
    overhead = workload.step.micro_batch_s / 2  # half with each of forward and backward
    fwd, bwd = workload.stage_seconds(stage_of, num_stages)
    f, b = fwd * scale + overhead, bwd * scale + overhead
    # Cut traffic: a value crosses once per (producer, destination stage).
    act, grad, received = _cut_traffic(workload, stage_of, num_stages)
    order = _stage_order(num_stages, act)
    depth = [0] * num_stages
    for s in reversed(order):
        depth[s] = max((depth[c] + 1 for (a, c) in act if a == s), default=0)
    stage_params: list[dict[int, int]] = [{} for _ in range(num_stages)]
    units, pids, sizes = workload.param_lists()
    for s, pid, size in zip(stage_of[units].tolist(), pids, sizes, strict=True):
        stage_params[s][pid] = size
    return StageGraph(
        num_stages=num_stages,
        stage_of=stage_of,
        fwd_s=f,
        bwd_s=b,
        act=act,
        grad=grad,
        order=order,
        depth=depth,
        model_input_bytes=np.bincount(stage_of, weights=workload.input_bytes, minlength=num_stages),
        received_bytes=received,
        loss_stage=int(stage_of[workload.output_unit]) if workload.output_unit >= 0 else num_stages - 1,
        stage_params=stage_params,
        scale=scale,
    )


def estimate(
    workload: Workload,
    unit_stage: Sequence[int],
    stage_workers: Sequence[int],
    topology: Topology,
    *,
    micro_batches: int,
    schedule: str = "1f1b",
    cut_bytes_scale: Mapping[tuple[int, int], tuple[float, float]] | None = None,
) -> Estimate:
    """Predict step time and per-worker peak memory of a placement.

    Args:
        workload: the costed units.
        unit_stage: stage index of every unit (stages ``0 .. S-1``, any acyclic assignment).
        stage_workers: topology worker index of every stage.
        topology: speeds, memory and links.
        micro_batches: ``M``.
        schedule: ``gpipe`` or ``1f1b``.
        cut_bytes_scale: per cut, the factors on its activation and gradient bytes on the
            wire (a codec's encoded over dense size); memory is priced dense either way.

    Raises:
        PlanError: the stage graph is cyclic or an index is out of range.
    """
    sg = stage_graph(workload, unit_stage, stage_workers, topology)
    num_stages, f, b, act, grad, order = sg.num_stages, sg.fwd_s, sg.bwd_s, sg.act, sg.grad, sg.order
    saved = np.bincount(sg.stage_of, weights=workload.saved_bytes, minlength=num_stages)
    stash_in = sg.model_input_bytes + sg.received_bytes  # received inputs stay stashed until backward
    for (a, _), size in act.items():
        stash_in[a] += size  # so do the outputs a stage sent
    if workload.output_unit >= 0:
        stash_in[sg.loss_stage] += 2 * workload.output_bytes
    feed, feed_period, driver_control_s = _driver_path(sg, stage_workers, topology, workload.step.target_bytes)
    if cut_bytes_scale:
        act = {k: v * cut_bytes_scale.get(k, (1.0, 1.0))[0] for k, v in act.items()}
        grad = {k: v * cut_bytes_scale.get(k, (1.0, 1.0))[1] for k, v in grad.items()}
    x = {k: topology.transfer_s(stage_workers[k[0]], stage_workers[k[1]], v) for k, v in act.items()}
    g = {k: topology.transfer_s(stage_workers[k[1]], stage_workers[k[0]], grad[k]) if grad[k] else 0.0 for k in act}

    # Critical path of one micro-batch: forward then backward.
    fwd_done = np.zeros(num_stages)
    for s in order:
        start = max((fwd_done[a] + x[(a, c)] for (a, c) in act if c == s), default=0.0)
        fwd_done[s] = max(start, feed[s]) + f[s]
    bwd_done = np.zeros(num_stages)
    for s in reversed(order):
        start = max((bwd_done[c] + g[(a, c)] for (a, c) in act if a == s), default=0.0)
        bwd_done[s] = max(start, fwd_done[s]) + b[s]
    critical = float(bwd_done.max()) if num_stages else 0.0
    window = _window_s(sg, fwd_done - f, bwd_done, micro_batches, schedule)
    link = {
        (a, c): max(
            link_busy_s(topology, stage_workers[a], stage_workers[c], v),
            link_busy_s(topology, stage_workers[c], stage_workers[a], grad[(a, c)]),
        )
        for (a, c), v in act.items()
    }
    period = max(
        float((f + b).max()) if num_stages else 0.0,
        max(link.values(), default=0.0),
        float(feed_period.max()) if num_stages else 0.0,
        _shared_machine_s(f + b, stage_workers, topology),
        window,
    )

    depth = sg.depth
    stage_params = sg.stage_params
    param_bytes = [float(sum(sp.values())) for sp in stage_params]

    # Memory per stage, then per worker.
    factor = 2.0 + OPTIMIZER_STATE_FACTOR[workload.optimizer]
    memory: dict[int, int] = {}
    for s in range(num_stages):
        inflight = micro_batches if schedule == "gpipe" else min(depth[s] + 1, micro_batches)
        stage_mem = factor * param_bytes[s] + inflight * (saved[s] + stash_in[s])
        w = stage_workers[s]
        memory[w] = memory.get(w, 0) + int(stage_mem)

    opt_s = optimizer_s(workload, sg)
    tied_s = tied_sync_s(sg, stage_workers, topology)
    step_s = critical + (micro_batches - 1) * period + workload.step.control_s + driver_control_s + opt_s + tied_s
    return Estimate(
        step_s=float(step_s),
        stage_compute_s=tuple(float(v) for v in f + b),
        link_s=link,
        link_bytes=dict(sg.act),
        peak_memory_bytes=memory,
        bottleneck_s=float(period),
        depth=tuple(depth),
    )


def _window_s(sg: StageGraph, fwd_start: np.ndarray, bwd_done: np.ndarray, micro_batches: int, schedule: str) -> float:
    """The period a stage's in-flight window allows (module docstring): a micro-batch stays
    in flight on stage ``s`` from the start of its forward there to the end of its backward
    there, ``loop_s`` (one micro-batch alone, so at least that long), and under 1F1B ``s``
    holds at most ``depth_s + 1`` micro-batches at once, so it starts at most that many per
    ``loop_s``. A stage that may hold all ``M`` (every stage under GPipe) never waits for a
    backward before a forward, and its window sets no bound."""
    if not sg.num_stages or schedule == "gpipe":
        return 0.0
    held = np.asarray(sg.depth, dtype=np.float64) + 1
    bound = held < micro_batches
    return float(((bwd_done - fwd_start)[bound] / held[bound]).max(initial=0.0))


def answer_s(topology: Topology, i: int, j: int) -> float:
    """Seconds until a sender hears that its transfer to ``i`` arrived (the answer from
    ``i`` back to ``j``)."""
    return 0.0 if i == j else float(topology.latency_s[i][j])


def link_busy_s(topology: Topology, i: int, j: int, size_bytes: float) -> float:
    """Seconds one transfer of ``size_bytes`` holds the link ``i -> j`` before the next may
    start. Paced sends (:attr:`Topology.paced_sends`, :mod:`executor.sender`): its bytes, the
    next starting as they leave, the latencies overlapping. Otherwise the transfer and its
    answer: a round trip plus the bytes."""
    if i == j or not size_bytes:
        return 0.0
    if topology.paced_sends:
        return float(size_bytes / topology.bandwidth_bytes_per_s[i][j])
    return topology.transfer_s(i, j, size_bytes) + answer_s(topology, j, i)


def _shared_machine_s(compute: np.ndarray, stage_workers: Sequence[int], topology: Topology) -> float:
    """The most compute per micro-batch that one machine does for its stages (they take
    turns on it; module docstring)."""
    if len(stage_workers) < 2:
        return 0.0
    machine = np.array([topology.machine_of[w] for w in stage_workers], dtype=np.int64)
    return float(np.bincount(machine, weights=compute).max())


def _driver_path(
    sg: StageGraph, stage_workers: Sequence[int], topology: Topology, target_bytes: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Per stage, when the first micro-batch's feed has arrived ``φ_s`` and how long the feed
    holds the driver's link per micro-batch; and the control round trips per step (module
    docstring). Zeros when the topology does not know the driver's links."""
    first, period = np.zeros(sg.num_stages), np.zeros(sg.num_stages)
    if topology.driver_links is None or not sg.num_stages:
        return first, period, 0.0
    rtts = []
    for s, w in enumerate(stage_workers):
        link = topology.driver_link(w)
        rtts.append(link[0])
        sends = sg.feed_bytes(s, target_bytes)
        period[s] = feed_s(link, sends, paced=topology.paced_sends)
        # Paced, the last send arrives half a round trip after its bytes left; one at a
        # time, each has arrived (and been answered) by the end of its round trip. Neither
        # waits for RunStep, which reaches the stage half a round trip after it left.
        first[s] = max(link[0] / 2, period[s] + (link[0] / 2 if topology.paced_sends and sends else 0.0))
    return first, period, DRIVER_CONTROL_ROUND_TRIPS * max(rtts)


def feed_s(driver_link: tuple[float, float], sends: Sequence[float], *, paced: bool = False) -> float:
    """Seconds the driver's ``sends`` (bytes each) to one worker hold ``driver_link`` (round
    trip, bandwidth), which is what the next micro-batch's feed waits for. One synchronous
    send after another: each holds it its bytes and a round trip. Paced
    (:mod:`executor.driver`): each starts once the bytes of the one before it have left, so
    the link is held for the bytes."""
    rtt, bw = driver_link
    return sum((0.0 if paced else rtt) + size / bw for size in sends)


def optimizer_s(workload: Workload, sg: StageGraph) -> float:
    """The optimizer update of the slowest stage (all stages update at once)."""
    if not sg.num_stages:
        return 0.0
    return workload.step.optimizer_s_per_byte * max(
        sum(sp.values()) * sg.scale[s] for s, sp in enumerate(sg.stage_params)
    )


def tied_sync_s(sg: StageGraph, stage_workers: Sequence[int], topology: Topology) -> float:
    """Parameters several stages hold: once its schedule is done, each holder sends its
    gradient straight to every other holder, all at once, and goes on (to its optimizer
    step) once its own sends are acknowledged and the others' gradients are in, so the
    slowest transfer plus its acknowledgement sets the time. (Priced after the whole
    pipeline although a holder early in it may finish its exchange sooner.)"""
    holders: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for s, sp in enumerate(sg.stage_params):
        for pid, size in sp.items():
            holders.setdefault(pid, []).append(s)
            sizes[pid] = size
    total = 0.0
    for pid, stages in holders.items():
        if len(stages) < 2:
            continue
        exchange = max(
            topology.transfer_s(stage_workers[a], stage_workers[b], sizes[pid])
            + answer_s(topology, stage_workers[b], stage_workers[a])
            for a in stages
            for b in stages
            if a != b
        )
        total += exchange
    return total


def _cut_traffic(
    workload: Workload, stage_of: np.ndarray, num_stages: int
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int], np.ndarray]:
    """Activation and gradient bytes per (src stage, dst stage), and bytes received per stage."""
    arrays = workload.edge_arrays()
    if arrays is None:
        return {}, {}, np.zeros(num_stages)
    src, dst, size, gsize = arrays
    a, c = stage_of[src], stage_of[dst]
    cross = np.flatnonzero(a != c)  # few edges: the rest is plain Python over them
    act: dict[tuple[int, int], int] = {}
    grad: dict[tuple[int, int], int] = {}
    received = np.zeros(num_stages)
    sent: set[tuple[int, int]] = set()
    for value, s, d, nbytes, gbytes in zip(
        src[cross].tolist(),
        a[cross].tolist(),
        c[cross].tolist(),
        size[cross].tolist(),
        gsize[cross].tolist(),
        strict=True,
    ):
        if (value, d) in sent:
            continue  # once per (value, dst stage)
        sent.add((value, d))
        act[(s, d)] = act.get((s, d), 0) + int(nbytes)
        grad[(s, d)] = grad.get((s, d), 0) + int(gbytes)
        received[d] += nbytes
    return dict(sorted(act.items())), dict(sorted(grad.items())), received


def _stage_order(num_stages: int, links: dict[tuple[int, int], int]) -> list[int]:
    indeg = [0] * num_stages
    succ: dict[int, list[int]] = {s: [] for s in range(num_stages)}
    for a, c in links:
        succ[a].append(c)
        indeg[c] += 1
    ready = [s for s in range(num_stages) if indeg[s] == 0]
    order = []
    while ready:
        s = ready.pop()
        order.append(s)
        for c in succ[s]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(order) != num_stages:
        raise PlanError("the placement's stage graph is cyclic")
    return order

"""Measure what planning needs on live workers, then plan: the coordinator's and
``fusion profile``'s shared path from a job to a :class:`~scheduler.plan.Plan`.

1. **Probe the links** between every pair of workers (``ProbeLinks``, both directions, over
   the real gRPC tensor path) and from the driver to each worker, fitted as
   ``latency_s + bytes / bandwidth_bytes_per_s``.
2. **Profile the model** on the worker nearest the driver (``ProfileModel``): per-node forward/backward
   seconds and saved activation bytes on that worker's device, the device's matmul speed,
   the optimizer's cost per byte. Cached per (graph fingerprint, device), so a second job
   with the same model does not pay again. Node times are scaled to other workers by the
   ratio of measured matmul speeds.
3. **Calibrate** the executor there, once per cached profile (:func:`calibrate_executor`).
4. Build a :class:`~scheduler.topology.Topology` from the measurements and call the
   planner.

:class:`LinkTable` keeps the link fits and refreshes them from the transfers training
makes (bytes and seconds each stage reports per destination).
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from compress.calibration import job_calibrator
from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.driver import value_spec
from fusion.auth import PROBE_KEY_TTL_S, probe_key
from fusion.config import JobSpec
from fusion.errors import FusionError, RemoteError
from fusion.graph.ir import OpDag
from fusion.training import example_micro_batch
from fusion.wire import executor_pb2 as epb
from scheduler.estimator import DRIVER_CONTROL_ROUND_TRIPS, StepCosts, feed_s
from scheduler.plan import Plan
from scheduler.planner import PlanRequest, make_plan, request_for_job
from scheduler.recompress import cut_nodes, with_compression
from scheduler.topology import Topology, WorkerSpec

logger = logging.getLogger(__name__)

#: Probe sizes: small ones pin the latency, large ones the bandwidth.
PROBE_SIZES = (1 << 10, 64 << 10, 512 << 10, 4 << 20)
#: Weight of a new observation when refreshing a link's bandwidth from training traffic.
REFRESH_WEIGHT = 0.2


@dataclass(frozen=True)
class Endpoint:
    """A worker as planning sees it."""

    name: str
    address: str
    matmul_flops: float
    memory_bytes: int | None = None
    device_name: str = ""
    machine: str | None = None
    """What the worker computes on, as it reported it; workers reporting the same share it."""

    @staticmethod
    def from_registration(name: str, address: str, resources: Mapping[str, Any]) -> Endpoint:
        """The endpoint of a registered worker, from the resources it reported (a dict of
        the ``WorkerResources`` message)."""
        return Endpoint(
            name=name,
            address=address,
            matmul_flops=float(resources.get("matmul_flops") or 1.0e12),
            memory_bytes=int(resources["device_memory_bytes"]) if resources.get("device_memory_bytes") else None,
            device_name=str(resources.get("device_name", "")),
            machine=str(resources["machine"]) if resources.get("machine") else None,
        )


@dataclass
class ModelProfile:
    """What ``ProfileModel`` measured on one device."""

    nodes: dict[str, dict[str, float]]
    matmul_flops: float
    optimizer_s_per_byte: float
    device_name: str
    overhead_step_s: float | None = None
    """Executor overhead per step, once calibrated (see :func:`calibrate_executor`)."""
    overhead_micro_batch_s: float | None = None
    """Executor overhead per micro-batch, once calibrated."""
    compute_factor: float | None = None
    """The compute the executor measured while calibrating over the node profile's sum,
    once calibrated; planning scales every node's time by it (:func:`costed_dag`)."""
    cache_key: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str) -> ModelProfile:
        return ModelProfile(**json.loads(text))


class ProfileCache:
    """In-memory cache of model profiles keyed by (fingerprint, device); the coordinator
    backs it with SQLite through ``load``/``store`` callables."""

    def __init__(
        self, load: Callable[[str], str | None] | None = None, store: Callable[[str, str], None] | None = None
    ) -> None:
        self._mem: dict[str, ModelProfile] = {}
        self._load = load
        self._store = store
        self._lock = threading.Lock()

    def get(self, key: str) -> ModelProfile | None:
        with self._lock:
            if key in self._mem:
                return self._mem[key]
        text = self._load(key) if self._load else None
        if text is None:
            return None
        profile = ModelProfile.from_json(text)
        with self._lock:
            self._mem[key] = profile
        return profile

    def put(self, key: str, profile: ModelProfile) -> None:
        with self._lock:
            self._mem[key] = profile
        if self._store:
            self._store(key, profile.to_json())


class JobProfileCache(ProfileCache):
    """One job's view of a :class:`ProfileCache` (the same entries): it remembers the
    profile the job's planning got or stored last, which :attr:`profile` gives."""

    def __init__(self, shared: ProfileCache) -> None:
        super().__init__(shared._load, shared._store)
        self._mem = shared._mem
        self._lock = shared._lock
        #: The profile the job was planned with (``None`` until it was measured).
        self.profile: ModelProfile | None = None

    def get(self, key: str) -> ModelProfile | None:
        profile = super().get(key)
        if profile is not None:
            self.profile = profile
        return profile

    def put(self, key: str, profile: ModelProfile) -> None:
        super().put(key, profile)
        self.profile = profile


def profile_model(
    spec: JobSpec,
    dag: OpDag,
    worker: Endpoint,
    pool: ChannelPool,
    *,
    device: str = "cpu",
    cache: ProfileCache | None = None,
    repeats: int = 5,
) -> ModelProfile:
    """Profile the job's model on ``worker`` (or take it from the cache)."""
    shapes = ";".join(f"{dag.node(n).value.dtype}{list(dag.node(n).value.shape or ())}" for n in dag.input_names())
    # "v3": calibration also measures the executor's compute (compute_factor); "v2":
    # calibrated overheads exclude the driver's path (measured per worker since).
    key = f"v3|{dag.fingerprint}|{shapes}|{device}|{worker.device_name}|{spec.train.optimizer}"
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            logger.info("profile of %s taken from the cache", dag.fingerprint)
            return hit
    request = epb.ProfileModelRequest(
        model=epb.ModelSpec(
            name=spec.model.name,
            preset=spec.model.preset or "",
            kwargs_json=json.dumps(spec.model.kwargs),
            leaf_modules=list(spec.model.leaf_modules),
        ),
        example_inputs=[value_spec(n, dag.node(n).value) for n in dag.input_names()],
        device=device,
        train_json=json.dumps(spec.train.to_dict()),
        repeats=repeats,
    )
    client = ExecutorClient(worker.address, pool)
    response = client._call(client.stub.ProfileModel, request, "ProfileModel", 600.0)
    if response.graph_fingerprint != dag.fingerprint:
        raise FusionError(f"worker {worker.name} captured a different graph than the coordinator; check torch versions")
    profile = ModelProfile(
        nodes=json.loads(response.profile_json),
        matmul_flops=response.matmul_flops,
        optimizer_s_per_byte=response.optimizer_s_per_byte,
        device_name=response.device_name,
    )
    profile.cache_key = key
    if cache is not None:
        cache.put(key, profile)
    return profile


def costed_dag(dag: OpDag, profile: ModelProfile) -> OpDag:
    """The DAG with the profiled node costs, their times scaled by the calibrated
    ``compute_factor`` (the executor's compute over the profile's)."""
    from fusion.profiling import scale_node_times

    return dag.with_profile(
        scale_node_times(profile.nodes, profile.compute_factor or 1.0), reference_flops=profile.matmul_flops
    )


def probe_keys_for(addresses: Sequence[str], pool: ChannelPool) -> str:
    """``ProbeLinks.auth``: a short-lived probe key for each target whose control key this
    process holds, so the prober may call the target's ``Probe`` and nothing else."""
    expiry = int(time.time()) + PROBE_KEY_TTL_S
    keys = {}
    for address in addresses:
        control = pool.keyring.control(address)
        if control is not None:
            keys[address] = [expiry, probe_key(control, expiry).hex()]
    return json.dumps(keys)


class LinkProbeError(RemoteError):
    """Measuring links failed. ``unreachable`` holds the addresses of the workers to blame:
    those whose own ``ProbeLinks`` (or the driver's probe) failed, and those no worker that
    probed could reach. Empty when the failures name no one worker (a partial partition)."""

    def __init__(self, message: str, *, unreachable: Sequence[str]) -> None:
        super().__init__(message)
        self.unreachable = tuple(unreachable)


def probe_links(
    workers: Sequence[Endpoint], pool: ChannelPool, *, sizes: Sequence[int] = PROBE_SIZES
) -> tuple[list[list[float]], list[list[float]]]:
    """(latency_s, bandwidth_bytes_per_s) matrices between ``workers``, measured both ways.
    The latency is one way, as :class:`~scheduler.topology.Topology` holds it: half the
    fitted intercept, since each probe is timed from its first byte out to its answer back.

    Every worker probes (in parallel) however the others fare; any failure raises one
    :class:`LinkProbeError` that names every failed link and blames the workers it can."""
    n = len(workers)
    lat = [[0.0] * n for _ in range(n)]
    bw = [[float("inf")] * n for _ in range(n)]
    failed_probers: dict[int, str] = {}  # worker idx -> why its ProbeLinks failed
    failed_links: dict[tuple[int, int], str] = {}  # (from, to) -> the fit's error

    def probe_from(i: int) -> None:
        others = [w.address for j, w in enumerate(workers) if j != i]
        if not others:
            return
        client = ExecutorClient(workers[i].address, pool)
        request = epb.ProbeLinksRequest(
            addresses=others, sizes_bytes=list(sizes), repeats=5, auth=probe_keys_for(others, pool)
        )
        try:
            response = client._call(client.stub.ProbeLinks, request, "ProbeLinks", 120.0 + 5.0 * len(others))
        except RemoteError as e:
            failed_probers[i] = str(e)
            return
        by_address = {f.address: f for f in response.links}
        for j, w in enumerate(workers):
            if j == i:
                continue
            fit = by_address.get(w.address)
            if fit is None or fit.error:
                failed_links[(i, j)] = fit.error if fit else "no answer"
                continue
            lat[i][j] = fit.latency_s / 2  # a probe is timed until its answer: the intercept is a round trip
            bw[i][j] = fit.bandwidth_bytes_per_s

    run_parallel([lambda i=i: probe_from(i) for i in range(n)], name="probe-links")
    if failed_probers or failed_links:
        raise _probe_failure(workers, failed_probers, failed_links)
    return lat, bw


def _probe_failure(
    workers: Sequence[Endpoint], failed_probers: Mapping[int, str], failed_links: Mapping[tuple[int, int], str]
) -> LinkProbeError:
    """One error for every failed probe; a target is blamed when every prober that ran failed
    to reach it (one bad link between two live workers blames neither of them)."""
    blamed = set(failed_probers)
    for j in range(len(workers)):
        ran = [i for i in range(len(workers)) if i != j and i not in failed_probers]
        if ran and all((i, j) in failed_links for i in ran):
            blamed.add(j)
    lines = [f"ProbeLinks on worker {workers[i].name} failed: {why}" for i, why in sorted(failed_probers.items())]
    lines += [
        f"worker {workers[i].name} cannot reach {workers[j].name} ({workers[j].address}): {why}"
        for (i, j), why in sorted(failed_links.items())
    ]
    more = f" (and {len(lines) - 1} more failed probe(s))" if len(lines) > 1 else ""
    return LinkProbeError(lines[0] + more, unreachable=[workers[i].address for i in sorted(blamed)])


#: Driver probe sizes: the driver's sends are small (inputs, targets, control), so the
#: probe stays small too and costs little on an 8 Mbps link.
DRIVER_PROBE_SIZES = (1 << 10, 64 << 10, 256 << 10)


def probe_driver_links(
    workers: Sequence[Endpoint], pool: ChannelPool, *, sizes: Sequence[int] = DRIVER_PROBE_SIZES, repeats: int = 3
) -> list[tuple[float, float]]:
    """Per worker, ``(round_trip_s, bandwidth_bytes_per_s)`` of the driver's calls to it,
    fitted over the same tensor path the feed uses (one worker at a time, so the fits do
    not share this host's CPU or uplink). Workers that cannot be reached are all named in
    one :class:`LinkProbeError`."""
    from fusion.profiling import probe_link

    links = []
    failed: list[tuple[Endpoint, str]] = []
    for w in workers:
        client = ExecutorClient(w.address, pool)
        try:
            client.probe(sizes[0], attempts=1)  # warm the channel: connection set-up is not the link
            links.append(probe_link(lambda size, c=client: c.probe(size)[0], sizes, repeats=repeats))
        except RemoteError as e:
            failed.append((w, str(e)))
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise LinkProbeError(
            f"the driver cannot reach worker {failed[0][0].name} ({failed[0][0].address}): {failed[0][1]}{more}",
            unreachable=[w.address for w, _ in failed],
        )
    return links


def measured_topology(
    workers: Sequence[Endpoint], latency: list[list[float]], bandwidth: list[list[float]]
) -> Topology:
    """A topology from profiled numbers (each worker is its own cluster label; OP-Fence
    finds the real clusters from the bandwidths)."""
    specs = [
        WorkerSpec(name=w.name, cluster=w.name, flops=w.matmul_flops, memory_bytes=w.memory_bytes, machine=w.machine)
        for w in workers
    ]
    return Topology.from_measurements(specs, latency, bandwidth)


@dataclass(frozen=True)
class ExecutorOverhead:
    """Executor costs beyond compute and links, measured by :func:`calibrate_executor`."""

    step_s: float = 0.0
    """Fixed seconds per step."""
    micro_batch_s: float = 0.0
    """Seconds per micro-batch on a stage."""
    compute_factor: float = 1.0
    """Compute the executor measured over the compute the node profile predicts."""


#: Calibration times steps until the ``M``-micro-batch ones have computed this long (and
#: at least ``steps`` of each count). A shared machine's speed moves from one second to the
#: next, in phases of a few seconds (docs/benchmarks.md has the trace), and five steps land
#: in one phase: the level they set for every node then misses a run of minutes by as much.
CALIBRATE_MIN_S = 3.0
#: Share of the calibration steps left out at each end before averaging: preemptions and
#: the first steps after a pause, not the machine's speed.
CALIBRATE_TRIM = 0.1


def calibrate_executor(
    spec: JobSpec,
    model: Any,
    captured: Any,
    dataset: Any,
    worker: Endpoint,
    pool: ChannelPool,
    profile: ModelProfile,
    *,
    device: str = "cpu",
    steps: int = 5,
    min_time_s: float = CALIBRATE_MIN_S,
    driver_link: tuple[float, float] = (0.0, float("inf")),
) -> ExecutorOverhead:
    """Time the whole model as one stage on ``worker`` with 1 and with ``M`` micro-batches.

    The node profile times every operator on its own; the executor runs them in one
    autograd graph, between mailboxes and hand-offs, on a machine whose load has moved
    since. So the run measures both: the stage's compute as the executor reports it, which
    over the profile's sum gives ``compute_factor`` (the profile keeps the relative costs
    of the nodes, the run sets their level), and the rest of the step. That rest is
    ``step_s + M · micro_batch_s + optimizer + driver path``; two micro-batch counts
    separate the fixed part from the per-micro-batch part. The optimizer is priced from
    its own measurement and the driver's path from ``driver_link`` (the worker's measured
    ``(round_trip_s, bandwidth)``), so what is left is the executor's own overhead
    (serialisation, mailboxes, hand-offs), which the estimator adds to every plan.

    The two counts take turns, step by step, so that both see the same machine, until the
    ``M``-micro-batch steps have computed ``min_time_s`` (:data:`CALIBRATE_MIN_S`); each
    figure is a trimmed mean over the steps (:func:`fusion.profiling.trimmed_mean`): the
    mix of fast and slow phases a run of minutes meets, not the one phase a median of a
    few steps falls in.
    """
    from executor.driver import PipelineDriver
    from fusion.graph.split import split_stages
    from fusion.profiling import trimmed_mean
    from fusion.training import job_batch

    if steps < 1 or not min_time_s >= 0:
        raise FusionError(f"calibration needs steps >= 1 and min_time_s >= 0, got {steps} and {min_time_s}")
    mb = spec.micro_batch_size
    counts = sorted({1, max(2, spec.train.micro_batches)})
    profiled = sum(
        float(v.get("fwd_time_s", 0.0)) + float(v.get("bwd_time_s", 0.0))
        for k, v in profile.nodes.items()
        if not k.startswith("__")
    )
    stages = split_stages(captured.dag, {n.name: 0 for n in captured.dag.compute_nodes()})
    jobs = [spec.replace(data={"batch_size": mb * count}, train={"micro_batches": count}) for count in counts]
    drivers: list[Any] = []
    rest: list[list[float]] = [[] for _ in counts]
    compute: list[list[float]] = [[] for _ in counts]
    try:
        for count, job in zip(counts, jobs, strict=True):
            _, example_y = example_micro_batch(job, dataset)
            driver = PipelineDriver(
                job_id=f"calibrate-{count}-{time.monotonic_ns()}",
                job=job,
                model=model,
                captured=captured,
                stages=stages,
                addresses=[worker.address],
                example_target=example_y,
                device=device,
                pool=pool,
                leaf_modules=spec.model.leaf_modules,
            )
            drivers.append(driver)
            driver.load()
        step = 0
        # Step 0 warms up; then until both the step count and the compute time are reached
        # (within three times that in all: where compute is a small part of each step, as on
        # a GPU, the rest is measured long enough by then).
        t0 = time.monotonic()
        while step <= steps or (sum(compute[-1]) < min_time_s and time.monotonic() - t0 < 3 * min_time_s):
            for k, (driver, job) in enumerate(zip(drivers, jobs, strict=True)):
                x, y = job_batch(job, dataset, step)
                stats = driver.train_step(step, (x,), y)
                if step:
                    spent = sum(stats.compute_s.values())
                    compute[k].append(spent)
                    rest[k].append(max(stats.step_s - spent, 0.0))
            step += 1
    finally:
        for driver in drivers:
            driver.close()
    logger.info(
        "calibrated the executor on %s over %d steps of each micro-batch count %s", worker.name, step - 1, counts
    )
    # The M-micro-batch steps (the last count) are the ones plans resemble; their compute sets the level.
    measured = trimmed_mean(compute[-1], CALIBRATE_TRIM) / (counts[-1] * profiled) if profiled > 0 else 0.0
    factor = measured if measured > 0 else 1.0
    rest_s = [trimmed_mean(r, CALIBRATE_TRIM) for r in rest]
    slope = (rest_s[1] - rest_s[0]) / (counts[1] - counts[0])
    per_mb = max(slope, 0.0)
    # The optimizer update is priced separately (per parameter byte): leave it out here, and
    # so is the driver's path to this worker (estimator: control round trips and the feed).
    optimizer_s = profile.optimizer_s_per_byte * captured.dag.total_param_bytes
    example_x, example_y = example_micro_batch(spec, dataset)
    driver_s = DRIVER_CONTROL_ROUND_TRIPS * driver_link[0] + feed_s(
        driver_link, [wire_bytes(example_x), wire_bytes(example_y)]
    )
    fixed = max(rest_s[0] - per_mb - optimizer_s - driver_s, 0.0)
    return ExecutorOverhead(step_s=fixed, micro_batch_s=per_mb, compute_factor=factor)


def plan_request(
    spec: JobSpec,
    profile: ModelProfile,
    round_trip_s: float,
    *,
    strategy: str | None = None,
    overhead: ExecutorOverhead | None = None,
    target_bytes: int = 0,
) -> PlanRequest:
    """The planner's view of the job."""
    overhead = overhead or ExecutorOverhead(step_s=3 * round_trip_s)
    costs = StepCosts(
        control_s=overhead.step_s,
        micro_batch_s=overhead.micro_batch_s,
        optimizer_s_per_byte=profile.optimizer_s_per_byte,
        driver_round_trip_s=round_trip_s,
        target_bytes=target_bytes,
    )
    return request_for_job(spec, strategy=strategy, step_costs=costs)


@dataclass
class Measurements:
    """Everything measured for planning one job."""

    dag: OpDag
    profile: ModelProfile
    topology: Topology
    round_trip_s: float
    overhead: ExecutorOverhead
    target_bytes: int = 0
    """Bytes of one micro-batch's targets (the driver sends them to the loss stage)."""
    calibrator: Any = None
    """Measures codec errors on the job's own tensors (:class:`compress.calibration.JobCalibrator`);
    None: compression is chosen from the convergence model's prior."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (the job's ``measured.json``): the measured topology and the
        calibrated costs; the node profile is left out (it is in the coordinator's cache)."""
        p = self.profile
        return {
            "topology": self.topology.to_dict(),
            "matmul_flops": p.matmul_flops,
            "compute_factor": p.compute_factor,
            "overhead_step_s": self.overhead.step_s,
            "overhead_micro_batch_s": self.overhead.micro_batch_s,
            "optimizer_s_per_byte": p.optimizer_s_per_byte,
            "round_trip_s": self.round_trip_s,
            "target_bytes": self.target_bytes,
        }

    def subset(self, indices: Sequence[int]) -> Measurements:
        """The same measurements restricted to some workers."""
        return replace(self, topology=self.topology.subset(list(indices)))


#: ``phase(name, detail)``: planning entered the step ``name`` (``detail`` says on what).
Phase = Callable[[str, str], None]


def _no_phase(name: str, detail: str) -> None:
    pass


def measure(
    spec: JobSpec,
    model: Any,
    captured: Any,
    dataset: Any,
    workers: Sequence[Endpoint],
    pool: ChannelPool,
    *,
    device: str = "cpu",
    cache: ProfileCache | None = None,
    calibrate_s: float = CALIBRATE_MIN_S,
    phase: Phase | None = None,
) -> Measurements:
    """Probe the driver's links and those between workers, profile the model and calibrate
    the executor on the worker nearest the driver (where a one-stage plan would run) for at
    least ``calibrate_s`` seconds of compute (:func:`calibrate_executor`).

    ``phase(name, detail)`` is called as each step begins: ``probing links``, ``profiling``
    and, when the cached profile is not calibrated yet, ``calibrating``."""
    phase = phase or _no_phase
    phase("probing links", f"{len(workers)} worker{'s' if len(workers) != 1 else ''} and the driver")
    driver_links = probe_driver_links(workers, pool)
    lat, bw = probe_links(workers, pool)
    home = min(range(len(workers)), key=lambda i: driver_links[i][0])
    phase("profiling", f"the model on {workers[home].name}")
    profile = profile_model(spec, captured.dag, workers[home], pool, device=device, cache=cache)
    # Node times were measured on workers[home] at profile.matmul_flops; other workers run at
    # their speed *relative to it* (the speeds workers report at join were measured under
    # different load, so only their ratios are trusted). Workers of one device on one machine
    # compute at one speed, its best report: otherwise that noise would rank two processes on
    # one CPU, and the planner could pick the one farther from the driver.
    reported = machine_speeds(workers)
    base = reported[home] or profile.matmul_flops
    scaled = [
        replace(w, matmul_flops=profile.matmul_flops * (speed or base) / base)
        for w, speed in zip(workers, reported, strict=True)
    ]
    topology = measured_topology(scaled, lat, bw).with_driver_links(driver_links)
    if profile.overhead_step_s is None or profile.overhead_micro_batch_s is None or profile.compute_factor is None:
        phase("calibrating", f"the executor on {workers[home].name} for {calibrate_s:g}s of compute")
        calibrated = calibrate_executor(
            spec,
            model,
            captured,
            dataset,
            workers[home],
            pool,
            profile,
            device=device,
            min_time_s=calibrate_s,
            driver_link=driver_links[home],
        )
        profile.overhead_step_s, profile.overhead_micro_batch_s = calibrated.step_s, calibrated.micro_batch_s
        profile.compute_factor = calibrated.compute_factor
        if cache is not None:
            cache.put(profile.cache_key, profile)
    overhead = ExecutorOverhead(step_s=profile.overhead_step_s, micro_batch_s=profile.overhead_micro_batch_s)
    _, example_y = example_micro_batch(spec, dataset)
    return Measurements(
        dag=costed_dag(captured.dag, profile),
        profile=profile,
        topology=topology,
        round_trip_s=statistics.median(rtt for rtt, _ in driver_links),
        overhead=overhead,
        target_bytes=wire_bytes(example_y),
        calibrator=job_calibrator(spec, captured, dataset) if spec.compression.mode != "none" else None,
    )


def machine_speeds(workers: Sequence[Endpoint]) -> list[float]:
    """Per worker, the fastest matmul speed reported by the workers of its device on its
    machine (same ``machine`` and ``device_name``; its own report where it named no machine).

    Processes that share one device measured it under different loads at join: their
    reports are noise around one speed, and the best is the device's. A different device
    name under one machine label is a different device (an operator's ``--machine`` label
    over unlike devices, or a testbed's stand-in for a slower one) and keeps its own speed,
    while the estimator still lets the machine's stages take turns (same ``machine``)."""
    best: dict[tuple[str, str], float] = {}
    for w in workers:
        if w.machine is not None:
            key = (w.machine, w.device_name)
            best[key] = max(best.get(key, 0.0), w.matmul_flops)
    return [best[(w.machine, w.device_name)] if w.machine is not None else w.matmul_flops for w in workers]


def wire_bytes(t: Any) -> int:
    """Bytes of a micro-batch's tensor (targets, inputs) on the wire."""
    return int(t.numel() * t.element_size())


def plan_job(spec: JobSpec, m: Measurements, *, strategy: str | None = None, memory_scale: float = 1.0) -> Plan:
    """Plan the job over the measured topology (predicted peaks times ``memory_scale``)."""
    request = plan_request(
        spec, m.profile, m.round_trip_s, strategy=strategy, overhead=m.overhead, target_bytes=m.target_bytes
    )
    request = replace(request, memory_scale=memory_scale)
    plan = make_plan(m.dag, m.topology, request)
    return calibrated(plan, m.dag, m.topology, request, m.calibrator)


def calibrated(plan: Plan, dag: OpDag, topology: Topology, request: PlanRequest, calibrator: Any) -> Plan:
    """``plan`` with its compression chosen again from the codecs' errors measured on the
    values that cross its cuts (unchanged without a calibrator or without cuts)."""
    if calibrator is None or not plan.cuts:
        return plan
    table = calibrator.table(cut_nodes(dag, plan))
    return with_compression(dag, topology, plan, replace(request, calibration=table))


class LinkTable:
    """Link fits between worker addresses, ``(one-way latency_s, bandwidth_bytes_per_s)``,
    refreshed from training transfers."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        self._lock = threading.Lock()

    def set(self, a: str, b: str, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        with self._lock:
            self._links[(a, b)] = (latency_s, bandwidth_bytes_per_s)

    def get(self, a: str, b: str) -> tuple[float, float] | None:
        with self._lock:
            return self._links.get((a, b))

    def bandwidths(self, addresses: Sequence[str]) -> dict[tuple[int, int], float]:
        """Measured bandwidth between each ordered pair of ``addresses`` by index (a job's
        stages, on those workers); unmeasured pairs and a stage with itself left out."""
        with self._lock:
            fits = {
                (i, j): self._links.get((a, b))
                for i, a in enumerate(addresses)
                for j, b in enumerate(addresses)
                if i != j
            }
        return {pair: fit[1] for pair, fit in fits.items() if fit is not None}

    def observe(self, a: str, b: str, size_bytes: int, seconds: float) -> None:
        """Fold one observed transfer into the link's bandwidth (exponential average)."""
        with self._lock:
            current = self._links.get((a, b))
            if current is None or size_bytes <= 0:
                return
            latency, bandwidth = current
            moving = seconds - 2 * latency  # a send is timed until its answer: the bytes and a round trip
            if moving <= 0:
                return
            observed = size_bytes / moving
            self._links[(a, b)] = (latency, (1 - REFRESH_WEIGHT) * bandwidth + REFRESH_WEIGHT * observed)

    def observe_step(
        self,
        sent_bytes: Mapping[tuple[int, int], int],
        sent_s: Mapping[tuple[int, int], float],
        addresses: Sequence[str],
        micro_batches: int,
    ) -> None:
        """Fold one step's transfers between stages (bytes and seconds per stage pair, the
        stages on ``addresses``) into the links, one message per micro-batch."""
        for (s, d), size in sent_bytes.items():
            seconds = sent_s.get((s, d), 0.0)
            if seconds > 0 and size > 0:
                self.observe(addresses[s], addresses[d], size // micro_batches, seconds / micro_batches)

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                f"{a}->{b}": {"latency_s": lat, "bandwidth_bytes_per_s": bw}
                for (a, b), (lat, bw) in self._links.items()
            }

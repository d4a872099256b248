"""Run one job on a set of workers: plan, load stages, train, write outputs.

A :class:`JobRunner` is a thread owned by the coordinator. It moves the job through
``planning`` → ``running`` → ``succeeded`` (or ``failed``/``cancelled`` with a reason),
records what planning measured (``measured.json``) and per-step metrics in SQLite and
``metrics.jsonl``, and at the end writes ``model.safetensors``, ``loss.png``, ``plan.json``
and ``summary.json``.

Volunteers come and go (DESIGN.md, Checkpoints and failures), so around the steps the runner:

- asks every stage to **snapshot** its state every ``checkpoint.replicate_every`` steps and
  stream it to a **buddy** worker (:mod:`~fusion.coordinator.replicas`), and has a durable
  checkpoint written every ``checkpoint.durable_every`` steps
  (:class:`~fusion.coordinator.durable_writer.DurableWriter`);
- on a failed step, hands the job to its :class:`~fusion.coordinator.recovery.Recovery`,
  which drops the workers that are gone, re-places the job and restores every stage, and
  replays from the step it returns;
- between steps, lets a worker that is leaving (Ctrl-C) hand off its state and puts workers
  that joined to use when that pays off (both a :meth:`Recovery.move`).

Placing the job — planning over workers, building and loading the driver, choosing buddies
(:meth:`JobRunner.configure`) — stays here: training and recovery both change it, and it is
the state they share. Every event (``worker_lost``, ``replaced``, ``replanned``,
``restored_from``, ``resumed_at_step``, …) goes to the job's log (``fusion status``) and
``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from compress import AdaTopK
from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.codec_trial import CodecTrial
from executor.compression import RatioController, cut_settings, encodes_any
from executor.driver import PipelineDriver, StepStats
from fusion.checkpoint import CheckpointDir
from fusion.config import JobSpec
from fusion.coordinator.durable_writer import DurableWriter
from fusion.coordinator.eligibility import CodeGate
from fusion.coordinator.loss_plot import read_records
from fusion.coordinator.memory_ledger import MemoryLedger, lent_bytes
from fusion.coordinator.outputs import (
    METRICS_FILE,
    JobOutputs,
    job_summary,
    metrics_record,
    read_history,
)
from fusion.coordinator.planning import (
    CALIBRATE_MIN_S,
    Endpoint,
    LinkProbeError,
    LinkTable,
    Measurements,
    ProfileCache,
    measure,
    plan_job,
)
from fusion.coordinator.recovery import MAX_RECOVERIES, Recovery, answering, diagnose
from fusion.coordinator.replicas import choose_buddies, snapshot_request
from fusion.coordinator.store import Store, WorkerRow
from fusion.errors import FusionError, StateError
from fusion.graph.split import StageSpec, split_stages
from fusion.training import (
    build_job_dataset,
    build_job_model,
    capture_job_model,
    example_micro_batch,
    job_batch,
)
from scheduler.plan import Plan

logger = logging.getLogger(__name__)

#: A joiner is used under ``use_joiners = "if_faster"`` when the re-plan is this much faster.
JOINER_GAIN = 0.9
#: Probes of a needed re-plan whose failures blame no worker are tried again this often, this far apart.
PROBE_RETRIES = 2
PROBE_RETRY_S = 5.0


class JobRunner(threading.Thread):
    """Drives one job to a terminal state on the given workers."""

    def __init__(
        self,
        *,
        store: Store,
        job_id: str,
        spec: JobSpec,
        workers: Sequence[WorkerRow],
        output_dir: str,
        pool: ChannelPool,
        on_done: Callable[[JobRunner], None],
        profiles: ProfileCache,
        links: LinkTable,
        device: str = "cpu",
        claim_idle: Callable[[JobRunner], list[WorkerRow]] | None = None,
        release: Callable[[JobRunner, WorkerRow, str], None] | None = None,
        calibrate_s: float = CALIBRATE_MIN_S,
    ) -> None:
        super().__init__(name=f"job-{job_id}", daemon=True)
        self.store = store
        self.job_id = job_id
        self.spec = spec
        self.workers = list(workers)
        self.output_dir = output_dir
        self.pool = pool
        self.on_done = on_done
        self.device = device
        self.calibrate_s = calibrate_s
        self.profiles = profiles
        self.links = links
        self.claim_idle = claim_idle or (lambda runner: [])
        self.release = release or (lambda runner, worker, state: None)
        self.checkpoints = CheckpointDir(Path(output_dir) / "checkpoints", keep=spec.checkpoint.keep)
        self.stage_workers: list[WorkerRow] = []
        self.buddies: dict[int, str] = {}
        self._stop_state: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._driver: PipelineDriver | None = None
        self._lost: dict[str, str] = {}
        self._leaving: dict[str, threading.Event] = {}
        #: Set when the job has ended and lets every worker go: one leaving from then on is
        #: released at once (the thread may still be closing its files for a while).
        self._released = False
        self._measurements: Measurements | None = None
        self._measured: list[str] = []  # worker ids in measurement order
        self._outputs: JobOutputs | None = None
        self._phase: tuple[str, float] | None = None  # (name, time.monotonic() it began)
        self._history: list[tuple[int, float]] = []
        #: Why the placement runs dense after its codec trial (None: it does not).
        self._trial_note: str | None = None
        self._write_failing = False
        self._durable: DurableWriter | None = None
        self.code_gate = CodeGate(self)
        #: Each stage's measured peak against its worker's cap, and the factor on predictions.
        self.memory = MemoryLedger()
        self.recovery = Recovery(self, pool=pool, checkpoints=self.checkpoints, initial=lambda: self.model.state_dict())

    # ------------------------------------------------------------- control from the coordinator
    @property
    def worker_ids(self) -> set[str]:
        return {w.worker_id for w in self.workers}

    def stop(self, state: str, reason: str) -> None:
        """End the job as ``state`` (``cancelled`` or ``failed``) with ``reason``, now."""
        with self._lock:
            if self._stop_state is None:
                self._stop_state = (state, reason)
            driver = self._driver
        if driver is not None:
            driver.abort(reason)

    def worker_lost(self, worker_id: str, reason: str) -> None:
        """A worker stopped heart-beating: abort the step, abandoning the driver's calls to it
        in flight (a frozen worker would hold them to their deadlines); the loop recovers
        without it."""
        with self._lock:
            self._lost[worker_id] = reason
            driver = self._driver
            address = next((w.address for w in self.stage_workers if w.worker_id == worker_id), None)
        if driver is not None and address is not None:
            driver.abandon(address, reason)

    def worker_leaving(self, worker_id: str) -> threading.Event:
        """A worker wants to leave: its state is handed off at the next step boundary.

        The returned event is set once the job no longer needs the worker.
        """
        with self._lock:
            event = self._leaving.setdefault(worker_id, threading.Event())
            released = self._released
        if released or not self.is_alive():
            event.set()
        return event

    def stopping(self) -> tuple[str, str] | None:
        """``(state, reason)`` once :meth:`stop` was called, else ``None``."""
        with self._lock:
            return self._stop_state

    def phase(self) -> tuple[str, float] | None:
        """``(name, seconds in it)`` of the planning step under way (``None`` between them)."""
        with self._lock:
            current = self._phase
        return None if current is None else (current[0], time.monotonic() - current[1])

    def enter_phase(self, name: str, detail: str = "") -> None:
        """Planning enters step ``name``: the status shows it, the log says so (``planning:
        probing links (3 workers and the driver)``) with how long the step before took."""
        now = time.monotonic()
        with self._lock:
            previous, self._phase = self._phase, (name, now)
        message = f"{name} ({detail})" if detail else name
        extra: dict[str, Any] = {"phase": name}
        if previous is not None:
            extra["previous_phase"], extra["previous_s"] = previous[0], round(now - previous[1], 3)
            message += f"; {previous[0]} took {now - previous[1]:.1f}s"
        self.event("planning", message, to_metrics=False, **extra)

    def end_phase(self) -> None:
        """Planning is over (the job trains, or ends)."""
        with self._lock:
            self._phase = None

    @property
    def driver(self) -> PipelineDriver:
        """The driver of the current placement."""
        assert self._driver is not None
        return self._driver

    # ------------------------------------------------------------- the job
    def run(self) -> None:
        try:
            outputs = JobOutputs(self.output_dir)
        except OSError as e:  # made at submit; removed or made unwritable since
            reason = f"cannot create the job's output directory {self.output_dir} ({e.strerror or e})"
            logger.error("job %s failed: %s", self.job_id, reason)
            self.store.transition(self.job_id, "failed", reason)
            self.on_done(self)
            return
        self._outputs = outputs
        t_start = time.time()
        try:
            self.store.transition(self.job_id, "planning")
            self.enter_phase("tracing", f"the model {self.spec.model.name}")
            self._prepare()
            step = self._place_first()
            self.end_phase()
            self.store.transition(self.job_id, "running")
            while step < self.spec.train.steps:
                if self.stopping() is not None:
                    break
                try:
                    step = self._between_steps(step)
                except FusionError as e:
                    # A hand-off or a joiner's re-plan failed (a worker died, froze or was cut
                    # off during it): recovered like a failed step.
                    if self.stopping() is not None:
                        raise
                    step = self._recover(e, step)
                    continue
                x, y = job_batch(self.spec, self.dataset, step)
                try:
                    stats = self.driver.train_step(
                        step,
                        (x,),
                        y,
                        snapshot=snapshot_request(
                            self.spec, step, self.buddies, [w.address for w in self.stage_workers], self.links.get
                        ),
                    )
                except FusionError as e:
                    if self.stopping() is not None:
                        raise
                    step = self._recover(e, step)
                    continue
                self._after_step(stats, x, step)
                step += 1
            stop = self.stopping()
            if stop is not None:
                raise StateError(stop[1])
            if self._durable is not None:
                self._durable.wait()
            state_dict = self.driver.state_dict()
            outputs.write_model(
                state_dict,
                metadata={"job_id": self.job_id, "model": self.spec.model.name, "steps": str(self.spec.train.steps)},
            )
            self._write("loss.png", lambda: self._plot(outputs))
            self._write("summary.json", lambda: outputs.write_summary(self._summary("succeeded", None, t_start)))
            self.store.transition(self.job_id, "succeeded")
        except BaseException as e:  # every failure ends the job with a reason; nothing escapes the thread
            stop = self.stopping()
            state, reason = (
                stop
                if stop is not None
                else ("failed", diagnose(e, [(w.name, w.address) for w in self.workers], self.pool))
            )
            if stop is None and not isinstance(e, FusionError):
                logger.error("job %s failed:\n%s", self.job_id, traceback.format_exc())
            # Record the end at once (the summary is quick); the plot and the clean-up after
            # a lost worker can take seconds.
            self._write("summary.json", lambda: outputs.write_summary(self._summary(state, reason, t_start)))
            try:
                if self.store.job(self.job_id).state != state:  # a waiting job stopped to wait on
                    self.store.transition(self.job_id, state, reason)
            except FusionError as e2:
                logger.error("job %s: could not record its end (%s): %s", self.job_id, reason, e2)
            if self._history:
                self._write("loss.png", lambda: self._plot(outputs))
        finally:
            self.end_phase()
            self._write("measured.json", lambda: outputs.write_measured(memory=self.memory.to_dict()))
            with self._lock:
                self._released = True
                leaving = list(self._leaving.values())
            for event in leaving:
                event.set()
            if self._durable is not None:
                self._durable.close()
            self._write("metrics.jsonl", outputs.close)
            if self._driver is not None:
                self._driver.close()
            self.on_done(self)

    def _recover(self, error: FusionError, step: int) -> int:
        """Recover from ``error`` at ``step``; a recovery that fails in turn (another worker
        lost while it placed or restored the job) is recovered from again, up to the
        recoveries a job may go through. Re-raises what recovery cannot mend."""
        while True:
            try:
                return self.recovery.recover(error, step, self._take_lost())
            except FusionError as e:
                if e is error or self.stopping() is not None or self.recovery.count >= MAX_RECOVERIES:
                    raise
                logger.warning("job %s: recovery failed (%s); recovering again", self.job_id, e)
                error = e

    def _after_step(self, stats: StepStats, x: Any, step: int) -> None:
        self.links.observe_step(
            stats.sent_bytes, stats.sent_s, [w.address for w in self.stage_workers], self.spec.train.micro_batches
        )
        self.memory.observe(stats.peak_memory_bytes)
        if stats.trial_verdict is not None:
            self.event("codec_trial", f"step {step}: {stats.trial_verdict}")
            if self.driver.codec_trial is not None and self.driver.codec_trial.verdict == "dense":
                self._trial_note = f"compression: every cut dense from step {step + 1} on: {stats.trial_verdict}"
        record = self._record(stats, x)
        assert self._outputs is not None
        self._write("metrics.jsonl", lambda: self._outputs.append_metrics(record))
        self.store.log(self.job_id, "metric", record)
        self.store.set_progress(self.job_id, step=step + 1, loss=stats.loss, samples_per_s=record["samples_per_s"])
        self._history.append((step, stats.loss))
        done = step + 1
        if done % self.spec.checkpoint.durable_every == 0 and done < self.spec.train.steps:
            self._durable_writer().submit(done, self.driver)

    def _durable_writer(self) -> DurableWriter:
        if self._durable is None:
            self._durable = DurableWriter(
                job_id=self.job_id,
                pool=self.pool,
                checkpoints=self.checkpoints,
                records=self.store,
                keep=self.spec.checkpoint.keep,
            )
        return self._durable

    def checkpoint(self, step: int) -> bool:
        """Write the durable checkpoint of ``step`` from the stages' snapshots of it, and wait
        for it; whether it was written."""
        writer = self._durable_writer()
        writer.wait()  # one being written would make this one be skipped
        writer.submit(step, self.driver)
        writer.wait()
        return any(c.step == step for c in self.checkpoints.list())

    def _write(self, what: str, write: Callable[[], None]) -> None:
        """Write one of the job's records in its output directory; a full (or failing) disk
        does not stop training: what cannot be written is logged, once until a write
        succeeds again. The model and the durable checkpoints have their own checks."""
        try:
            write()
        except OSError as e:
            if not self._write_failing:
                logger.warning(
                    "job %s: cannot write %s in %s (%s); training goes on, and records are lost until it can",
                    self.job_id,
                    what,
                    self.output_dir,
                    e.strerror or e,
                )
            self._write_failing = True
            return
        self._write_failing = False

    def event(self, event: str, message: str, *, to_metrics: bool = True, **extra: Any) -> None:
        """Log a job event (``fusion status``); changes of course also go to metrics.jsonl."""
        record = {"event": event, "message": message, **extra}
        self.store.log(self.job_id, "event", record)
        if to_metrics and self._outputs is not None:
            outputs = self._outputs
            self._write("metrics.jsonl", lambda: outputs.append_metrics(record))
        logger.info("job %s: %s: %s", self.job_id, event, message)

    # ------------------------------------------------------------- planning
    def _prepare(self) -> None:
        spec = self.spec
        self.model = build_job_model(spec)
        self.dataset = build_job_dataset(spec)
        example_x, self.example_y = example_micro_batch(spec, self.dataset)
        self.captured = capture_job_model(spec, self.model, example_x)

    def _endpoint(self, w: WorkerRow) -> Endpoint:
        return Endpoint.from_registration(w.name, w.address, w.resources)

    def _measure_all(self, workers: Sequence[WorkerRow]) -> None:
        """Profile the model (cached) and probe the links between ``workers``."""
        endpoints = [self._endpoint(w) for w in workers]
        t0 = time.perf_counter()
        m = measure(
            self.spec,
            self.model,
            self.captured,
            self.dataset,
            endpoints,
            self.pool,
            device=self.device,
            cache=self.profiles,
            calibrate_s=self.calibrate_s,
            phase=self.enter_phase,
        )
        for i, a in enumerate(endpoints):
            for j, b in enumerate(endpoints):
                if i != j:
                    self.links.set(
                        a.address, b.address, m.topology.latency_s[i][j], m.topology.bandwidth_bytes_per_s[i][j]
                    )
        self._measurements = m
        self._measured = [w.worker_id for w in workers]
        if self._outputs is not None:
            outputs = self._outputs
            self._write("measured.json", lambda: outputs.write_measured(m.to_dict()))
        self.store.log(
            self.job_id,
            "event",
            {
                "event": "measured",
                "message": f"profiled the model and {len(endpoints)} workers' links in {time.perf_counter() - t0:.1f}s",
            },
        )

    def _measure(self, workers: Sequence[WorkerRow]) -> list[WorkerRow]:
        """Measure ``workers`` for a placement the job needs (its first, a recovery's, a
        hand-off's); the workers the probes cannot reach are lost: each is dropped
        from the job (a ``worker_lost`` event) and the rest are measured again. Returns the
        workers measured. Failures that blame no worker (a link down for a moment) are
        probed again, :data:`PROBE_RETRIES` times; re-raises then, or when every worker is blamed."""
        held = list(workers)
        retries = PROBE_RETRIES
        while True:
            try:
                self._measure_all(held)
                return held
            except LinkProbeError as e:
                if self.stopping() is not None:
                    raise
                gone = [w for w in held if w.address in e.unreachable]
                if not gone and retries > 0:
                    retries -= 1
                    logger.warning("job %s: probing links failed (%s); probing again", self.job_id, e)
                    time.sleep(PROBE_RETRY_S)
                    continue
                if not gone or len(gone) == len(held):
                    raise
                for w in gone:
                    self.event(
                        "worker_lost",
                        f"worker {w.name} ({w.address}) cannot be reached while re-planning; left out: {e}",
                        worker=w.name,
                    )
                    if w in self.workers:
                        self.drop(w, "gone")
                held = [w for w in held if w not in gone]

    def planning_set(self, workers: Sequence[WorkerRow]) -> list[WorkerRow]:
        """The workers to plan over: all but the job's spares (at least one)."""
        keep = max(1, len(workers) - self.spec.cluster.spares)
        return list(workers[:keep])

    def _plan_over(self, workers: Sequence[WorkerRow], held: Sequence[WorkerRow]) -> Plan:
        """A plan over ``workers``; unmeasured ones have the links of all ``held`` measured first.

        This re-plan is needed (a recovery, a hand-off): a worker the probes cannot reach is
        treated as lost (:meth:`_measure`) and left out of the plan."""
        assert self._measurements is not None
        if any(w.worker_id not in self._measured for w in workers):
            measured = {w.worker_id for w in self._measure(held)}
            workers = [w for w in workers if w.worker_id in measured]
        assert self._measurements is not None
        indices = [self._measured.index(w.worker_id) for w in workers]
        strategy = self.spec.plan.strategy
        source = "the default [plan] strategy" if strategy == "opfence" else "the job file's [plan] strategy"
        self.enter_phase("searching", f"strategy {strategy}, {source}, over {len(workers)} workers")
        return plan_job(self.spec, self._measurements.subset(indices), memory_scale=self.memory.scale)

    def configure(
        self,
        workers: Sequence[WorkerRow],
        *,
        why: str,
        same_stages: bool,
        replace: Mapping[str, WorkerRow] | None = None,
        note: str = "",
        held: Sequence[WorkerRow] | None = None,
    ) -> None:
        """Build (and load) the driver for a new placement.

        ``same_stages``: keep the current stages and swap workers per ``replace`` (old worker
        id → new worker); otherwise plan over ``workers`` afresh. The new driver's stages are
        loaded without parameters when a restore follows (``why`` other than ``planned``).
        ``held``: the job's workers the placement may use (default: all it holds); the old
        stages are unloaded there, the rest are admitted as spares and buddies.
        """
        t0 = time.perf_counter()
        held = list(self.workers if held is None else held)
        if same_stages:
            assert replace is not None
            stage_workers = [replace.get(w.worker_id, w) for w in self.stage_workers]
            plan = dataclasses.replace(
                self.plan,
                stages=tuple(
                    dataclasses.replace(s, worker=w.name) for s, w in zip(self.plan.stages, stage_workers, strict=False)
                ),
            )
            stages = self.stages
        else:
            plan = self._plan_over(workers, held)
            held = [w for w in held if w.worker_id in self.worker_ids]  # less any found unreachable
            by_name = {w.name: w for w in workers}
            stage_workers = [by_name[s.worker] for s in plan.stages]
            stages = split_stages(self.captured.dag, plan.assignment())
            if plan.extra.get("why"):
                self.event("left_out", str(plan.extra["why"]), to_metrics=why != "planned")
            if plan.extra.get("compression_note"):
                self.event("compression", str(plan.extra["compression_note"]))
        where = ", ".join(w.name for w in stage_workers)
        self.enter_phase("loading stages", f"{len(stages)} stage{'s' if len(stages) != 1 else ''} on {where}")
        old = self._driver
        if old is not None:
            # The old stages go; their snapshots stay (the restore reads them).
            addresses = {w.address for w in held}
            run_parallel(
                [
                    lambda a=a: _quiet(
                        lambda: ExecutorClient(a, self.pool).unload_job(self.job_id, keep_snapshots=True)
                    )
                    for a in addresses
                ],
                name="unload",
            )
            old.release()
        self.plan, self.stages, self.stage_workers = plan, stages, stage_workers
        self.memory.placed(
            [s.peak_memory_bytes for s in plan.stages], [(w.name, lent_bytes(w.resources)) for w in stage_workers]
        )
        driver = self._make_driver(plan, stages, stage_workers)
        with self._lock:
            self._driver = driver
            if self._stop_state is not None:
                raise StateError(self._stop_state[1])
        self.store.set_plan(self.job_id, plan.to_dict(), [w.name for w in stage_workers])
        assert self._outputs is not None
        outputs = self._outputs
        self._write("plan.json", lambda: outputs.write_plan(plan.to_dict()))
        driver.load(set_initial=why == "planned")
        in_plan = {w.worker_id for w in stage_workers}
        spares = [w.address for w in held if w.worker_id not in in_plan]
        # Workers the job still holds outside ``held`` (leavers handing off) serve their
        # snapshots to the new stages' restore, which proves the new job key.
        kept = {w.worker_id for w in held}
        spares += [w.address for w in self.workers if w.worker_id not in kept]
        run_parallel([lambda a=a: _quiet(lambda: driver.admit([a])) for a in spares], name="admit")
        self.buddies = choose_buddies(
            [w.address for w in self.stage_workers], [w.address for w in held], self.links.get
        )
        predicted = f", predicted {plan.predicted_step_s:.3f}s/step" if plan.predicted_step_s is not None else ""
        buddies = ", ".join(
            f"{stage_workers[i].name}→{self._name_of(a, held)}" for i, a in sorted(self.buddies.items())
        )
        self.event(
            why,
            f"{note}{plan.strategy}: {len(stages)} stage(s) on {where}{predicted}; "
            f"replicas {buddies or 'none'} ({time.perf_counter() - t0:.2f}s)",
            to_metrics=why != "planned",
            stages=[w.name for w in stage_workers],
            buddies={stage_workers[i].name: self._name_of(a, held) for i, a in self.buddies.items()},
        )
        self.end_phase()

    def _make_driver(
        self, plan: Plan, stages: Sequence[StageSpec], stage_workers: Sequence[WorkerRow]
    ) -> PipelineDriver:
        spec = self.spec
        self._trial_note = None  # the new placement's compression is tried afresh
        settings = cut_settings(
            [
                (c.src_stage, c.dst_stage, c.codec, c.keep_ratio, c.bits)
                + (c.gradient_codec, c.gradient_keep_ratio, c.gradient_bits)
                for c in plan.cuts
            ],
            directions=spec.compression.directions,
        )
        addresses = [w.address for w in stage_workers]
        controller = None
        if spec.compression.mode == "adatopk" and settings:
            controller = RatioController(
                AdaTopK(min_keep_ratio=spec.compression.min_keep_ratio),
                link_of=lambda a, b: self.links.get(addresses[a], addresses[b]),
                floors={cut: setting.keep_ratio for cut, setting in settings.items()},
            )
        return PipelineDriver(
            job_id=self.job_id,
            job=spec,
            model=self.model,
            captured=self.captured,
            stages=stages,
            addresses=addresses,
            example_target=self.example_y,
            device=self.device,
            pool=self.pool,
            cut_settings=settings,
            ratio_controller=controller,
            codec_trial=codec_trial_for(spec, plan, encodes_any(settings)),  # a new placement, a new trial
            link_bytes_per_s=self.links.bandwidths(addresses),
            feed_bytes_per_s=self._feed_bandwidths(stage_workers),
            leaf_modules=spec.model.leaf_modules,
            planned_peak_memory_bytes=[s.peak_memory_bytes or 0 for s in plan.stages],
        )

    def _feed_bandwidths(self, stage_workers: Sequence[WorkerRow]) -> dict[int, float]:
        """Per stage, the measured bandwidth of the driver's link to its worker (none where
        the driver's links were not probed)."""
        topology = self._measurements.topology if self._measurements is not None else None
        if topology is None or topology.driver_links is None:
            return {}
        index = {w.name: i for i, w in enumerate(topology.workers)}
        return {s: topology.driver_link(index[w.name])[1] for s, w in enumerate(stage_workers) if w.name in index}

    @staticmethod
    def _name_of(address: str, workers: Sequence[WorkerRow]) -> str:
        return next((w.name for w in workers if w.address == address), address)

    # ------------------------------------------------------------- membership
    def _take_lost(self) -> dict[str, str]:
        """The workers reported lost since the last call (worker id -> reason)."""
        with self._lock:
            flagged = dict(self._lost)
            self._lost.clear()
        return flagged

    def drop(self, worker: WorkerRow, state: str) -> None:
        """Let ``worker`` go from the job; the coordinator records it as ``state``."""
        self.workers.remove(worker)
        self.release(self, worker, state)

    def rewind(self, step: int) -> None:
        """Forget the losses from ``step`` on (they are replayed) and report ``step`` as the progress."""
        self._history = [(s, loss) for s, loss in self._history if s < step]
        self.store.set_progress(
            self.job_id,
            step=step,
            loss=self._history[-1][1] if self._history else float("nan"),
            samples_per_s=0.0,
        )

    def loss_found(self, step: int, loss: float) -> None:
        """Add the loss of a ``step`` the driver never heard end (recovery read it from the
        loss stage's snapshot) to the loss curve; :meth:`rewind` to ``step + 1`` came first,
        so every step the curve holds is before it."""
        self._history.append((step, loss))

    def wait_for(self, text: str | None) -> None:
        """Wait, ``pending``, saying ``text`` (what the job needs and has), or with ``None``
        go back to ``running``."""
        state = self.store.job(self.job_id).state
        self.store.set_waiting(self.job_id, text)
        if text is not None:
            self.event("waiting_for_workers", f"waiting for workers: the job {text}")
            if state == "running":
                self.store.transition(self.job_id, "pending")
        elif state == "pending":
            self.store.transition(self.job_id, "planning")
            self.store.transition(self.job_id, "running")

    def _place_first(self) -> int:
        """The job's first placement (after a coordinator restart: and its restore from the
        newest durable checkpoint); returns the step to start at. A worker lost meanwhile
        (killed, frozen past the heartbeat timeout, cut off) is dropped and the job placed
        again without it, up to the recoveries a job may go through."""
        for _ in range(MAX_RECOVERIES):
            try:
                self.code_gate.place()
                return self._resume_from_durable()
            except FusionError as e:
                if self.stopping() is not None:
                    raise
                flagged = self._take_lost()
                alive = answering([w.address for w in self.workers], self.pool, (2.0, 8.0))
                gone = [w for w, ok in zip(list(self.workers), alive, strict=True) if not ok or w.worker_id in flagged]
                if not gone or len(gone) == len(self.workers):
                    raise
                for w in gone:
                    self.event(
                        "worker_lost",
                        f"worker {w.name} ({w.address}) was lost while the job was placed ({e}); placing it again",
                        worker=w.name,
                    )
                    self.drop(w, "gone")
        raise StateError(f"gave up placing the job after {MAX_RECOVERIES} tries: workers kept being lost")

    def _resume_from_durable(self) -> int:
        """After a coordinator restart: continue from the newest durable checkpoint."""
        point = self.recovery.resume()
        if point is None:
            return 0
        self._history = read_history(Path(self.output_dir) / METRICS_FILE, point.step)
        self.event("resumed_at_step", f"resumed at step {point.step} from {point.describe()}", step=point.step)
        return point.step

    # ------------------------------------------------------------- between steps
    def claim(self, *, force: bool = False) -> list[WorkerRow]:
        """Take idle workers from the coordinator (used as spares or in the next re-plan)."""
        joined = self.code_gate.screen([w for w in self.claim_idle(self) if w.worker_id not in self.worker_ids])
        self.workers.extend(joined)
        for w in joined:
            self.event("worker_joined", f"worker {w.name} ({w.address}) joined the job", worker=w.name)
        return joined

    def leaving(self) -> set[str]:
        """Ids of the job's workers that asked to leave and are not let go yet."""
        with self._lock:
            return {wid for wid, ev in self._leaving.items() if not ev.is_set() and wid in self.worker_ids}

    def _between_steps(self, step: int) -> int:
        """Leavers hand off, silent spares are dropped, joiners are put to use; returns the
        step to train next (earlier than ``step`` only when a snapshot of it was lost).

        A leave that arrives while joiners are measured turns their re-plan into the
        leavers' hand-off (joiners included): a leaving worker is never placed."""
        leaving = self.leaving()
        with self._lock:
            flagged = {wid: r for wid, r in self._lost.items() if wid not in {w.worker_id for w in self.stage_workers}}
            for wid in flagged:
                self._lost.pop(wid, None)
        for wid, reason in flagged.items():  # a spare stopped heart-beating: just let it go
            w = next((w for w in self.workers if w.worker_id == wid), None)
            if w is not None:
                self.event("worker_lost", reason, worker=w.name, failed_step=step)
                self.drop(w, "gone")
                self.buddies = choose_buddies(
                    [w.address for w in self.stage_workers], [w.address for w in self.workers], self.links.get
                )
        if leaving:
            return self._handoff(step, leaving)
        policy = self.spec.cluster.use_joiners
        if policy == "never":
            return step
        joined = self.claim()
        if not joined or not self._measure_with_joiners(joined):
            return step
        if policy == "if_faster" and not self.code_gate.attempt(self._faster_with_joiners):
            leaving = self.leaving()
            return self._handoff(step, leaving) if leaving else step
        leaving = self.leaving()
        if leaving:
            return self._handoff(step, leaving)
        return self.recovery.move(step, exclude=set(), why="replanned")

    def _measure_with_joiners(self, joined: Sequence[WorkerRow]) -> bool:
        """Measure the links of the job's workers with ``joined``; ``False`` keeps the current
        plan. The re-plan is optional: a probe that fails (a worker killed, frozen or cut
        off meanwhile) never fails the job. The joiners it blames are let go (``gone``); the
        stage workers it blames stay, for the heartbeat (or the next step) to judge."""
        try:
            self._measure_all(self.workers)
            return True
        except FusionError as e:
            if self.stopping() is not None:
                raise
            self.end_phase()
            blamed = set(e.unreachable) if isinstance(e, LinkProbeError) else set()
            dropped = [w for w in joined if w.address in blamed and w in self.workers]
            for w in dropped:
                self.drop(w, "gone")
            let_go = f"; let go: {', '.join(w.name for w in dropped)}" if dropped else ""
            self.event(
                "replan_skipped",
                f"measuring links with {', '.join(w.name for w in joined)} failed ({e}); keeping the current "
                f"plan{let_go}",
                workers=[w.name for w in joined],
                dropped=[w.name for w in dropped],
            )
            return False

    def _faster_with_joiners(self) -> bool:
        current = self.plan.predicted_step_s
        candidate = self._plan_over(self.planning_set(self.workers), self.workers)
        self.end_phase()
        faster = (
            current is not None
            and candidate.predicted_step_s is not None
            and candidate.predicted_step_s < JOINER_GAIN * current
        )
        self.event(
            "replan_considered",
            f"with {len(self.workers)} workers the plan would take {candidate.predicted_step_s}s/step "
            f"vs {current}s now: {'re-planning' if faster else 'keeping the plan'}",
        )
        return faster

    def _handoff(self, step: int, leaving: set[str]) -> int:
        names = [w.name for w in self.workers if w.worker_id in leaving]
        self.event(
            "worker_leaving",
            f"{', '.join(names)} asked to leave; handing off their state at step {step}",
            workers=names,
        )
        resumed = self.recovery.move(step, exclude=leaving, why="replanned", let_go=lambda: self._let_go(leaving))
        self._let_go(leaving)
        return resumed

    def _let_go(self, leaving: set[str]) -> None:
        """The job no longer needs the ``leaving`` workers: drop them and end their wait."""
        with self._lock:
            events = [self._leaving[wid] for wid in leaving]
        for w in [w for w in self.workers if w.worker_id in leaving]:
            self.drop(w, "gone")
        for ev in events:
            ev.set()

    # ------------------------------------------------------------- records
    def _record(self, stats: StepStats, x: Any) -> dict[str, Any]:
        workers = self.stage_workers
        bandwidth = self.links.bandwidths([w.address for w in workers])
        return metrics_record(
            stats, x, [w.name for w in workers], lambda s, d: bandwidth.get((s, d)), self.plan.predicted_step_s
        )

    def _plot(self, outputs: JobOutputs) -> None:
        steps = [s for s, _ in self._history]
        losses = [loss for _, loss in self._history]
        records = read_records(outputs.dir / METRICS_FILE)  # its events are marked on the curve
        outputs.write_loss_plot(steps, losses, f"{self.spec.name} ({self.job_id})", records=records)

    def _summary(self, state: str, reason: str | None, t_start: float) -> dict[str, Any]:
        return job_summary(
            self.job_id,
            self.spec,
            state,
            reason,
            [loss for _, loss in self._history],
            wall_s=time.time() - t_start,
            workers=[w.name for w in self.workers],
            recoveries=self.recovery.count,
            compression_note=self._trial_note or _compression_note(getattr(self, "plan", None)),
        )


def _compression_note(plan: Plan | None) -> str | None:
    """The plan's note that its compression settings compress no cut, if any."""
    return None if plan is None else plan.extra.get("compression_note")


def codec_trial_for(spec: JobSpec, plan: Plan, compresses: bool) -> CodecTrial | None:
    """The trial of a placement's compression against dense steps (:mod:`executor.codec_trial`):
    for AdaTopK's choice when it compresses a cut, with the plan's convergence cost; None for
    a fixed codec the owner named, or when nothing is compressed."""
    if spec.compression.mode != "adatopk" or not compresses:
        return None
    return CodecTrial(convergence_cost=float(plan.extra.get("compression", {}).get("convergence_cost", 1.0)))


def _quiet(call: Callable[[], Any]) -> None:
    try:
        call()
    except FusionError as e:
        logger.info("ignored during re-placement: %s", e)

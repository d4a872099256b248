"""Run one job on a set of workers: plan, load stages, train, write the outputs.

A :class:`JobRunner` is a thread owned by the coordinator. It moves the job through
``planning`` → ``running`` → ``succeeded`` (or ``failed``/``cancelled`` with a reason),
records per-step metrics in SQLite and ``metrics.jsonl``, and at the end writes
``model.safetensors``, ``loss.png``, ``plan.json`` and ``summary.json``. The coordinator
stops a runner through :meth:`JobRunner.stop` (cancel, or a lost worker), which aborts the
step in flight on every worker so nothing waits for a peer that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from executor.client import ChannelPool, run_parallel
from compress import AdaTopK
from executor.compression import RatioController, cut_settings
from executor.driver import PipelineDriver, StepStats
from fusion.config import JobSpec
from fusion.coordinator.outputs import JobOutputs
from fusion.coordinator.store import Store, WorkerRow
from fusion.errors import FusionError, StateError
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch
from fusion.coordinator.planning import Endpoint, LinkTable, ProfileCache, measure, plan_job
from scheduler.plan import Plan

logger = logging.getLogger(__name__)


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
        self.profiles = profiles
        self.links = links
        self.plan_workers: dict[str, WorkerRow] = {}
        self._stop_state: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._driver: PipelineDriver | None = None

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

    def _stopping(self) -> tuple[str, str] | None:
        with self._lock:
            return self._stop_state

    def run(self) -> None:
        outputs = JobOutputs(self.output_dir)
        driver: PipelineDriver | None = None
        steps: list[int] = []
        losses: list[float] = []
        t_start = time.time()
        try:
            self.store.transition(self.job_id, "planning")
            driver, plan, dataset = self._plan(outputs)
            with self._lock:
                self._driver = driver
                if self._stop_state is not None:
                    raise StateError(self._stop_state[1])
            driver.load()
            self.store.transition(self.job_id, "running")
            for step in range(self.spec.train.steps):
                if self._stopping() is not None:
                    break
                x, y = job_batch(self.spec, dataset, step)
                stats = driver.train_step(step, (x,), y)
                self._refresh_links(stats, plan)
                record = self._record(stats, x, plan)
                outputs.append_metrics(record)
                self.store.log(self.job_id, "metric", record)
                self.store.set_progress(self.job_id, step=step + 1, loss=stats.loss, samples_per_s=record["samples_per_s"])
                steps.append(step)
                losses.append(stats.loss)
            stop = self._stopping()
            if stop is not None:
                raise StateError(stop[1])
            state_dict = driver.state_dict()
            outputs.write_model(state_dict, metadata={"job_id": self.job_id, "model": self.spec.model.name, "steps": str(len(steps))})
            outputs.write_loss_plot(steps, losses, f"{self.spec.name} ({self.job_id})")
            outputs.write_summary(self._summary("succeeded", None, steps, losses, t_start))
            self.store.transition(self.job_id, "succeeded")
        except BaseException as e:  # every failure ends the job with a reason; nothing escapes the thread
            stop = self._stopping()
            state, reason = stop if stop is not None else ("failed", self._diagnose(e))
            if stop is None and not isinstance(e, FusionError):
                logger.error("job %s failed:\n%s", self.job_id, traceback.format_exc())
            # Record the end at once (the summary is quick); the plot and the clean-up after
            # a lost worker can take seconds.
            outputs.write_summary(self._summary(state, reason, steps, losses, t_start))
            try:
                self.store.transition(self.job_id, state, reason)
            except FusionError as e2:
                logger.error("job %s: could not record its end (%s): %s", self.job_id, reason, e2)
            if steps:
                outputs.write_loss_plot(steps, losses, f"{self.spec.name} ({self.job_id})")
        finally:
            outputs.close()
            if driver is not None:
                driver.close()
            self.on_done(self)

    def _diagnose(self, e: BaseException) -> str:
        """The failure reason; names the workers that no longer answer, if any."""
        reason = _reason(e)
        if not isinstance(e, FusionError):
            return reason
        from executor.client import ExecutorClient

        def answers(w: WorkerRow) -> bool:
            try:
                ExecutorClient(w.address, self.pool).ping(timeout_s=1.0, attempts=1)
                return True
            except FusionError:
                return False

        alive = run_parallel([lambda w=w: answers(w) for w in self.workers], name="diagnose")
        gone = [f"{w.name} ({w.address})" for w, ok in zip(self.workers, alive) if not ok]
        if gone:
            return f"worker {', '.join(gone)} stopped answering: {reason}"
        return reason

    def _plan(self, outputs: JobOutputs) -> tuple[PipelineDriver, Plan, Any]:
        """Measure (profile, links, executor overhead), plan with the job's strategy, build the driver."""
        spec = self.spec
        model = build_job_model(spec)
        dataset = build_job_dataset(spec)
        example_x, example_y = example_micro_batch(spec, dataset)
        captured = capture(model, (example_x,))
        endpoints = [
            Endpoint(
                name=w.name,
                address=w.address,
                matmul_flops=float(w.resources.get("matmul_flops") or 1.0e12),
                memory_bytes=int(w.resources["device_memory_bytes"]) if w.resources.get("device_memory_bytes") else None,
                device_name=str(w.resources.get("device_name", "")),
            )
            for w in self.workers
        ]
        t0 = time.perf_counter()
        measurements = measure(spec, model, captured, dataset, endpoints, self.pool, device=self.device, cache=self.profiles)
        for i, a in enumerate(endpoints):
            for j, b in enumerate(endpoints):
                if i != j:
                    self.links.set(a.address, b.address, measurements.topology.latency_s[i][j], measurements.topology.bandwidth_bytes_per_s[i][j])
        self.store.log(self.job_id, "event", {"event": "measured", "message": f"profiled the model and {len(endpoints)} workers' links in {time.perf_counter() - t0:.1f}s"})
        plan = plan_job(spec, measurements)
        self.plan_workers = {w.name: w for w in self.workers}
        used = [self.plan_workers[s.worker] for s in plan.stages]
        stages = split_stages(captured.dag, plan.assignment())
        self.store.set_plan(self.job_id, plan.to_dict(), [w.name for w in used])
        outputs.write_plan(plan.to_dict())
        predicted = f", predicted {plan.predicted_step_s:.3f}s/step" if plan.predicted_step_s is not None else ""
        self.store.log(
            self.job_id,
            "event",
            {"event": "planned", "message": f"{plan.strategy}: {len(stages)} stage(s) on {', '.join(w.name for w in used)}{predicted} ({plan.planning_s:.2f}s)"},
        )
        settings = cut_settings([(c.src_stage, c.dst_stage, c.codec, c.keep_ratio) for c in plan.cuts], directions=spec.compression.directions)
        controller = None
        if spec.compression.mode == "adatopk" and settings:
            addresses = [w.address for w in used]
            controller = RatioController(
                AdaTopK(min_keep_ratio=spec.compression.min_keep_ratio),
                link_of=lambda a, b: self.links.get(addresses[a], addresses[b]),
            )
        driver = PipelineDriver(
            job_id=self.job_id,
            job=spec,
            model=model,
            captured=captured,
            stages=stages,
            addresses=[w.address for w in used],
            example_target=example_y,
            device=self.device,
            pool=self.pool,
            cut_settings=settings,
            ratio_controller=controller,
        )
        return driver, plan, dataset

    def _refresh_links(self, stats: StepStats, plan: Plan) -> None:
        """Fold the step's transfers into the link estimates (one message per micro-batch)."""
        m = self.spec.train.micro_batches
        for (s, d), size in stats.sent_bytes.items():
            seconds = stats.sent_s.get((s, d), 0.0)
            a, b = self.plan_workers[plan.stages[s].worker].address, self.plan_workers[plan.stages[d].worker].address
            if seconds > 0 and size > 0:
                self.links.observe(a, b, size // m, seconds / m)

    def _record(self, stats: StepStats, x: Any, plan: Plan) -> dict[str, Any]:
        batch = int(x.shape[0])
        record: dict[str, Any] = {
            "step": stats.step,
            "loss": stats.loss,
            "step_s": round(stats.step_s, 6),
            "samples_per_s": batch / stats.step_s if stats.step_s > 0 else 0.0,
        }
        if x.dim() == 2 and not x.is_floating_point():  # token ids (B, T)
            record["tokens_per_s"] = x.numel() / stats.step_s if stats.step_s > 0 else 0.0
        record["bytes_per_link"] = {
            f"{plan.stages[s].worker}->{plan.stages[d].worker}": size for (s, d), size in sorted(stats.sent_bytes.items())
        }
        record["compute_s"] = {plan.stages[s].worker: round(c, 6) for s, c in sorted(stats.compute_s.items())}
        links = {}
        for s, d in sorted(stats.sent_bytes):
            a, b = self.plan_workers[plan.stages[s].worker], self.plan_workers[plan.stages[d].worker]
            fit = self.links.get(a.address, b.address)
            if fit is not None:
                links[f"{a.name}->{b.name}"] = round(fit[1], 1)
        record["link_bandwidth_bytes_per_s"] = links
        if stats.keep_ratios:
            record["compression"] = {
                f"{plan.stages[s].worker}->{plan.stages[d].worker}": {
                    "keep_ratio": round(ratio, 5),
                    "dense_bytes": stats.dense_bytes.get((s, d), 0),
                    "sent_bytes": stats.sent_bytes.get((s, d), 0),
                }
                for (s, d), ratio in sorted(stats.keep_ratios.items())
            }
        if plan.predicted_step_s is not None:
            record["predicted_step_s"] = round(plan.predicted_step_s, 6)
        return record

    def _summary(self, state: str, reason: str | None, steps: list[int], losses: list[float], t_start: float) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "name": self.spec.name,
            "state": state,
            "reason": reason,
            "steps_done": len(steps),
            "steps": self.spec.train.steps,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "wall_s": round(time.time() - t_start, 3),
            "workers": [w.name for w in self.workers],
            "spec": self.spec.to_dict(),
        }


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, FusionError) else f"{type(e).__name__}: {text}"

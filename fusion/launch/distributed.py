"""Train a job over executors that are already running: the coordinator's work, without one.

:func:`train_distributed` captures the job's model, cuts it (an explicit assignment or an
even split), loads the stages onto the executors at the given addresses (for instance a
:class:`~fusion.launch.executors.LocalCluster`'s) and runs the steps, returning the losses
and the trained ``state_dict`` under the original names — the same shape of result as
:func:`fusion.training.train_reference`, which the parity tests compare it with.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from executor.client import ChannelPool
from executor.compression import CutSetting, RatioController
from executor.driver import PipelineDriver, StepStats
from fusion.config import JobSpec
from fusion.errors import FusionError
from fusion.graph.export import capture
from fusion.graph.ir import OpDag
from fusion.graph.split import StageSpec, split_stages
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch
from scheduler.baselines import uniform_assignment

logger = logging.getLogger(__name__)


@dataclass
class DistributedResult:
    """What a distributed run produced."""

    losses: list[float] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients of the last step before its optimizer update (canonical names), if asked for."""
    stats: list[StepStats] = field(default_factory=list)
    dag: OpDag | None = None
    stages: list[StageSpec] = field(default_factory=list)


def train_distributed(
    job: JobSpec,
    addresses: Sequence[str],
    *,
    assignment: Mapping[str, int] | None = None,
    stage_workers: Sequence[int] | None = None,
    steps: int | None = None,
    leaf_modules: Sequence[str] = (),
    device: str = "cpu",
    collect_gradients: bool = False,
    pool: ChannelPool | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    cut_settings: Mapping[tuple[int, int], CutSetting] | None = None,
    ratio_controller: RatioController | None = None,
    link_bytes_per_s: Mapping[tuple[int, int], float] | None = None,
    feed_bytes_per_s: Mapping[int, float] | None = None,
) -> DistributedResult:
    """Train ``job`` with its model split over the executors at ``addresses``.

    Args:
        job: the job (model, data, training settings).
        addresses: executor addresses; by default stage ``i`` runs on ``addresses[i]``.
        assignment: compute node → stage index; default: an even split into
            ``len(addresses)`` stages.
        stage_workers: which address index hosts each stage (several stages may share one).
        steps: number of steps (default ``job.train.steps``).
        leaf_modules: module paths to keep whole during capture.
        device: device of every stage (``cpu``, ``cuda``, ``cuda:N``).
        collect_gradients: also return the last step's gradients (costs one fetch per step).
        pool: gRPC channels to reuse.
        on_step: called after every step with its statistics.
        cut_settings: codecs of compressed cuts, by (src stage, dst stage).
        ratio_controller: AdaTopK's per-step ratio updates for those cuts.
        link_bytes_per_s: bandwidth between the workers of two stages, by (src, dst) stage:
            the stages pace their sends at it (:mod:`executor.sender`); unlisted pairs send
            one transfer at a time.
        feed_bytes_per_s: bandwidth from this process to each stage's worker, by stage: the
            driver paces its feed of inputs and targets at it; unlisted stages are fed one
            send at a time.
    """
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    example_x, example_y = example_micro_batch(job, dataset)
    captured = capture(model, (example_x,), leaf_modules=leaf_modules)
    if assignment is None:
        assignment = uniform_assignment(captured.dag, len(addresses))
    stages = split_stages(captured.dag, assignment)
    workers = list(stage_workers) if stage_workers is not None else list(range(len(stages)))
    if len(workers) != len(stages) or any(not 0 <= w < len(addresses) for w in workers):
        raise FusionError(
            f"stage_workers must give a worker index in [0, {len(addresses)}) for each of {len(stages)} stages"
        )
    driver = PipelineDriver(
        job_id=f"local-{uuid.uuid4().hex[:8]}",
        job=job,
        model=model,
        captured=captured,
        stages=stages,
        addresses=[addresses[w] for w in workers],
        example_target=example_y,
        leaf_modules=leaf_modules,
        device=device,
        pool=pool,
        cut_settings=cut_settings,
        ratio_controller=ratio_controller,
        link_bytes_per_s=link_bytes_per_s,
        feed_bytes_per_s=feed_bytes_per_s,
    )
    result = DistributedResult(dag=captured.dag, stages=stages)
    try:
        driver.load()
        for step in range(job.train.steps if steps is None else steps):
            x, y = job_batch(job, dataset, step)
            t0 = time.perf_counter()
            stats = driver.forward_backward(step, (x,), y)
            driver.sync_tied_gradients(step)
            if collect_gradients:
                result.gradients = driver.gradients()
            driver.apply(step)
            stats.step_s = time.perf_counter() - t0
            result.losses.append(stats.loss)
            result.stats.append(stats)
            if on_step is not None:
                on_step(stats)
        result.state_dict = driver.state_dict()
    finally:
        driver.close()
    return result

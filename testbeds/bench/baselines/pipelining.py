"""Baseline: ``torch.distributed.pipelining`` GPipe with an even split, one stage per host.

    python -m testbeds.bench.baselines.pipelining --job J --rank R --world-size S --master HOST:PORT \
        --address MY_IP [--steps N] [--metrics PATH]

Every rank builds the job's model (seeded, as fusion does), splits it with ``pipeline()`` at
the even block boundaries of :mod:`testbeds.sim.block_split` and keeps stage ``R``; the
schedule is :class:`~torch.distributed.pipelining.ScheduleGPipe` with the job's
micro-batches and the mean loss per micro-batch (gradients scaled by ``1 / M``), so a step
is the mean-loss step fusion takes. A parameter that two stages hold (GPT-2's tied
embedding and head) has its gradients summed between those ranks before the optimizer
step, as Megatron does; ``pipeline()`` alone would let the copies drift apart.

Rank 0 (which finishes last: backward ends there) records each step's wall seconds; the
last rank's loss, and the activation bytes each rank receives per step (its inbound cut,
whose gradients go back the same size), are all-reduced to rank 0 once after the last
step, outside any step's timing, with each rank's peak memory
(:mod:`testbeds.bench.baselines.memory`).

The ranks are the hosts the benchmark lists, stage 0 on the first: ``pipelining`` gives
the first hosts in join order, ``pipelining-best`` the cluster chain of
:func:`testbeds.bench.systems.best_pipeline_hosts`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

from fusion.losses import get_loss
from fusion.optim import build_optimizer
from fusion.training import (
    build_job_dataset,
    build_job_model,
    example_micro_batch,
    job_batch,
)
from testbeds.bench.baselines.memory import PeakMemory
from testbeds.bench.baselines.profiled import gpipe_attach_args
from testbeds.bench.baselines.rank import (
    MetricsWriter,
    StepTimer,
    gloo_group,
    parse_args,
    rank_main,
    token_count,
)
from testbeds.sim.block_split import block_names, even_split_points

logger = logging.getLogger(__name__)


def tied_groups(model: torch.nn.Module) -> list[set[str]]:
    """Sets of parameter names that are one tensor in the model (tied weights)."""
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    return [group for group in names.values() if len(group) > 1]


def stage_param_names(pipe: object, num_stages: int) -> list[set[str]]:
    """Parameter names (original FQNs) each stage of a ``Pipe`` holds."""
    return [
        {n for n, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False)} for s in range(num_stages)
    ]


def _holders(group: set[str], stages: list[set[str]]) -> list[int]:
    return [s for s, names in enumerate(stages) if names & group]


def _tensor_bytes(values: Iterable[object]) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def run(argv: list[str] | None = None) -> int:
    args = parse_args("python -m testbeds.bench.baselines.pipelining", "GPipe over gloo, one stage of S", argv)
    job = args.job
    num_stages, m = args.world_size, job.train.micro_batches
    with gloo_group(args):
        model = build_job_model(job)
        dataset = build_job_dataset(job)
        example_x, _ = example_micro_batch(job, dataset)
        points = even_split_points(block_names(model), num_stages)
        groups = tied_groups(model)
        pipe = pipeline(model, mb_args=(example_x,), split_spec={p: SplitPoint.BEGINNING for p in points})
        stages = stage_param_names(pipe, num_stages)
        # Every rank creates every tied group's process group, in the same order.
        sync: list[tuple[object, list[str]]] = []
        for group in groups:
            ranks = _holders(group, stages)
            if len(ranks) > 1:
                pg = dist.new_group(ranks)
                if args.rank in ranks:
                    sync.append((pg, sorted(group & stages[args.rank])))
        stage = pipe.build_stage(args.rank, torch.device("cpu"))
        module = stage.submod
        args.emulate(module, lambda doc: gpipe_attach_args(doc, args.rank))
        received = [0]
        if args.rank > 0:
            module.register_forward_pre_hook(
                lambda _m, inputs: received.__setitem__(0, received[0] + _tensor_bytes(inputs))
            )
        loss_fn = get_loss(job.train.loss)
        schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
        params = dict(module.named_parameters())
        optimizer = build_optimizer(job.train, module.parameters())
        peak = PeakMemory(module, optimizer)
        peaks = torch.zeros(num_stages, dtype=torch.float64)
        metrics = MetricsWriter(args.metrics if args.rank == 0 else None)
        last = num_stages - 1
        # Per step: the last rank's mean loss and each rank's inbound bytes, summed over the
        # ranks once after the last step (a collective between steps would end a latency
        # apart on different ranks and leak that skew into the next step's timing).
        stats = torch.zeros(args.steps, 2 + num_stages, dtype=torch.float64)
        seconds: list[float] = []
        tokens: int | None = None  # per step: every batch has the job's shape
        for step in range(args.steps):
            x, y = job_batch(job, dataset, step)
            losses: list[torch.Tensor] = []
            received[0] = 0
            with StepTimer() as timer:
                optimizer.zero_grad(set_to_none=True)
                with peak.step():
                    if args.rank == 0:
                        schedule.step(x)
                    elif args.rank == last:
                        schedule.step(target=y, losses=losses)
                    else:
                        schedule.step()
                for pg, names in sync:  # tied weights: sum the copies' gradients
                    for name in names:
                        grad = params[name].grad
                        if grad is not None:
                            dist.all_reduce(grad, group=pg)
                optimizer.step()
            peak.after_step()
            if args.rank == last:
                stats[step, 0] = float(torch.stack([loss.detach() for loss in losses]).mean())
            stats[step, 2 + args.rank] = received[0]
            seconds.append(timer.seconds)
            tokens = token_count(x)
        peaks[args.rank] = peak.bytes
        dist.all_reduce(stats)
        dist.all_reduce(peaks)
        for step, step_s in enumerate(seconds):
            metrics.write_step(
                step=step,
                loss=float(stats[step, 0]),
                step_s=step_s,
                samples=job.data.batch_size,
                tokens=tokens,
                # activations in, and their gradients back, over each cut (k-1 -> k)
                bytes_per_link={f"{k - 1}->{k}": 2 * int(stats[step, 2 + k]) for k in range(1, num_stages)},
                peak_memory_bytes={str(r): int(peaks[r]) for r in range(num_stages)},
            )
    return 0


if __name__ == "__main__":
    rank_main(run)

"""Baseline: PyTorch ``DistributedDataParallel`` over ``gloo``, one rank per testbed host.

    python -m testbeds.bench.baselines.ddp --job J --rank R --world-size N --master HOST:PORT \
        --address MY_IP [--steps S] [--metrics PATH]

Every rank builds the whole model exactly as fusion does (:func:`fusion.training.build_job_model`,
seeded) and the job's data set, and takes its slice (``B / N`` samples, as even as ``torch.tensor_split`` makes them) of
step ``s``'s batch
(:func:`fusion.training.job_batch`); DDP averages the gradients, so the update is that of
the mean loss over the whole batch, like fusion's. Rank 0 records per step: the global mean
loss and the bytes each rank's namespace sent (its share of the ring all-reduce, counted on
the link to its ring successor), both all-reduced once after the last step, outside any
step's timing, and the step's wall seconds.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fusion.errors import ConfigError
from fusion.losses import get_loss
from fusion.optim import build_optimizer
from fusion.training import build_job_dataset, build_job_model, job_batch
from testbeds.bench.baselines.profiled import ddp_attach_args
from testbeds.bench.baselines.rank import (
    MetricsWriter,
    StepTimer,
    bytes_sent,
    init_gloo,
    parse_args,
    token_count,
)

logger = logging.getLogger(__name__)


def run(argv: list[str] | None = None) -> int:
    args = parse_args("python -m testbeds.bench.baselines.ddp", "DDP over gloo, one rank of N", argv)
    job = args.job
    batch, n = job.data.batch_size, args.world_size
    if batch < n:
        raise ConfigError(f"DDP needs a sample per rank: batch_size {batch} < {n} ranks")
    init_gloo(args)
    try:
        local = build_job_model(job)
        samples = len(torch.tensor_split(torch.arange(batch), n)[args.rank])
        args.emulate(local, lambda doc: ddp_attach_args(doc, samples))
        model = DistributedDataParallel(local)
        dataset = build_job_dataset(job)
        loss_fn = get_loss(job.train.loss)
        optimizer = build_optimizer(job.train, model.parameters())
        metrics = MetricsWriter(args.metrics if args.rank == 0 else None)
        # Per step: this rank's weighted loss and bytes sent. They are summed over the ranks
        # once, after the last step: a collective between steps would end a latency apart on
        # different ranks, and that skew would leak into the next step's timing.
        stats = torch.zeros(args.steps, 1 + n, dtype=torch.float64)
        seconds: list[float] = []
        tokens: int | None = None  # per step: every batch has the job's shape
        for step in range(args.steps):
            x, y = job_batch(job, dataset, step)
            xr, yr = torch.tensor_split(x, n)[args.rank], torch.tensor_split(y, n)[args.rank]
            # DDP averages the ranks' gradients; weighting each rank's mean loss by its share
            # of the batch makes that average the gradient of the mean over the whole batch,
            # also when B is not a multiple of N.
            weight = len(xr) * n / batch
            sent0 = bytes_sent()
            with StepTimer() as timer:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(xr), yr)
                (loss * weight).backward()  # DDP all-reduces (averages) the gradients here
                optimizer.step()
            stats[step, 0], stats[step, 1 + args.rank] = float(loss.detach()) * weight, bytes_sent() - sent0
            seconds.append(timer.seconds)
            tokens = token_count(x)
        dist.all_reduce(stats)  # global mean loss and every rank's bytes, per step
        for step, step_s in enumerate(seconds):
            metrics.write_step(
                step=step,
                loss=float(stats[step, 0]) / n,
                step_s=step_s,
                samples=batch,
                tokens=tokens,
                # the ring all-reduce sends rank r's share to rank r + 1
                bytes_per_link={f"{r}->{(r + 1) % n}": int(stats[step, 1 + r]) for r in range(n)},
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run())

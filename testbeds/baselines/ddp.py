"""Baseline: PyTorch ``DistributedDataParallel`` over ``gloo``, one rank per testbed host.

    python -m testbeds.baselines.ddp --job J --rank R --world-size N --master HOST:PORT \
        --address MY_IP [--steps S] [--metrics PATH]

Every rank builds the whole model exactly as fusion does (:func:`fusion.training.build_job_model`,
seeded) and the job's data set, and takes its ``B / N`` slice of step ``s``'s batch
(:func:`fusion.training.job_batch`); DDP averages the gradients, so the update is that of
the mean loss over the whole batch, like fusion's. Rank 0 records per step: the global mean
loss (all-reduced after the step, outside its timing), the step's wall seconds, and the
bytes its namespace sent (its share of the ring all-reduce).
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
from testbeds.baselines.rank import MetricsWriter, StepTimer, bytes_sent, init_gloo, parse_args

logger = logging.getLogger(__name__)


def run(argv: list[str] | None = None) -> int:
    args = parse_args("python -m testbeds.baselines.ddp", "DDP over gloo, one rank of N", argv)
    job = args.job
    batch, n = job.data.batch_size, args.world_size
    if batch % n:
        raise ConfigError(f"DDP splits the batch evenly: batch_size {batch} is not a multiple of {n} ranks")
    per_rank = batch // n
    init_gloo(args)
    try:
        model = DistributedDataParallel(build_job_model(job))
        dataset = build_job_dataset(job)
        loss_fn = get_loss(job.train.loss)
        optimizer = build_optimizer(job.train, model.parameters())
        metrics = MetricsWriter(args.metrics if args.rank == 0 else None)
        for step in range(args.steps):
            x, y = job_batch(job, dataset, step)
            xr, yr = x[args.rank * per_rank : (args.rank + 1) * per_rank], y[args.rank * per_rank : (args.rank + 1) * per_rank]
            sent0 = bytes_sent()
            with StepTimer() as timer:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(xr), yr)
                loss.backward()  # DDP all-reduces (averages) the gradients here
                optimizer.step()
            sent = bytes_sent() - sent0
            total = loss.detach().clone()
            dist.all_reduce(total)  # global mean loss, outside the timed step
            record = {
                "step": step,
                "loss": float(total) / n,
                "step_s": timer.seconds,
                "samples_per_s": batch / timer.seconds,
                "bytes_sent": sent,
            }
            if x.dim() == 2 and not x.is_floating_point():
                record["tokens_per_s"] = x.numel() / timer.seconds
            metrics.write(record)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run())

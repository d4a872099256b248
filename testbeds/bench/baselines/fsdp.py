"""Baseline: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``gloo``, one rank per host.

    python -m testbeds.bench.baselines.fsdp --job J --rank R --world-size N --master HOST:PORT \
        --address MY_IP [--steps S] [--metrics PATH]

What a user picks when a model does not fit one device: every rank builds the whole model
(seeded, as fusion does), then :func:`shard` makes each of its repeated blocks
(:func:`testbeds.sim.block_split.block_names`) an FSDP unit and the root one more, over a
1-D CPU device mesh of the N ranks: each rank keeps 1/N of every parameter, its gradient
and its optimizer state, all-gathers a unit's parameters for its forward and backward, and
reduce-scatters its gradients (averaged over the ranks). A block holding a tied parameter
(GPT-2's embedding and head) is left to the root unit, which then owns the tied tensor once.

The data are split as :mod:`testbeds.bench.baselines.ddp` splits them (each rank its slice
of the batch, its loss weighted by its share), so the update is that of the mean loss over
the whole batch. Rank 0 records per step: the global mean loss, the step's wall seconds,
the bytes each rank's namespace sent (counted on the link to its ring successor, as gloo's
ring collectives send), and every rank's peak memory (:mod:`testbeds.bench.baselines.memory`),
all-reduced once after the last step, outside any step's timing.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fusion.errors import ConfigError
from fusion.losses import get_loss
from fusion.optim import build_optimizer
from fusion.training import build_job_dataset, build_job_model, job_batch
from testbeds.bench.baselines.memory import PeakMemory
from testbeds.bench.baselines.pipelining import tied_groups
from testbeds.bench.baselines.rank import MetricsWriter, StepTimer, bytes_sent, init_gloo, parse_args, token_count
from testbeds.sim.block_split import block_names

logger = logging.getLogger(__name__)


def shard(model: torch.nn.Module, mesh: object) -> list[str]:
    """Make ``model``'s blocks (those without a tied parameter) and then the model itself
    FSDP2 units over ``mesh``; returns the blocks sharded as their own units."""
    tied = set().union(*tied_groups(model)) if tied_groups(model) else set()
    units = []
    for name in block_names(model):
        block = model.get_submodule(name)
        if any(f"{name}.{p}" in tied for p, _ in block.named_parameters(remove_duplicate=False)):
            continue
        fully_shard(block, mesh=mesh)
        units.append(name)
    fully_shard(model, mesh=mesh)
    return units


def run(argv: list[str] | None = None) -> int:
    args = parse_args("python -m testbeds.bench.baselines.fsdp", "FSDP2 over gloo, one rank of N", argv)
    job = args.job
    batch, n = job.data.batch_size, args.world_size
    if batch < n:
        raise ConfigError(f"FSDP needs a sample per rank: batch_size {batch} < {n} ranks")
    init_gloo(args)
    try:
        mesh = init_device_mesh("cpu", (n,))
        model = build_job_model(job)
        samples = len(torch.tensor_split(torch.arange(batch), n)[args.rank])
        if args.slowdown > 1.0 and args.emulation == "profile":
            raise ConfigError("the fsdp baseline emulates slower devices by wall time only (--emulation wall)")
        args.emulate(model, lambda doc: {"samples": samples})
        units = shard(model, mesh)
        logger.info("rank %d: %d block units and the root", args.rank, len(units))
        dataset = build_job_dataset(job)
        loss_fn = get_loss(job.train.loss)
        optimizer = build_optimizer(job.train, model.parameters())
        peak = PeakMemory(model, optimizer)
        metrics = MetricsWriter(args.metrics if args.rank == 0 else None)
        stats = torch.zeros(args.steps, 1 + n, dtype=torch.float64)
        peaks = torch.zeros(n, dtype=torch.float64)
        seconds: list[float] = []
        tokens: int | None = None
        for step in range(args.steps):
            x, y = job_batch(job, dataset, step)
            xr, yr = torch.tensor_split(x, n)[args.rank], torch.tensor_split(y, n)[args.rank]
            weight = len(xr) * n / batch
            sent0 = bytes_sent()
            with StepTimer() as timer:
                optimizer.zero_grad(set_to_none=True)
                with peak.step():
                    loss = loss_fn(model(xr), yr)
                    (loss * weight).backward()  # FSDP reduce-scatters (averages) the gradients
                optimizer.step()
            peak.after_step()
            stats[step, 0], stats[step, 1 + args.rank] = float(loss.detach()) * weight, bytes_sent() - sent0
            seconds.append(timer.seconds)
            tokens = token_count(x)
        peaks[args.rank] = peak.bytes
        dist.all_reduce(stats)
        dist.all_reduce(peaks)
        for step, step_s in enumerate(seconds):
            metrics.write_step(
                step=step,
                loss=float(stats[step, 0]) / n,
                step_s=step_s,
                samples=batch,
                tokens=tokens,
                bytes_per_link={f"{r}->{(r + 1) % n}": int(stats[step, 1 + r]) for r in range(n)},
                peak_memory_bytes={str(r): int(peaks[r]) for r in range(n)},
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run())

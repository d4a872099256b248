"""The training loop the data-parallel baselines share (:mod:`~testbeds.bench.baselines.ddp`,
:mod:`~testbeds.bench.baselines.fsdp`): each rank its slice of every batch, its loss
weighted by its share, the wrapper's collectives inside ``backward``.

Rank ``r`` of ``N`` takes ``torch.tensor_split(batch, N)[r]`` (as even as that makes them)
and weights its mean loss by ``len(slice) * N / B``: the wrapper averages the ranks'
gradients, so the update is the gradient of the mean loss over the whole batch, also when
``B`` is not a multiple of ``N``. Per step every rank keeps its weighted loss and the bytes
its namespace sent; they (and each rank's peak memory, when measured) are summed over the
ranks once, after the last step: a collective between steps would end a latency apart on
different ranks, and that skew would leak into the next step's timing. Rank 0 writes the
rows: the global mean loss, the step's wall seconds, and the bytes counted on each rank's
link to its ring successor (gloo's ring collectives send a rank's share there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fusion.errors import ConfigError
from fusion.losses import get_loss
from fusion.optim import build_optimizer
from fusion.training import build_job_dataset, job_batch
from testbeds.bench.baselines.memory import PeakMemory
from testbeds.bench.baselines.rank import MetricsWriter, RankArgs, StepTimer, bytes_sent, token_count


def rank_samples(args: RankArgs, what: str) -> int:
    """This rank's samples per step; ``ConfigError`` when a rank would have none."""
    batch, n = args.job.data.batch_size, args.world_size
    if batch < n:
        raise ConfigError(f"{what} needs a sample per rank: batch_size {batch} < {n} ranks")
    return len(torch.tensor_split(torch.arange(batch), n)[args.rank])


def train_data_parallel(
    args: RankArgs,
    model: torch.nn.Module,
    *,
    peak_of: torch.nn.Module | None = None,
) -> None:
    """Train ``model`` (already wrapped: its ``backward`` averages the gradients over the
    ranks) for ``args.steps`` steps and write rank 0's metrics (module docstring).

    ``peak_of``: measure this module's peak memory each step (:class:`PeakMemory`) and add
    every rank's to the rows; ``None`` measures nothing, so the steps carry no hooks."""
    job, n = args.job, args.world_size
    batch = job.data.batch_size
    dataset = build_job_dataset(job)
    loss_fn = get_loss(job.train.loss)
    optimizer = build_optimizer(job.train, model.parameters())
    peak = PeakMemory(peak_of, optimizer) if peak_of is not None else None
    metrics = MetricsWriter(args.metrics if args.rank == 0 else None)
    stats = torch.zeros(args.steps, 1 + n, dtype=torch.float64)
    peaks = torch.zeros(n, dtype=torch.float64)
    seconds: list[float] = []
    tokens: int | None = None  # per step: every batch has the job's shape
    for step in range(args.steps):
        x, y = job_batch(job, dataset, step)
        xr, yr = torch.tensor_split(x, n)[args.rank], torch.tensor_split(y, n)[args.rank]
        weight = len(xr) * n / batch
        sent0 = bytes_sent()
        with StepTimer() as timer:
            optimizer.zero_grad(set_to_none=True)
            if peak is None:
                loss = loss_fn(model(xr), yr)
                (loss * weight).backward()
            else:
                with peak.step():
                    loss = loss_fn(model(xr), yr)
                    (loss * weight).backward()
            optimizer.step()
        if peak is not None:
            peak.after_step()
        stats[step, 0], stats[step, 1 + args.rank] = float(loss.detach()) * weight, bytes_sent() - sent0
        seconds.append(timer.seconds)
        tokens = token_count(x)
    if peak is not None:
        peaks[args.rank] = peak.bytes
        dist.all_reduce(peaks)
    dist.all_reduce(stats)
    for step, step_s in enumerate(seconds):
        metrics.write_step(
            step=step,
            loss=float(stats[step, 0]) / n,
            step_s=step_s,
            samples=batch,
            tokens=tokens,
            bytes_per_link={f"{r}->{(r + 1) % n}": int(stats[step, 1 + r]) for r in range(n)},
            peak_memory_bytes={str(r): int(peaks[r]) for r in range(n)} if peak is not None else None,
        )

"""Baseline: PyTorch ``DistributedDataParallel`` over ``gloo``, one rank per testbed host.

    python -m testbeds.bench.baselines.ddp --job J --rank R --world-size N --master HOST:PORT \
        --address MY_IP [--steps S] [--metrics PATH]

Every rank builds the whole model exactly as fusion does (:func:`fusion.training.build_job_model`,
seeded), wraps it in DDP, and trains on its slice of each batch
(:mod:`testbeds.bench.baselines.data_parallel`); DDP all-reduces (averages) the gradients in
``backward``, so the update is that of the mean loss over the whole batch, like fusion's.
"""

from __future__ import annotations

import logging

from torch.nn.parallel import DistributedDataParallel

from fusion.training import build_job_model
from testbeds.bench.baselines.data_parallel import rank_samples, train_data_parallel
from testbeds.bench.baselines.profiled import ddp_attach_args
from testbeds.bench.baselines.rank import gloo_group, parse_args, rank_main

logger = logging.getLogger(__name__)


def run(argv: list[str] | None = None) -> int:
    args = parse_args("python -m testbeds.bench.baselines.ddp", "DDP over gloo, one rank of N", argv)
    samples = rank_samples(args, "DDP")
    with gloo_group(args):
        local = build_job_model(args.job)
        args.emulate(local, lambda doc: ddp_attach_args(doc, samples))
        train_data_parallel(args, DistributedDataParallel(local))
    return 0


if __name__ == "__main__":
    rank_main(run)

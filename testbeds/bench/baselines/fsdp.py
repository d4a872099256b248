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

The data are split and the rows written as for DDP (:mod:`testbeds.bench.baselines.data_parallel`),
with every rank's peak memory (:mod:`testbeds.bench.baselines.memory`) added to the rows.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fusion.errors import ConfigError
from fusion.training import build_job_model
from testbeds.bench.baselines.data_parallel import rank_samples, train_data_parallel
from testbeds.bench.baselines.pipelining import tied_groups
from testbeds.bench.baselines.rank import gloo_group, parse_args, rank_main
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
    samples = rank_samples(args, "FSDP")
    if args.slowdown > 1.0 and args.emulation == "profile":
        raise ConfigError("the fsdp baseline emulates slower devices by wall time only (--emulation wall)")
    with gloo_group(args):
        mesh = init_device_mesh("cpu", (args.world_size,))
        model = build_job_model(args.job)
        args.emulate(model, lambda doc: {"samples": samples})
        units = shard(model, mesh)
        logger.info("rank %d: %d block units and the root", args.rank, len(units))
        train_data_parallel(args, model, peak_of=model)
    return 0


if __name__ == "__main__":
    rank_main(run)

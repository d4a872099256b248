"""Baselines the side-by-side benchmark runs next to fusion, one process per testbed host.

- :mod:`testbeds.bench.baselines.ddp`: PyTorch ``DistributedDataParallel`` over ``gloo``.
- :mod:`testbeds.bench.baselines.pipelining`: ``torch.distributed.pipelining`` GPipe, even split.

Each is a ``python -m`` module that a testbed starts inside a host's network namespace; rank
0 writes one JSON line per step (loss, step seconds, bytes sent) to ``--metrics``.
"""

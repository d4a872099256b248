"""Measuring devices: what a worker reports about itself when it joins.

Measured, not assumed: the matmul throughput comes from timing real matmuls on the
worker's device (after warm-up, median of repeats), because a volunteer's laptop and a
datacenter GPU differ by orders of magnitude and the scheduler needs the ratio.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """A worker's resources as measured at start-up."""

    num_cores: int
    """Logical CPU cores of the host."""
    memory_bytes: int
    """Total host memory."""
    device: str
    """``cpu`` or ``cuda:N``."""
    device_name: str
    """Human-readable device name."""
    device_memory_bytes: int
    """Memory of the device (host memory for the CPU)."""
    matmul_flops: float
    """Measured fp32 matmul throughput, FLOP/s."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: torch.device, *, size: int = 512, repeats: int = 5, warmup: int = 2) -> float:
    """Median fp32 FLOP/s of ``size``×``size`` matmuls on ``device`` (2·n³ FLOPs each)."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(warmup):
        a @ b
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / max(statistics.median(times), 1e-9)


def measure_device(device: str = "cpu") -> DeviceProfile:
    """Profile this host and ``device`` (a short compute benchmark included)."""
    dev = torch.device(device)
    vm = psutil.virtual_memory()
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        name, dev_mem, label = props.name, int(props.total_memory), f"cuda:{index}"
        dev = torch.device(label)
    else:
        name, dev_mem, label = f"CPU ({torch.get_num_threads()} threads)", int(vm.total), "cpu"
    flops = measure_matmul_flops(dev)
    profile = DeviceProfile(
        num_cores=os.cpu_count() or 1,
        memory_bytes=int(vm.total),
        device=label,
        device_name=name,
        device_memory_bytes=dev_mem,
        matmul_flops=flops,
    )
    logger.info("measured %s: %.1f GFLOP/s", label, flops / 1e9)
    return profile

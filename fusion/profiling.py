"""Measuring devices: what a worker reports about itself when it joins.

Measured, not assumed: the matmul throughput comes from timing real matmuls on the
worker's device (after warm-up, median of repeats), because a volunteer's laptop and a
datacenter GPU differ by orders of magnitude and the scheduler needs the ratio.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch
from torch.utils import _pytree as pytree

from fusion.saved_activations import SavedBytes, storage_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """A worker's resources as measured at start-up."""

    num_cores: int
    """Logical CPU cores of the host."""
    memory_bytes: int
    """Host memory the worker lends: its ``--memory-gb`` cap on the CPU, else what the host
    had free at start-up."""
    device: str
    """``cpu`` or ``cuda:N``."""
    device_name: str
    """Human-readable device name."""
    device_memory_bytes: int
    """Memory of the device the worker lends its stages (host memory for the CPU): its
    ``--memory-gb`` cap where smaller than the device, else what the device had free at
    start-up. The planner plans each worker within it."""
    matmul_flops: float
    """Measured fp32 matmul throughput, FLOP/s."""
    machine: str = ""
    """The machine and device computed on (:func:`machine_id`)."""


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


#: The running kernel's boot id: the same for every process (and container, and network
#: namespace) on one machine, different on another or after a reboot.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def machine_id(device: str, *, boot_id_path: str = BOOT_ID_PATH) -> str:
    """Who else computes on what this worker computes on: ``BOOT-ID/cpu`` for the CPU (every
    worker process on the machine shares its cores), ``BOOT-ID/cuda:UUID`` for a GPU (two
    GPUs in one box are two devices). The host name stands in where there is no boot id."""
    try:
        with open(boot_id_path) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    host = boot or f"host:{socket.gethostname()}"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"{host}/{dev.type}"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{host}/cuda:{uuid if uuid is not None else index}"


def free_memory_bytes(device: str = "cpu") -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory now (host memory for the CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def lent_memory_bytes(free_bytes: int, total_bytes: int, cap_bytes: int | None) -> int:
    """What a worker lends: its cap (never more than the memory there is), else what is free."""
    return min(cap_bytes, total_bytes) if cap_bytes is not None else free_bytes


def measure_device(
    device: str = "cpu", *, machine: str | None = None, memory_cap_bytes: int | None = None
) -> DeviceProfile:
    """Profile this host and ``device`` (a short compute benchmark included); ``machine``
    overrides :func:`machine_id` (an operator who knows better, e.g. pinned CPU sets);
    ``memory_cap_bytes`` is the memory the volunteer lends (``--memory-gb``; default: what
    is free now), reported as the device's memory (and the host's, for the CPU)."""
    dev = torch.device(device)
    host_free, host_total = free_memory_bytes("cpu")
    host_lent = lent_memory_bytes(host_free, host_total, memory_cap_bytes)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        label = f"cuda:{index}"
        free, total = free_memory_bytes(label)
        name, dev_mem = props.name, lent_memory_bytes(free, total, memory_cap_bytes)
        host_lent = host_free
        dev = torch.device(label)
    else:
        name, dev_mem, label = f"CPU ({torch.get_num_threads()} threads)", host_lent, "cpu"
    flops = measure_matmul_flops(dev)
    profile = DeviceProfile(
        num_cores=os.cpu_count() or 1,
        memory_bytes=host_lent,
        device=label,
        device_name=name,
        device_memory_bytes=dev_mem,
        matmul_flops=flops,
        machine=machine or machine_id(label),
    )
    logger.info("measured %s: %.1f GFLOP/s, lending %d bytes of memory", label, flops / 1e9, dev_mem)
    return profile


# ---------------------------------------------------------------- per-node costs
def trimmed_mean(values: Sequence[float], trim: float = 0.1) -> float:
    """The mean of ``values`` without the ``trim`` share at each end: on a shared machine
    that switches between speeds, the mix of phases a long run meets (a median lands in one
    phase), without the odd preemption."""
    if not values:
        raise ValueError("trimmed_mean of no values")
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return statistics.fmean(kept)


def scale_node_times(nodes: dict[str, dict[str, float]], factor: float) -> dict[str, dict[str, float]]:
    """A node profile (as :func:`profile_graph` returns it) with the forward and backward
    times scaled by ``factor`` (a calibration's), the whole-graph ``__`` entries dropped."""
    return {
        name: {key: value * factor if key in ("fwd_time_s", "bwd_time_s") else value for key, value in costs.items()}
        for name, costs in nodes.items()
        if not name.startswith("__")
    }


def _sync_all(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _NodeTimer(torch.fx.Interpreter):
    """Runs a graph node by node, timing each and attributing saved activations to it."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, params: set[int]) -> None:
        super().__init__(gm)
        self.device = device
        self.saved_bytes = SavedBytes(params)
        self.times: dict[str, float] = {}
        self.bwd_times: dict[str, float] = {}
        # The autograd nodes each graph node created, kept alive so their ids stay unique.
        self._owned: dict[int, tuple[object, str]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._started: dict[int, float] = {}

    @property
    def saved(self) -> dict[str, int]:
        """Node name -> bytes its forward saved for backward (:class:`SavedBytes`)."""
        return self.saved_bytes.saved

    def run_node(self, n: torch.fx.Node) -> object:
        self.saved_bytes.current = n.name
        _sync_all(self.device)
        t0 = time.perf_counter()
        out = super().run_node(n)
        _sync_all(self.device)
        self.times[n.name] = self.times.get(n.name, 0.0) + time.perf_counter() - t0
        self._claim_grad_fns(out, n.name)
        return out

    def _claim_grad_fns(self, out: object, name: str) -> None:
        """Charge to ``name`` every autograd node its outputs' backward reaches that no
        earlier graph node created, and time each when the backward runs it."""
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if id(fn) in self._owned:
                continue
            self._owned[id(fn)] = (fn, name)
            self._handles.append(fn.register_prehook(self._bwd_start(id(fn))))
            self._handles.append(fn.register_hook(self._bwd_end(id(fn), name)))
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)

    def _bwd_start(self, key: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            _sync_all(self.device)
            self._started[key] = time.perf_counter()

        return hook

    def _bwd_end(self, key: int, name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            _sync_all(self.device)
            elapsed = time.perf_counter() - self._started.pop(key, time.perf_counter())
            self.bwd_times[name] = self.bwd_times.get(name, 0.0) + elapsed

        return hook

    def remove_hooks(self) -> None:
        """Unhook the autograd nodes: a parameter's ``AccumulateGrad`` outlives the run."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._owned.clear()


def _scalar_loss(out: object) -> torch.Tensor:
    """A stand-in loss whose backward touches every differentiable output."""
    tensors = (
        [out]
        if isinstance(out, torch.Tensor)
        else [t for t in (out if isinstance(out, (tuple, list)) else []) if isinstance(t, torch.Tensor)]
    )
    return sum((t.float().sum() for t in tensors if t.requires_grad), torch.zeros(()))


def profile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    min_time_s: float = 0.25,
) -> dict[str, dict[str, float]]:
    """Measure every compute node's forward and backward seconds and saved activation bytes.

    Per-node forward times come from running the graph node by node (synchronising the
    device around each); they are rescaled so that they sum to the graph's measured
    forward time when run normally (the per-node instrumentation adds overhead that a real
    run does not have). Per-node backward times come the same way: each autograd node is
    charged to the graph node whose forward created it and timed by hooks when the backward
    runs it, and the shares are rescaled to the whole graph's measured backward. A node's
    backward is not a fixed multiple of its forward (a ResNet's five pipeline stages measure
    0.67-0.87x, the whole model 1.3x; an op on inputs that need no gradient has none), and a
    stage's cost is what the planner and the simulator place. Saved activation bytes are what autograd keeps
    for backward (``saved_tensors_hooks``), parameters excluded. Medians over ``repeats``
    runs after ``warmup``; the whole-graph timing repeats further until it has measured
    ``min_time_s``, because it sets the level of every node's time and a small graph's few
    milliseconds can fall inside one preemption on a loaded machine (seen in CI: a 2 ms
    graph timed 6x too slow from 3 repeats). The module's buffers are restored afterwards.

    Returns:
        node name → ``{"fwd_time_s", "bwd_time_s", "saved_bytes"}``, plus the key
        ``"__graph__"`` with the whole graph's ``fwd_time_s``/``bwd_time_s``.
    """
    import copy
    import statistics

    dev = torch.device(device)
    module = copy.deepcopy(gm).to(dev)
    module.train()
    inputs = tuple(x.to(dev) for x in example_inputs)
    params = {k[0] for p in module.parameters() if (k := storage_key(p)) is not None}
    rng = torch.random.get_rng_state()
    fwd_total, bwd_total = [], []
    node_times: list[dict[str, float]] = []
    node_bwd_times: list[dict[str, float]] = []
    saved: dict[str, int] = {}
    try:
        # Whole-graph timings first, back to back, as training runs them.
        i = 0
        while i < warmup + repeats or sum(fwd_total) + sum(bwd_total) < min_time_s:
            _sync_all(dev)
            t0 = time.perf_counter()
            out = module(*inputs)
            _sync_all(dev)
            t1 = time.perf_counter()
            _scalar_loss(out).backward()
            _sync_all(dev)
            t2 = time.perf_counter()
            module.zero_grad(set_to_none=True)
            del out
            if i >= warmup:
                fwd_total.append(t1 - t0)
                bwd_total.append(t2 - t1)
            i += 1
        # Then node by node, for the shares and the saved activations.
        for i in range(warmup + repeats):
            timer = _NodeTimer(module, dev, params)
            try:
                with torch.autograd.graph.saved_tensors_hooks(timer.saved_bytes.pack, lambda t: t):
                    out = timer.run(*inputs)
                _scalar_loss(out).backward()
            finally:
                timer.remove_hooks()
            module.zero_grad(set_to_none=True)
            del out
            if i >= warmup:
                node_times.append(timer.times)
                node_bwd_times.append(timer.bwd_times)
                saved = timer.saved
    finally:
        torch.random.set_rng_state(rng)
    fwd = statistics.median(fwd_total)
    bwd = statistics.median(bwd_total)
    compute = [n.name for n in module.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    raw = {name: statistics.median(t.get(name, 0.0) for t in node_times) for name in compute}
    raw_bwd = {name: statistics.median(t.get(name, 0.0) for t in node_bwd_times) for name in compute}
    total_raw = sum(raw.values()) or 1.0
    if sum(raw_bwd.values()) <= 0.0:  # nothing needed a gradient: keep the forward's shares
        raw_bwd = raw
    total_raw_bwd = sum(raw_bwd.values()) or 1.0
    result: dict[str, dict[str, float]] = {}
    for name in compute:
        result[name] = {
            "fwd_time_s": fwd * raw[name] / total_raw,
            "bwd_time_s": bwd * raw_bwd[name] / total_raw_bwd,
            "saved_bytes": float(saved.get(name, 0)),
        }
    result["__graph__"] = {"fwd_time_s": fwd, "bwd_time_s": bwd}
    return result


def measure_optimizer_s_per_byte(optimizer: str, *, device: str = "cpu", numel: int = 1 << 22) -> float:
    """Seconds per parameter byte of one optimizer update (median of a few).

    The default 4 Mi parameters is larger than any cache, as real models are: AdamW's
    update reads and writes the parameter, its gradient and two moments, 64 MiB in all. The
    update is memory-bound and a small tensor would make it look several times faster; 16 Mi
    parameters measured the same figure per byte and took four times as long, a second of
    every job's planning.
    """
    import statistics

    dev = torch.device(device)
    p = torch.nn.Parameter(torch.randn(numel, device=dev))
    p.grad = torch.randn(numel, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3) if optimizer == "adamw" else torch.optim.SGD([p], lr=1e-3, momentum=0.9)
    times = []
    for i in range(5):
        _sync_all(dev)
        t0 = time.perf_counter()
        opt.step()
        _sync_all(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / (numel * 4)


# ---------------------------------------------------------------- links
#: A probe size whose transfer the samples so far predict to take longer is skipped: on an
#: 8 Mbps link 4 MiB takes 4 s, and five of them each way made planning take minutes.
PROBE_MAX_TRANSFER_S = 2.0
#: Repeats of one size stop once they have taken this long together.
PROBE_SIZE_BUDGET_S = 1.0


def probe_link(probe: Callable[[int], float], sizes: Sequence[int], *, repeats: int) -> tuple[float, float]:
    """Fit a link from timed transfers: ``probe(size)`` returns the seconds one took.

    Sizes go smallest first; each is repeated (best of ``repeats``, fewer when the repeats
    already took :data:`PROBE_SIZE_BUDGET_S`), and the larger sizes are skipped once the fit
    so far predicts one would take over :data:`PROBE_MAX_TRANSFER_S`: slow links are
    measured in seconds, not minutes, and fast ones still get the big transfers that pin
    their bandwidth.
    """
    ordered = sorted(set(sizes))
    samples: list[tuple[int, float]] = []
    for size in ordered:
        if len(samples) >= 2:
            latency, bandwidth = fit_link(samples)
            if latency + size / bandwidth > PROBE_MAX_TRANSFER_S:
                break
        times: list[float] = []
        while len(times) < repeats and sum(times) < PROBE_SIZE_BUDGET_S:
            times.append(probe(size))
        samples.append((size, min(times)))
    return fit_link(samples)


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = latency_s + bytes / bandwidth_bytes_per_s``.

    Args:
        samples: (bytes, seconds) pairs, at least two distinct sizes.

    Returns:
        ``(latency_s, bandwidth_bytes_per_s)``; latency clamped at 0, bandwidth positive.
    """
    import numpy as np

    if len({s for s, _ in samples}) < 2:
        raise ValueError("fitting a link needs samples of at least two sizes")
    x = np.array([float(s) for s, _ in samples])
    y = np.array([t for _, t in samples])
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:  # noise on a very fast link: bandwidth from the largest transfer alone
        big = int(np.argmax(x))
        slope = max(y[big] - max(intercept, 0.0), 1e-12) / x[big]
    return max(float(intercept), 0.0), float(1.0 / slope)

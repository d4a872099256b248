"""What a transfer costs the computation it overlaps in the same executor process.

An executor computes on one thread and moves tensors on others (gRPC handlers receive and
check a transfer, a :class:`~executor.sender.PeerSender` encodes and sends one out). They
share the process's interpreter lock and caches, so a computation that a transfer overlaps
takes longer: on loopback a 22 ms computation ran about 1.5 ms longer for each 256 KB
transfer wholly inside it, received or sent, about what the executor spends on the
transfer on the CPU. A pipeline stage of the testbed sends and receives while it computes
(its next micro-batch starts while the last one's output is still leaving), so its forward
and backward take longer than the profile says; the replay
(:func:`testbeds.replay.replay_step`) charges each computation the transfers it overlaps.

The probe times a stage-sized computation back to back on this process's main thread while
transfers of one size run at random gaps, either into an executor service in this process
(sent by a child process) or out of this process (to an executor process), and fits the
computation's time against how much of a transfer overlapped it (the overlapped share of
each transfer's duration, summed): the slope is the cost of one transfer wholly inside a
computation. Part of ``python -m testbeds.pause_cost`` (stored in ``pause-cost.json``).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import ConfigError, FusionError

#: Transfer sizes probed (bytes): the benchmark jobs' activations and gradients are 64 KB - 1 MB.
SIZES_BYTES = (16 << 10, 256 << 10, 1 << 20)
#: Seconds of timing per size and side.
SECONDS_PER_CASE = 8.0
#: Gaps between transfers (uniform, seconds): every overlap, none to several per computation.
GAP_S = (0.005, 0.03)
#: Back-to-back runs of the pause probe's block per timed computation (~20 ms: most
#: transfers fall wholly inside one).
RUNS_PER_COMPUTATION = 4
ROUNDS = 3

_SENDER = """
import json, random, sys, time
import torch
torch.set_num_threads(1)
from executor.client import ChannelPool, ExecutorClient
from fusion.auth import process_keyring
address, key, size, seconds, lo, hi = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
process_keyring().set_control(address, key)
pool = ChannelPool()
client = ExecutorClient(address, pool)
client.probe(size)
print("ready", flush=True)
spans, rnd, end = [], random.Random(0), time.time() + seconds
while time.time() < end:
    time.sleep(rnd.uniform(lo, hi))
    t0 = time.time()
    client.probe(size)
    spans.append((t0, time.time()))
print(json.dumps(spans), flush=True)
pool.close()
"""


@dataclass(frozen=True)
class TransferInterference:
    """Extra seconds a computation takes for each transfer of ``sizes_bytes[i]`` wholly
    inside it: ``send_s[i]`` when its process sends it, ``receive_s[i]`` when it receives
    it. Linear in size between measured sizes; beyond the largest at the last step's rate
    per byte; below the smallest, the smallest's."""

    sizes_bytes: tuple[int, ...]
    send_s: tuple[float, ...]
    receive_s: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.sizes_bytes)
        if n < 2 or list(self.sizes_bytes) != sorted(set(self.sizes_bytes)) or self.sizes_bytes[0] <= 0:
            raise ConfigError(
                f"a transfer interference needs two or more increasing positive sizes, got {self.sizes_bytes}"
            )
        if (
            len(self.send_s) != n
            or len(self.receive_s) != n
            or any(not 0 <= c < 1 for c in (*self.send_s, *self.receive_s))
        ):
            raise ConfigError(
                f"a transfer interference needs one send and one receive cost of 0-1 s per size, got {self}"
            )

    def send(self, size_bytes: float) -> float:
        return by_size(self.sizes_bytes, self.send_s, size_bytes)

    def receive(self, size_bytes: float) -> float:
        return by_size(self.sizes_bytes, self.receive_s, size_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"sizes_bytes": list(self.sizes_bytes), "send_s": list(self.send_s), "receive_s": list(self.receive_s)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferInterference:
        try:
            return cls(
                tuple(map(int, d["sizes_bytes"])), tuple(map(float, d["send_s"])), tuple(map(float, d["receive_s"]))
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"not a transfer interference ({e!r}): needs sizes_bytes, send_s and receive_s lists"
            ) from e


def by_size(sizes: Sequence[int], costs: Sequence[float], size_bytes: float) -> float:
    """``costs`` at ``size_bytes``: linear between ``sizes``, the first below them, beyond the
    last at the last step's rate per byte (never falling)."""
    if size_bytes > sizes[-1]:
        per_byte = max(costs[-1] - costs[-2], 0.0) / (sizes[-1] - sizes[-2])
        return costs[-1] + (size_bytes - sizes[-1]) * per_byte
    return float(np.interp(size_bytes, sizes, costs))


def overlap_share(start: float, end: float, t0: float, t1: float) -> float:
    """How much of the span ``[t0, t1]`` lies inside ``[start, end]`` (0-1); a span of no
    length counts whole when it falls strictly inside."""
    if t1 <= t0:
        return 1.0 if start < t0 < end else 0.0
    return max(0.0, min(end, t1) - max(start, t0)) / (t1 - t0)


def cost_per_transfer(computations: Sequence[tuple[float, float]], transfers: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of each computation's seconds against the transfers overlapping
    it (each counted by the share of it inside): the extra seconds one transfer wholly
    inside a computation costs it (0 when the fit says less)."""
    if len(computations) < 3 or not transfers:
        raise FusionError(f"too little to fit: {len(computations)} computations, {len(transfers)} transfers")
    x = np.array([sum(overlap_share(a, b, t0, t1) for t0, t1 in transfers) for a, b in computations])
    y = np.array([b - a for a, b in computations])
    if np.ptp(x) == 0:
        raise FusionError("no computation overlapped a different amount of transfer than the others: nothing to fit")
    slope, _ = np.polyfit(x, y, 1)
    return max(float(slope), 0.0)


def _time_computations(run: Callable[[], object], seconds: float) -> list[tuple[float, float]]:
    spans, end = [], time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        run()
        spans.append((t0, time.time()))
    return spans


def measure_receive(run: Callable[[], object], size: int, seconds: float, address: str, key: bytes) -> float:
    """Cost per received transfer: the executor service of this process at ``address``
    (control key ``key``) receives ``Probe`` transfers from a child process (stopped by its
    pid) while this thread computes."""
    from fusion.launch import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [address, key.hex(), str(size), str(seconds), *map(str, GAP_S)]
    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert sender.stdout is not None
        if sender.stdout.readline().strip() != "ready":
            raise FusionError(f"the probe's sender did not start (exit {sender.poll()})")
        computations = _time_computations(run, seconds)
        line = sender.stdout.readline()
        if not line:
            raise FusionError(f"the probe's sender stopped without its timings (exit {sender.wait(timeout=30)})")
        transfers = [tuple(span) for span in json.loads(line)]
    finally:
        sender.kill()
        sender.wait(timeout=10)
    return cost_per_transfer(computations, transfers)


def measure_send(run: Callable[[], object], size: int, seconds: float, client: Any) -> float:
    """Cost per sent transfer: a thread of this process sends ``Probe`` transfers through
    ``client`` (to an executor process) while the main thread computes."""
    transfers: list[tuple[float, float]] = []
    stop = threading.Event()
    failed: list[BaseException] = []

    def send() -> None:
        rnd = random.Random(1)
        try:
            while not stop.is_set():
                time.sleep(rnd.uniform(*GAP_S))
                t0 = time.time()
                client.probe(size)
                transfers.append((t0, time.time()))
        except BaseException as e:  # reported on the main thread
            failed.append(e)

    sender = threading.Thread(target=send, name="interference-sender", daemon=True)
    sender.start()
    try:
        computations = _time_computations(run, seconds)
    finally:
        stop.set()
        sender.join(timeout=60)
    if failed:
        raise FusionError(f"the probe's transfers failed: {failed[0]}") from failed[0]
    return cost_per_transfer(computations, transfers)


def measure_interference(
    sizes: Sequence[int] = SIZES_BYTES,
    *,
    seconds: float = SECONDS_PER_CASE,
    rounds: int = ROUNDS,
    echo: Callable[[str], None] = print,
) -> tuple[TransferInterference, TransferInterference, TransferInterference]:
    """Both sides for every size on this machine, ``rounds`` times over (about
    ``2 * len(sizes) * seconds * rounds``); returns the median over rounds and the lowest
    and highest round (one round's fit moves by about 1 ms)."""
    from executor.access import ExecutorAccess
    from executor.client import ChannelPool, ExecutorClient
    from executor.server import ExecutorService, start_server
    from fusion.auth import new_key
    from fusion.launch.executors import LocalCluster
    from testbeds.bench_core import EXECUTOR_WARM_UP_S
    from testbeds.pause_cost import probe_computation

    block = probe_computation()

    def run() -> None:
        for _ in range(RUNS_PER_COMPUTATION):
            block()

    echo(
        f"timing a computation while transfers of {len(sizes)} sizes overlap it, received and sent: {rounds} rounds of {seconds:g} s each"
    )
    receive: dict[int, list[float]] = {size: [] for size in sizes}
    send: dict[int, list[float]] = {size: [] for size in sizes}
    key = new_key()
    service = ExecutorService(worker_name="interference-probe")  # receives in this process
    service.access = ExecutorAccess(keyring=service.pool.keyring, control_key=key)
    server, port = start_server(service, "127.0.0.1:0")
    try:
        with LocalCluster(1, torch_threads=1) as cluster:  # receives what this process sends
            pool = ChannelPool()
            try:
                client = ExecutorClient(cluster.addresses[0], pool)
                client.probe(sizes[-1])
                time.sleep(EXECUTOR_WARM_UP_S)  # both executors import in the background for their first seconds
                for _ in range(rounds):
                    for size in sizes:
                        receive[size].append(measure_receive(run, size, seconds, f"127.0.0.1:{port}", key))
                        send[size].append(measure_send(run, size, seconds, client))
            finally:
                pool.close()
    finally:
        server.stop(0)
        service.close()

    def pick(f: Callable[[list[float]], float]) -> TransferInterference:
        return TransferInterference(tuple(sizes), tuple(f(send[s]) for s in sizes), tuple(f(receive[s]) for s in sizes))

    middle = pick(statistics.median)
    echo(
        "  "
        + ", ".join(
            f"{s >> 10} KB: +{middle.receive(s) * 1e3:.2f} ms received, +{middle.send(s) * 1e3:.2f} ms sent"
            for s in sizes
        )
    )
    return middle, pick(min), pick(max)


def interference_beside(directory: Path) -> TransferInterference | None:
    """The machine's transfer interference when ``pause-cost.json`` in ``directory`` has one."""
    from testbeds.pause_cost import document_in

    doc = document_in(directory)
    return TransferInterference.from_dict(doc["interference"]) if doc is not None and "interference" in doc else None

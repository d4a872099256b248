"""This machine's costs beyond the profile, measured for the simulator's validation
(:mod:`testbeds.sim.machine` says what each models and why). One run per sitting, right
after the benchmark runs it prices (about 6 minutes):

    python -m testbeds.bench.machine_probe       # -> testbeds/results/bench/pause-cost.json

- the pause cost: a stage-sized single-thread computation (:func:`probe_computation`)
  timed back to back and after sleeping each of :data:`PAUSES_S`, trials of every pause
  shuffled together so the machine's drift falls on all alike, with the other cores idle
  and then with one other core computing;
- the transfer path: ``Probe`` transfers of each size to one executor process on loopback
  (where the wire costs next to nothing), back to back and after each quiet, over several
  rounds (the figure moves from one minute to the next);
- the transfer interference: the same computation timed back to back while transfers of
  one size run at random gaps, into an executor service in this process (sent by a child
  process) or out of it, fitted against how much of a transfer overlapped each
  computation: the slope is the cost of one transfer wholly inside a computation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import FusionError
from testbeds.sim.machine import MACHINE_COSTS_FILE, PauseCost, TransferInterference, TransferPathCost, overlap_share

#: Pauses measured (seconds): stages here wait 1-300 ms between computations.
PAUSES_S = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
TRIALS = 80
#: Transfers timed (bytes): the benchmark jobs' activations and gradients are 64 KB - 1 MB.
TRANSFER_SIZES_BYTES = (16 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
TRANSFER_PAUSES_S = (0.003, 0.03, 0.1)
TRANSFER_ROUNDS = 4
RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"
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

#: A busy core for the ``loaded`` curve: one thread of matmuls until killed.
_HOG = (
    "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\na = torch.tanh(a @ a)\n"
    "print('ready', flush=True)\n"
    "while True:\n    a = torch.tanh(a @ a)\n"
)

_SENDER = """
import json, random, sys, time
import torch
torch.set_num_threads(1)
from executor.client import ChannelPool, ExecutorClient
from fusion.auth import process_keyring
address, key = sys.argv[1], bytes.fromhex(sys.argv[2])
size, seconds, lo, hi = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
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


def probe_computation() -> Callable[[], None]:
    """A stage-sized single-thread computation: a transformer MLP block's forward and
    backward (4 x 64 tokens, 128 wide; ~5-10 ms on these cores)."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.LayerNorm(128), torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    )
    x = torch.randn(4, 64, 128, generator=gen, requires_grad=True)

    def run() -> None:
        block(x).sum().backward()

    return run


def time_after_pauses(
    run: Callable[[], object], pauses: Sequence[float] = PAUSES_S, *, trials: int = TRIALS, seed: int = 0
) -> dict[float, float]:
    """Median extra seconds of ``run`` after sleeping each pause, over back-to-back runs."""
    times = median_after_pauses(run, pauses, trials=trials, seed=seed)
    return {p: max(times[p] - times[0.0], 0.0) for p in pauses}


def median_after_pauses(
    run: Callable[[], object], pauses: Sequence[float] = PAUSES_S, *, trials: int = TRIALS, seed: int = 0
) -> dict[float, float]:
    """Median seconds of ``run`` back to back (key ``0.0``) and after sleeping each pause.

    Trials of every pause (and of none) are shuffled together, each preceded by one
    untimed run, so the machine's drift over the measurement falls on all alike.
    """
    for _ in range(10):
        run()
    times: dict[float, list[float]] = {p: [] for p in (0.0, *pauses)}
    order = list(times) * trials
    random.Random(seed).shuffle(order)
    for pause in order:
        run()
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        run()
        times[pause].append(time.perf_counter() - t0)
    return {p: statistics.median(v) for p, v in times.items()}


def measure(
    pauses: Sequence[float] = PAUSES_S, *, trials: int = TRIALS, echo: Callable[[str], None] = print
) -> PauseCost:
    """Both curves on this machine: other cores idle, then one other core computing (a
    child process, stopped by its pid whatever happens)."""
    run = probe_computation()
    echo(f"timing a computation after {len(pauses)} pause lengths, {trials} trials each, other cores idle")
    idle = time_after_pauses(run, pauses, trials=trials)
    echo("  " + ", ".join(f"{p * 1e3:g} ms: +{c * 1e3:.2f} ms" for p, c in idle.items()))
    echo("again with another core computing")
    hog = subprocess.Popen([sys.executable, "-c", _HOG], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None
        if hog.stdout.readline().strip() != "ready":  # torch imported and computing: time from here
            raise FusionError(f"the busy process for the loaded curve did not start (exit {hog.poll()})")
        loaded = time_after_pauses(run, pauses, trials=trials, seed=1)
    finally:
        hog.kill()
        hog.wait(timeout=10)
    echo("  " + ", ".join(f"{p * 1e3:g} ms: +{c * 1e3:.2f} ms" for p, c in loaded.items()))
    return PauseCost(tuple(pauses), tuple(idle[p] for p in pauses), tuple(loaded[p] for p in pauses))


def measure_transfer_path(
    sizes: Sequence[int] = TRANSFER_SIZES_BYTES,
    pauses: Sequence[float] = TRANSFER_PAUSES_S,
    *,
    trials: int = TRIALS,
    rounds: int = TRANSFER_ROUNDS,
    echo: Callable[[str], None] = print,
) -> tuple[TransferPathCost, TransferPathCost, TransferPathCost]:
    """Time the executors' tensor path (``Probe``, or ``ProbeWhole`` for a transfer of one
    chunk, as ``Send`` and ``SendWhole``: header checks and reassembly every transfer takes,
    to the answer) on loopback, where the wire costs
    next to nothing, from this process to one executor process (stopped by its pid).

    The figure moves by up to 2x from one minute to the next on this VM (128 KB after 30 ms
    of quiet: 3.4 to 6.8 ms in five measurements), more than between pauses within one
    round, so ``rounds`` rounds over every size, ``trials / rounds`` trials per pause each;
    returns the median over rounds and the lowest and highest round.
    """
    from executor.client import ChannelPool, ExecutorClient
    from fusion.launch.executors import LocalCluster
    from testbeds.bench.transport import wait_until_warm

    per_round = max(3, trials // rounds)
    echo(
        f"timing the executors' transfer path for {len(sizes)} sizes after {len(pauses)} pause lengths, "
        f"{rounds} rounds of {per_round} trials"
    )
    keys = (0.0, *pauses)
    rows: dict[tuple[float, int], list[float]] = {(p, size): [] for p in keys for size in sizes}
    with LocalCluster(1, torch_threads=1) as cluster:
        pool = ChannelPool()
        try:
            client = ExecutorClient(cluster.addresses[0], pool)
            client.probe(1 << 20)
            wait_until_warm([p.pid for p in cluster.processes])
            for r in range(rounds):
                for k, size in enumerate(sizes):
                    times = median_after_pauses(
                        lambda size=size: client.probe(size), pauses, trials=per_round, seed=r * len(sizes) + k
                    )
                    for p, t in times.items():
                        rows[(p, size)].append(t)
            for size in sizes:
                echo(
                    f"  {size >> 10} KB: "
                    + ", ".join(f"{p * 1e3:g} ms quiet {statistics.median(rows[(p, size)]) * 1e3:.2f} ms" for p in keys)
                )
        finally:
            pool.close()

    def grid(pick: Callable[[list[float]], float]) -> TransferPathCost:
        return TransferPathCost(tuple(sizes), keys, tuple(tuple(pick(rows[(p, size)]) for size in sizes) for p in keys))

    return grid(statistics.median), grid(min), grid(max)


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
    from testbeds.bench.transport import wait_until_warm

    block = probe_computation()

    def run() -> None:
        for _ in range(RUNS_PER_COMPUTATION):
            block()

    echo(
        f"timing a computation while transfers of {len(sizes)} sizes overlap it, received and sent: "
        f"{rounds} rounds of {seconds:g} s each"
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
                wait_until_warm([os.getpid(), *(p.pid for p in cluster.processes)])  # both services warm up
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.bench.machine_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=TRIALS, help=f"timed runs per pause and load (default {TRIALS})")
    p.add_argument(
        "--interference-seconds",
        type=float,
        default=SECONDS_PER_CASE,
        help="seconds of timing per transfer size and side for the transfer interference "
        f"(default {SECONDS_PER_CASE:g})",
    )
    p.add_argument(
        "--interference-rounds",
        type=int,
        default=ROUNDS,
        help=f"rounds of the transfer interference (default {ROUNDS})",
    )
    p.add_argument(
        "--transfer-rounds",
        type=int,
        default=TRANSFER_ROUNDS,
        help=f"rounds of the transfer path over every size (default {TRANSFER_ROUNDS})",
    )
    p.add_argument(
        "--out",
        default=str(RESULTS / MACHINE_COSTS_FILE),
        help="JSON path (default: testbeds/results/bench/pause-cost.json)",
    )
    args = p.parse_args(argv)
    if args.trials < 3:
        print("error: --trials must be at least 3", file=sys.stderr)
        return 2
    if args.interference_seconds <= 0 or args.interference_rounds < 1 or args.transfer_rounds < 1:
        print(
            "error: --interference-seconds must be positive, --interference-rounds and --transfer-rounds at least 1",
            file=sys.stderr,
        )
        return 2
    cost = measure(trials=args.trials)
    path, lowest, highest = measure_transfer_path(trials=args.trials, rounds=args.transfer_rounds)
    interference, least, most = measure_interference(seconds=args.interference_seconds, rounds=args.interference_rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    doc = {
        **cost.to_dict(),
        "trials": args.trials,
        "computation": "a transformer MLP block, forward and backward, 4 x 64 x 128, one thread",
        "transfer_path": path.to_dict(),
        "transfer_path_round_range": {"lowest": lowest.to_dict()["seconds"], "highest": highest.to_dict()["seconds"]},
        "interference": interference.to_dict(),
        "interference_round_range": {"lowest": least.to_dict(), "highest": most.to_dict()},
    }
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

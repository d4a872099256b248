"""What a computation costs beyond its profiled time when its core has been idle.

The profile and the executor's calibration time computations back to back. A pipeline
stage computes in bursts: it waits (asleep on its mailbox) for an input, computes one
micro-batch's forward or backward, and waits again. On this testbed's VM a single-thread
computation that starts after its process slept takes longer than the same computation
run back to back, by an amount that grows with the pause and hardly with the computation
(interleaved trials, so the machine's drift cancels; the probe's transformer MLP block:
+0.4 ms after 3 ms asleep, +1.1 ms after 10 ms, +1.7-1.9 ms after 30-300 ms; in separate
runs a 10 ms GPT-2 mini block, a 2 ms matmul and a 6 ms ResNet layer alike). Spinning through the pause instead
of sleeping removed most of it (one measurement, +0.0-0.5 ms); with the other core
computing it was +0.6-1.0 ms in one measurement and about as much as with both idle in
others: what one expects of a core that slows down while idle and speeds up again over a
millisecond or two, not of caches (the penalty does not grow with the computation).
The testbed's emulated slow hosts make it matter: an emulated device stretches every
computation, penalty included, ``slowdown`` times, and sleeps before each next one.

:class:`PauseCost` holds the two measured curves (another core idle / computing);
:func:`testbeds.replay.replay_step` adds the matching one to each action of a stage by how
long its process has been off the core and whether another core of its machine is busy
when it starts.

The same holds for the executors' own work on a transfer (encoding, the gRPC call, checks,
reassembly, the answer), which the replay had priced at nothing beyond the wire: timed on
loopback to a real executor process, 1.0 ms for 16 KB and 3.0-3.1 ms for 1 MB back to back,
2.2-5.7 ms after 30 ms or more of quiet on the pair (medians of four rounds, with a transfer
of one chunk sent as one message; as a request stream it was 1.8 and 3.7-4.0 ms back to
back; in some minutes the same transfers take up to twice as long).
:class:`TransferPathCost` holds that grid, and the replay adds it to each transfer between
stages by how long its pair was quiet. One run per machine (about 3 minutes):

    python -m testbeds.pause_cost        # -> testbeds/results/pause-cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import ConfigError, FusionError
from testbeds.interference import (
    ROUNDS,
    SECONDS_PER_CASE,
    by_size,
    measure_interference,
)

#: Pauses measured (seconds): stages here wait 1-300 ms between computations.
PAUSES_S = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
TRIALS = 80
#: Transfers timed (bytes): the benchmark jobs' activations and gradients are 64 KB - 1 MB.
TRANSFER_SIZES_BYTES = (16 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
TRANSFER_PAUSES_S = (0.003, 0.03, 0.1)
TRANSFER_ROUNDS = 4
RESULTS = Path(__file__).resolve().parent / "results"
#: A busy core for the ``loaded`` curve: one thread of matmuls until killed.
_HOG = (
    "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\na = torch.tanh(a @ a)\nprint('ready', flush=True)\n"
    "while True:\n    a = torch.tanh(a @ a)\n"
)


@dataclass(frozen=True)
class PauseCost:
    """Extra seconds of a computation after a pause, with the machine's other cores idle
    (``idle_s``) or computing (``loaded_s``); zero for no pause, interpolated in the log
    of the pause between measured ones, flat beyond the longest."""

    pauses_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    loaded_s: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.pauses_s)
        if (
            n < 1
            or len(self.idle_s) != n
            or len(self.loaded_s) != n
            or list(self.pauses_s) != sorted(set(self.pauses_s))
        ):
            raise ConfigError(
                f"a pause cost needs increasing pauses with one idle and one loaded cost each, got {self}"
            )
        if self.pauses_s[0] <= 0 or any(not 0 <= c < 1 for c in (*self.idle_s, *self.loaded_s)):
            raise ConfigError(f"pause costs need positive pauses and costs of 0-1 s, got {self}")

    def __call__(self, pause_s: float, others_busy: bool) -> float:
        """Extra seconds for a computation after ``pause_s`` off the core."""
        costs = self.loaded_s if others_busy else self.idle_s
        if pause_s <= 0:
            return 0.0
        # From no pause (no cost) to the shortest measured one linearly; beyond, in log(pause).
        if pause_s < self.pauses_s[0]:
            return costs[0] * pause_s / self.pauses_s[0]
        return float(np.interp(np.log(pause_s), np.log(self.pauses_s), costs))

    def to_dict(self) -> dict[str, Any]:
        return {"pauses_s": list(self.pauses_s), "idle_s": list(self.idle_s), "loaded_s": list(self.loaded_s)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PauseCost:
        try:
            return cls(
                tuple(map(float, d["pauses_s"])), tuple(map(float, d["idle_s"])), tuple(map(float, d["loaded_s"]))
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a pause cost document ({e!r}): needs pauses_s, idle_s and loaded_s lists") from e


@dataclass(frozen=True)
class TransferPathCost:
    """Seconds a transfer spends in the executors (encoding, the gRPC call, checks,
    reassembly, the answer) beyond the wire, by size and by how long the pair was quiet
    before it: ``seconds[i][j]`` for ``pauses_s[i]`` (the first 0: back to back) and
    ``sizes_bytes[j]``. Linear in size (beyond the largest, at the last step's rate per byte),
    in the log of the pause between measured ones, flat beyond the longest."""

    sizes_bytes: tuple[int, ...]
    pauses_s: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if (
            len(self.sizes_bytes) < 2
            or list(self.sizes_bytes) != sorted(set(self.sizes_bytes))
            or self.sizes_bytes[0] <= 0
        ):
            raise ConfigError(
                f"a transfer path cost needs two or more increasing positive sizes, got {self.sizes_bytes}"
            )
        if len(self.pauses_s) < 2 or self.pauses_s[0] != 0 or list(self.pauses_s) != sorted(set(self.pauses_s)):
            raise ConfigError(f"a transfer path cost needs pauses from 0 up, increasing, got {self.pauses_s}")
        if len(self.seconds) != len(self.pauses_s) or any(len(row) != len(self.sizes_bytes) for row in self.seconds):
            raise ConfigError(f"a transfer path cost needs one time per size for each pause, got {self.seconds}")
        if any(not 0 <= t < 60 for row in self.seconds for t in row):
            raise ConfigError(f"transfer path times must be 0-60 s, got {self.seconds}")

    def __call__(self, size_bytes: float, pause_s: float) -> float:
        """Seconds for a transfer of ``size_bytes`` after ``pause_s`` of quiet on its pair."""
        at_size = [by_size(self.sizes_bytes, row, size_bytes) for row in self.seconds]
        if pause_s <= 0:
            return at_size[0]
        if pause_s < self.pauses_s[1]:  # linearly from back to back up to the shortest pause
            return at_size[0] + (at_size[1] - at_size[0]) * pause_s / self.pauses_s[1]
        return float(np.interp(np.log(pause_s), np.log(self.pauses_s[1:]), at_size[1:]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes_bytes": list(self.sizes_bytes),
            "pauses_s": list(self.pauses_s),
            "seconds": [list(r) for r in self.seconds],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferPathCost:
        try:
            return cls(
                tuple(map(int, d["sizes_bytes"])),
                tuple(map(float, d["pauses_s"])),
                tuple(tuple(map(float, r)) for r in d["seconds"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a transfer path cost ({e!r}): needs sizes_bytes, pauses_s and seconds") from e


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
    from testbeds.bench_core import EXECUTOR_WARM_UP_S

    per_round = max(3, trials // rounds)
    echo(
        f"timing the executors' transfer path for {len(sizes)} sizes after {len(pauses)} pause lengths, {rounds} rounds of {per_round} trials"
    )
    keys = (0.0, *pauses)
    rows: dict[tuple[float, int], list[float]] = {(p, size): [] for p in keys for size in sizes}
    with LocalCluster(1, torch_threads=1) as cluster:
        pool = ChannelPool()
        try:
            client = ExecutorClient(cluster.addresses[0], pool)
            client.probe(1 << 20)
            time.sleep(EXECUTOR_WARM_UP_S)  # the executor imports in the background for its first seconds
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


def pause_cost_beside(directory: Path) -> PauseCost | None:
    """The machine's pause cost when ``pause-cost.json`` sits in ``directory``, else ``None``."""
    doc = document_in(directory)
    return PauseCost.from_dict(doc) if doc is not None else None


def transfer_path_beside(directory: Path) -> TransferPathCost | None:
    """The machine's transfer path cost when ``pause-cost.json`` in ``directory`` has one."""
    doc = document_in(directory)
    return TransferPathCost.from_dict(doc["transfer_path"]) if doc is not None and "transfer_path" in doc else None


def document_in(directory: Path) -> dict[str, Any] | None:
    """``pause-cost.json`` in ``directory`` as a dict (``None`` when absent); ``ConfigError``
    when it is not a JSON object."""
    path = directory / "pause-cost.json"
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e}); re-run python -m testbeds.pause_cost") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a pause cost document (a JSON object)")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.pause_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=TRIALS, help=f"timed runs per pause and load (default {TRIALS})")
    p.add_argument(
        "--interference-seconds",
        type=float,
        default=SECONDS_PER_CASE,
        help=f"seconds of timing per transfer size and side for the transfer interference (default {SECONDS_PER_CASE:g})",
    )
    p.add_argument(
        "--interference-rounds",
        type=int,
        default=ROUNDS,
        help=f"rounds of the transfer interference (default {ROUNDS})",
    )
    p.add_argument(
        "--out", default=str(RESULTS / "pause-cost.json"), help="JSON path (default: testbeds/results/pause-cost.json)"
    )
    args = p.parse_args(argv)
    if args.trials < 3:
        print("error: --trials must be at least 3", file=sys.stderr)
        return 2
    if args.interference_seconds <= 0 or args.interference_rounds < 1:
        print("error: --interference-seconds must be positive and --interference-rounds at least 1", file=sys.stderr)
        return 2
    cost = measure(trials=args.trials)
    path, lowest, highest = measure_transfer_path(trials=args.trials)
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

"""What one machine shared by several workers costs beyond the profile: the simulator's
model of a testbed on one host, for validating it against the benchmark's runs.

A profile (and the executor's calibration) times computations back to back on an idle
process. A testbed's pipeline stages run otherwise, and three costs follow that the
replay (:func:`testbeds.sim.replay.replay_step`) adds where a measured file gives them:

- :class:`PauseCost`: a computation that starts after its process slept (a stage waiting
  for its input) takes longer than back to back, by an amount that grows with the pause
  and hardly with the computation (a core that slows down while idle and speeds up again
  over a millisecond or two), with the machine's other cores idle or computing. An
  emulated slow device stretches it too, and sleeps before each next computation, so the
  emulated hosts pay it at every action.
- :class:`TransferPathCost`: the executors' own work on a transfer beyond the wire
  (encoding, the gRPC call, checks, reassembly, the answer), by size and by how long the
  pair was quiet.
- :class:`TransferInterference`: what a transfer costs a computation it overlaps in the
  same process (the gRPC threads share the interpreter lock and caches with the compute
  thread); a stage sends and receives while it computes.

None of them exists for devices that are separate machines, which is why the at-scale
simulation leaves them out; :mod:`testbeds.sim.validation` takes them from
``pause-cost.json`` beside a benchmark result (measured in the same sitting by
``python -m testbeds.bench.machine_probe``), and without them it underestimates the
compute-bound cells of a one-host testbed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import ConfigError

#: The file beside a benchmark result that holds the machine's measured costs.
MACHINE_COSTS_FILE = "pause-cost.json"


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


def document_in(directory: Path) -> dict[str, Any] | None:
    """``pause-cost.json`` in ``directory`` as a dict (``None`` when absent); ``ConfigError``
    when it is not a JSON object."""
    path = directory / MACHINE_COSTS_FILE
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e}); re-run python -m testbeds.bench.machine_probe") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a pause cost document (a JSON object)")
    return doc


def pause_cost_beside(directory: Path) -> PauseCost | None:
    """The machine's pause cost when ``pause-cost.json`` sits in ``directory``, else ``None``."""
    doc = document_in(directory)
    return PauseCost.from_dict(doc) if doc is not None else None


def transfer_path_beside(directory: Path) -> TransferPathCost | None:
    """The machine's transfer path cost when ``pause-cost.json`` in ``directory`` has one."""
    doc = document_in(directory)
    return TransferPathCost.from_dict(doc["transfer_path"]) if doc is not None and "transfer_path" in doc else None


def interference_beside(directory: Path) -> TransferInterference | None:
    """The machine's transfer interference when ``pause-cost.json`` in ``directory`` has one."""
    doc = document_in(directory)
    return TransferInterference.from_dict(doc["interference"]) if doc is not None and "interference" in doc else None

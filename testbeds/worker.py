"""``python -m testbeds.worker``: a product worker that stands in for a testbed host's device.

The same flags as ``fusion-worker``, plus what a one-machine testbed needs, added through
the executor's seams (:mod:`executor.hooks`) so that the product carries none of it:

- ``--emulate-slowdown FACTOR`` (:class:`EmulatedDevice`): each forward and backward of a
  micro-batch is followed by a sleep, so the worker computes as a device ``FACTOR`` times
  slower (:mod:`testbeds.emulation`). ``--emulation wall`` sleeps ``FACTOR - 1`` times the
  computation's wall time here; ``--emulation profile`` ``FACTOR - 1`` times its seconds in
  the profile the job was planned with, which the worker asks the coordinator for when a
  stage is loaded (``GetProfile``, with the worker's token) and sums over the stage's nodes
  as the planner costs them (:func:`stage_seconds`).
- ``--dilate D`` (:mod:`testbeds.dilation`): time dilation, a device ``D`` times slower
  again on top of ``--emulate-slowdown``. A computation's own time is the CPU time the
  stage's computations of its kind typically use (with one torch thread; otherwise the
  wall time), so that waiting for a core shared with other hosts is absorbed. The reported
  speed is divided by ``D`` too.
- ``--machine-flops F``: the speed the worker reports, before the slowdown, instead of its
  own start-up measurement; a launcher measures the machine once and passes it to every
  worker, so that workers started one after another report one speed.
- ``--peer-map FILE`` (default ``$FUSION_PEER_MAP``): dial peers through the testbed's
  link proxies (:mod:`testbeds.peer_map`).

**What the coordinator sees, and why planning is unchanged.** An emulated worker reports
``matmul_flops = machine_flops / FACTOR`` (the speed it emulates), its machine's label as
every worker on this CPU does (the estimator still lets their stages take turns on the
machine, :mod:`scheduler.estimator`), and its device name with the factor appended
(e.g. ``"CPU (1 threads), 3x slower"``). The coordinator's
:func:`~fusion.coordinator.planning.machine_speeds` takes the best report per machine *and
device name*, so unlike devices on one machine keep their own speeds: the planner prices
each worker at ``machine_flops / FACTOR``, as it did when the factor travelled on the wire.
A worker with factor 1 reports the machine's speed under the plain device name.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

import torch

from executor.hooks import FORWARD, StageHooks, StageInfo
from fusion.cli.env import resolve_token
from fusion.cli.worker import build_parser, run_worker
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import ConfigError, FusionError
from fusion.profiling import DeviceProfile
from fusion.wire import coordinator_pb2 as cpb
from testbeds.dilation import check_dilation, dilation_label
from testbeds.emulation import EMULATIONS, Slowdown, check_factor
from testbeds.peer_map import PeerMap, add_peer_map_arg, peer_map_channels

logger = logging.getLogger(__name__)

#: Most seconds one stage's forward or backward may take in a profile (a sanity bound).
MAX_STAGE_S = 3600.0

#: Computations of one kind on one stage whose CPU times give a dilated device's own time.
CPU_WINDOW = 20
#: Which quantile of them: the computations least disturbed (:meth:`EmulatedDevice._typical_cpu_s`).
CPU_QUANTILE = 0.25

#: A stage's (forward, backward) seconds per micro-batch, looked up when it is loaded.
StageSecondsFn = Callable[[StageInfo], tuple[float, float]]


def stage_seconds(profile: cpb.GetProfileResponse, nodes: Sequence[str]) -> tuple[float, float]:
    """The (forward, backward) seconds of one micro-batch of the stage computing ``nodes``,
    as the planner costs them: each node's profiled seconds times the calibration's
    ``compute_factor`` (1 when not calibrated), summed; nodes the profile has no entry for
    (inputs, outputs) cost nothing."""
    factor = profile.compute_factor or 1.0
    costs = {n.name: n for n in profile.nodes}
    fwd = sum(costs[n].forward_s * factor for n in nodes if n in costs)
    bwd = sum(costs[n].backward_s * factor for n in nodes if n in costs)
    return fwd, bwd


def coordinator_stage_seconds(coordinator: str, token: str) -> StageSecondsFn:
    """A stage's seconds from the profile its job was planned with, asked of the coordinator."""

    def lookup(stage: StageInfo) -> tuple[float, float]:
        with CoordinatorClient(coordinator, token) as client:
            try:
                profile = client.get_profile(stage.job_id)
            except FusionError as e:
                raise ConfigError(
                    f"worker {stage.worker_name or '?'} emulates a slower device by the profile (--emulation profile), "
                    f"but the coordinator has no profile of job {stage.job_id} for stage {stage.stage_idx}: {e}"
                ) from e
        return stage_seconds(profile, stage.nodes)

    return lookup


class EmulatedDevice(StageHooks):
    """Compute hooks that make every stage of this worker compute as a device ``factor``
    times slower (:class:`testbeds.emulation.Slowdown`; factor 1: no change), and ``dilation``
    times slower again (time dilation). A dilated computation's own time is a low quantile
    (:data:`CPU_QUANTILE`) of the CPU times of the stage's last :data:`CPU_WINDOW`
    computations of its kind (forward or backward), measured on the computing thread when
    torch computes on it alone (one torch thread; otherwise the wall time stands in).

    ``emulation="profile"`` needs ``seconds``: it is called when a stage is loaded and gives
    the stage's (forward, backward) seconds per micro-batch to stretch by; a stage whose
    seconds are missing (all zero) or not finite numbers in ``[0, 3600]`` is refused.
    """

    def __init__(
        self, factor: float, *, emulation: str = "wall", seconds: StageSecondsFn | None = None, dilation: float = 1.0
    ) -> None:
        self.slowdown = Slowdown(factor, emulation=emulation, dilation=dilation)
        if self.slowdown.by_profile and seconds is None:
            raise ConfigError("profile emulation needs a source of the stages' profiled seconds")
        self._seconds = seconds
        self._profiled: dict[tuple[str, int], tuple[float, float]] = {}
        self._cpu_s: dict[tuple[str, int, str], collections.deque[float]] = {}
        self._lock = threading.Lock()

    def stage_loaded(self, stage: StageInfo) -> None:
        if not self.slowdown.by_profile:
            return
        assert self._seconds is not None
        profiled = self._seconds(stage)
        if not all(math.isfinite(v) and 0 <= v <= MAX_STAGE_S for v in profiled):
            raise ConfigError(
                f"stage {stage.stage_idx} of job {stage.job_id}: profiled seconds must be finite, "
                f"0 to {MAX_STAGE_S:.0f}, got {profiled}"
            )
        if not any(profiled):
            raise ConfigError(
                f"worker {stage.worker_name or '?'} emulates a slower device by the profile (--emulation profile), "
                f"but stage {stage.stage_idx} of job {stage.job_id} has no profiled seconds"
            )
        with self._lock:
            self._profiled[(stage.job_id, stage.stage_idx)] = profiled

    def compute(self, stage: StageInfo, kind: str, step: int, micro_batch_idx: int) -> AbstractContextManager[None]:
        if not self.slowdown.active:
            return contextlib.nullcontext()
        reference = None
        if self.slowdown.by_profile:
            with self._lock:
                fwd, bwd = self._profiled[(stage.job_id, stage.stage_idx)]
            reference = fwd if kind == FORWARD else bwd
        return self._stretched(reference, (stage.job_id, stage.stage_idx, kind))

    @contextlib.contextmanager
    def _stretched(self, reference_s: float | None, key: tuple[str, int, str]) -> Iterator[None]:
        # The thread's CPU time is the computation's own only when torch computes on it alone.
        by_cpu = self.slowdown.dilation > 1.0 and torch.get_num_threads() == 1
        c0 = time.thread_time() if by_cpu else 0.0
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        own = self._typical_cpu_s(key, time.thread_time() - c0) if by_cpu else None
        self.slowdown.stretch(seconds, reference_s, own)

    def _typical_cpu_s(self, key: tuple[str, int, str], cpu_s: float) -> float:
        """The :data:`CPU_QUANTILE` of the CPU times of the stage's last :data:`CPU_WINDOW`
        computations of this kind, this one included: every micro-batch of a stage computes
        the same, and disturbances only add CPU time (another process's use of the caches,
        a core woken from a sleep), so a low quantile is the device's undisturbed time."""
        with self._lock:
            window = self._cpu_s.setdefault(key, collections.deque(maxlen=CPU_WINDOW))
            window.append(cpu_s)
            ordered = sorted(window)
        return ordered[int(CPU_QUANTILE * (len(ordered) - 1))]


def emulated_profile(
    profile: DeviceProfile, factor: float, machine_flops: float | None, dilation: float = 1.0
) -> DeviceProfile:
    """What a worker emulating a device ``factor`` times slower, dilated ``dilation`` times,
    reports (module docstring)."""
    flops = machine_flops if machine_flops is not None else profile.matmul_flops
    if factor == 1.0 and dilation == 1.0:
        return replace(profile, matmul_flops=flops)
    name = profile.device_name
    if factor != 1.0:
        name = f"{name}, {factor:g}x slower"
    if dilation != 1.0:
        name = f"{name}, {dilation_label(dilation)}"
    return replace(profile, matmul_flops=flops / (factor * dilation), device_name=name)


def add_emulation_args(parser: argparse.ArgumentParser) -> None:
    """The testbed's flags on top of ``fusion-worker``'s."""
    g = parser.add_argument_group("testbed emulation")
    g.add_argument(
        "--emulate-slowdown",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="behave as a device FACTOR times slower: each computation is followed by a sleep of FACTOR - 1 times "
        "its length, and the reported speed is divided by FACTOR (default: %(default)s, none)",
    )
    g.add_argument(
        "--emulation",
        choices=EMULATIONS,
        default="wall",
        help="what --emulate-slowdown multiplies: each computation's wall time here, or its seconds in the profile "
        "the coordinator planned the job with (default: %(default)s)",
    )
    g.add_argument(
        "--dilate",
        type=float,
        default=1.0,
        metavar="D",
        help="time dilation: compute D times slower again on top of --emulate-slowdown, each computation "
        "measured by the CPU time it used, and report a speed D times lower; the testbed dilates the links "
        "and divides the times it reports by D (default: %(default)s, none)",
    )
    g.add_argument(
        "--machine-flops",
        type=float,
        default=None,
        metavar="F",
        help="this machine's matmul speed (FLOP/s), measured once by the launcher, reported (over FACTOR) instead "
        "of this worker's own measurement",
    )
    add_peer_map_arg(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(prog="python -m testbeds.worker")
    add_emulation_args(parser)
    args = parser.parse_args(argv)
    try:
        factor = check_factor(args.emulate_slowdown)
    except ConfigError as e:
        parser.error(f"--emulate-slowdown: {e}")
    try:
        dilation = check_dilation(args.dilate)
    except ConfigError as e:
        parser.error(f"--dilate: {e}")
    if args.machine_flops is not None and not (math.isfinite(args.machine_flops) and args.machine_flops > 0):
        parser.error(f"--machine-flops must be a positive number, got {args.machine_flops}")
    hooks = None
    if factor > 1.0 or dilation > 1.0:
        seconds = None
        if args.emulation == "profile" and factor > 1.0:
            token = resolve_token(args.token, args.token_file, required=False) or ""
            seconds = coordinator_stage_seconds(args.coordinator, token)
        hooks = EmulatedDevice(factor, emulation=args.emulation, seconds=seconds, dilation=dilation)
    channels = peer_map_channels(PeerMap(args.peer_map)) if args.peer_map else None
    return run_worker(
        args,
        hooks=hooks,
        channel_factory=channels,
        report=lambda p: emulated_profile(p, factor, args.machine_flops, dilation),
    )


if __name__ == "__main__":
    sys.exit(main())

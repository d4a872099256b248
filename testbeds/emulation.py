"""Emulated slower devices, for testbeds that run every host on one machine.

A WAN testbed on one Linux host runs every worker on the same CPU, so every host computes
at one speed. A topology's hosts are not alike (a V100 site and a GTX 1060 site), and a
system's answer to that — fusion's planner avoiding the slow devices, DDP waiting for the
slowest rank — is part of what the benchmark measures. :class:`Slowdown` stands in for a
device ``factor`` times slower: after each computation it sleeps ``factor - 1`` times the
computation's wall time. Sleeping, not spinning, leaves the shared cores to the other hosts,
as a separate device would. Wall time, not CPU time: the fast hosts compute on the same
loaded CPU, so stretching the wall time keeps the topology's speed ratio between them; the
price is that contention a slow host meets while computing is stretched ``factor`` times too
(what the simulator's shared-core model does not follow; ``docs/benchmarks.md``).

Two ways to measure the stretch (:data:`EMULATIONS`, ``--emulation``):

- ``wall`` (the default): ``factor - 1`` times each computation's wall time here. Whatever
  this machine adds to a computation is then multiplied by the factor too: the cost of
  computing after a sleep (``testbeds/sim/machine.py``), the transfers its process handles
  meanwhile, waiting for a shared core. On volunteers' 25.4x host the computations took
  2.6x their profile on the core, so the host ran as a device about 65x slower than its
  profile (``docs/benchmarks.md``).
- ``profile``: ``factor - 1`` times the computation's reference seconds, the coordinator's
  calibrated node profile for it. What this machine adds is paid once, and the device
  computes at the topology's speed over the profile, which is what the planner and the
  simulator assume. fusion's workers (:mod:`testbeds.worker`) sum their stage's nodes in
  the profile the coordinator serves (``GetProfile``); the baselines get theirs from the
  benchmark.

This is emulation and is labelled as such wherever it is used (``python -m testbeds.worker
--emulate-slowdown``, the baselines' ``--slowdown``, ``testbeds.bench --emulate-speeds``);
it has no place on a real deployment, and the product does not know of it: it reaches
fusion's executor through its compute hook (:mod:`executor.hooks`).

**Dilation** (:mod:`testbeds.dilation`): ``dilation=D`` makes the device ``D`` times slower
again, on top of ``factor``, and measures what the computation itself took by the CPU time
it used when the caller gives it (``cpu_s``): the computation ends ``D * factor * cpu_s``
after it began (``profile``: ``D * (cpu_s + (factor - 1) * reference_s)``), whatever it
waited for a core meanwhile, as long as that wait is less than the dilated time. Without
``cpu_s`` (the baselines' hooks) the wall time stands in for it.

Forward and backward computations are stretched; the optimizer step is not (it is a small
share of a step, and the simulator prices it so: ``testbeds/replay.py``).

Two ways in, one stretch:

- :meth:`Slowdown.stretch` after a timed computation (:class:`testbeds.worker.EmulatedDevice`
  times each micro-batch's forward and backward of fusion's executor through its hook).
- :meth:`Slowdown.attach` for a plain ``torch.nn.Module`` (the DDP and GPipe baselines):
  forward hooks stretch each forward; in the backward, a parameter's gradient accumulation
  stretches the computation since the last stretch once that is :data:`MIN_PIECE_S` or
  more (or since the backward reached the module's output), and the end of the pass
  stretches the rest. The backward is stretched as it goes, so DDP's gradient buckets
  become ready when they would on the slower device (give or take a piece): an
  all-reduce cannot hide behind emulated time that comes later.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch

from fusion.errors import ConfigError
from testbeds.dilation import check_dilation

#: Shortest backward piece stretched on its own (seconds of this machine's compute): each
#: stretch is a sleep, and the piece after a sleep computes slower on a cold core (the
#: pause cost, ``testbeds/pause_cost.py``), a slowdown the stretch then multiplies. Per
#: parameter, that made an emulated backward 1.6-3.6x longer than ``factor`` times the
#: real one (GPT-2 mini / ResNet-18/16, factors 2.9 and 25.4); shorter pieces wait for the
#: next gradient or the end of the pass.
MIN_PIECE_S = 0.002


#: How an emulated device's extra time is measured (module docstring).
EMULATIONS = ("wall", "profile")


def check_factor(factor: float) -> float:
    """``factor`` as a float, or ``ConfigError``: a slowdown is a finite number >= 1."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1.0:
        raise ConfigError(f"slowdown must be a finite number >= 1 (1: none), got {factor!r}")
    return float(factor)


def check_emulation(emulation: str) -> str:
    """``emulation``, or ``ConfigError`` naming the choices (:data:`EMULATIONS`)."""
    if emulation not in EMULATIONS:
        raise ConfigError(f"unknown emulation {emulation!r}; choose from {', '.join(EMULATIONS)}")
    return emulation


class Slowdown:
    """Stretch computations to ``factor`` times their wall time, or (``emulation=
    "profile"``) to their wall time plus ``factor - 1`` times their reference seconds
    (1: leave them alone)."""

    def __init__(
        self, factor: float = 1.0, *, min_piece_s: float = MIN_PIECE_S, emulation: str = "wall", dilation: float = 1.0
    ) -> None:
        self.factor = check_factor(factor)
        self.emulation = check_emulation(emulation)
        #: The common time dilation ``D`` on top of ``factor`` (module docstring; 1: none).
        self.dilation = check_dilation(dilation)
        #: :meth:`attach`'s shortest backward piece (:data:`MIN_PIECE_S`; 0: every gradient).
        self.min_piece_s = min_piece_s
        self._lock = threading.Lock()
        #: When the backward's last stretched piece ended (``None``: no backward yet).
        self._mark: float | None = None
        #: ``profile`` emulation: reference seconds of the backward stretched so far.
        self._done_s = 0.0
        self._backward_s = 0.0
        self._ready_s: dict[int, float] = {}

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or self.dilation > 1.0

    @property
    def by_profile(self) -> bool:
        """Whether stretches are ``factor - 1`` times reference seconds (``profile``)."""
        return self.factor > 1.0 and self.emulation == "profile"

    def extra_s(self, seconds: float, reference_s: float | None = None, cpu_s: float | None = None) -> float:
        """What :meth:`stretch` sleeps after a computation that took ``seconds`` of wall time
        here, ``reference_s`` in the profile (``profile`` emulation, where it is required) and
        ``cpu_s`` of CPU time (dilation only; ``None``: the wall time stands in)."""
        seconds = max(0.0, seconds)
        if self.by_profile:
            if reference_s is None or not math.isfinite(reference_s) or reference_s < 0:
                raise ConfigError(f"profile emulation needs the computation's profiled seconds, got {reference_s!r}")
        if self.dilation == 1.0:
            return (self.factor - 1.0) * (reference_s if self.by_profile else seconds)
        own = seconds if cpu_s is None else min(seconds, max(0.0, cpu_s))
        device = own + (self.factor - 1.0) * reference_s if self.by_profile else own * self.factor
        return max(0.0, self.dilation * device - seconds)

    def stretch(self, seconds: float, reference_s: float | None = None, cpu_s: float | None = None) -> float:
        """Sleep for the rest of a computation (:meth:`extra_s`); the seconds slept."""
        extra = self.extra_s(seconds, reference_s, cpu_s)
        if extra > 0.0:
            time.sleep(extra)
        return extra

    def attach(
        self,
        module: torch.nn.Module,
        *,
        forward_s: float | None = None,
        backward_s: float | None = None,
        ready_s: dict[str, float] | None = None,
    ) -> None:
        """Stretch every forward and backward of ``module`` (no-op for factor 1).

        The backward is stretched piece by piece: a parameter's gradient accumulation
        stretches the time since the last stretch (or since the gradient reached the
        module's output) once it is ``min_piece_s`` or more, and the end of the backward
        pass stretches what is left; a forward whose output needs no gradient is stretched
        alone.

        ``profile`` emulation prices the same pieces from the profile: each forward
        ``forward_s``, and the backward ``backward_s`` in all, cut where a parameter named
        in ``ready_s`` (seconds into the backward at which its gradient is ready) gets its
        gradient, ``min_piece_s`` or more after the last cut. Without ``ready_s`` the whole
        backward is stretched when the pass ends.
        """
        if not self.active:
            return
        if self.by_profile:
            if forward_s is None or backward_s is None:
                raise ConfigError("profile emulation needs the module's profiled forward and backward seconds")
            named = dict(module.named_parameters())
            unknown = sorted(set(ready_s or {}) - set(named))
            if unknown:
                raise ConfigError(
                    f"profile emulation: no parameter {unknown[0]!r} in the module ({len(unknown)} unknown)"
                )
            self._backward_s = float(backward_s)
            self._ready_s = {id(named[n]): float(s) for n, s in (ready_s or {}).items()}
        params = [p for p in module.parameters() if p.requires_grad]
        state: dict[str, float] = {}

        def before_forward(_m: torch.nn.Module, _inputs: Any) -> None:
            state["t0"] = time.perf_counter()

        def after_forward(_m: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self.stretch(time.perf_counter() - state.pop("t0", time.perf_counter()), forward_s)
            first = next((t for t in _tensors(output) if t.requires_grad), None)
            if first is not None and params:
                first.register_hook(self._backward_started)

        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)
        for p in params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _backward_started(self, grad: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._mark = time.perf_counter()
            self._done_s = 0.0
        # What is left of the backward after its last stretched piece is stretched when the
        # pass ends (the autograd engine runs queued callbacks then, as DDP's reducer uses).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        return grad

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self.by_profile:
            ready = self._ready_s.get(id(param))
            if ready is not None:
                self._stretch_profiled(ready, self.min_piece_s)
            return
        self._stretch_piece(self.min_piece_s)

    def _backward_ended(self) -> None:
        if self.by_profile:
            self._stretch_profiled(self._backward_s, 0.0)
            return
        self._stretch_piece(0.0)

    def _stretch_profiled(self, until_s: float, at_least: float) -> None:
        """``profile`` emulation: stretch the backward's reference seconds up to ``until_s``
        once that is ``at_least`` past the last piece."""
        with self._lock:
            piece = until_s - self._done_s
            if piece <= 0.0 or piece < at_least:
                return
            self._done_s = until_s
        self.stretch(piece, piece)

    def _stretch_piece(self, at_least: float) -> None:
        """Stretch the backward since the last piece once it has computed ``at_least``."""
        with self._lock:
            if self._mark is None:
                return
            since = time.perf_counter() - self._mark
            if since < at_least:
                return
        self.stretch(since)
        with self._lock:
            self._mark = time.perf_counter()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []

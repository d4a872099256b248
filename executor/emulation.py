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
(what the simulator's shared-core model does not follow; ``testbeds/results/bench-notes.md``).

This is emulation and is labelled as such wherever it is used (``fusion-worker
--emulate-slowdown``, the baselines' ``--slowdown``, ``testbeds.bench --emulate-speeds``);
it has no place on a real deployment.

Forward and backward computations are stretched; the optimizer step is not (it is a small
share of a step, and the simulator prices it so: ``testbeds/replay.py``).

Two ways in, one stretch:

- :meth:`Slowdown.stretch` after a timed computation (fusion's executor times each
  micro-batch's forward and backward itself).
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

#: Shortest backward piece stretched on its own (seconds of this machine's compute): each
#: stretch is a sleep, and the piece after a sleep computes slower on a cold core (the
#: pause cost, ``testbeds/pause_cost.py``), a slowdown the stretch then multiplies. Per
#: parameter, that made an emulated backward 1.6-3.6x longer than ``factor`` times the
#: real one (GPT-2 mini / ResNet-18/16, factors 2.9 and 25.4); shorter pieces wait for the
#: next gradient or the end of the pass.
MIN_PIECE_S = 0.002


def check_factor(factor: float) -> float:
    """``factor`` as a float, or ``ConfigError``: a slowdown is a finite number >= 1."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1.0:
        raise ConfigError(f"slowdown must be a finite number >= 1 (1: none), got {factor!r}")
    return float(factor)


class Slowdown:
    """Stretch computations to ``factor`` times their wall time (1: leave them alone)."""

    def __init__(self, factor: float = 1.0, *, min_piece_s: float = MIN_PIECE_S) -> None:
        self.factor = check_factor(factor)
        #: :meth:`attach`'s shortest backward piece (:data:`MIN_PIECE_S`; 0: every gradient).
        self.min_piece_s = min_piece_s
        self._lock = threading.Lock()
        #: When the backward's last stretched piece ended (``None``: no backward yet).
        self._mark: float | None = None

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def stretch(self, seconds: float) -> float:
        """Sleep for the rest of a computation that took ``seconds`` on this machine; the
        seconds slept."""
        extra = (self.factor - 1.0) * max(0.0, seconds)
        if extra > 0.0:
            time.sleep(extra)
        return extra

    def attach(self, module: torch.nn.Module) -> None:
        """Stretch every forward and backward of ``module`` (no-op for factor 1).

        The backward is stretched piece by piece: a parameter's gradient accumulation
        stretches the time since the last stretch (or since the gradient reached the
        module's output) once it is ``min_piece_s`` or more, and the end of the backward
        pass stretches what is left; a forward whose output needs no gradient is stretched
        alone.
        """
        if not self.active:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        state: dict[str, float] = {}

        def before_forward(_m: torch.nn.Module, _inputs: Any) -> None:
            state["t0"] = time.perf_counter()

        def after_forward(_m: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self.stretch(time.perf_counter() - state.pop("t0", time.perf_counter()))
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
        # What is left of the backward after its last stretched piece is stretched when the
        # pass ends (the autograd engine runs queued callbacks then, as DDP's reducer uses).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        return grad

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        self._stretch_piece(self.min_piece_s)

    def _backward_ended(self) -> None:
        self._stretch_piece(0.0)

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

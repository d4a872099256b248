"""Counting a stage's activation memory as autograd saves it, per micro-batch."""

from __future__ import annotations

import contextlib

import torch


class MemoryMeter:
    """Live activation bytes of a stage's micro-batches, and their peak within a step.

    Counts what a stage keeps between a micro-batch's forward and its backward: the
    tensors autograd saves for backward (via ``saved_tensors_hooks``), the received
    inputs and the outputs it keeps. Each storage is counted once; parameters are not
    activations and are skipped.
    """

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.enabled = False
        self.live = 0
        self.peak = 0
        self._by_mb: dict[int, int] = {}
        self._ptrs: dict[int, set[int]] = {}

    def charge(self, m: int, t: torch.Tensor) -> None:
        if not self.enabled:
            return
        try:
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        seen = self._ptrs.setdefault(m, set())
        if ptr in self.param_ptrs or ptr in seen:
            return
        seen.add(ptr)
        self._by_mb[m] = self._by_mb.get(m, 0) + size
        self.live += size
        self.peak = max(self.peak, self.live)

    def hooks(self, m: int) -> contextlib.AbstractContextManager[object]:
        if not self.enabled:
            return contextlib.nullcontext()

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.charge(m, t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def release(self, m: int) -> None:
        self.live -= self._by_mb.pop(m, 0)
        self._ptrs.pop(m, None)

    def reset(self) -> None:
        self.live = self.peak = 0
        self._by_mb.clear()
        self._ptrs.clear()

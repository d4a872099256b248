"""A baseline rank's peak memory, measured by the rank itself.

On CUDA: ``torch.cuda.max_memory_allocated`` (the allocator's peak). On CPU, where no
allocator keeps a peak: the bytes of the rank's local training state (parameters, their
gradients, the optimizer's state tensors; an FSDP rank's DTensors count their local shard)
plus the peak bytes of tensors autograd saved for backward within a step
(:class:`SavedTensorsPeak`, via ``torch.autograd.graph.saved_tensors_hooks``; tensors
sharing storage counted once, parameters not again). Transient buffers (an FSDP all-gather,
a matmul's output before it is saved) are not counted, so on CPU this is a lower bound of
the rank's true peak, measured the same way for every rank baseline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Self

import torch

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the (local parts of the) tensors among ``tensors``."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = _local(t)
            total += local.numel() * local.element_size()
    return total


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``module``'s parameters, their gradients and ``optimizer``'s state tensors."""
    params = list(module.parameters())
    total = tensor_bytes(params) + tensor_bytes(p.grad for p in params if p.grad is not None)
    if optimizer is not None:
        for state in optimizer.state.values():
            total += tensor_bytes(state.values())
    return total


class SavedTensorsPeak:
    """Within ``with tracker.step():``, the bytes of tensors autograd saves; :attr:`peak` is
    the most any one step saved (each step's forward saves all it keeps before backward
    frees it, in every schedule the baselines run)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self._seen: set[int] = set()
        self._current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            ptr = t.untyped_storage().data_ptr()
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return t
        if ptr not in self._seen and ptr not in self._params:
            self._seen.add(ptr)
            self._current += size
            self.peak = max(self.peak, self._current)
        return t

    def step(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one step (the running count starts from zero)."""
        self._seen.clear()
        self._current = 0
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


class PeakMemory:
    """A rank's peak (module docstring): ``with peak.step(): ...`` around each step's
    forward and backward, :meth:`after_step` after its optimizer step, :attr:`bytes` at the end."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in module.parameters())
        self.saved = SavedTensorsPeak(module)
        self._state = 0

    def step(self) -> torch.autograd.graph.saved_tensors_hooks:
        return self.saved.step()

    def after_step(self) -> Self:
        self._state = max(self._state, state_bytes(self.module, self.optimizer))
        return self

    @property
    def bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated())
        return self._state + self.saved.peak

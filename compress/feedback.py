"""Error feedback: what compression dropped is added back to the next tensor sent.

With residual ``e_0 = 0``, each step sends ``s_t = C(g_t + e_t)`` and keeps
``e_{t+1} = g_t + e_t - s_t``. Summing over steps telescopes::

    s_0 + ... + s_{T-1} = g_0 + ... + g_{T-1} - e_T

so nothing is lost, only delayed: every dropped coordinate is sent once it has grown large
enough to be among the top k. For a compressor that keeps a fixed fraction of the energy
(top-k: ``|x - C(x)|^2 <= (1 - k/d) |x|^2``) the residual stays bounded, so SGD with error
feedback follows the uncompressed trajectory up to a bounded, shrinking-step-size
perturbation and keeps SGD's convergence rate (Stich, Cordonnier & Jaggi, "Sparsified SGD
with Memory", NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019). Without it, top-k is a biased estimator and the
small coordinates are never updated.

The executor keys residuals by ``(cut, micro-batch slot)``: the gradients crossing a cut for
slot ``m`` of the next step are the closest analogue of those of this step. There the
guarantee above is a heuristic (the gradients belong to different samples each step); the
telescoping sum still holds exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping

import torch

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory for compressed tensors, one residual per key.

    Keys may be any hashable whose ``repr`` is stable across processes (tuples of ints and
    strings): residuals are stored under ``repr(key)`` so that :meth:`state_dict` can be
    checkpointed and loaded into another process.

    Example::

        fb = ErrorFeedback()
        compensated = fb.compensate(key, grad)
        encoded = codec.encode(compensated, keep_ratio=0.1)
        sent = codec.decode(encoded.data, dtype=grad.dtype, shape=tuple(grad.shape))
        fb.update(key, compensated, sent)
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual kept for ``key`` (``grad`` itself when there is none).

        Raises:
            ValueError: the residual's shape differs from ``grad``'s.
        """
        residual = self._residuals.get(repr(key))
        if residual is None:
            return grad
        if residual.shape != grad.shape:
            raise ValueError(
                f"error feedback for {key!r}: residual has shape {tuple(residual.shape)}, gradient has "
                f"{tuple(grad.shape)}; a key must always carry tensors of one shape (clear() after a re-plan)"
            )
        return grad + residual.to(device=grad.device, dtype=grad.dtype)

    def update(self, key: Hashable, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``compensated - sent`` (what the receiver did not get) for ``key``.

        ``sent`` is what the receiver decodes (it may live on another device, e.g. the CPU).

        Raises:
            ValueError: the shapes of ``compensated`` and ``sent`` differ.
        """
        if compensated.shape != sent.shape:
            raise ValueError(
                f"error feedback for {key!r}: compensated has shape {tuple(compensated.shape)}, sent has "
                f"{tuple(sent.shape)}"
            )
        sent = sent.detach().to(device=compensated.device, dtype=compensated.dtype)
        self._residuals[repr(key)] = compensated.detach() - sent

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual kept for ``key``, or None."""
        return self._residuals.get(repr(key))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by ``repr(key)``. The tensors are not copied; :meth:`update` replaces,
        never modifies, a stored residual, so a snapshot stays valid while training goes on."""
        return dict(self._residuals)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual with those of a :meth:`state_dict`.

        Raises:
            ValueError: a key is not a string or a value is not a tensor.
        """
        bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"error feedback state must map str to tensors; bad entries: {bad[:5]!r}")
        self._residuals = {k: v.detach() for k, v in state.items()}

    def clear(self) -> None:
        """Forget every residual (after a re-plan changes the cuts)."""
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self)} residuals)"

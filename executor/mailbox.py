"""What a stage receives for a step: the check every boundary value passes on arrival, and
the mailbox where gRPC handler threads deposit transfers for the compute thread to take.

Handler threads only validate and deposit; a transfer that arrives twice, a wait that
outlasts its timeout and a step aborted by the driver (or by the stage's own failure) each
end the wait with an error that says which.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from executor.transport import dtype_from_wire, scalar_kind
from fusion.errors import StageError, StateError, WireError
from fusion.wire import tensor_pb2 as pb


@dataclass(frozen=True, kw_only=True)
class ExpectedValue:
    """What a boundary value must look like on the wire."""

    kind: str
    """``tensor`` or a scalar kind (see :class:`fusion.graph.ir.ValueMeta`)."""
    dtype: torch.dtype | None = None
    """Tensor dtype."""
    shape: tuple[int, ...] | None = None
    """Tensor shape."""

    def check(self, name: str, meta: pb.TensorMeta | None, scalar: pb.ScalarValue | None) -> None:
        """Raise ``WireError`` unless the received entry matches."""
        if self.kind == "tensor":
            if meta is None:
                raise WireError(f"value {name!r} must be a tensor")
            dtype = dtype_from_wire(meta.dtype)
            if dtype != self.dtype:
                raise WireError(f"tensor {name!r} has dtype {dtype}, expected {self.dtype}")
            if tuple(meta.shape) != self.shape:
                raise WireError(f"tensor {name!r} has shape {list(meta.shape)}, expected {list(self.shape or ())}")
        else:
            if scalar is None:
                raise WireError(f"value {name!r} must be a {self.kind}, not a tensor")
            if scalar_kind(scalar) != self.kind:
                raise WireError(f"value {name!r} is a {scalar_kind(scalar)}, expected a {self.kind}")


Payload = dict[str, Any]
MailKey = tuple[int, int, int]  # (transfer kind, micro-batch, source stage)


class Aborted(StateError):
    """The step was aborted (by the driver, or because this stage failed)."""


class Mailbox:
    """Transfers received for the current step, waited on by the compute thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: dict[MailKey, Payload] = {}
        self._aborted: str | None = None

    def put(self, key: MailKey, payload: Payload) -> None:
        with self._cv:
            if key in self._items:
                raise WireError(f"duplicate transfer for (kind {key[0]}, micro-batch {key[1]}, from stage {key[2]})")
            self._items[key] = payload
            self._cv.notify_all()

    def take(self, key: MailKey, *, timeout_s: float, what: str) -> Payload:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while key not in self._items:
                if self._aborted is not None:
                    raise Aborted(f"aborted while waiting for {what}: {self._aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(f"timed out after {timeout_s:.0f}s waiting for {what}")
                self._cv.wait(timeout=min(left, 1.0))
            return self._items.pop(key)

    def abort(self, reason: str) -> None:
        with self._cv:
            self._aborted = reason
            self._cv.notify_all()

    def reset(self) -> None:
        with self._cv:
            self._items.clear()
            self._aborted = None

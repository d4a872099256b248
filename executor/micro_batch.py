"""One micro-batch on one stage: its forward, its backward, and what is kept in between.

Remote autodiff, the runtime way (rather than a ``torch.autograd.Function`` per cut): a
forward of micro-batch ``m`` turns every received floating-point activation into a leaf
that requires grad, runs the stage module, *keeps* inputs and outputs for ``m``, and sends
each output to the stages that consume it. The backward of ``m`` waits for one gradient
message from every consumer stage (several consumers of one value have their gradients
summed), calls ``torch.autograd.backward`` on the kept outputs, and sends the input leaves'
``.grad`` upstream, one message per producer stage. Parameter gradients accumulate over
the micro-batches of a step; each micro-batch's loss is scaled by its share of the batch,
so the accumulated gradient is that of the mean loss over the whole batch.

:class:`MicroBatchExecutor` does that work on the stage's compute thread; the stage's
lifecycle around it (steps, optimizer, snapshots, state) is :class:`executor.runtime.StageRuntime`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.compression import CutCompression
from executor.hooks import BACKWARD, FORWARD, StageHooks, StageInfo
from executor.mailbox import Mailbox, Payload
from executor.memory_meter import MemoryMeter
from fusion.errors import MemoryCapError, PoisonedInputError
from fusion.graph.split import DRIVER, StageSpec
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Name under which the driver sends loss targets to the loss stage.
TARGET_NAME = "@target"


@dataclass
class StepResult:
    """Outcome of one step on one stage."""

    step: int
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    loss: float = 0.0
    compute_s: float = 0.0
    sent_bytes: dict[int, int] = field(default_factory=dict)
    sent_s: dict[int, float] = field(default_factory=dict)
    dense_bytes: dict[int, int] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    poisoned: PoisonedInputError | None = None
    """Set when the step failed because a peer sent a poisoned tensor."""
    over_cap: MemoryCapError | None = None
    """Set when the step failed because the stage's measured peak exceeded its worker's cap."""
    tied_synced: bool = False
    """The tied gradients of this run of the step were exchanged (at most once)."""


#: Sends ``(dst_stage, header, tensors, scalars, encoded)`` asynchronously; the future gives
#: (bytes, seconds).
SendFn = Callable[
    [int, pb.TransferHeader, Mapping[str, torch.Tensor], Mapping[str, Any], Mapping[str, tuple[pb.TensorMeta, bytes]]],
    "Future[tuple[int, float]]",
]

#: A timeline event of the stage: ``(event, step, **fields)`` (:mod:`executor.trace`).
EventFn = Callable[..., None]


class MicroBatchExecutor:
    """Forward and backward of one stage's micro-batches, with what each keeps for backward.

    Not thread-safe: only the stage's compute thread calls :meth:`forward`,
    :meth:`backward` and :meth:`clear`. Every computation runs inside
    ``hooks.compute(...)`` and every outgoing tensor set passes ``hooks.outgoing(...)``
    (:mod:`executor.hooks`).
    """

    def __init__(
        self,
        *,
        info: StageInfo,
        spec: StageSpec,
        module: torch.fx.GraphModule,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        device: torch.device,
        mailbox: Mailbox,
        compression: CutCompression,
        meter: MemoryMeter,
        send: SendFn,
        micro_batch_weights: list[float],
        step_timeout_s: float,
        hooks: StageHooks,
        event: EventFn,
    ) -> None:
        self.info = info
        self.spec = spec
        self.module = module
        self.loss_fn = loss_fn
        self.device = device
        self.mailbox = mailbox
        self.compression = compression
        self.meter = meter
        self._send = send
        self.micro_batch_weights = micro_batch_weights
        self.step_timeout_s = step_timeout_s
        self.hooks = hooks
        self._event = event
        #: Source stage -> the names of the inputs it sends this stage.
        self.inputs_from: dict[int, list[str]] = {}
        for name, src in spec.inputs:
            self.inputs_from.setdefault(src, []).append(name)
        #: Destination stage -> indices into ``spec.outputs`` of what it is sent.
        self.outputs_to: dict[int, list[int]] = {}
        for i, (_, dsts) in enumerate(spec.outputs):
            for d in dsts:
                self.outputs_to.setdefault(d, []).append(i)
        # Per micro-batch: (input leaves by name, outputs tuple, weighted loss or None).
        self._kept: dict[int, tuple[dict[str, torch.Tensor], tuple[Any, ...], torch.Tensor | None]] = {}

    def clear(self) -> None:
        """Drop whatever micro-batches kept (a step ended or was aborted)."""
        self._kept.clear()

    def forward(self, result: StepResult, m: int) -> list[Future[tuple[int, float]]]:
        """Micro-batch ``m``'s forward: wait for its inputs, compute, keep, send the outputs."""
        received: dict[int, Payload] = {}
        for src in self.inputs_from:
            received[src] = self.mailbox.take(
                (pb.TRANSFER_KIND_ACTIVATION, m, src),
                timeout_s=self.step_timeout_s,
                what=f"micro-batch {m} from stage {src}",
            )
        leaves: dict[str, torch.Tensor] = {}
        args = []
        for name, src in self.spec.inputs:
            value = received[src][name]
            if isinstance(value, torch.Tensor):
                value = value.to(self.device, non_blocking=True)
                if src != DRIVER and value.is_floating_point():
                    value = value.detach().requires_grad_(True)
                    leaves[name] = value
            args.append(value)
        target = None
        if self.spec.is_loss_stage:
            target = self.mailbox.take(
                (pb.TRANSFER_KIND_TARGET, m, DRIVER), timeout_s=self.step_timeout_s, what=f"targets of micro-batch {m}"
            )[TARGET_NAME].to(self.device, non_blocking=True)
        for leaf in leaves.values():
            self.meter.charge(m, leaf)
        self._event("F0", result.step, mb=m)
        t0 = time.perf_counter()
        with self.hooks.compute(self.info, FORWARD, result.step, m), self.meter.hooks(m):
            outs = self.module(*args)
            loss = None
            if target is not None:
                assert self.loss_fn is not None
                loss = self.loss_fn(outs[-1], target) * self.micro_batch_weights[m]
                result.loss += float(loss.detach())
        result.compute_s += time.perf_counter() - t0
        self._event("F1", result.step, mb=m)
        for out in outs:
            if isinstance(out, torch.Tensor):
                self.meter.charge(m, out)
        self._kept[m] = (leaves, outs, loss)
        sends = []
        for dst, idxs in self.outputs_to.items():
            tensors: dict[str, torch.Tensor] = {}
            scalars: dict[str, Any] = {}
            for i in idxs:
                name = self.spec.outputs[i][0]
                value = outs[i]
                if isinstance(value, torch.Tensor):
                    tensors[name] = value.detach()
                else:
                    scalars[name] = value
            header = self._header(result, pb.TRANSFER_KIND_ACTIVATION, m, dst)
            tensors = dict(self.hooks.outgoing(self.info, FORWARD, result.step, dst, tensors))
            raw, encoded, dense = self.compression.encode_activations(dst, m, tensors)
            sends.append(self._send_tracked(result, dst, header, raw, scalars, encoded, dense))
        return sends

    def backward(self, result: StepResult, m: int) -> list[Future[tuple[int, float]]]:
        """Micro-batch ``m``'s backward: wait for its output gradients, run autograd on what
        the forward kept, send the input gradients upstream."""
        grads: dict[int, torch.Tensor] = {}
        for dst in self.outputs_to:
            payload = self.mailbox.take(
                (pb.TRANSFER_KIND_GRADIENT, m, dst),
                timeout_s=self.step_timeout_s,
                what=f"gradients of micro-batch {m} from stage {dst}",
            )
            for i in self.outputs_to[dst]:
                name = self.spec.outputs[i][0]
                g = payload.get(name)
                if g is not None:
                    g = self.compression.mask_gradient(dst, m, name, g.to(self.device, non_blocking=True))
                    grads[i] = grads[i] + g if i in grads else g
        leaves, outs, loss = self._kept.pop(m)
        self.meter.release(m)
        tensors: list[torch.Tensor] = []
        grad_tensors: list[torch.Tensor | None] = []
        for i, g in grads.items():
            out = outs[i]
            if isinstance(out, torch.Tensor) and out.requires_grad:
                tensors.append(out)
                grad_tensors.append(g)
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grad_tensors.append(None)
        self._event("B0", result.step, mb=m)
        if tensors:
            t0 = time.perf_counter()
            with self.hooks.compute(self.info, BACKWARD, result.step, m):
                torch.autograd.backward(tensors, grad_tensors)
            result.compute_s += time.perf_counter() - t0
        self._event("B1", result.step, mb=m)
        sends = []
        for src, names in self.inputs_from.items():
            if src == DRIVER:
                continue
            tensors_out = {n: leaves[n].grad for n in names if n in leaves and leaves[n].grad is not None}
            header = self._header(result, pb.TRANSFER_KIND_GRADIENT, m, src)
            tensors_out = dict(self.hooks.outgoing(self.info, BACKWARD, result.step, src, tensors_out))
            raw, encoded, dense = self.compression.encode_gradients(src, m, tensors_out)
            sends.append(self._send_tracked(result, src, header, raw, {}, encoded, dense))
        return sends

    def _header(self, result: StepResult, kind: int, micro_batch_idx: int, dst: int) -> pb.TransferHeader:
        return pb.TransferHeader(
            job_id=self.info.job_id,
            stage_idx=dst,
            src_stage_idx=self.spec.stage_idx,
            step=result.step,
            micro_batch_idx=micro_batch_idx,
            kind=kind,
        )

    def _send_tracked(
        self,
        result: StepResult,
        dst: int,
        header: pb.TransferHeader,
        tensors: Mapping[str, torch.Tensor],
        scalars: Mapping[str, Any],
        encoded: Mapping[str, tuple[pb.TensorMeta, bytes]],
        dense_bytes: int,
    ) -> Future[tuple[int, float]]:
        """Hand one transfer to the sender; its bytes and seconds are added to ``result``."""
        where = {"kind": int(header.kind), "mb": header.micro_batch_idx, "dst": dst}
        self._event("send", result.step, **where)
        fut = self._send(dst, header, tensors, scalars, encoded)
        result.dense_bytes[dst] = result.dense_bytes.get(dst, 0) + dense_bytes

        def account(f: Future[tuple[int, float]]) -> None:
            self._event("answered", result.step, **where)
            if f.exception() is None:
                size, seconds = f.result()
                result.sent_bytes[dst] = result.sent_bytes.get(dst, 0) + size
                result.sent_s[dst] = result.sent_s.get(dst, 0.0) + seconds

        fut.add_done_callback(account)
        return fut

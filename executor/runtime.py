"""The stage runtime: one stage's sub-graph, its mailbox, its schedule and its optimizer.

Remote autodiff, the runtime way (rather than a ``torch.autograd.Function`` per cut): a
forward of micro-batch ``m`` turns every received floating-point activation into a leaf
that requires grad, runs the stage module, *keeps* inputs and outputs for ``m``, and sends
each output to the stages that consume it. The backward of ``m`` waits for one gradient
message from every consumer stage (several consumers of one value have their gradients
summed), calls ``torch.autograd.backward`` on the kept outputs, and sends the input leaves'
``.grad`` upstream, one message per producer stage. Parameter gradients accumulate over
the micro-batches of a step; each micro-batch's loss is scaled by its share of the batch,
so the accumulated gradient is that of the mean loss over the whole batch.

Threads: gRPC handler threads only validate and deposit transfers into the
:class:`Mailbox`; every step runs on the stage's one long-lived compute thread; sends go
through one ordered background sender per destination, so transfers overlap compute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.compression import CutCompression
from executor.emulation import Slowdown
from executor.guard import Fault, InputGuard
from executor.mailbox import Aborted, ExpectedValue, Mailbox, Payload
from executor.memory_meter import MemoryMeter
from executor.schedule import Action, stage_actions
from executor.stage_state import check_state_header, read_state, write_state
from executor.tied import TiedParam, TiedSet
from executor.trace import tracer
from executor.transport import Transfer
from fusion.checkpoint import (
    Snapshot,
    capture_volatile,
    capture_weights,
    make_snapshot,
    restore_state,
)
from fusion.checkpoint.snapshot import serialize, snapshot_metadata, snapshot_of
from fusion.errors import (
    NotFoundError,
    PoisonedInputError,
    StateError,
    WireError,
)
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
    tied_synced: bool = False
    """The tied gradients of this run of the step were exchanged (at most once)."""


#: Sends ``(dst_stage, header, tensors, scalars, encoded)`` asynchronously; the future gives
#: (bytes, seconds).
SendFn = Callable[
    [int, pb.TransferHeader, Mapping[str, torch.Tensor], Mapping[str, Any], Mapping[str, tuple[pb.TensorMeta, bytes]]],
    "Future[tuple[int, float]]",
]


class StageRuntime:
    """Runs one stage of a job: forward/backward per micro-batch, optimizer, state.

    It owns a compute thread that lives until :meth:`close` (which its owner must call when
    it drops the stage: the thread holds the runtime, module and optimizer alive).
    """

    def __init__(
        self,
        *,
        job_id: str,
        spec: StageSpec,
        module: torch.fx.GraphModule,
        expected: Mapping[str, ExpectedValue],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        send: SendFn,
        micro_batch_weights: list[float],
        step_timeout_s: float = 600.0,
        compression: CutCompression | None = None,
        stage_key: str = "",
        input_guard: InputGuard | None = None,
        fault: Fault | None = None,
        tied: Sequence[TiedParam] = (),
        slowdown: Slowdown | None = None,
        profiled_s: tuple[float, float] | None = None,
    ) -> None:
        self.job_id = job_id
        self.stage_key = stage_key
        #: Checks incoming activations/gradients for NaN/Inf and absurd norms (:mod:`executor.guard`).
        self.input_guard = input_guard if input_guard is not None else InputGuard()
        #: Test-only: corrupt what this stage sends (``--inject-fault``).
        self.fault = fault
        #: Testbed emulation of a slower device (``--emulate-slowdown``): each computation
        #: is stretched, and its stretched time is what ``compute_s`` reports.
        self.slowdown = slowdown if slowdown is not None else Slowdown()
        #: The coordinator's profiled (forward, backward) seconds per micro-batch, which a
        #: ``profile`` emulation stretches by instead of the wall time.
        self.profiled_s = profiled_s or (None, None)
        self.spec = spec
        self.module = module
        self.expected = dict(expected)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.device = device
        self._send = send
        self.micro_batch_weights = list(micro_batch_weights)
        self.step_timeout_s = step_timeout_s
        self.compression = compression or CutCompression(spec.stage_idx, {})
        self.mailbox = Mailbox()
        self._lock = threading.Lock()
        self._step: StepResult | None = None
        self._num_micro_batches = 0
        self._last_applied: int | None = None
        self._inputs_from: dict[int, list[str]] = {}
        for name, src in spec.inputs:
            self._inputs_from.setdefault(src, []).append(name)
        self._outputs_to: dict[int, list[int]] = {}  # dst stage -> output indices
        for i, (_, dsts) in enumerate(spec.outputs):
            for d in dsts:
                self._outputs_to.setdefault(d, []).append(i)
        # Per micro-batch: (input leaves by name, outputs tuple, weighted loss or None).
        self._kept: dict[int, tuple[dict[str, torch.Tensor], tuple[Any, ...], torch.Tensor | None]] = {}
        self.meter = MemoryMeter({p.untyped_storage().data_ptr() for p in module.parameters()})
        # Set while no snapshot is copying the weights; the optimizer waits for it.
        self._weights_free = threading.Event()
        self._weights_free.set()
        self.tied = TiedSet(spec.stage_idx, dict(module.named_parameters(remove_duplicate=False)), tied)
        self._trace = tracer()
        # One compute thread for every step of the stage: torch's first forward and backward
        # on a new thread cost ~13 ms more (ResNet-18/16, batch 4: 26.5 against 13.8 ms),
        # which a thread per step paid at the start of each step's pipeline.
        # A daemon thread (not a ThreadPoolExecutor's, which the interpreter joins at exit):
        # a step blocked on a vanished peer must not hold up the process's exit.
        self._steps: queue.SimpleQueue[tuple[StepResult, list[Action]] | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._compute_loop, name=f"stage{spec.stage_idx}-compute", daemon=True).start()

    # ------------------------------------------------------------- receiving
    def check_transfer(self, header: pb.TransferHeader) -> None:
        """Validate a transfer header against the stage's boundary before its payload is read."""
        kind = header.kind
        src = header.src_stage_idx
        step = self._step
        if step is None or header.step != step.step:
            current = "none" if step is None else step.step
            raise StateError(f"stage {self.spec.stage_idx} is not running step {header.step} (current step: {current})")
        if header.micro_batch_idx >= self._num_micro_batches:
            raise NotFoundError(
                f"micro-batch {header.micro_batch_idx} does not exist: step {header.step} has {self._num_micro_batches}"
            )
        if kind == pb.TRANSFER_KIND_ACTIVATION:
            if src not in self._inputs_from:
                raise WireError(f"stage {self.spec.stage_idx} takes no activations from stage {src}")
            names = self._inputs_from[src]
        elif kind == pb.TRANSFER_KIND_GRADIENT:
            if src not in self._outputs_to:
                raise WireError(
                    f"stage {self.spec.stage_idx} sends nothing to stage {src}, so takes no gradients from it"
                )
            names = [self.spec.outputs[i][0] for i in self._outputs_to[src]]
        elif kind == pb.TRANSFER_KIND_TARGET:
            if not self.spec.is_loss_stage or src != DRIVER:
                raise WireError(f"stage {self.spec.stage_idx} does not compute the loss; targets go to the loss stage")
            names = [TARGET_NAME]
        elif kind == pb.TRANSFER_KIND_TIED_GRADIENT:
            self.tied.check_transfer(header)
            return
        else:
            raise WireError(f"transfer kind {kind} cannot be sent to a running stage")
        metas = {m.name: m for m in header.tensors}
        scalars = {v.name: v for v in header.values}
        received = set(metas) | set(scalars)
        allowed = set(names)
        if not received <= allowed:
            raise WireError(
                f"unexpected value(s) {sorted(received - allowed)}; stage {self.spec.stage_idx} expects {sorted(allowed)}"
            )
        if kind != pb.TRANSFER_KIND_GRADIENT and received != allowed:
            raise WireError(f"missing value(s) {sorted(allowed - received)} for stage {self.spec.stage_idx}")
        for name in received:
            exp = self.expected.get(name)
            if exp is None:
                raise WireError(f"no expected shape is known for value {name!r}")
            if kind == pb.TRANSFER_KIND_GRADIENT and exp.kind != "tensor":
                raise WireError(f"value {name!r} is a {exp.kind}; it has no gradient")
            exp.check(name, metas.get(name), scalars.get(name))

    def deliver(self, transfer: Transfer, tensors: Mapping[str, torch.Tensor]) -> None:
        """Deposit a validated transfer for the compute thread."""
        h = transfer.header
        if h.src_stage_idx != DRIVER and h.kind in (pb.TRANSFER_KIND_ACTIVATION, pb.TRANSFER_KIND_GRADIENT):
            try:
                self.input_guard.check(h.kind, h.src_stage_idx, tensors)
            except PoisonedInputError as e:
                step = self._step
                if step is not None and step.step == h.step and step.poisoned is None:
                    step.poisoned = e
                logger.warning("stage %d step %d: %s", self.spec.stage_idx, h.step, e)
                self.mailbox.abort(str(e))
                raise
        payload: Payload = dict(tensors)
        payload.update(transfer.scalars(self.device))
        self._event("arrive", h.step, kind=int(h.kind), mb=h.micro_batch_idx, src=h.src_stage_idx)
        self.mailbox.put((h.kind, h.micro_batch_idx, h.src_stage_idx), payload)

    # ------------------------------------------------------------- steps
    def start_step(
        self,
        step: int,
        num_micro_batches: int,
        schedule: str,
        *,
        measure_memory: bool = False,
        keep_ratios: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        """Begin ``step``: reset the mailbox and hand the schedule to the stage's compute thread."""
        if num_micro_batches != len(self.micro_batch_weights):
            raise WireError(
                f"step has {num_micro_batches} micro-batches but the stage was loaded for {len(self.micro_batch_weights)}"
            )
        actions = stage_actions(schedule, num_micro_batches=num_micro_batches, depth=self.spec.depth)
        with self._lock:
            if self._closed:
                raise StateError(
                    f"stage {self.spec.stage_idx} of job {self.job_id!r} was unloaded or reloaded; load it again"
                )
            if self._step is not None and not self._step.done.is_set():
                raise StateError(f"stage {self.spec.stage_idx} is still running step {self._step.step}")
            self.mailbox.reset()
            self._kept.clear()
            self.meter.reset()
            self.meter.enabled = measure_memory
            self.compression.reset_step()
            self.compression.set_ratios(keep_ratios or {})
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._num_micro_batches = num_micro_batches
            result = StepResult(step=step)
            self._step = result
            self._steps.put((result, actions))  # under the lock: never behind close()'s sentinel

    def wait_step(self, step: int, timeout_s: float) -> StepResult | None:
        """The step's result once done, or ``None`` if still running after ``timeout_s``."""
        result = self._step
        if result is None or result.step != step:
            raise StateError(f"stage {self.spec.stage_idx} has not started step {step}")
        return result if result.done.wait(timeout=max(0.0, timeout_s)) else None

    def abort(self, reason: str) -> None:
        """Unblock the compute thread; the step ends with an error."""
        self.mailbox.abort(reason)

    def close(self, reason: str) -> None:
        """Abort a running step and let the compute thread end once it has (unload, reload);
        a later :meth:`start_step` is refused."""
        with self._lock:
            self._closed = True
            self._steps.put(None)
        self.abort(reason)

    def _compute_loop(self) -> None:
        """The stage's compute thread: runs each step handed to it, until :meth:`close`."""
        while (item := self._steps.get()) is not None:
            result, actions = item
            try:
                self._run(result, actions)
            except BaseException as e:  # _run reports its own failures; this is a last resort
                logger.exception("stage %d: step %d escaped its handler", self.spec.stage_idx, result.step)
                result.error = (
                    result.error or f"stage {self.spec.stage_idx} step {result.step}: {type(e).__name__}: {e}"
                )
                result.done.set()

    def _run(self, result: StepResult, actions: list[Action]) -> None:
        self._event("start", result.step, thread=threading.current_thread().name)
        pending: list[Future[tuple[int, float]]] = []
        current: Action | None = None
        try:
            for current in actions:
                if current.kind == "F":
                    pending += self._forward(result, current.micro_batch_idx)
                else:
                    pending += self._backward(result, current.micro_batch_idx)
            current = None
            for f in pending:
                f.result(timeout=self.step_timeout_s)
            result.peak_memory_bytes = self._peak_memory()
            self._event("done", result.step)
        except Aborted as e:
            result.error = str(e)
        except Exception as e:
            where = f" at {current}" if current is not None else " while sending"
            logger.exception("stage %d step %d failed%s", self.spec.stage_idx, result.step, where)
            result.error = f"stage {self.spec.stage_idx} step {result.step}{where}: {type(e).__name__}: {e}"
            self.mailbox.abort(result.error)
        finally:
            self._kept.clear()
            result.done.set()

    def _event(self, ev: str, step: int, **fields: Any) -> None:
        """One timeline event of this stage (:mod:`executor.trace`; nothing when off)."""
        if self._trace.enabled:
            self._trace.event(ev, job=self.job_id, stage=self.spec.stage_idx, step=step, **fields)

    def _header(self, result: StepResult, kind: int, micro_batch_idx: int, dst: int) -> pb.TransferHeader:
        return pb.TransferHeader(
            job_id=self.job_id,
            stage_idx=dst,
            src_stage_idx=self.spec.stage_idx,
            step=result.step,
            micro_batch_idx=micro_batch_idx,
            kind=kind,
        )

    def _peak_memory(self) -> int:
        """The step's peak: the CUDA allocator's, or parameters + gradients + optimizer
        state + the activation meter's peak on the CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if not self.meter.enabled:
            return 0
        params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.module.parameters()}
        grads = sum(p.grad.untyped_storage().nbytes() for p in self.module.parameters() if p.grad is not None)
        state = sum(
            v.untyped_storage().nbytes()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return sum(params.values()) + grads + state + self.meter.peak

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

    def _forward(self, result: StepResult, m: int) -> list[Future[tuple[int, float]]]:
        received: dict[int, Payload] = {}
        for src in self._inputs_from:
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
        with self.meter.hooks(m):
            outs = self.module(*args)
            loss = None
            if target is not None:
                assert self.loss_fn is not None
                loss = self.loss_fn(outs[-1], target) * self.micro_batch_weights[m]
                result.loss += float(loss.detach())
        self.slowdown.stretch(time.perf_counter() - t0, self.profiled_s[0])
        result.compute_s += time.perf_counter() - t0
        self._event("F1", result.step, mb=m)
        for out in outs:
            if isinstance(out, torch.Tensor):
                self.meter.charge(m, out)
        self._kept[m] = (leaves, outs, loss)
        sends = []
        for dst, idxs in self._outputs_to.items():
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
            if self.fault is not None:
                tensors = self.fault.corrupt("activations", result.step, tensors)
            raw, encoded, dense = self.compression.encode_activations(dst, m, tensors)
            sends.append(self._send_tracked(result, dst, header, raw, scalars, encoded, dense))
        return sends

    def _backward(self, result: StepResult, m: int) -> list[Future[tuple[int, float]]]:
        grads: dict[int, torch.Tensor] = {}
        for dst in self._outputs_to:
            payload = self.mailbox.take(
                (pb.TRANSFER_KIND_GRADIENT, m, dst),
                timeout_s=self.step_timeout_s,
                what=f"gradients of micro-batch {m} from stage {dst}",
            )
            for i in self._outputs_to[dst]:
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
            torch.autograd.backward(tensors, grad_tensors)
            self.slowdown.stretch(time.perf_counter() - t0, self.profiled_s[1])
            result.compute_s += time.perf_counter() - t0
        self._event("B1", result.step, mb=m)
        sends = []
        for src, names in self._inputs_from.items():
            if src == DRIVER:
                continue
            tensors_out = {n: leaves[n].grad for n in names if n in leaves and leaves[n].grad is not None}
            header = self._header(result, pb.TRANSFER_KIND_GRADIENT, m, src)
            if self.fault is not None:
                tensors_out = self.fault.corrupt("gradients", result.step, tensors_out)
            raw, encoded, dense = self.compression.encode_gradients(src, m, tensors_out)
            sends.append(self._send_tracked(result, src, header, raw, {}, encoded, dense))
        return sends

    def sync_tied(self, step: int) -> tuple[int, float]:
        """Send this stage's gradient of each tied parameter to the other holders, take
        theirs, and set the gradient to the sum over holders in stage order.

        Peer to peer: the gradients never pass through the driver (a GPT-2 small head is
        154 MB; through the driver it crossed two links twice). Returns (bytes sent,
        seconds). Call once per step, after the step and before :meth:`apply_step`.
        """
        with self._lock:
            self._check_finished(step, "sync tied gradients of")
            result = self._step
            assert result is not None  # checked above
            if result.tied_synced:
                raise StateError(f"stage {self.spec.stage_idx} already synced the tied gradients of step {step}")
            result.tied_synced = True
        t0 = time.perf_counter()
        me = self.spec.stage_idx
        own = self.tied.own_gradients()
        sends = []
        for peer in self.tied.peers():
            header = pb.TransferHeader(
                job_id=self.job_id,
                stage_idx=peer,
                src_stage_idx=me,
                step=step,
                micro_batch_idx=0,
                kind=pb.TRANSFER_KIND_TIED_GRADIENT,
            )
            sends.append(
                self._send(peer, header, {t.canonical: own[t.canonical] for t in self.tied.shared_with(peer)}, {}, {})
            )
        # A send completes once the peer has it (its SyncTied need not have started), so an
        # unreachable peer fails here rather than after the wait below times out.
        sent = sum(f.result(timeout=self.step_timeout_s)[0] for f in sends)
        received = {
            peer: self.mailbox.take(
                (pb.TRANSFER_KIND_TIED_GRADIENT, 0, peer),
                timeout_s=self.step_timeout_s,
                what=f"tied gradients from stage {peer}",
            )
            for peer in self.tied.peers()
        }
        self.tied.set_sums(own, received)
        return sent, time.perf_counter() - t0

    def _check_finished(self, step: int, doing: str) -> None:
        result = self._step
        if result is None or result.step != step or not result.done.is_set():
            raise StateError(f"stage {self.spec.stage_idx} cannot {doing} step {step}: it has not finished it")
        if result.error is not None:
            raise StateError(f"stage {self.spec.stage_idx} cannot {doing} step {step}: it failed ({result.error})")
        if self._last_applied == step:
            raise StateError(f"stage {self.spec.stage_idx} already applied step {step}")

    def apply_step(
        self, step: int, *, optimizer_step: bool, snapshot_to: Callable[[Snapshot], None] | None = None
    ) -> None:
        """Run the optimizer (unless ``optimizer_step`` is false) and zero the gradients.

        With ``snapshot_to``, the state after this step (labelled ``step + 1``) is
        snapshotted in the background and handed to ``snapshot_to``; the next optimizer step
        waits for the copy, the next forward pass does not.
        """
        self._check_finished(step, "apply")
        self._weights_free.wait()
        if optimizer_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last_applied = step
        if snapshot_to is not None:
            self._snapshot_async(step + 1, snapshot_to)

    # ------------------------------------------------------------- snapshots
    def _snapshot_async(self, label: int, sink: Callable[[Snapshot], None]) -> None:
        volatile = capture_volatile(self.module, self.compression.feedback.state_dict())
        self._weights_free.clear()

        def work() -> None:
            try:
                meta = snapshot_metadata(self.job_id, self.spec.stage_idx, self.stage_key, label)
                # Serialise straight from the live weights: the optimizer waits until this is done.
                data = serialize({**capture_weights(self.module, self.optimizer, copy=False), **volatile}, meta)
            except BaseException:
                logger.exception("snapshot of stage %d at step %d failed", self.spec.stage_idx, label)
                return
            finally:
                self._weights_free.set()
            try:
                sink(snapshot_of(self.job_id, self.spec.stage_idx, self.stage_key, label, data))
            except BaseException:
                logger.exception("storing the snapshot of stage %d at step %d failed", self.spec.stage_idx, label)

        threading.Thread(target=work, name=f"snapshot-stage{self.spec.stage_idx}-{label}", daemon=True).start()

    def _check_idle(self, what: str) -> None:
        if self._step is not None and not self._step.done.is_set():
            raise StateError(f"stage {self.spec.stage_idx} is running step {self._step.step}; cannot {what} now")

    def snapshot(self, label: int) -> Snapshot:
        """Snapshot the stage now, between steps (for a planned re-plan or hand-off)."""
        self._check_idle("snapshot")
        self._weights_free.wait()
        volatile = capture_volatile(self.module, self.compression.feedback.state_dict())
        state = capture_weights(self.module, self.optimizer)
        return make_snapshot(self.job_id, self.spec.stage_idx, self.stage_key, label, {**state, **volatile})

    def restore(self, snap: Snapshot) -> None:
        """Load a snapshot of this very stage (checked by stage key and checksum)."""
        if snap.stage_key != self.stage_key:
            raise StateError(
                f"snapshot is of stage {snap.stage_key}, not of stage {self.spec.stage_idx} ({self.stage_key})"
            )
        self._check_idle("restore")
        self._weights_free.wait()
        restore_state(
            self.module, self.optimizer, snap.tensors(), load_residuals=self.compression.feedback.load_state_dict
        )
        self.optimizer.zero_grad(set_to_none=True)
        self._last_applied = snap.step - 1

    # ------------------------------------------------------------- state
    def get_state(self, kind: int, names: list[str]) -> dict[str, torch.Tensor]:
        """The stage's tensors of ``kind`` by name (:func:`executor.stage_state.read_state`)."""
        return read_state(self.module, self.compression.feedback.state_dict(), self.spec.stage_idx, kind, names)

    def check_state(self, kind: int, header: pb.TransferHeader) -> None:
        """Validate a SetState header: known names, matching dtypes and shapes."""
        check_state_header(self.module, self.spec.stage_idx, kind, header)

    def set_state(self, kind: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy parameters/buffers in, or set parameter gradients, between steps."""
        if self._step is not None and not self._step.done.is_set():
            raise StateError(f"stage {self.spec.stage_idx} is running step {self._step.step}; state cannot change now")
        write_state(self.module, self.device, kind, tensors)

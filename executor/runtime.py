"""A stage's lifecycle on a worker: its steps, optimizer, snapshots, tied parameters, state.

:class:`StageRuntime` owns one stage of a job from LoadStage to unload: it validates what
peers send against the stage's boundary and deposits it in the stage's :class:`Mailbox`;
runs each step's schedule on the stage's one long-lived compute thread, a micro-batch at a
time (:class:`executor.micro_batch.MicroBatchExecutor` does each forward and backward);
exchanges tied gradients, runs the optimizer (on the driver's calls, or on its own right
after the schedule when RunStep says how: :class:`StepFinish`), snapshots and restores the
stage, and reads and writes its state between steps.

Threads: gRPC handler threads only validate and deposit transfers into the mailbox;
every step runs on the stage's compute thread; sends go through one ordered background
sender per destination, so transfers overlap compute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from executor.compression import CutCompression, CutSetting
from executor.guard import InputGuard
from executor.hooks import StageHooks, StageInfo
from executor.mailbox import Aborted, ExpectedValue, Mailbox, Payload
from executor.memory_meter import MemoryMeter
from executor.micro_batch import TARGET_NAME, MicroBatchExecutor, SendFn, StepResult
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
    MemoryCapError,
    NotFoundError,
    PoisonedInputError,
    StateError,
    WireError,
)
from fusion.graph.split import DRIVER, StageSpec
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Transfers a stage takes before the step they belong to has started there: the driver
#: sends a step's inputs and targets at once with ``RunStep``, not after it (a round trip
#: sooner), so they, and the activations of a stage that started first, can come first.
#: Gradients and tied gradients follow the stage's own forward, so never come early.
EARLY_KINDS = (pb.TRANSFER_KIND_ACTIVATION, pb.TRANSFER_KIND_TARGET)


@dataclass(frozen=True)
class StepFinish:
    """How a stage finishes a step itself, once its schedule is done (RunStep's
    ``finish``): exchange its tied gradients, then apply as :meth:`StageRuntime.apply_step`
    would with these arguments."""

    optimizer_step: bool = True
    snapshot_to: Callable[[Snapshot], None] | None = None


class StageRuntime:
    """One stage of a job from load to unload: steps, optimizer, snapshots, state.

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
        tied: Sequence[TiedParam] = (),
        hooks: StageHooks | None = None,
        info: StageInfo | None = None,
        memory_cap_bytes: int | None = None,
        planned_peak_bytes: int = 0,
    ) -> None:
        self.job_id = job_id
        #: What the worker lends this stage; a step whose measured peak exceeds it fails with
        #: :class:`MemoryCapError` (``None``: unlimited, and memory is measured only on request).
        self.memory_cap_bytes = memory_cap_bytes
        #: The stage's predicted peak as planned (0: not planned).
        self.planned_peak_bytes = planned_peak_bytes
        self.worker_name = info.worker_name if info is not None else ""
        self.stage_key = stage_key
        #: Checks incoming activations/gradients for NaN/Inf and absurd norms (:mod:`executor.guard`).
        self.input_guard = input_guard if input_guard is not None else InputGuard()
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
        self._last_applied: int | None = None
        # Transfers that came before their step started (EARLY_KINDS; see _may_hold_early),
        # handed to the mailbox when it starts.
        self._early: dict[tuple[int, int, int], Payload] = {}
        self._early_step: int | None = None
        self.meter = MemoryMeter({p.untyped_storage().data_ptr() for p in module.parameters()})
        # Set while no snapshot is copying the weights; the optimizer waits for it.
        self._weights_free = threading.Event()
        self._weights_free.set()
        self.tied = TiedSet(spec.stage_idx, dict(module.named_parameters(remove_duplicate=False)), tied)
        self._trace = tracer()
        #: Each micro-batch's forward and backward, around which ``hooks`` are called
        #: (:mod:`executor.hooks`; ``info`` is the stage as they see it).
        self.micro_batches = MicroBatchExecutor(
            info=info if info is not None else StageInfo(job_id, spec.stage_idx, tuple(spec.nodes)),
            spec=spec,
            module=module,
            loss_fn=loss_fn,
            device=device,
            mailbox=self.mailbox,
            compression=self.compression,
            meter=self.meter,
            send=send,
            micro_batch_weights=self.micro_batch_weights,
            step_timeout_s=step_timeout_s,
            hooks=hooks if hooks is not None else StageHooks(),
            event=self._event,
        )
        # One compute thread for every step of the stage: torch's first forward and backward
        # on a new thread cost ~13 ms more (ResNet-18/16, batch 4: 26.5 against 13.8 ms),
        # which a thread per step paid at the start of each step's pipeline.
        # A daemon thread (not a ThreadPoolExecutor's, which the interpreter joins at exit):
        # a step blocked on a vanished peer must not hold up the process's exit.
        self._steps: queue.SimpleQueue[tuple[StepResult, list[Action], StepFinish | None] | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._compute_loop, name=f"stage{spec.stage_idx}-compute", daemon=True).start()

    # ------------------------------------------------------------- receiving
    def check_transfer(self, header: pb.TransferHeader) -> None:
        """Validate a transfer header against the stage's boundary before its payload is read."""
        kind = header.kind
        src = header.src_stage_idx
        step = self._step
        if not self._running(step, header.step, kind) and not (
            kind in EARLY_KINDS and self._may_hold_early(header.step)
        ):
            current = "none" if step is None else step.step
            raise StateError(f"stage {self.spec.stage_idx} is not running step {header.step} (current step: {current})")
        if header.micro_batch_idx >= len(self.micro_batch_weights):
            raise NotFoundError(
                f"micro-batch {header.micro_batch_idx} does not exist: "
                f"step {header.step} has {len(self.micro_batch_weights)}"
            )
        if kind == pb.TRANSFER_KIND_ACTIVATION:
            if src not in self.micro_batches.inputs_from:
                raise WireError(f"stage {self.spec.stage_idx} takes no activations from stage {src}")
            names = self.micro_batches.inputs_from[src]
        elif kind == pb.TRANSFER_KIND_GRADIENT:
            if src not in self.micro_batches.outputs_to:
                raise WireError(
                    f"stage {self.spec.stage_idx} sends nothing to stage {src}, so takes no gradients from it"
                )
            names = [self.spec.outputs[i][0] for i in self.micro_batches.outputs_to[src]]
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
                f"unexpected value(s) {sorted(received - allowed)}; "
                f"stage {self.spec.stage_idx} expects {sorted(allowed)}"
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
                self.input_guard.check(
                    h.kind,
                    h.src_stage_idx,
                    tensors,
                    self.compression.guard_settings(h.kind, h.src_stage_idx, h.tensors),
                )
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
        key = (h.kind, h.micro_batch_idx, h.src_stage_idx)
        with self._lock:
            if self._running(self._step, h.step, h.kind):
                self.mailbox.put(key, payload)
                return
            if h.kind not in EARLY_KINDS or not self._may_hold_early(h.step):
                raise StateError(f"stage {self.spec.stage_idx} is not running step {h.step}")
            if key in self._early:
                raise WireError(f"step {h.step} already has {key} waiting for the step to start")
            self._early_step = h.step
            self._early[key] = payload

    @staticmethod
    def _running(current: StepResult | None, step: int, kind: int) -> bool:
        """Whether a transfer of ``kind`` for ``step`` belongs to the step this stage runs.
        Once that step is done it takes no more inputs: an activation or target for its
        number is the feed of a run of it again (after a restore), held for that; tied
        gradients still come (the driver's ``SyncTied`` follows the step)."""
        if current is None or current.step != step:
            return False
        return not current.done.is_set() or kind not in EARLY_KINDS

    def _may_hold_early(self, step: int) -> bool:
        """Whether a transfer for ``step``, which has not started here, may wait for it: the
        stage is between steps (none running) and nothing is waiting for another step. (The
        next step need not follow the last: a restore goes back.)"""
        current = self._step
        if current is not None and not current.done.is_set():
            return False
        return not self._early or self._early_step == step

    # ------------------------------------------------------------- steps
    def start_step(
        self,
        step: int,
        num_micro_batches: int,
        schedule: str,
        *,
        measure_memory: bool = False,
        cut_settings: Mapping[tuple[int, int], CutSetting] | None = None,
        finish: StepFinish | None = None,
    ) -> None:
        """Begin ``step``: reset the mailbox and hand the schedule to the stage's compute thread.

        ``cut_settings``: this step's codec settings of the stage's compressed cuts
        (:meth:`~executor.compression.CutCompression.set_step`); cuts left out keep theirs.

        With ``finish`` the compute thread also finishes the step once the schedule is done
        (:meth:`_finish`), and the step counts as done only after that.
        """
        if num_micro_batches != len(self.micro_batch_weights):
            raise WireError(
                f"step has {num_micro_batches} micro-batches "
                f"but the stage was loaded for {len(self.micro_batch_weights)}"
            )
        actions = stage_actions(schedule, num_micro_batches=num_micro_batches, depth=self.spec.depth)
        with self._lock:
            if self._closed:
                raise StateError(
                    f"stage {self.spec.stage_idx} of job {self.job_id!r} was unloaded or reloaded; load it again"
                )
            if self._step is not None and not self._step.done.is_set():
                raise StateError(f"stage {self.spec.stage_idx} is still running step {self._step.step}")
            self.compression.set_step(cut_settings or {})  # first: a setting it refuses changes nothing
            self.mailbox.reset()
            if self._early_step == step:
                for key, payload in self._early.items():
                    self.mailbox.put(key, payload)
            self._early.clear()
            self.micro_batches.clear()
            self.meter.reset()
            # A capped stage measures every step: a step over the cap must fail, not swap.
            self.meter.enabled = measure_memory or self.memory_cap_bytes is not None
            self.compression.reset_step()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            result = StepResult(step=step)
            self._step = result
            self._steps.put((result, actions, finish))  # under the lock: never behind close()'s sentinel

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
            result, actions, finish = item
            try:
                self._run(result, actions, finish)
            except BaseException as e:  # _run reports its own failures; this is a last resort
                logger.exception("stage %d: step %d escaped its handler", self.spec.stage_idx, result.step)
                result.error = (
                    result.error or f"stage {self.spec.stage_idx} step {result.step}: {type(e).__name__}: {e}"
                )
                result.done.set()

    def _run(self, result: StepResult, actions: list[Action], finish: StepFinish | None) -> None:
        self._event("start", result.step, thread=threading.current_thread().name)
        pending: list[Future[tuple[int, float]]] = []
        current: Action | None = None
        where = " while sending"
        try:
            for current in actions:
                if current.kind == "F":
                    pending += self.micro_batches.forward(result, current.micro_batch_idx)
                else:
                    pending += self.micro_batches.backward(result, current.micro_batch_idx)
            current = None
            for f in pending:
                f.result(timeout=self.step_timeout_s)
            result.peak_memory_bytes = self._peak_memory()
            self._check_cap(result)
            if finish is not None:
                where = " while finishing the step"
                self._finish(result, finish)
            self._event("done", result.step)
        except MemoryCapError as e:
            logger.warning("stage %d step %d: %s", self.spec.stage_idx, result.step, e)
            result.over_cap = e
            result.error = str(e)
        except Aborted as e:
            result.error = str(e)
        except Exception as e:
            where = f" at {current}" if current is not None else where
            logger.exception("stage %d step %d failed%s", self.spec.stage_idx, result.step, where)
            result.error = f"stage {self.spec.stage_idx} step {result.step}{where}: {type(e).__name__}: {e}"
            self.mailbox.abort(result.error)
        finally:
            self.micro_batches.clear()
            result.done.set()

    def _event(self, ev: str, step: int, **fields: Any) -> None:
        """One timeline event of this stage (:mod:`executor.trace`; nothing when off)."""
        if self._trace.enabled:
            self._trace.event(ev, job=self.job_id, stage=self.spec.stage_idx, step=step, **fields)

    def _check_cap(self, result: StepResult) -> None:
        """Raise :class:`MemoryCapError` when the step's measured peak exceeded the cap."""
        cap = self.memory_cap_bytes
        if cap is not None and result.peak_memory_bytes > cap:
            raise MemoryCapError(
                worker=self.worker_name,
                stage_idx=self.spec.stage_idx,
                needed_bytes=result.peak_memory_bytes,
                cap_bytes=cap,
                planned_bytes=self.planned_peak_bytes,
                measured=True,
                job_id=self.job_id,
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
        return self._exchange_tied(step)

    def _exchange_tied(self, step: int) -> tuple[int, float]:
        """:meth:`sync_tied`'s exchange, its checks done."""
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

    def _check_finished(self, step: int, doing: str) -> StepResult:
        """The result of ``step``, which this stage has finished and not yet applied."""
        result = self._step
        if result is None or result.step != step or not result.done.is_set():
            raise StateError(f"stage {self.spec.stage_idx} cannot {doing} step {step}: it has not finished it")
        if result.error is not None:
            raise StateError(f"stage {self.spec.stage_idx} cannot {doing} step {step}: it failed ({result.error})")
        if self._last_applied == step:
            raise StateError(f"stage {self.spec.stage_idx} already applied step {step}")
        return result

    def apply_step(
        self, step: int, *, optimizer_step: bool, snapshot_to: Callable[[Snapshot], None] | None = None
    ) -> None:
        """Run the optimizer (unless ``optimizer_step`` is false) and zero the gradients.

        With ``snapshot_to``, the state after this step (labelled ``step + 1``) is
        snapshotted in the background and handed to ``snapshot_to``; the next optimizer step
        waits for the copy, the next forward pass does not.
        """
        result = self._check_finished(step, "apply")
        self._apply(result, optimizer_step=optimizer_step, snapshot_to=snapshot_to)

    def _apply(
        self, result: StepResult, *, optimizer_step: bool, snapshot_to: Callable[[Snapshot], None] | None
    ) -> None:
        """:meth:`apply_step`'s update of ``result``'s step, its checks done. The loss
        stage's snapshot carries the step's loss (:func:`fusion.checkpoint.snapshot.snapshot_metadata`)."""
        self._weights_free.wait()
        if optimizer_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last_applied = result.step
        if snapshot_to is not None:
            loss = result.loss if self.spec.is_loss_stage else None
            self._snapshot_async(result.step + 1, snapshot_to, step_loss=loss)

    def _finish(self, result: StepResult, finish: StepFinish) -> None:
        """Finish ``result``'s step on the compute thread, as :meth:`sync_tied` then
        :meth:`apply_step` would on the driver's calls: the driver saves those two round
        trips, which over a long link are a good part of a step. Holders of a tied
        parameter each finish their own schedule first; a holder's gradient arriving before
        the other's schedule is done waits in its mailbox (every holder is running the step
        by then: a stage finishes only after every stage it exchanges with has started)."""
        if self.tied.peers():
            result.tied_synced = True
            self._exchange_tied(result.step)
        self._apply(result, optimizer_step=finish.optimizer_step, snapshot_to=finish.snapshot_to)

    # ------------------------------------------------------------- snapshots
    def _snapshot_async(self, label: int, sink: Callable[[Snapshot], None], *, step_loss: float | None) -> None:
        volatile = capture_volatile(self.module, self.compression.feedback.state_dict())
        self._weights_free.clear()

        def work() -> None:
            try:
                meta = snapshot_metadata(self.job_id, self.spec.stage_idx, self.stage_key, label, step_loss=step_loss)
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

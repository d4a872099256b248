"""The pipeline driver: loads a job's stages onto workers and runs training steps.

One step, as the driver sees it:

1. ``RunStep`` on every stage (each starts its schedule on a compute thread);
2. at the same time, not after it, send each micro-batch's model inputs to the stages that
   read them, and its targets to the loss stage — from then on stages talk to each other
   directly (a stage holds what comes before its ``RunStep``: the feed, and the
   activations of a stage that started first, :data:`executor.runtime.EARLY_KINDS`).
   Over a link whose bandwidth the coordinator measured the sends are paced as a stage's
   are (:mod:`executor.sender`), so a stage across a slow link is not fed one round trip
   per micro-batch; elsewhere they go one at a time, each until its answer;
3. poll ``WaitStep`` on every stage once its ``RunStep`` has answered; the first failure
   aborts the step everywhere and is raised with the stage that caused it;
4. ``SyncTied`` on the stages that share a parameter (tied embeddings): they exchange
   its gradient directly and each keeps the sum, so the copies stay identical;
5. ``ApplyStep``: each stage runs the job's optimizer on its own parameters.

:meth:`PipelineDriver.train_step` folds 4 and 5 into 1: ``RunStep`` carries a
``finish`` that has each stage exchange its tied gradients and apply once its schedule is
done, before ``WaitStep`` reports it done. With the feed sent beside ``RunStep`` that
leaves one round trip to the farthest stage a step where there were three and a half,
some 0.25 s where it is 100 ms away; the separate calls remain for callers that read the
gradients in between (:meth:`PipelineDriver.gradients`).

The coordinator drives jobs through this class; tests and benchmarks use it through
:mod:`fusion.launch.distributed`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.codec_trial import CodecTrial
from executor.compression import CutSetting, RatioController, dense_settings, link_codecs, setting_to_wire
from executor.micro_batch import TARGET_NAME
from executor.sender import PeerSender
from executor.status import POISONED_SENDER_METADATA, memory_cap_error
from executor.trace import tracer
from executor.transport import DEFAULT_CHUNK_BYTES, dtype_to_wire
from fusion.auth import new_key, wrap_job_key
from fusion.checkpoint import stage_key
from fusion.config import JobSpec
from fusion.errors import FusionError, PoisonedInputError, RemoteError, StageError
from fusion.graph.export import CapturedModel
from fusion.graph.ir import ValueMeta
from fusion.graph.split import DRIVER, StageSpec
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

_SCHEDULES = {"gpipe": epb.SCHEDULE_GPIPE, "1f1b": epb.SCHEDULE_1F1B}

#: How long one WaitStep poll blocks on the worker.
POLL_S = 5.0


@dataclass
class StepStats:
    """What one distributed training step did."""

    step: int
    loss: float
    step_s: float
    compute_s: dict[int, float] = field(default_factory=dict)
    """Compute seconds per stage."""
    sent_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Bytes sent per (source stage, destination stage) link."""
    sent_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """Seconds spent sending per (source stage, destination stage) link."""
    peak_memory_bytes: dict[int, int] = field(default_factory=dict)
    """Peak memory per stage during the step."""
    dense_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Bytes per link before compression (``sent_bytes`` is after)."""
    keep_ratios: dict[tuple[int, int], float] = field(default_factory=dict)
    """Keep ratio used on each compressed cut during the step."""
    link_codecs: dict[tuple[int, int], dict] = field(default_factory=dict)
    """Per link that encodes, its codec, keep ratio and bits during the step."""
    compression_error: dict[tuple[int, int], float] = field(default_factory=dict)
    """Per link that encoded, the relative error of what it sent."""
    dense_trial: bool = False
    """Whether every cut ran dense for the codec trial (:mod:`executor.codec_trial`)."""
    trial_verdict: str | None = None
    """The codec trial's verdict, on the step that decided it (one line)."""


def value_spec(name: str, meta: ValueMeta) -> epb.ValueSpec:
    """The wire expectation of a boundary value from its OpDag metadata."""
    if meta.kind == "tensor":
        from executor.transport import dtype_from_name

        return epb.ValueSpec(
            name=name,
            kind="tensor",
            dtype=dtype_to_wire(dtype_from_name(meta.dtype or "")),
            shape=list(meta.shape or ()),
        )
    return epb.ValueSpec(name=name, kind=meta.kind)


def tensor_value_spec(name: str, t: torch.Tensor) -> epb.ValueSpec:
    """The wire expectation of a tensor shaped like ``t``."""
    return epb.ValueSpec(name=name, kind="tensor", dtype=dtype_to_wire(t.dtype), shape=list(t.shape))


@dataclass(frozen=True)
class SnapshotRequest:
    """Snapshot every stage after a step; replicate stage ``i``'s to ``buddies[i]``."""

    buddies: Mapping[int, str] = field(default_factory=dict)
    rate_bytes_per_s: float = 0.0


def tied_holders(stages: Sequence[StageSpec], tied_params: Mapping[str, str]) -> dict[str, list[tuple[int, str]]]:
    """Canonical name -> ``(stage, local name)`` per holder, ascending by stage, for every
    parameter more than one stage holds (a stage that holds it under two names counts once)."""
    holders: dict[str, list[tuple[int, str]]] = {}
    for spec in sorted(stages, key=lambda s: s.stage_idx):
        seen: set[str] = set()
        for name in spec.params:
            canonical = tied_params.get(name, name)
            if canonical not in seen:
                seen.add(canonical)
                holders.setdefault(canonical, []).append((spec.stage_idx, name))
    return {k: v for k, v in holders.items() if len(v) > 1}


class PipelineDriver:
    """Drives one job's stages on a set of workers."""

    def __init__(
        self,
        *,
        job_id: str,
        job: JobSpec,
        model: torch.nn.Module,
        captured: CapturedModel,
        stages: Sequence[StageSpec],
        addresses: Sequence[str],
        example_target: torch.Tensor,
        leaf_modules: Sequence[str] = (),
        device: str = "cpu",
        pool: ChannelPool | None = None,
        step_timeout_s: float = 600.0,
        cut_settings: Mapping[tuple[int, int], CutSetting] | None = None,
        ratio_controller: RatioController | None = None,
        codec_trial: CodecTrial | None = None,
        link_bytes_per_s: Mapping[tuple[int, int], float] | None = None,
        feed_bytes_per_s: Mapping[int, float] | None = None,
        planned_peak_memory_bytes: Sequence[int] = (),
    ) -> None:
        if len(addresses) != len(stages):
            raise ValueError(f"need one worker address per stage: {len(stages)} stages, {len(addresses)} addresses")
        self.job_id = job_id
        self.job = job
        self.model = model
        self.captured = captured
        self.dag = captured.dag
        self.stages = list(stages)
        self.addresses = list(addresses)
        self.example_target = example_target
        self.leaf_modules = tuple(leaf_modules)
        self.device = device
        self.pool = pool or ChannelPool(chunk_bytes=DEFAULT_CHUNK_BYTES)
        self._own_pool = pool is None
        self.step_timeout_s = step_timeout_s
        # The stages' calls go over the driver's own channels (keys, CA and channel factory
        # shared with ``pool``): closing one abandons every call in flight on it (abandon).
        self._channels = ChannelPool(
            chunk_bytes=self.pool.chunk_bytes,
            keyring=self.pool.keyring,
            tls_ca=self.pool.tls_ca,
            channel_factory=self.pool.channel_factory,
        )
        self._channels_lock = threading.Lock()
        self.clients = [ExecutorClient(a, self._channels) for a in self.addresses]
        self.loss_stage = next(s.stage_idx for s in self.stages if s.is_loss_stage)
        self._state_names: list[set[str]] = [set() for _ in self.stages]
        #: Canonical name -> (stage, local name) of each holder, for parameters several stages hold.
        self._tied = tied_holders(self.stages, self.dag.tied_params)
        self.cut_settings = {k: replace(v) for k, v in (cut_settings or {}).items()}
        self.ratio_controller = ratio_controller
        #: Puts the planned compression on trial against dense steps (None: no trial).
        self.codec_trial = codec_trial if self.cut_settings else None
        #: Each stage's predicted peak memory as planned (``LoadStage`` checks it against the
        #: worker's cap); empty when not planned.
        self.planned_peak_memory_bytes = [int(b) for b in planned_peak_memory_bytes]
        #: Measured bandwidth between the workers of two stages, ``(src, dst) -> bytes/s``:
        #: each stage paces its sends to ``dst`` at it (:mod:`executor.sender`).
        self.link_bytes_per_s = {k: float(v) for k, v in (link_bytes_per_s or {}).items() if v > 0}
        #: Measured bandwidth from the driver to each stage's worker, ``stage -> bytes/s``: the
        #: feed of inputs and targets to a stage listed here is paced at it, not one send at a
        #: time each until its answer (:mod:`executor.sender`).
        self.feed_bytes_per_s = {k: float(v) for k, v in (feed_bytes_per_s or {}).items() if v > 0}
        # A fresh key per job: stages prove it to each other on Send; it reaches each worker
        # wrapped under that worker's control key (LoadStage.auth), never in clear.
        self.job_key = new_key()
        self.pool.keyring.set_job(job_id, self.job_key)
        #: Each stage's identity for snapshots (its node set; see fusion.checkpoint.stage_key).
        self.stage_keys = [stage_key(list(s.nodes), self.dag.fingerprint) for s in self.stages]

    # ------------------------------------------------------------- loading
    def load_request(self, spec: StageSpec) -> epb.LoadStageRequest:
        """The LoadStage request for one stage."""
        job = self.job
        values = [value_spec(name, self.dag.node(name).value) for name, _ in spec.inputs]
        values += [value_spec(name, self.dag.node(name).value) for name, _ in spec.outputs]
        if spec.is_loss_stage:
            values.append(tensor_value_spec(TARGET_NAME, self.example_target))
        m = job.train.micro_batches
        return epb.LoadStageRequest(
            job_id=self.job_id,
            stage_idx=spec.stage_idx,
            model=epb.ModelSpec(
                name=job.model.name,
                preset=job.model.preset or "",
                kwargs_json=json.dumps(job.model.kwargs),
                leaf_modules=list(self.leaf_modules),
            ),
            example_inputs=[value_spec(n, self.dag.node(n).value) for n in self.dag.input_names()],
            nodes=list(spec.nodes),
            inputs=[epb.StageInput(name=n, src_stage_idx=s) for n, s in spec.inputs],
            outputs=[epb.StageOutput(name=n, dst_stage_idx=list(d)) for n, d in spec.outputs],
            values=values,
            is_loss_stage=spec.is_loss_stage,
            loss=job.train.loss,
            stage_addresses={s.stage_idx: self.addresses[s.stage_idx] for s in self.stages},
            depth=spec.depth,
            train_json=json.dumps(job.train.to_dict()),
            graph_fingerprint=self.dag.fingerprint,
            device=self.device,
            chunk_bytes=self.pool.chunk_bytes,
            micro_batch_weights=[1.0 / m] * m,
            cut_codecs=self._cut_codecs(spec.stage_idx),
            link_bytes_per_s={dst: bw for (src, dst), bw in self.link_bytes_per_s.items() if src == spec.stage_idx},
            planned_peak_memory_bytes=(
                self.planned_peak_memory_bytes[spec.stage_idx]
                if spec.stage_idx < len(self.planned_peak_memory_bytes)
                else 0
            ),
            auth=self._wrapped_job_key(self.addresses[spec.stage_idx]),
            tied=[
                epb.TiedParameter(name=name, canonical=canonical, holder_stage_idx=[h for h, _ in holders])
                for canonical, holders in sorted(self._tied.items())
                for h, name in holders
                if h == spec.stage_idx
            ],
        )

    def _cut_codecs(
        self, stage_idx: int | None = None, settings: Mapping[tuple[int, int], CutSetting] | None = None
    ) -> list[epb.CutCodec]:
        return [
            setting_to_wire((a, b), c)
            for (a, b), c in sorted((self.cut_settings if settings is None else settings).items())
            if stage_idx is None or stage_idx in (a, b)
        ]

    def load(self, *, set_initial: bool = True) -> None:
        """Build every stage on its worker and send it its initial parameters and buffers.

        ``set_initial=False`` skips the parameters: the caller restores every stage from a
        snapshot next (recovery), so sending the initial weights would be wasted traffic.
        """
        state = self.model.state_dict()

        def load_one(spec: StageSpec) -> None:
            client = self.clients[spec.stage_idx]
            try:
                response = client.load_stage(self.load_request(spec))
            except RemoteError as e:
                raise memory_cap_error(e) or e from None
            names = list(response.parameter_names) + list(response.buffer_names)
            self._state_names[spec.stage_idx] = set(names)
            if set_initial:
                tensors = {n: state[n] for n in names if n in state}
                client.set_state(self.job_id, spec.stage_idx, pb.TRANSFER_KIND_PARAMETER, tensors)

        run_parallel([lambda s=s: load_one(s) for s in self.stages], name="load-stage")
        if self._tied:
            logger.info("parameters shared across stages: %s", {k: [s for s, _ in v] for k, v in self._tied.items()})

    # ------------------------------------------------------------- steps
    def forward_backward(
        self,
        step: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor,
        *,
        measure_memory: bool = False,
        finish: bool = False,
        snapshot: SnapshotRequest | None = None,
    ) -> StepStats:
        """Run forward and backward of one batch over all stages; returns the step's loss.

        With ``measure_memory`` each stage also counts its activation memory (slower). With
        ``finish`` each stage also syncs its tied gradients and runs the optimizer (module
        docstring), and snapshots as ``snapshot`` says, so the step is complete when this
        returns; without, ``snapshot`` is ignored (pass it to :meth:`apply`).
        """
        self._event("step", step)
        trial_dense = self.codec_trial is not None and self.codec_trial.dense_next()
        settings = dense_settings(self.cut_settings) if trial_dense else self.cut_settings
        t0 = time.perf_counter()
        m = self.job.train.micro_batches
        schedule = _SCHEDULES[self.job.train.schedule]
        input_names = self.dag.input_names()
        if len(inputs) != len(input_names):
            raise ValueError(f"model takes {len(input_names)} inputs ({input_names}), got {len(inputs)}")
        chunks = [torch.chunk(x, m) for x in inputs]
        targets = torch.chunk(target, m)
        failure = threading.Event()
        errors: list[tuple[int, BaseException]] = []
        results: dict[int, epb.WaitStepResponse] = {}
        lock = threading.Lock()
        not_started = {s.stage_idx for s in self.stages}

        def fail(stage_idx: int, e: BaseException) -> None:
            with lock:
                errors.append((stage_idx, e))
            if not failure.is_set():
                failure.set()
                for c in self.clients:
                    c.abort(self.job_id, f"stage {stage_idx} failed: {e}")

        # A sender of its own per step: abandon() replaces the channels it sends over.
        feeder = PeerSender(
            self.job_id, dict(enumerate(self.addresses)), self._channels, link_bytes_per_s=self.feed_bytes_per_s
        )

        def feed(spec: StageSpec) -> None:
            names = [n for n, src in spec.inputs if src == DRIVER]
            sent = []
            try:
                for mb in range(m):
                    if failure.is_set():
                        break
                    if names:
                        tensors = {n: chunks[input_names.index(n)][mb] for n in names}
                        header = self._header(spec.stage_idx, step, mb, pb.TRANSFER_KIND_ACTIVATION)
                        sent.append(feeder(spec.stage_idx, header, tensors, {}, {}))
                    if spec.is_loss_stage:
                        header = self._header(spec.stage_idx, step, mb, pb.TRANSFER_KIND_TARGET)
                        sent.append(feeder(spec.stage_idx, header, {TARGET_NAME: targets[mb]}, {}, {}))
                for done in sent:
                    done.result()
            except FusionError as e:
                fail(spec.stage_idx, e)

        def start_and_wait(spec: StageSpec) -> None:
            try:
                self.clients[spec.stage_idx].run_step(
                    self.job_id,
                    spec.stage_idx,
                    step,
                    m,
                    schedule,
                    measure_memory=measure_memory,
                    cut_codecs=self._cut_codecs(spec.stage_idx, settings),
                    finish=self._finish(spec.stage_idx, optimizer_step=True, snapshot=snapshot) if finish else None,
                )
            except FusionError as e:
                fail(spec.stage_idx, e)
                return
            with lock:
                not_started.discard(spec.stage_idx)
                if not not_started:
                    self._event("run_step", step)
            deadline = time.monotonic() + self.step_timeout_s
            try:
                while time.monotonic() < deadline:
                    r = self.clients[spec.stage_idx].wait_step(self.job_id, spec.stage_idx, step, POLL_S)
                    if r.done:
                        results[spec.stage_idx] = r
                        return
                raise StageError(f"stage {spec.stage_idx} did not finish step {step} within {self.step_timeout_s:.0f}s")
            except FusionError as e:
                fail(spec.stage_idx, e)

        # The feed goes out with RunStep, not after it: a stage holds what comes before its
        # step starts (executor.runtime.EARLY_KINDS), and a far stage has its targets a
        # round trip sooner.
        calls = [lambda s=s: feed(s) for s in self.stages] + [lambda s=s: start_and_wait(s) for s in self.stages]
        try:
            run_parallel(calls, name=f"step{step}")
        finally:
            feeder.close()
        if errors:
            raise self._root_cause(step, errors)
        self._event("forward_backward", step)
        stats = StepStats(step=step, loss=results[self.loss_stage].loss, step_s=time.perf_counter() - t0)
        for s, r in results.items():
            stats.compute_s[s] = r.compute_s
            stats.peak_memory_bytes[s] = r.peak_memory_bytes
            for dst, size in r.sent_bytes.items():
                stats.sent_bytes[(s, dst)] = size
            for dst, seconds in r.sent_s.items():
                stats.sent_s[(s, dst)] = seconds
            for dst, size in r.dense_bytes.items():
                stats.dense_bytes[(s, dst)] = size
            for dst, err in r.compression_error.items():
                stats.compression_error[(s, dst)] = err
        stats.dense_trial = trial_dense
        stats.link_codecs = link_codecs(settings)
        stats.keep_ratios = {k: c.keep_ratio for k, c in settings.items() if c.codec == pb.CODEC_TOPK}
        if self.ratio_controller is not None and self.cut_settings:
            for cut, ratio in self.ratio_controller.update(stats, m).items():
                if cut in self.cut_settings:
                    self.cut_settings[cut].keep_ratio = ratio
        return stats

    def admit(self, addresses: Sequence[str]) -> None:
        """Give workers that host no stage (spares holding replicas) this job's key."""
        template = self.load_request(self.stages[0])

        def admit(address: str) -> None:
            request = epb.AdmitJobRequest(
                job_id=self.job_id,
                auth=self._wrapped_job_key(address),
                model=template.model,
                example_inputs=template.example_inputs,
                train_json=template.train_json,
            )
            ExecutorClient(address, self.pool).admit_job(request)

        run_parallel([lambda a=a: admit(a) for a in addresses], name="admit")

    def _wrapped_job_key(self, address: str) -> str:
        control = self.pool.keyring.control(address)
        return wrap_job_key(control, self.job_key) if control is not None else ""

    def _poisoned(self, errors: list[tuple[int, BaseException]]) -> PoisonedInputError | None:
        """The report of a stage that rejected a tensor, naming the stage that sent it."""
        for receiver, e in errors:
            sender = e.metadata.get(POISONED_SENDER_METADATA) if isinstance(e, RemoteError) else None
            if sender is not None and sender.isdigit() and int(sender) < len(self.addresses):
                s = int(sender)
                reason = str(e).split("sent a poisoned tensor: ", 1)[-1]
                return PoisonedInputError(s, f"{reason} (rejected by stage {receiver})", address=self.addresses[s])
        return None

    def _root_cause(self, step: int, errors: list[tuple[int, BaseException]]) -> FusionError:
        """Prefer the stage that failed over the stages that were aborted because of it."""

        def secondary(e: BaseException) -> bool:
            return "aborted" in str(e).lower()

        poisoned = self._poisoned(errors)
        if poisoned is not None:
            return poisoned
        over_cap = next((c for _, e in errors if (c := memory_cap_error(e)) is not None), None)
        if over_cap is not None:
            return over_cap
        stage_idx, error = sorted(errors, key=lambda se: secondary(se[1]))[0]
        if isinstance(error, RemoteError):
            return RemoteError(
                f"step {step} failed on stage {stage_idx} ({self.addresses[stage_idx]}): {error}",
                code=error.code,
                peer=error.peer,
            )
        return StageError(f"step {step} failed on stage {stage_idx}: {error}")

    def _event(self, ev: str, step: int) -> None:
        """One timeline event of the driver (:mod:`executor.trace`; nothing when off)."""
        trace = tracer()
        if trace.enabled:
            trace.event(ev, job=self.job_id, stage=DRIVER, step=step)

    def _header(self, stage_idx: int, step: int, micro_batch_idx: int, kind: int) -> pb.TransferHeader:
        return pb.TransferHeader(
            job_id=self.job_id,
            stage_idx=stage_idx,
            src_stage_idx=DRIVER,
            step=step,
            micro_batch_idx=micro_batch_idx,
            kind=kind,
        )

    def sync_tied_gradients(self, step: int) -> None:
        """Give every holder of a shared parameter the sum of all holders' gradients.

        The holders exchange their gradients directly (``SyncTied``); the driver only
        starts the exchange on each, at once.
        """
        stages = sorted({s for holders in self._tied.values() for s, _ in holders})
        if not stages:
            return
        try:
            run_parallel(
                [lambda s=s: self.clients[s].sync_tied(self.job_id, s, step, self.step_timeout_s) for s in stages],
                name="tied-sync",
            )
        except FusionError as e:
            # A holder waiting for a peer that failed would wait out the step timeout.
            self.abort(f"tied-gradient sync of step {step} failed: {e}")
            raise

    def apply(self, step: int, *, optimizer_step: bool = True, snapshot: SnapshotRequest | None = None) -> None:
        """Run the optimizer on every stage (or only zero the gradients); optionally snapshot."""

        def one(s: StageSpec) -> None:
            f = self._finish(s.stage_idx, optimizer_step=optimizer_step, snapshot=snapshot)
            self.clients[s.stage_idx].apply_step(
                self.job_id,
                s.stage_idx,
                step,
                optimizer_step=f.optimizer_step,
                snapshot=f.snapshot,
                replicate_to=f.replicate_to,
                replicate_bytes_per_s=f.replicate_bytes_per_s,
            )

        run_parallel([lambda s=s: one(s) for s in self.stages], name="apply")
        self._event("applied", step)

    @staticmethod
    def _finish(stage_idx: int, *, optimizer_step: bool, snapshot: SnapshotRequest | None) -> epb.StepFinish:
        """How stage ``stage_idx`` ends a step: the update, and whether to snapshot the
        result and where to replicate it."""
        if snapshot is None:
            return epb.StepFinish(optimizer_step=optimizer_step)
        return epb.StepFinish(
            optimizer_step=optimizer_step,
            snapshot=True,
            replicate_to=snapshot.buddies.get(stage_idx, ""),
            replicate_bytes_per_s=snapshot.rate_bytes_per_s,
        )

    def train_step(
        self,
        step: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor,
        *,
        measure_memory: bool = False,
        snapshot: SnapshotRequest | None = None,
    ) -> StepStats:
        """One full training step: forward, backward, tied-gradient sync, optimizer.

        ``step_s`` of the result covers all of it (``forward_backward`` alone reports only
        its own part). With ``snapshot``, every stage snapshots its state after the step in
        the background (labelled ``step + 1``) and streams it to its buddy.
        """
        t0 = time.perf_counter()
        stats = self.forward_backward(
            step, inputs, target, measure_memory=measure_memory, finish=True, snapshot=snapshot
        )
        self._event("applied", step)
        stats.step_s = time.perf_counter() - t0
        if self.codec_trial is not None and self.codec_trial.observe(stats.step_s) is not None:
            stats.trial_verdict = self.codec_trial.describe()
        return stats

    # ------------------------------------------------------------- state
    def gradients(self) -> dict[str, torch.Tensor]:
        """Accumulated parameter gradients by canonical parameter name (call before apply)."""
        out: dict[str, torch.Tensor] = {}
        for spec in self.stages:
            got = self.clients[spec.stage_idx].get_state(self.job_id, spec.stage_idx, epb.STATE_KIND_GRADIENTS)
            for name, g in got.items():
                out.setdefault(self.dag.tied_params.get(name, name), g)
        return out

    def canonical(self, name: str) -> str:
        """One name for a parameter the model shares under several (tied weights)."""
        return self.dag.tied_params.get(name, name)

    def state_names(self, stage_idx: int) -> list[str]:
        """The ``state_dict`` names stage ``stage_idx`` holds (known once loaded)."""
        return sorted(self._state_names[stage_idx])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict`` under the original names.

        Entries no stage holds (parameters the graph never reads) keep their initial value.
        """
        fetched: dict[str, torch.Tensor] = {}
        for spec in self.stages:
            got = self.clients[spec.stage_idx].get_state(self.job_id, spec.stage_idx, epb.STATE_KIND_PARAMETERS)
            for name, t in got.items():
                fetched.setdefault(name, t)
                fetched.setdefault(self.dag.tied_params.get(name, name), t)
        out: dict[str, torch.Tensor] = {}
        for name, initial in self.model.state_dict().items():
            canonical = self.dag.tied_params.get(name, name)
            out[name] = fetched.get(name, fetched.get(canonical, initial.detach().cpu())).clone()
        return out

    def abort(self, reason: str) -> None:
        """Abort the running step on every worker (best effort, in parallel)."""
        run_parallel([lambda c=c: c.abort(self.job_id, reason) for c in self.clients], name="abort")

    def abandon(self, address: str, reason: str) -> None:
        """The worker at ``address`` is gone: fail the driver's calls to it that are in flight
        now (``CANCELLED``; a frozen worker would hold them to their deadlines) and abort the
        step on the others. Later calls to ``address`` go over a fresh channel."""
        with self._channels_lock:
            fresh = ChannelPool(
                chunk_bytes=self._channels.chunk_bytes,
                keyring=self._channels.keyring,
                tls_ca=self._channels.tls_ca,
                channel_factory=self._channels.channel_factory,
            )
            old, self._channels = self._channels, fresh
            self.clients = [ExecutorClient(a, fresh) for a in self.addresses]
        old.close()
        logger.info("job %s: abandoned the calls in flight to %s: %s", self.job_id, address, reason)
        self.abort(reason)

    def release(self) -> None:
        """Close the driver's channels and leave its stages loaded (a new placement's driver
        took over; the coordinator unloads them). The driver makes no calls afterwards."""
        with self._channels_lock:
            self._channels.close()

    def close(self) -> None:
        """Unload the job's stages from every worker (best effort) and close channels."""
        for address, client in {a: c for a, c in zip(self.addresses, self.clients, strict=False)}.items():
            try:
                client.unload_job(self.job_id)
            except RemoteError as e:
                logger.info("unloading job %s from %s failed: %s", self.job_id, address, e)
        self.release()
        if self._own_pool:
            self.pool.close()

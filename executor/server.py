"""The Executor gRPC service: hosts stages on a worker and serves the remote backward pass.

Handler threads never compute: they validate a request, deposit tensors into a stage's
mailbox, or hand a step to (or await) the stage's compute thread. Every handler maps fusion
errors to status codes (:func:`executor.status.rpc_errors`), so a malformed or unexpected
request is answered with a clear error and the worker keeps serving.

Run a bare executor (what ``fusion-worker`` wraps, and what the local driver starts)::

    python -m executor.server --listen 127.0.0.1:0 --allow-code
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from executor.access import ExecutorAccess
from executor.binding import executor_handler
from executor.build import GraphCache, build_stage
from executor.client import ChannelPool, ExecutorClient
from executor.compression import CutCompression, decode_tensor, setting_from_wire
from executor.hooks import ChannelFactory, StageHooks, StageInfo
from executor.runtime import StageRuntime, StepFinish
from executor.sender import PeerSender
from executor.snapshots import Replicator, assemble, snapshot_chunks, snapshot_info
from executor.status import rpc_errors
from executor.stream_client import ConnectionFactory, DataPlaneClient
from executor.stream_server import DataListener, StageSink
from executor.tied import TiedParam
from executor.transport import (
    DEFAULT_CHUNK_BYTES,
    RawChunk,
    decode_transfer,
    encode_transfer_wire,
    grpc_message_options,
)
from fusion.checkpoint import Snapshot, SnapshotStore, stage_key
from fusion.config import TrainSpec
from fusion.errors import FusionError, MemoryCapError, NotFoundError, StateError, WireError
from fusion.losses import get_loss
from fusion.optim import build_optimizer
from fusion.stop_signals import catch_stop_signals, wait_for_stop
from fusion.tls import ServerTls, add_port, set_client_ca, warn_if_exposed
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Largest transfer a stage accepts (each tensor is also checked against its expected shape).
MAX_TRANSFER_BYTES = 8 << 30
#: Largest link probe accepted.
MAX_PROBE_BYTES = 256 << 20
#: Most RPCs an executor serves at once; more are refused rather than queued.
MAX_CONCURRENT_RPCS = 256
#: Most peers one ProbeLinks call may measure.
MAX_PROBE_TARGETS = 256
#: Longest a WaitStep call blocks before answering "not done yet".
MAX_WAIT_S = 30.0

_SCHEDULES = {epb.SCHEDULE_GPIPE: "gpipe", epb.SCHEDULE_1F1B: "1f1b"}


def train_spec(text: str) -> TrainSpec:
    """The ``[train]`` section a request carries as JSON."""
    try:
        return TrainSpec.from_dict(json.loads(text or "{}"))
    except json.JSONDecodeError as e:
        raise WireError(f"malformed train_json: {e}") from e


def check_probe_targets(addresses: Sequence[str]) -> list[str]:
    """The distinct HOST:PORT addresses a ProbeLinks request names; ``WireError`` for junk."""
    if len(addresses) > MAX_PROBE_TARGETS:
        raise WireError(f"ProbeLinks names {len(addresses)} peers; at most {MAX_PROBE_TARGETS}")
    out: list[str] = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        if (
            not host
            or not port.isdigit()
            or not 0 < int(port) < 65536
            or len(a) > 255
            or not a.isascii()
            or not a.isprintable()
            or " " in a
        ):
            raise WireError(f"ProbeLinks target {a!r} is not HOST:PORT")
        if a not in out:
            out.append(a)
    return out


def parse_probe_keys(text: str) -> dict[str, tuple[int, bytes]]:
    """``ProbeLinks.auth``: ``{"HOST:PORT": [expiry, "hex key"]}`` (JSON data, never code)."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
        keys = {str(a): (int(v[0]), bytes.fromhex(v[1])) for a, v in raw.items()}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise WireError(f"malformed probe keys in ProbeLinks.auth: {e}") from e
    return keys


class ExecutorService:
    """Hosts any number of stages, keyed by (job id, stage index).

    Seams (:mod:`executor.hooks`): ``hooks`` are called for every stage loaded here (when
    it loads, around each computation, on what it sends); ``channel_factory`` makes the
    channels to peers (sends, snapshot replicas, probes). Both default to the plain product.
    """

    def __init__(
        self,
        *,
        worker_name: str = "",
        allow_code: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        access: ExecutorAccess | None = None,
        hooks: StageHooks | None = None,
        channel_factory: ChannelFactory | None = None,
        memory_cap_bytes: int | None = None,
        data_plane: bool = True,
        connection_factory: ConnectionFactory | None = None,
    ) -> None:
        self.worker_name = worker_name
        #: The memory this worker lends its stages (``fusion-worker --memory-gb``; ``None``:
        #: unlimited): a stage planned over what is left of it is refused at LoadStage, and
        #: a step whose measured peak exceeds it fails (:class:`~fusion.errors.MemoryCapError`).
        self.memory_cap_bytes = memory_cap_bytes
        self.allow_code = allow_code
        #: Channels to peers, made by ``channel_factory`` (:mod:`executor.hooks`; default: plain).
        self.pool = ChannelPool(chunk_bytes=chunk_bytes, channel_factory=channel_factory)
        #: Credentials and limits every RPC is checked against (:mod:`executor.access`).
        self.access = access if access is not None else ExecutorAccess(keyring=self.pool.keyring)
        #: Called around the work of every stage loaded here (:class:`executor.hooks.StageHooks`).
        self.hooks = hooks if hooks is not None else StageHooks()
        self._stages: dict[tuple[str, int], StageRuntime] = {}
        self._senders: dict[tuple[str, int], PeerSender] = {}
        self._lock = threading.Lock()
        self.snapshots = SnapshotStore(keep=2)
        self.graphs = GraphCache()
        threading.Thread(target=_warm_imports, name="warm-imports", daemon=True).start()
        self.replicator = Replicator(self._replicate)
        #: Whether this executor serves the direct data plane (:mod:`executor.frames`) and
        #: sends over it to peers that do; ``False``: tensors go over gRPC only.
        self.data_plane = data_plane
        self.data_listener: DataListener | None = None
        # Peers are dialled through the channel factory; data connections need a matching
        # connection factory, or they would bypass whatever route the factory chose.
        self.data_client = (
            DataPlaneClient(
                self.pool.keyring, tls_ca=self.pool.tls_ca, connect=connection_factory, ports=self.pool.data_ports
            )
            if data_plane and (channel_factory is None or connection_factory is not None)
            else None
        )

    def start_data_plane(self, host: str, tls: ServerTls | None) -> int:
        """Listen for data-plane frames on ``host`` (a free port, TLS when ``tls``); the port."""
        self.data_listener = DataListener(
            host,
            keys=self.access.keyring.job,
            nonces=self.access.nonces,
            sink=StageSink(self.stage, max_probe_bytes=MAX_PROBE_BYTES),
            max_bytes=MAX_TRANSFER_BYTES,
            tls=tls,
            failures=self.access.failures,
            retired=self.access.retired_keys,
        )
        return self.data_listener.port

    @property
    def data_port(self) -> int:
        """The data-plane port peers are told in ``SendResponse`` (0: none)."""
        return self.data_listener.port if self.data_listener is not None else 0

    def stage(self, job_id: str, stage_idx: int) -> StageRuntime:
        """The loaded stage, or ``NotFoundError`` naming what is loaded."""
        with self._lock:
            runtime = self._stages.get((job_id, stage_idx))
            if runtime is None:
                loaded = sorted(f"{j}/{s}" for j, s in self._stages)
                raise NotFoundError(
                    f"no stage {stage_idx} of job {job_id!r} on this worker (loaded: {loaded or 'none'})"
                )
            return runtime

    def stage_cap(self, job_id: str, stage_idx: int, planned_bytes: int) -> int | None:
        """What the worker lends a stage it is asked to load: its cap less the planned peaks
        of the other stages it holds; :class:`MemoryCapError` if ``planned_bytes`` exceeds it."""
        cap = self.memory_cap_bytes
        if cap is None:
            return None
        with self._lock:
            held = sum(rt.planned_peak_bytes for k, rt in self._stages.items() if k != (job_id, stage_idx))
        left = max(cap - held, 0)
        if planned_bytes > left:
            raise MemoryCapError(
                worker=self.worker_name,
                stage_idx=stage_idx,
                needed_bytes=planned_bytes,
                cap_bytes=left,
                planned_bytes=planned_bytes,
                job_id=job_id,
            )
        return left

    def _step_cap(self, stage_cap: int | None, planned_bytes: int, device: torch.device) -> int | None:
        """The cap a stage's steps are held to: none for a stage loaded without a planned peak
        (the coordinator's measurements: one-stage profiling and calibration runs, which must
        run on a worker that could not train the whole model); else the CUDA allocator's peak
        (every stage on the device) against the whole cap, the CPU meter's (this stage)
        against the stage's share."""
        if stage_cap is None or planned_bytes <= 0:
            return None
        return self.memory_cap_bytes if device.type == "cuda" else stage_cap

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted({j for j, _ in self._stages})

    # ------------------------------------------------------------- RPCs
    @rpc_errors
    def LoadStage(self, request: epb.LoadStageRequest, context: grpc.ServicerContext) -> epb.LoadStageResponse:
        if not request.job_id:
            raise WireError("LoadStage needs a job_id")
        info = StageInfo(
            job_id=request.job_id,
            stage_idx=request.stage_idx,
            nodes=tuple(request.nodes),
            worker_name=self.worker_name,
        )
        stage_cap = self.stage_cap(request.job_id, request.stage_idx, request.planned_peak_memory_bytes)
        self.hooks.stage_loaded(info)
        built = build_stage(request, allow_code=self.allow_code, graphs=self.graphs)
        self.access.add_job(request.job_id, request.auth)  # peers prove this job key to Send
        loss_fn = get_loss(request.loss or "cross_entropy") if built.spec.is_loss_stage else None
        params = list(built.module.parameters())
        optimizer = build_optimizer(built.train, params)
        sender = PeerSender(
            request.job_id,
            dict(request.stage_addresses),
            self.pool,
            link_bytes_per_s=dict(request.link_bytes_per_s),
            data=self.data_client,
        )
        weights = list(request.micro_batch_weights) or [1.0]
        compression = CutCompression(
            request.stage_idx,
            {
                (c.src_stage_idx, c.dst_stage_idx): setting_from_wire(c)
                for c in request.cut_codecs
                if request.stage_idx in (c.src_stage_idx, c.dst_stage_idx)
            },
        )
        runtime = StageRuntime(
            job_id=request.job_id,
            spec=built.spec,
            module=built.module,
            expected=built.expected,
            loss_fn=loss_fn,
            optimizer=optimizer,
            device=built.device,
            send=sender,
            micro_batch_weights=weights,
            compression=compression,
            stage_key=stage_key(list(request.nodes), request.graph_fingerprint),
            hooks=self.hooks,
            info=info,
            tied=[TiedParam(t.name, t.canonical, tuple(t.holder_stage_idx)) for t in request.tied],
            memory_cap_bytes=self._step_cap(stage_cap, request.planned_peak_memory_bytes, built.device),
            planned_peak_bytes=request.planned_peak_memory_bytes,
        )
        key = (request.job_id, request.stage_idx)
        with self._lock:
            old = self._stages.pop(key, None)
            old_sender = self._senders.pop(key, None)
            self._stages[key] = runtime
            self._senders[key] = sender
        if old is not None:
            old.close("stage reloaded")
        if old_sender is not None:
            old_sender.close()
        state = built.module.state_dict()
        param_names = [n for n, _ in built.module.named_parameters(remove_duplicate=False)]
        logger.info(
            "loaded stage %d of job %s: %d nodes, %d parameters",
            request.stage_idx,
            request.job_id,
            len(built.spec.nodes),
            len(params),
        )
        return epb.LoadStageResponse(
            parameter_names=param_names,
            buffer_names=[n for n in state if n not in set(param_names)],
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        )

    @rpc_errors
    def SetState(self, request_iterator: Iterator[RawChunk], context: grpc.ServicerContext) -> epb.SetStateResponse:
        holder: dict[str, StageRuntime] = {}

        def check(header: pb.TransferHeader) -> None:
            runtime = self.stage(header.job_id, header.stage_idx)
            runtime.check_state(header.kind, header)
            holder["rt"] = runtime

        transfer = decode_transfer(request_iterator, max_bytes=MAX_TRANSFER_BYTES, check=check)
        tensors = transfer.tensors()
        holder["rt"].set_state(transfer.header.kind, tensors)
        return epb.SetStateResponse(num_tensors=len(tensors))

    @rpc_errors
    def GetState(self, request: epb.GetStateRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        runtime = self.stage(request.job_id, request.stage_idx)
        tensors = runtime.get_state(request.kind, list(request.names))
        kind = (
            pb.TRANSFER_KIND_PARAMETER
            if request.kind != epb.STATE_KIND_GRADIENTS
            else pb.TRANSFER_KIND_PARAMETER_GRADIENT
        )
        header = pb.TransferHeader(job_id=request.job_id, stage_idx=request.stage_idx, kind=kind)
        # Materialise here so errors surface inside the handler, not mid-stream.
        return iter(list(encode_transfer_wire(header, tensors, chunk_bytes=self.pool.chunk_bytes)))

    @rpc_errors
    def Send(self, request_iterator: Iterator[RawChunk], context: grpc.ServicerContext) -> epb.SendResponse:
        return self._receive(request_iterator)

    @rpc_errors
    def SendWhole(self, request: RawChunk, context: grpc.ServicerContext) -> epb.SendResponse:
        return self._receive(iter((request,)))

    def _receive(self, chunks: Iterator[RawChunk]) -> epb.SendResponse:
        """Validate one transfer against the stage it names and deliver it to that stage."""
        holder: dict[str, StageRuntime] = {}

        def check(header: pb.TransferHeader) -> None:
            runtime = self.stage(header.job_id, header.stage_idx)
            runtime.check_transfer(header)
            holder["rt"] = runtime

        transfer = decode_transfer(chunks, max_bytes=MAX_TRANSFER_BYTES, check=check)
        holder["rt"].deliver(transfer, transfer.tensors(decode=decode_tensor))
        return epb.SendResponse(received_bytes=transfer.size_bytes, data_port=self.data_port)

    @rpc_errors
    def RunStep(self, request: epb.RunStepRequest, context: grpc.ServicerContext) -> epb.RunStepResponse:
        runtime = self.stage(request.job_id, request.stage_idx)
        schedule = _SCHEDULES.get(request.schedule)
        if schedule is None:
            raise WireError(f"unknown schedule {request.schedule}; use SCHEDULE_GPIPE or SCHEDULE_1F1B")
        settings = {(c.src_stage_idx, c.dst_stage_idx): setting_from_wire(c) for c in request.cut_codecs}
        finish = None
        if request.HasField("finish"):
            f = request.finish
            finish = StepFinish(
                optimizer_step=f.optimizer_step,
                snapshot_to=self._snapshot_sink(f.replicate_to, f.replicate_bytes_per_s) if f.snapshot else None,
            )
        runtime.start_step(
            request.step,
            request.num_micro_batches,
            schedule,
            measure_memory=request.measure_memory,
            cut_settings=settings,
            finish=finish,
        )
        return epb.RunStepResponse()

    @rpc_errors
    def WaitStep(self, request: epb.WaitStepRequest, context: grpc.ServicerContext) -> epb.WaitStepResponse:
        runtime = self.stage(request.job_id, request.stage_idx)
        result = runtime.wait_step(request.step, min(max(request.timeout_s, 0.0), MAX_WAIT_S))
        if result is None:
            return epb.WaitStepResponse(done=False)
        if result.poisoned is not None:
            raise result.poisoned
        if result.over_cap is not None:
            raise result.over_cap
        if result.error is not None:
            raise StateError(result.error)
        return epb.WaitStepResponse(
            done=True,
            loss=result.loss,
            has_loss=runtime.spec.is_loss_stage,
            compute_s=result.compute_s,
            sent_bytes=result.sent_bytes,
            sent_s=result.sent_s,
            dense_bytes=result.dense_bytes,
            peak_memory_bytes=result.peak_memory_bytes,
            compression_error=runtime.compression.relative_errors(),
        )

    @rpc_errors
    def SyncTied(self, request: epb.SyncTiedRequest, context: grpc.ServicerContext) -> epb.SyncTiedResponse:
        sent_bytes, seconds = self.stage(request.job_id, request.stage_idx).sync_tied(request.step)
        return epb.SyncTiedResponse(sent_bytes=sent_bytes, seconds=seconds)

    @rpc_errors
    def ApplyStep(self, request: epb.ApplyStepRequest, context: grpc.ServicerContext) -> epb.ApplyStepResponse:
        sink = self._snapshot_sink(request.replicate_to, request.replicate_bytes_per_s) if request.snapshot else None
        self.stage(request.job_id, request.stage_idx).apply_step(
            request.step, optimizer_step=request.optimizer_step, snapshot_to=sink
        )
        return epb.ApplyStepResponse()

    def _snapshot_sink(self, buddy: str, rate_bytes_per_s: float) -> Callable[[Snapshot], None]:
        """Where a step's snapshot goes: this executor's store, and a replica to ``buddy``
        (none when empty) streamed at up to ``rate_bytes_per_s``."""

        def sink(snap: Snapshot) -> None:
            self.snapshots.put(snap)
            if buddy:
                self.replicator.submit(snap, buddy, rate_bytes_per_s)

        return sink

    # ------------------------------------------------------------- snapshots
    def _replicate(self, snap: Snapshot, address: str, rate_bytes_per_s: float) -> None:
        ExecutorClient(address, self.pool).put_snapshot(snap, rate_bytes_per_s=rate_bytes_per_s)

    @rpc_errors
    def AdmitJob(self, request: epb.AdmitJobRequest, context: grpc.ServicerContext) -> epb.AdmitJobResponse:
        if not request.job_id:
            raise WireError("AdmitJob needs a job_id")
        self.access.add_job(request.job_id, request.auth)
        if request.HasField("model"):
            train = train_spec(request.train_json)

            def warm() -> None:
                try:
                    self.graphs.get(
                        request.model, list(request.example_inputs), seed=train.seed, allow_code=self.allow_code
                    )
                except FusionError as e:
                    logger.info("capturing job %s's model ahead of time failed: %s", request.job_id, e)

            threading.Thread(target=warm, name=f"warm-{request.job_id}", daemon=True).start()
        return epb.AdmitJobResponse()

    @rpc_errors
    def TakeSnapshot(self, request: epb.TakeSnapshotRequest, context: grpc.ServicerContext) -> epb.TakeSnapshotResponse:
        snap = self.stage(request.job_id, request.stage_idx).snapshot(request.step)
        self.snapshots.put(snap)
        return epb.TakeSnapshotResponse(info=snapshot_info(snap))

    @rpc_errors
    def ListSnapshots(
        self, request: epb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> epb.ListSnapshotsResponse:
        return epb.ListSnapshotsResponse(snapshots=[snapshot_info(s) for s in self.snapshots.list(request.job_id)])

    @rpc_errors
    def GetSnapshot(
        self, request: epb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.SnapshotChunk]:
        snap = self.snapshots.get(request.job_id, request.stage_key, request.step)
        return snapshot_chunks(snap, self.pool.chunk_bytes)

    @rpc_errors
    def PutSnapshot(
        self, request_iterator: Iterator[epb.SnapshotChunk], context: grpc.ServicerContext
    ) -> epb.PutSnapshotResponse:
        snap = assemble(request_iterator, replica=True)
        self.snapshots.put(snap)
        return epb.PutSnapshotResponse(info=snapshot_info(snap))

    @rpc_errors
    def RestoreStage(self, request: epb.RestoreStageRequest, context: grpc.ServicerContext) -> epb.RestoreStageResponse:
        runtime = self.stage(request.job_id, request.stage_idx)
        if request.source_address:
            snap = ExecutorClient(request.source_address, self.pool).get_snapshot(
                request.job_id, runtime.stage_key, request.step
            )
            self.snapshots.put(snap)
        else:
            snap = self.snapshots.get(request.job_id, runtime.stage_key, request.step)
        runtime.restore(snap)
        logger.info("restored stage %d of job %s to step %d", request.stage_idx, request.job_id, request.step)
        return epb.RestoreStageResponse(info=snapshot_info(snap))

    @rpc_errors
    def Abort(self, request: epb.AbortRequest, context: grpc.ServicerContext) -> epb.AbortResponse:
        with self._lock:
            runtimes = [rt for (j, _), rt in self._stages.items() if j == request.job_id]
        for rt in runtimes:
            rt.abort(request.reason or "aborted by the driver")
        return epb.AbortResponse()

    @rpc_errors
    def UnloadJob(self, request: epb.UnloadJobRequest, context: grpc.ServicerContext) -> epb.UnloadJobResponse:
        self.unload(request.job_id, keep_snapshots=request.keep_snapshots)
        return epb.UnloadJobResponse()

    @rpc_errors
    def Probe(self, request_iterator: Iterator[RawChunk], context: grpc.ServicerContext) -> epb.ProbeResponse:
        return self._drop_probe(request_iterator)

    @rpc_errors
    def ProbeWhole(self, request: RawChunk, context: grpc.ServicerContext) -> epb.ProbeResponse:
        return self._drop_probe(iter((request,)))

    @staticmethod
    def _drop_probe(chunks: Iterator[RawChunk]) -> epb.ProbeResponse:
        """Read a probe transfer through the tensor path, drop it, say how long it took."""
        t0: list[float] = []

        def check(header: pb.TransferHeader) -> None:
            t0.append(time.perf_counter())
            if header.kind != pb.TRANSFER_KIND_PROBE:
                raise WireError("Probe takes only TRANSFER_KIND_PROBE transfers")

        transfer = decode_transfer(chunks, max_bytes=MAX_PROBE_BYTES, check=check)
        return epb.ProbeResponse(received_bytes=transfer.size_bytes, receive_s=time.perf_counter() - t0[0])

    @rpc_errors
    def ProfileModel(self, request: epb.ProfileModelRequest, context: grpc.ServicerContext) -> epb.ProfileModelResponse:
        from executor.build import build_model_graph, example_inputs, parse_device
        from fusion.profiling import (
            measure_device,
            measure_optimizer_s_per_byte,
            profile_graph,
        )

        device = parse_device(request.device)
        train = train_spec(request.train_json)
        gm = build_model_graph(request.model, list(request.example_inputs), seed=train.seed, allow_code=self.allow_code)
        inputs = tuple(example_inputs(list(request.example_inputs)))
        profile = profile_graph(gm, inputs, device=str(device), repeats=max(1, request.repeats or 5))
        measured = measure_device(str(device))
        from fusion.graph.export import graph_fingerprint

        return epb.ProfileModelResponse(
            profile_json=json.dumps(profile),
            matmul_flops=measured.matmul_flops,
            optimizer_s_per_byte=measure_optimizer_s_per_byte(train.optimizer, device=str(device)),
            graph_fingerprint=graph_fingerprint(gm),
            device_name=measured.device_name,
        )

    @rpc_errors
    def ProbeLinks(self, request: epb.ProbeLinksRequest, context: grpc.ServicerContext) -> epb.ProbeLinksResponse:
        from fusion.profiling import probe_link

        sizes = [int(s) for s in request.sizes_bytes] or [16 << 10, 256 << 10, 2 << 20]
        if any(s <= 0 or s > MAX_PROBE_BYTES for s in sizes):
            raise WireError(f"probe sizes must be in 1..{MAX_PROBE_BYTES} bytes")
        repeats = max(1, min(int(request.repeats or 3), 20))
        addresses = check_probe_targets(request.addresses)
        for address, (expiry, key) in parse_probe_keys(request.auth).items():
            self.pool.keyring.set_probe(address, expiry, key)
        out = epb.ProbeLinksResponse()
        for address in addresses:
            client = ExecutorClient(address, self.pool)
            try:
                client.probe(sizes[0], attempts=1)  # warm the channel: connection set-up is not the link
                latency, bandwidth = probe_link(lambda size, c=client: c.probe(size)[0], sizes, repeats=repeats)
                out.links.add(address=address, latency_s=latency, bandwidth_bytes_per_s=bandwidth)
            except (FusionError, ValueError) as e:
                out.links.add(address=address, error=str(e))
        return out

    @rpc_errors
    def Ping(self, request: epb.PingRequest, context: grpc.ServicerContext) -> epb.PingResponse:
        return epb.PingResponse(worker_name=self.worker_name, jobs=self.jobs(), data_port=self.data_port)

    def unload(self, job_id: str, *, keep_snapshots: bool = False) -> None:
        """Drop every stage of ``job_id`` (aborting a running step), and its snapshots unless kept."""
        if not keep_snapshots:
            self.snapshots.drop_job(job_id)
            self.replicator.drop_job(job_id)
        with self._lock:
            keys = [k for k in self._stages if k[0] == job_id]
            runtimes = [self._stages.pop(k) for k in keys]
            senders = [self._senders.pop(k) for k in keys if k in self._senders]
        for rt in runtimes:
            rt.close("job unloaded")
        for s in senders:
            s.close()

    def close(self) -> None:
        for job in self.jobs():
            self.unload(job)
        self.replicator.close()
        if self.data_listener is not None:
            self.data_listener.close()
        if self.data_client is not None:
            self.data_client.close()
        self.pool.close()


def _warm_imports() -> None:
    """Pay once, at start-up, what the first optimizer costs (torch imports its compiler
    machinery, ~3 s on a small CPU), so a stage loaded in a hurry (recovery) is quick."""
    try:
        build_optimizer(TrainSpec(), [torch.nn.Parameter(torch.zeros(1))])
    except Exception:  # only a warm-up: the real construction reports real errors
        logger.debug("optimizer warm-up failed", exc_info=True)


def start_server(
    service: ExecutorService,
    listen: str,
    *,
    max_workers: int = 32,
    server: grpc.Server | None = None,
    tls: ServerTls | None = None,
) -> tuple[grpc.Server, int]:
    """Start (or add to) a gRPC server for ``service`` on ``listen`` (TLS when ``tls`` is
    given); returns it and its port."""
    if server is None:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="executor-rpc"),
            options=grpc_message_options(service.pool.chunk_bytes),
            # Calls beyond this are refused (RESOURCE_EXHAUSTED) instead of queueing without bound.
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        server.add_generic_rpc_handlers((executor_handler(service),))
        port = add_port(server, listen, tls)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        if service.data_plane and service.data_listener is None:
            service.start_data_plane(listen.rpartition(":")[0] or "0.0.0.0", tls)
        server.start()
        return server, port
    server.add_generic_rpc_handlers((executor_handler(service),))
    return server, 0


READY_PREFIX = "FUSION_EXECUTOR_READY"


def build_parser(prog: str = "python -m executor.server") -> argparse.ArgumentParser:
    """The bare executor's flags (a wrapper may add its own before parsing)."""
    parser = argparse.ArgumentParser(prog=prog, description="Run a fusion Executor service.")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0 picks a free one)")
    parser.add_argument("--name", default=f"executor-{os.getpid()}", help="worker name reported by Ping")
    parser.add_argument("--allow-code", action="store_true", help="allow job owners' module:factory models")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory (GiB) this executor lends its stages; a stage planned or measured over it is refused "
        "(default: unlimited)",
    )
    parser.add_argument(
        "--no-data-plane",
        action="store_true",
        help="send and receive tensors over gRPC only, without the direct data-plane port",
    )
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="transfer chunk size")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--control-key-file",
        default=None,
        help="file holding the hex control key callers must prove (without it every call is refused)",
    )
    parser.add_argument("--tls-cert", default=None, help="serve TLS with this certificate chain (PEM)")
    parser.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", default=None, help="CA bundle to verify peer executors with (TLS to peers)")
    parser.add_argument(
        "--auth-failure-burst",
        type=float,
        default=30.0,
        help="failed authentications per peer IP before its failing calls are refused for a while; "
        "calls with a valid credential are always served (default: %(default)s)",
    )
    return parser


def serve(
    args: argparse.Namespace, *, hooks: StageHooks | None = None, channel_factory: ChannelFactory | None = None
) -> int:
    """Run a bare executor configured by ``args`` (:func:`build_parser`) until SIGTERM/SIGINT;
    prints ``FUSION_EXECUTOR_READY <port>`` once it listens. ``hooks`` and
    ``channel_factory`` are the executor's seams (:mod:`executor.hooks`)."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    tls = ServerTls.from_files(args.tls_cert, args.tls_key)
    if args.tls_ca:
        set_client_ca(args.tls_ca)
    warn_if_exposed(args.listen.rpartition(":")[0], tls, "the executor")
    control = bytes.fromhex(Path(args.control_key_file).read_text().strip()) if args.control_key_file else None
    service = ExecutorService(
        worker_name=args.name,
        allow_code=args.allow_code,
        chunk_bytes=args.chunk_bytes,
        hooks=hooks,
        channel_factory=channel_factory,
        memory_cap_bytes=None if args.memory_gb is None else max(1, int(args.memory_gb * (1 << 30))),
        data_plane=not args.no_data_plane,
    )
    service.access = ExecutorAccess(
        keyring=service.pool.keyring, control_key=control, failure_burst=args.auth_failure_burst
    )
    server, port = start_server(service, args.listen, tls=tls)
    stop = catch_stop_signals()
    print(f"{READY_PREFIX} {port}", flush=True)
    wait_for_stop(stop)
    server.stop(grace=2.0).wait()
    service.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run a bare executor until SIGTERM/SIGINT; prints ``FUSION_EXECUTOR_READY <port>``."""
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

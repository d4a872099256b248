"""Client side of the Executor service: channels, deadlines, retries, chunked transfers.

Used by the driver (to load stages and run steps) and by stages themselves (to send
activations and gradients to their peers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import torch

from executor.binding import ExecutorStub
from executor.hooks import ChannelFactory, default_channel
from executor.snapshots import assemble, snapshot_chunks
from executor.status import call_with_retry, remote_error
from executor.transport import (
    DEFAULT_CHUNK_BYTES,
    decode_transfer,
    encode_transfer_wire,
    grpc_message_options,
    scalar_to_wire,
)
from fusion.auth import KeyRing, process_keyring
from fusion.checkpoint import Snapshot
from fusion.errors import RemoteError
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Deadline for control calls (load, start, apply).
CONTROL_TIMEOUT_S = 120.0
#: Minimum throughput assumed when sizing a transfer's deadline (bytes/s): 8 Mbps.
SLOWEST_LINK_BYTES_PER_S = 1_000_000
#: Fixed part of a transfer's deadline.
TRANSFER_BASE_TIMEOUT_S = 60.0


def transfer_timeout_s(size_bytes: int) -> float:
    """A deadline for moving ``size_bytes``: long enough for an 8 Mbps link, never unbounded."""
    return TRANSFER_BASE_TIMEOUT_S + size_bytes / SLOWEST_LINK_BYTES_PER_S


class ChannelPool:
    """One gRPC channel per peer address, shared by every caller in the process.

    Channels are made by ``channel_factory`` (:data:`executor.hooks.ChannelFactory`;
    default :func:`executor.hooks.default_channel`, a plain channel with the pool's
    options and CA): a testbed may route each peer through its link proxy that way
    (``testbeds.worker --peer-map``). Callers always name peers by their real address, and a
    channel, once made, is kept until :meth:`close`.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keyring: KeyRing | None = None,
        tls_ca: bytes | None = None,
        channel_factory: ChannelFactory | None = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        #: Keys the pool's calls are signed with (:mod:`fusion.auth`); the process's by default.
        self.keyring = keyring if keyring is not None else process_keyring()
        #: CA bundle for TLS channels (default: the process's, :func:`fusion.tls.set_client_ca`).
        self.tls_ca = tls_ca
        #: How a channel to a peer is made (:mod:`executor.hooks`).
        self.channel_factory: ChannelFactory = channel_factory or default_channel
        self._channels: dict[str, grpc.Channel] = {}
        #: Peers that answered a one-message transfer UNIMPLEMENTED (an older release).
        self.stream_only: set[str] = set()
        #: Data-plane ports peers advertised in their ``Send`` answers (:mod:`executor.stream_client`).
        self.data_ports: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self.channel_factory(address, grpc_message_options(self.chunk_bytes), self.tls_ca)
                self._channels[address] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


class ExecutorClient:
    """Typed calls to one worker's Executor service."""

    def __init__(self, address: str, pool: ChannelPool) -> None:
        self.address = address
        self.pool = pool
        self.stub = ExecutorStub(
            pool.get(address), sign=lambda method, job_id: pool.keyring.metadata(address, method, job_id)
        )

    def _call(
        self, method: Any, request: Any, what: str, timeout_s: float = CONTROL_TIMEOUT_S, *, attempts: int = 4
    ) -> Any:
        return call_with_retry(method, request, peer=self.address, what=what, timeout_s=timeout_s, attempts=attempts)

    def ping(self, timeout_s: float = 5.0, *, attempts: int = 4) -> epb.PingResponse:
        return self._call(self.stub.Ping, epb.PingRequest(), "Ping", timeout_s, attempts=attempts)

    def load_stage(self, request: epb.LoadStageRequest, timeout_s: float = 600.0) -> epb.LoadStageResponse:
        return self._call(self.stub.LoadStage, request, f"LoadStage(stage {request.stage_idx})", timeout_s)

    def send(
        self,
        header: pb.TransferHeader,
        tensors: Mapping[str, torch.Tensor],
        scalars: Mapping[str, Any] | None = None,
        *,
        encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None = None,
    ) -> int:
        """Send one transfer (activations, gradients or targets); returns payload bytes."""
        for name, value in (scalars or {}).items():
            header.values.append(scalar_to_wire(name, value))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        size += sum(len(b) for _, b in (encoded or {}).values())

        def chunks() -> Iterator[bytes]:
            return encode_transfer_wire(header, tensors, chunk_bytes=self.pool.chunk_bytes, encoded=encoded)

        what = f"Send(kind {header.kind} to stage {header.stage_idx}, micro-batch {header.micro_batch_idx})"
        response = self._transfer(self.stub.Send, self.stub.SendWhole, chunks, size, what)
        if response.data_port:
            self.pool.data_ports[self.address] = response.data_port
        return size

    def _transfer(
        self,
        stream: Any,
        whole: Any,
        chunks: Callable[[], Iterator[bytes]],
        size_bytes: int,
        what: str,
        *,
        attempts: int = 4,
    ) -> Any:
        """One transfer of ``size_bytes`` of payload: as one unary message (``whole``) when it
        fits in one chunk, else as a stream of chunks (``stream``). A request stream costs a
        thread hand-off per message on each side, which a loaded machine delays (a 32 KB
        transfer took 1.9 ms as a stream, 0.5 ms as one message, beside two busy cores)."""
        timeout_s = transfer_timeout_s(size_bytes)
        # encode_transfer_wire yields exactly one chunk up to chunk_bytes
        if size_bytes <= self.pool.chunk_bytes and self.address not in self.pool.stream_only:
            try:
                return self._call(whole, lambda: next(chunks()), what, timeout_s, attempts=attempts)
            except RemoteError as e:
                if e.code != "UNIMPLEMENTED":
                    raise
                # A worker of an older release serves only the stream: use it from now on.
                logger.info("%s serves no one-message transfers; streaming to it", self.address)
                self.pool.stream_only.add(self.address)
        return self._call(stream, chunks, what, timeout_s, attempts=attempts)

    def probe(self, size_bytes: int, *, attempts: int = 4) -> tuple[float, epb.ProbeResponse]:
        """Send ``size_bytes`` of probe bytes through the tensor path; returns (seconds, answer)."""
        payload = torch.zeros(size_bytes, dtype=torch.uint8)
        header = pb.TransferHeader(kind=pb.TRANSFER_KIND_PROBE)

        def chunks() -> Iterator[bytes]:
            return encode_transfer_wire(header, {"probe": payload}, chunk_bytes=self.pool.chunk_bytes)

        t0 = time.perf_counter()
        response = self._transfer(
            self.stub.Probe, self.stub.ProbeWhole, chunks, size_bytes, f"Probe({size_bytes} bytes)", attempts=attempts
        )
        return time.perf_counter() - t0, response

    def set_state(self, job_id: str, stage_idx: int, kind: int, tensors: Mapping[str, torch.Tensor]) -> None:
        header = pb.TransferHeader(job_id=job_id, stage_idx=stage_idx, kind=kind)
        size = sum(t.numel() * t.element_size() for t in tensors.values())

        def chunks() -> Iterator[bytes]:
            return encode_transfer_wire(header, tensors, chunk_bytes=self.pool.chunk_bytes)

        self._call(self.stub.SetState, chunks, f"SetState(stage {stage_idx})", transfer_timeout_s(size))

    def get_state(
        self, job_id: str, stage_idx: int, kind: int, names: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        request = epb.GetStateRequest(job_id=job_id, stage_idx=stage_idx, kind=kind, names=names or [])
        what = f"GetState(stage {stage_idx})"
        try:
            stream = self.stub.GetState(request, timeout=transfer_timeout_s(1 << 30))
            transfer = decode_transfer(stream, max_bytes=1 << 40)
        except grpc.RpcError as e:
            raise remote_error(e, peer=self.address, what=what) from None
        return {k: v.clone() for k, v in transfer.tensors().items()}

    def run_step(
        self,
        job_id: str,
        stage_idx: int,
        step: int,
        num_micro_batches: int,
        schedule: int,
        *,
        measure_memory: bool = False,
        cut_codecs: list[epb.CutCodec] | None = None,
        finish: epb.StepFinish | None = None,
    ) -> None:
        """Start the step; with ``finish`` the stage also syncs its tied gradients and
        applies the update on its own once its schedule is done."""
        request = epb.RunStepRequest(
            job_id=job_id,
            stage_idx=stage_idx,
            step=step,
            num_micro_batches=num_micro_batches,
            schedule=schedule,
            measure_memory=measure_memory,
            cut_codecs=cut_codecs or [],
            finish=finish,
        )
        self._call(self.stub.RunStep, request, f"RunStep(stage {stage_idx}, step {step})")

    def wait_step(self, job_id: str, stage_idx: int, step: int, timeout_s: float) -> epb.WaitStepResponse:
        request = epb.WaitStepRequest(job_id=job_id, stage_idx=stage_idx, step=step, timeout_s=timeout_s)
        return self._call(self.stub.WaitStep, request, f"WaitStep(stage {stage_idx}, step {step})", timeout_s + 30.0)

    def sync_tied(self, job_id: str, stage_idx: int, step: int, timeout_s: float) -> epb.SyncTiedResponse:
        """Once per step and not retried: the holders exchange gradients with each other."""
        request = epb.SyncTiedRequest(job_id=job_id, stage_idx=stage_idx, step=step)
        return self._call(
            self.stub.SyncTied, request, f"SyncTied(stage {stage_idx}, step {step})", timeout_s, attempts=1
        )

    def apply_step(
        self,
        job_id: str,
        stage_idx: int,
        step: int,
        *,
        optimizer_step: bool = True,
        snapshot: bool = False,
        replicate_to: str = "",
        replicate_bytes_per_s: float = 0.0,
    ) -> None:
        request = epb.ApplyStepRequest(
            job_id=job_id,
            stage_idx=stage_idx,
            step=step,
            optimizer_step=optimizer_step,
            snapshot=snapshot,
            replicate_to=replicate_to,
            replicate_bytes_per_s=replicate_bytes_per_s,
        )
        self._call(self.stub.ApplyStep, request, f"ApplyStep(stage {stage_idx}, step {step})")

    def abort(self, job_id: str, reason: str) -> None:
        """Best effort: a peer that is gone cannot be aborted, and that is fine."""
        try:
            self._call(self.stub.Abort, epb.AbortRequest(job_id=job_id, reason=reason), "Abort", 2.0, attempts=1)
        except RemoteError as e:
            logger.info("abort on %s failed: %s", self.address, e)

    def unload_job(self, job_id: str, *, keep_snapshots: bool = False) -> None:
        self._call(
            self.stub.UnloadJob, epb.UnloadJobRequest(job_id=job_id, keep_snapshots=keep_snapshots), "UnloadJob", 30.0
        )

    # ------------------------------------------------------------- snapshots
    def admit_job(self, request: epb.AdmitJobRequest) -> None:
        self._call(self.stub.AdmitJob, request, "AdmitJob", 10.0, attempts=2)

    def take_snapshot(self, job_id: str, stage_idx: int, step: int) -> epb.SnapshotInfo:
        request = epb.TakeSnapshotRequest(job_id=job_id, stage_idx=stage_idx, step=step)
        return self._call(self.stub.TakeSnapshot, request, f"TakeSnapshot(stage {stage_idx}, step {step})", 600.0).info

    def list_snapshots(self, job_id: str, timeout_s: float = 10.0) -> list[epb.SnapshotInfo]:
        response = self._call(
            self.stub.ListSnapshots, epb.ListSnapshotsRequest(job_id=job_id), "ListSnapshots", timeout_s, attempts=2
        )
        return list(response.snapshots)

    def get_snapshot(self, job_id: str, stage_key: str, step: int) -> Snapshot:
        """Fetch a snapshot; it arrives checked (complete, checksum matching)."""
        what = f"GetSnapshot(stage {stage_key}, step {step})"
        request = epb.GetSnapshotRequest(job_id=job_id, stage_key=stage_key, step=step)
        try:
            return assemble(self.stub.GetSnapshot(request, timeout=transfer_timeout_s(1 << 32)), replica=True)
        except grpc.RpcError as e:
            raise remote_error(e, peer=self.address, what=what) from None

    def put_snapshot(self, snap: Snapshot, *, rate_bytes_per_s: float = 0.0) -> epb.SnapshotInfo:
        def chunks() -> Iterator[epb.SnapshotChunk]:
            return snapshot_chunks(snap, self.pool.chunk_bytes, rate_bytes_per_s=rate_bytes_per_s)

        timeout = transfer_timeout_s(snap.size_bytes) + (
            snap.size_bytes / rate_bytes_per_s if rate_bytes_per_s > 0 else 0.0
        )
        what = f"PutSnapshot(stage {snap.stage_idx}, step {snap.step})"
        return self._call(self.stub.PutSnapshot, chunks, what, timeout, attempts=1).info

    def restore_stage(self, job_id: str, stage_idx: int, step: int, *, source_address: str = "") -> epb.SnapshotInfo:
        request = epb.RestoreStageRequest(job_id=job_id, stage_idx=stage_idx, step=step, source_address=source_address)
        return self._call(
            self.stub.RestoreStage, request, f"RestoreStage(stage {stage_idx}, step {step})", 600.0, attempts=1
        ).info


def run_parallel(calls: list[Callable[[], Any]], *, name: str = "call") -> list[Any]:
    """Run callables on threads; return results in order; re-raise the first failure."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results

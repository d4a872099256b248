"""Typed client of the Coordinator service, for the CLI, workers, the demo and tests."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from executor.status import call_with_retry
from fusion.config import JobSpec
from fusion.errors import RemoteError
from fusion.tls import open_channel
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import coordinator_pb2_grpc as cgrpc

logger = logging.getLogger(__name__)

AUTH_METADATA = "fusion-auth"
TIMEOUT_S = 30.0

#: gRPC's words for "nothing answered at that address" (refused, no route, unknown host).
_UNREACHABLE = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed", "Connection refused")


def _unreachable_message(e: RemoteError, address: str) -> str | None:
    """One line for a coordinator that could not be reached, or ``None`` for other errors."""
    if e.code != "UNAVAILABLE":
        return None
    text = str(e)
    if "handshake" in text.lower():
        return (
            f"TLS handshake with the coordinator at {address} failed — does it serve TLS, "
            "and did the CA given with --tls-ca sign its certificate?"
        )
    if "Socket closed" in text:  # what a plain-text client sees of a TLS server
        return (
            f"the coordinator at {address} closed the connection at once — "
            "if it serves TLS, pass --tls-ca (or set FUSION_TLS_CA)"
        )
    if any(s in text for s in _UNREACHABLE):
        return f"no coordinator at {address} — is fusion-coordinator running?"
    return None


class CoordinatorClient:
    """Calls to one coordinator, authenticated with a token or a worker session."""

    def __init__(self, address: str, credential: str, *, timeout_s: float = TIMEOUT_S) -> None:
        self.address = address
        self.credential = credential
        self.timeout_s = timeout_s
        self.channel = open_channel(address)  # TLS when the process has a CA (fusion.tls)
        self.stub = cgrpc.CoordinatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, what: str, *, attempts: int = 4, timeout_s: float | None = None) -> Any:
        metadata = ((AUTH_METADATA, self.credential),)

        def call(req: Any, timeout: float) -> Any:
            return method(req, timeout=timeout, metadata=metadata)

        try:
            return call_with_retry(
                call, request, peer=self.address, what=what, timeout_s=timeout_s or self.timeout_s, attempts=attempts
            )
        except RemoteError as e:
            message = _unreachable_message(e, self.address)
            if message is None:
                raise
            raise RemoteError(message, code=e.code, peer=self.address, metadata=e.metadata) from e

    # ------------------------------------------------------------- workers
    def register(self, name: str, address: str, resources: cpb.WorkerResources) -> cpb.RegisterResponse:
        return self._call(
            self.stub.Register, cpb.RegisterRequest(name=name, address=address, resources=resources), "Register"
        )

    def heartbeat(self, worker_id: str) -> bool:
        return bool(
            self._call(self.stub.Heartbeat, cpb.HeartbeatRequest(worker_id=worker_id), "Heartbeat", attempts=1).known
        )

    def deregister(self, worker_id: str, reason: str) -> None:
        # Long deadline: the coordinator answers once the worker's jobs have handed its state off.
        self._call(
            self.stub.Deregister,
            cpb.DeregisterRequest(worker_id=worker_id, reason=reason),
            "Deregister",
            attempts=2,
            timeout_s=150.0,
        )

    def workers(self) -> list[cpb.WorkerInfo]:
        return list(self._call(self.stub.ListWorkers, cpb.ListWorkersRequest(), "ListWorkers").workers)

    # ------------------------------------------------------------- jobs
    def submit(self, spec: JobSpec) -> str:
        return str(
            self._call(
                self.stub.SubmitJob, cpb.SubmitJobRequest(spec_json=spec.to_json(indent=None)), "SubmitJob"
            ).job_id
        )

    def status(self, job_id: str) -> dict[str, Any]:
        return json.loads(self._call(self.stub.GetJob, cpb.GetJobRequest(job_id=job_id), "GetJob").status_json)

    def jobs(self) -> list[dict[str, Any]]:
        return [json.loads(s) for s in self._call(self.stub.ListJobs, cpb.ListJobsRequest(), "ListJobs").status_json]

    def cancel(self, job_id: str) -> str:
        return str(self._call(self.stub.CancelJob, cpb.CancelJobRequest(job_id=job_id), "CancelJob").state)

    def profile(
        self,
        spec: JobSpec,
        *,
        check: bool,
        steps: int = 0,
        max_workers: int = 0,
        device: str = "",
        timeout_s: float = 3600.0,
    ) -> dict[str, Any]:
        """Have the coordinator measure ``spec`` on its idle workers (``fusion profile``); one attempt."""
        request = cpb.ProfileWorkersRequest(
            spec_json=spec.to_json(indent=None), check=check, steps=steps, max_workers=max_workers, device=device
        )
        return json.loads(
            self._call(self.stub.ProfileWorkers, request, "ProfileWorkers", attempts=1, timeout_s=timeout_s).result_json
        )

    def get_profile(self, job_id: str) -> cpb.GetProfileResponse:
        """The model profile ``job_id`` was planned with (the Coordinator's ``GetProfile``)."""
        return self._call(self.stub.GetProfile, cpb.GetProfileRequest(job_id=job_id), "GetProfile")

    def logs(self, job_id: str, after_seq: int = 0) -> tuple[list[str], int]:
        r = self._call(self.stub.GetLogs, cpb.GetLogsRequest(job_id=job_id, after_seq=after_seq), "GetLogs")
        return list(r.lines), int(r.last_seq)

    def fetch_outputs(
        self, job_id: str, *, checkpoint: bool = False, timeout_s: float = 3 * 3600.0
    ) -> Iterator[cpb.FetchOutputsResponse]:
        """The parts of ``job_id``'s output files as the coordinator streams them (``FetchOutputs``:
        per file a start, data chunks, an end with its SHA-256); one attempt, one deadline for the
        whole stream. gRPC failures, also mid-stream, raise :class:`~fusion.errors.RemoteError`."""
        import grpc

        from executor.status import remote_error

        request = cpb.FetchOutputsRequest(job_id=job_id, checkpoint=checkpoint)
        call = self.stub.FetchOutputs(request, timeout=timeout_s, metadata=((AUTH_METADATA, self.credential),))
        try:
            yield from call
        except grpc.RpcError as e:
            raise remote_error(e, peer=self.address, what="FetchOutputs") from None
        finally:
            call.cancel()

"""The coordinator's gRPC server, answering ``fusion status`` before the service is loaded.

The service (:mod:`fusion.coordinator.service`) pulls in torch and the planner: seconds to
import, tens of seconds on a busy machine. Everything ``fusion status`` needs is in the
state file, so ``fusion-coordinator`` binds its port first (:func:`open_server`) and
answers from the :class:`~fusion.coordinator.store.Store` while it loads: ``GetJob`` and
``ListJobs`` for the job owner; every other call is refused with ``UNAVAILABLE`` (a worker
or a client retries it as it would a coordinator that is not up yet). Once the service is
built, :meth:`Switchboard.ready` sends every call to it.

Jobs that were in flight when the previous process stopped are put back to ``pending``
(:func:`requeue_after_restart`) before the first answer, so status never shows a job as
running that no process runs.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

import grpc

from fusion.auth import AUTH_METADATA
from fusion.coordinator.store import JobRow, Store
from fusion.errors import AuthError, FusionError
from fusion.tls import ServerTls, add_port
from fusion.wire import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)

#: How many recent events ``fusion status --json`` carries (a first plan alone logs about a dozen).
STATUS_EVENTS = 50
#: Largest request the coordinator reads (a job spec, a worker's resources): 4 MiB.
MAX_MESSAGE_BYTES = 4 << 20
#: Most calls in flight; more are refused (RESOURCE_EXHAUSTED) rather than queued.
MAX_CONCURRENT_RPCS = 512
#: What a call other than status is told while the coordinator loads.
STARTING = "the coordinator is starting (loading the planner); retry in a few seconds"


def credential(context: grpc.ServicerContext) -> str:
    """The ``fusion-auth`` metadata of a call ("" when absent)."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_METADATA:
            return str(value)
    return ""


def job_status(store: Store, job: JobRow, *, events: bool = True, phase: tuple[str, float] | None = None) -> dict:
    """The ``fusion status --json`` document of ``job``.

    ``waiting``: what a pending job waits for, in one line (``None`` otherwise); ``phase``:
    the planning step a job is in (``profiling``, ``probing links`` …; ``None`` outside
    planning) and how long it has been in it, as its runner reports them."""
    end = job.finished_at or time.time()
    doc: dict[str, Any] = {
        "id": job.job_id,
        "name": job.name,
        "state": job.state,
        "reason": job.reason,
        "step": job.step,
        "steps": job.steps,
        "loss": job.loss,
        "samples_per_s": job.samples_per_s,
        "workers": job.workers,
        "output_dir": job.output_dir,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "elapsed_s": round(end - job.started_at, 3) if job.started_at else None,
        "waiting": job.waiting if job.state == "pending" else None,
        "phase": None,
        "phase_elapsed_s": None,
    }
    if phase is not None:
        doc["phase"], doc["phase_elapsed_s"] = phase[0], round(phase[1], 1)
    if job.plan_json:
        plan = json.loads(job.plan_json)
        doc["plan"] = {
            "strategy": plan["strategy"],
            "stages": [{"worker": s["worker"], "nodes": len(s["nodes"])} for s in plan["stages"]],
            "why": plan.get("extra", {}).get("why"),
        }
        doc["compression_note"] = plan.get("extra", {}).get("compression_note")
    if events:
        records = store.log_records(job.job_id, kind="event")
        doc["events"] = [{"time": ts, **rec} for _, ts, _, rec in records[-STATUS_EVENTS:]]
    else:
        doc["events"] = []
    return doc


def requeue_after_restart(store: Store) -> list[str]:
    """Put the jobs the previous process was running back to ``pending`` (:meth:`Store.recover`)
    and say so; returns their ids (none the second time)."""
    requeued = store.recover()
    if requeued:
        logger.warning(
            "%d job(s) were running when the coordinator stopped; "
            "they resume from their checkpoints once workers rejoin: %s",
            len(requeued),
            requeued,
        )
    return requeued


class _Starting:
    """The calls answered while the service loads: status for the job owner, from the store."""

    def __init__(self, store: Store, token: str) -> None:
        self.store = store
        self._token = token

    def _check_owner(self, context: grpc.ServicerContext) -> None:
        if not hmac.compare_digest(credential(context).encode(), self._token.encode()):
            raise AuthError("wrong or missing token: pass the coordinator's token with --token or FUSION_TOKEN")

    def GetJob(self, request: cpb.GetJobRequest, context: grpc.ServicerContext) -> cpb.GetJobResponse:
        self._check_owner(context)
        return cpb.GetJobResponse(status_json=json.dumps(job_status(self.store, self.store.job(request.job_id))))

    def ListJobs(self, request: cpb.ListJobsRequest, context: grpc.ServicerContext) -> cpb.ListJobsResponse:
        self._check_owner(context)
        docs = [json.dumps(job_status(self.store, j, events=False)) for j in reversed(self.store.jobs())]
        return cpb.ListJobsResponse(status_json=docs)


def starting_handler(store: Store, token: str) -> grpc.GenericRpcHandler:
    """The Coordinator service while it loads: ``GetJob`` and ``ListJobs`` answered from
    ``store`` for ``token``'s holder, every other method ``UNAVAILABLE``."""
    from google.protobuf import message_factory

    from executor.status import status_code_of

    starting = _Starting(store, token)
    desc = cpb.DESCRIPTOR.services_by_name["Coordinator"]
    handlers = {}
    for method in desc.methods:
        fn = getattr(starting, method.name, None)

        def answer(request: Any, context: grpc.ServicerContext, fn: Any = fn) -> Any:
            if fn is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, STARTING)
            try:
                return fn(request, context)
            except FusionError as e:
                context.abort(status_code_of(e), f"{type(e).__name__}: {e}")

        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            answer,
            request_deserializer=message_factory.GetMessageClass(method.input_type).FromString,
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(desc.full_name, handlers)


class Switchboard(grpc.GenericRpcHandler):
    """Sends each call to the current handler: the starting one, then the service's."""

    def __init__(self, handler: grpc.GenericRpcHandler) -> None:
        self._handler = handler

    def ready(self, handler: grpc.GenericRpcHandler) -> None:
        """From now on, every new call goes to ``handler``."""
        self._handler = handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._handler.service(handler_call_details)


def open_server(
    handler: grpc.GenericRpcHandler, host: str, port: int, *, tls: ServerTls | None = None
) -> tuple[grpc.Server, int, Switchboard]:
    """Serve ``handler`` on ``host:port`` (port 0 picks a free one), with TLS when given;
    returns the started server, the bound port and the switchboard to hand calls on with.
    Raises ``OSError`` when the port cannot be bound."""
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(
        ThreadPoolExecutor(max_workers=16, thread_name_prefix="coordinator-rpc"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", 64 << 20)],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    board = Switchboard(handler)
    server.add_generic_rpc_handlers((board,))
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound, board


__all__ = [
    "MAX_CONCURRENT_RPCS",
    "MAX_MESSAGE_BYTES",
    "STARTING",
    "STATUS_EVENTS",
    "Switchboard",
    "credential",
    "job_status",
    "open_server",
    "requeue_after_restart",
    "starting_handler",
]

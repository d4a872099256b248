"""The Coordinator gRPC service: admits workers, watches their heartbeats, runs jobs.

Three kinds of work happen here:

- **RPCs** (worker registration and heartbeats; job submission, status, cancel, logs).
  Handlers only read and write the :class:`~fusion.coordinator.store.Store` and wake the
  background loop; they never train.
- **The background loop** (one thread, every ``heartbeat_interval_s`` or when woken):
  declares workers whose heartbeats stopped ``gone`` and fails the jobs that used them;
  starts pending jobs once enough idle workers exist.
- **Job runners** (:class:`~fusion.coordinator.runner.JobRunner`, one thread per running
  job).

Authentication: the ``fusion-auth`` metadata of each call carries either the coordinator
token (job owners, and workers registering) or the session credential a worker received
at registration; only its SHA-256 is stored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from executor.client import ChannelPool
from executor.hooks import ChannelFactory
from executor.status import rpc_errors, status_code_of
from fusion.auth import KeyRing, RateLimiter, control_key_from_hash, peer_host
from fusion.config import JobSpec
from fusion.coordinator.fetch import stream_errors, stream_outputs
from fusion.coordinator.planning import CALIBRATE_MIN_S, JobProfileCache, LinkTable, ProfileCache
from fusion.coordinator.recovery import answering
from fusion.coordinator.runner import JobRunner
from fusion.coordinator.serving import credential, job_status, open_server, requeue_after_restart
from fusion.coordinator.store import TERMINAL_STATES, JobRow, Store, WorkerRow
from fusion.errors import AuthError, ConfigError, FusionError, RateLimitError, StateError, WireError
from fusion.tls import ServerTls
from fusion.wire import coordinator_pb2 as cpb

logger = logging.getLogger(__name__)

#: Shortest token the coordinator accepts without a warning (16 URL-safe characters: 96 bits).
MIN_TOKEN_CHARS = 16
#: How long a leaving worker waits for its jobs to hand its state off.
HANDOFF_TIMEOUT_S = 120.0


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def validate_job(spec: JobSpec) -> None:
    """Reject at submit time what would only fail later: unknown models, data sets, losses.

    Checks the model's name and options without building it (a GPT-2 XL job is validated
    as fast as a tiny one) and builds the data set (cheap, and it catches missing files).
    """
    from fusion.losses import get_loss
    from fusion.models import check_model
    from fusion.training import build_job_dataset

    check_model(spec.model.name, spec.model.preset, **spec.model.kwargs)
    dataset = build_job_dataset(spec)
    if len(dataset) < spec.data.batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"data.batch_size {spec.data.batch_size} is larger than the data set ({len(dataset)} samples)"
        )  # type: ignore[arg-type]
    get_loss(spec.train.loss)


class CoordinatorService:
    """State, background loop and RPC handlers of a coordinator."""

    def __init__(
        self,
        *,
        store: Store,
        token: str,
        heartbeat_interval_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        device: str = "cpu",
        calibrate_s: float = CALIBRATE_MIN_S,
        register_burst: float = 32.0,
        registers_per_s: float = 2.0,
        auth_failure_burst: float = 30.0,
        auth_failures_per_s: float = 0.5,
        channel_factory: ChannelFactory | None = None,
    ) -> None:
        """``channel_factory``: how the coordinator dials workers' executors (planning probes
        and the jobs' drivers; :mod:`executor.hooks`; default: a plain channel)."""
        if not token:
            raise ConfigError("the coordinator needs a non-empty token")
        if len(token) < MIN_TOKEN_CHARS:
            # A valid token is accepted from any address, however many wrong guesses came
            # from it (no lockout): only the token's length stops online guessing.
            logger.warning(
                "the coordinator token is %d characters: short tokens can be guessed online; use at least %d "
                "random characters (omit --token and the coordinator generates one)",
                len(token),
                MIN_TOKEN_CHARS,
            )
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise ConfigError("heartbeat timeout must be longer than the heartbeat interval")
        self.store = store
        self._token = token
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.device = device
        #: Compute seconds of each model's executor calibration (:func:`calibrate_executor`).
        self.calibrate_s = calibrate_s
        # Calls to workers' executors are signed with each worker's control key, derived
        # from its stored session hash (so it survives a coordinator restart).
        self.pool = ChannelPool(keyring=KeyRing(resolve_control=self._control_key_of), channel_factory=channel_factory)
        #: Registrations per source address (counted once the token is proven), and failed
        #: calls per source address (wrong or missing credentials, malformed requests): past
        #: its budget a source's failing calls are refused with RESOURCE_EXHAUSTED, while its
        #: calls with a valid credential are still served. Both tables are bounded.
        self.register_limit = RateLimiter(burst=register_burst, per_s=registers_per_s)
        self.auth_failures = RateLimiter(burst=auth_failure_burst, per_s=auth_failures_per_s)
        self.profiles = ProfileCache(load=store.get_profile, store=store.put_profile)
        self.links = LinkTable()
        #: Each job's view of the profile cache, which remembers the profile it was planned
        #: with (``GetProfile``); kept after the job ends, for as long as this process runs.
        self._job_profiles: dict[str, JobProfileCache] = {}
        self._runners: dict[str, JobRunner] = {}
        #: Workers waiting in Deregister for their hand-off: alive (the call is open), not heart-beating.
        self._departing: set[str] = set()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._background, name="coordinator-loop", daemon=True)
        requeue_after_restart(store)

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        """Stop the loop and every running job (their jobs end as failed)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            runners = list(self._runners.values())
        for r in runners:
            r.stop(
                "pending",
                "the coordinator shut down; the job resumes from its last durable checkpoint when it restarts",
            )
        for r in runners:
            r.join(timeout=30)
        if self._loop.is_alive():
            self._loop.join(timeout=10)
        self.pool.close()

    # ------------------------------------------------------------- auth
    def _control_key_of(self, address: str) -> bytes | None:
        """The control key of the live worker serving at ``address`` (newest registration)."""
        rows = [w for w in self.store.workers("idle", "busy") if w.address == address]
        if not rows:
            return None
        return control_key_from_hash(max(rows, key=lambda w: w.registered_at).session_hash)

    def _failed(self, context: grpc.ServicerContext, error: FusionError) -> FusionError:
        """Count a failed call against its source address: ``error`` while the source is
        within its budget, past it a :class:`RateLimitError` that names the address.

        Only failing calls are counted and only they are refused: a call that authenticates
        is served whatever its address's count (whoever shares the address, a NAT or a
        campus, cannot lock the job owner or the volunteers out by failing)."""
        host = peer_host(context.peer() or "")
        if self.auth_failures.allow(host):
            return error
        return RateLimitError(
            f"too many failed authentications from {host} ({error}); this address's failing calls are refused "
            "for a while, calls with a valid credential are still served"
        )

    def _is_owner(self, context: grpc.ServicerContext) -> bool:
        return hmac.compare_digest(credential(context).encode(), self._token.encode())

    def _check_owner(self, context: grpc.ServicerContext) -> None:
        if not self._is_owner(context):
            raise self._failed(
                context, AuthError("wrong or missing token: pass the coordinator's token with --token or FUSION_TOKEN")
            )

    def _check_worker(self, context: grpc.ServicerContext, worker_id: str) -> None:
        from fusion.errors import NotFoundError

        try:
            row = self.store.worker(worker_id)
        except NotFoundError:
            raise self._failed(context, AuthError(f"unknown worker {worker_id!r}: register first")) from None
        if not hmac.compare_digest(_hash(credential(context)), row.session_hash):
            raise self._failed(context, AuthError(f"wrong session credential for worker {worker_id!r}"))

    def malformed(self, context: grpc.ServicerContext, error: WireError) -> FusionError:
        """What to answer a request that does not parse: ``error`` for the job owner (a
        buggy client, not counted); from anyone else it counts as a failed authentication
        (:meth:`_failed`), so garbage cannot be sent at a rate wrong tokens cannot."""
        if self._is_owner(context):
            return error
        return self._failed(context, error)

    # ------------------------------------------------------------- workers
    @rpc_errors
    def Register(self, request: cpb.RegisterRequest, context: grpc.ServicerContext) -> cpb.RegisterResponse:
        self._check_owner(context)
        # Counted only once the token is proven: failures of others at this address never
        # use up a volunteer's registrations.
        host = peer_host(context.peer() or "")
        if not self.register_limit.allow(host):
            raise RateLimitError(
                f"too many registrations from {host} (more than {self.register_limit.burst:.0f} at once, then "
                f"{self.register_limit.per_s:g}/s); retry in a few seconds"
            )
        if (
            not request.address
            or ":" not in request.address
            or len(request.address) > MAX_LABEL_CHARS
            or len(request.name) > MAX_LABEL_CHARS
        ):
            raise WireError(f"register needs the worker's executor address as HOST:PORT, got {request.address!r}")
        r = request.resources
        long = [
            f
            for f in ("device", "device_name", "machine", "torch_version", "fusion_version")
            if len(getattr(r, f)) > MAX_LABEL_CHARS
        ]
        if long:
            raise WireError(
                f"register: resources.{long[0]} is {len(getattr(r, long[0]))} characters; at most {MAX_LABEL_CHARS}"
            )
        name = request.name or request.address
        worker_id = f"w-{uuid.uuid4().hex[:10]}"
        session = secrets.token_urlsafe(32)
        from google.protobuf.json_format import MessageToDict

        resources = MessageToDict(request.resources, preserving_proto_field_name=True)
        with self._lock:
            # One live row per name: checked and written under the lock, so two processes
            # registering one name at once cannot both get in.
            retired = self._admit_name(name, request.address)
            self.store.add_worker(
                worker_id=worker_id,
                name=name,
                address=request.address,
                resources=resources,
                session_hash=_hash(session),
            )
        for old, why in retired:
            self._fail_jobs_of(old.worker_id, f"worker {name} ({old.address}) {why}")
        logger.info("worker %s (%s) joined from %s", name, worker_id, request.address)
        self._wake.set()
        return cpb.RegisterResponse(
            worker_id=worker_id, session=session, heartbeat_interval_s=self.heartbeat_interval_s
        )

    def _admit_name(self, name: str, address: str) -> list[tuple[WorkerRow, str]]:
        """Make room for a registration of ``name`` from ``address``; call under ``_lock``.

        A name belongs to one volunteer. Its earlier registrations that are live (``idle``
        or ``busy``) are retired (declared ``gone``) when they are the same volunteer back,
        which a live row cannot tell apart from a stale one: the same executor address (no
        second live process can serve on it), or a row silent past the heartbeat timeout
        that the background loop has not reaped yet. Any other live holder of the name is a
        different process, and the registration is refused (``StateError``).

        Returns the rows whose jobs must hear that the worker is gone, with why: the live
        rows retired here, and the rows already ``gone`` that a running job still holds (a
        worker frozen or cut off past the timeout, back before its job let it go). The job
        drops the old row at its next failure or recovery; until then
        :meth:`_claim_idle` keeps the new row from it, so no plan sees two rows of one name.
        """
        now = time.time()
        retired: list[tuple[WorkerRow, str]] = []
        for row in self.store.workers():
            if row.name != name:
                continue
            silent_s = now - row.last_heartbeat
            if row.state in ("idle", "busy"):
                if row.address != address and silent_s <= self.heartbeat_timeout_s:
                    raise StateError(
                        f"worker name {name!r} is taken by a live worker at {row.address} (its last heartbeat "
                        f"{silent_s:.1f}s ago): every worker needs a unique name; start this one with another "
                        "--name, or stop the other one first"
                    )
                self.store.set_worker_state(row.worker_id, "gone")
                logger.warning(
                    "worker %s registered again from %s; its earlier registration %s (%s, %s, %.1fs silent) is dropped",
                    name,
                    address,
                    row.worker_id,
                    row.address,
                    row.state,
                    silent_s,
                )
                retired.append((row, f"registered again from {address}; its earlier registration is dropped"))
            elif row.state == "gone" and any(row.worker_id in r.worker_ids for r in self._runners.values()):
                retired.append((row, f"was declared gone and registered again from {address}"))
        return retired

    @rpc_errors
    def Heartbeat(self, request: cpb.HeartbeatRequest, context: grpc.ServicerContext) -> cpb.HeartbeatResponse:
        from fusion.errors import NotFoundError

        try:
            row = self.store.worker(request.worker_id)
        except NotFoundError:
            return cpb.HeartbeatResponse(known=False)
        self._check_worker(context, request.worker_id)
        if row.state == "gone":
            return cpb.HeartbeatResponse(known=False)
        return cpb.HeartbeatResponse(known=self.store.heartbeat(request.worker_id))

    @rpc_errors
    def Deregister(self, request: cpb.DeregisterRequest, context: grpc.ServicerContext) -> cpb.DeregisterResponse:
        self._check_worker(context, request.worker_id)
        row = self.store.worker(request.worker_id)
        if row.state == "gone":
            # A stale call (a worker frozen or cut off past the timeout, stopped before it
            # registered again): its jobs already recovered without it; nothing changes.
            raise StateError(
                f"worker {row.name} ({request.worker_id}) is no longer registered: it was declared gone "
                "(no heartbeat within the timeout), so there is nothing to deregister"
            )
        reason = request.reason or "deregistered"
        with self._lock:
            runners = [r for r in self._runners.values() if request.worker_id in r.worker_ids]
        # A worker that leaves cleanly hands its state off first: its jobs move it elsewhere
        # at their next step boundary, and only then is it let go.
        with self._lock:
            self._departing.add(request.worker_id)
        try:
            handed = all(r.worker_leaving(request.worker_id).wait(HANDOFF_TIMEOUT_S) for r in runners)
        finally:
            with self._lock:
                self._departing.discard(request.worker_id)
        self.store.set_worker_state(request.worker_id, "gone")
        logger.info("worker %s left: %s", row.name, reason)
        if not handed:
            self._fail_jobs_of(
                request.worker_id, f"worker {row.name} ({row.address}) left before its state was handed off: {reason}"
            )
        return cpb.DeregisterResponse()

    @rpc_errors
    def ListWorkers(self, request: cpb.ListWorkersRequest, context: grpc.ServicerContext) -> cpb.ListWorkersResponse:
        self._check_owner(context)
        now = time.time()
        out = cpb.ListWorkersResponse()
        for w in self.store.workers():
            info = out.workers.add(
                worker_id=w.worker_id,
                name=w.name,
                address=w.address,
                state=w.state,
                last_heartbeat_age_s=now - w.last_heartbeat,
                job_id=w.job_id or "",
            )
            from google.protobuf.json_format import ParseDict

            ParseDict(w.resources, info.resources, ignore_unknown_fields=True)
        return out

    # ------------------------------------------------------------- jobs
    @rpc_errors
    def SubmitJob(self, request: cpb.SubmitJobRequest, context: grpc.ServicerContext) -> cpb.SubmitJobResponse:
        self._check_owner(context)
        spec = JobSpec.from_json(request.spec_json)
        validate_job(spec)
        job_id = f"job-{uuid.uuid4().hex[:8]}"
        output_dir = str(_create_output_dir(Path(spec.output.dir).expanduser().resolve() / job_id))
        self.store.add_job(
            job_id=job_id,
            name=spec.name,
            spec_json=spec.to_json(indent=None),
            steps=spec.train.steps,
            output_dir=output_dir,
        )
        logger.info("job %s (%s) submitted", job_id, spec.name)
        self._wake.set()
        return cpb.SubmitJobResponse(job_id=job_id)

    @rpc_errors
    def GetJob(self, request: cpb.GetJobRequest, context: grpc.ServicerContext) -> cpb.GetJobResponse:
        self._check_owner(context)
        return cpb.GetJobResponse(status_json=json.dumps(self.status(self.store.job(request.job_id))))

    @rpc_errors
    def ListJobs(self, request: cpb.ListJobsRequest, context: grpc.ServicerContext) -> cpb.ListJobsResponse:
        self._check_owner(context)
        jobs = list(reversed(self.store.jobs()))
        return cpb.ListJobsResponse(status_json=[json.dumps(self.status(j, events=False)) for j in jobs])

    @rpc_errors
    def CancelJob(self, request: cpb.CancelJobRequest, context: grpc.ServicerContext) -> cpb.CancelJobResponse:
        self._check_owner(context)
        job = self.store.job(request.job_id)
        if job.state in TERMINAL_STATES:
            raise StateError(f"job {job.job_id} already {job.state}; nothing to cancel")
        with self._lock:
            runner = self._runners.get(job.job_id)
            if runner is None:
                self.store.transition(job.job_id, "cancelled", "cancelled by the job owner")
                return cpb.CancelJobResponse(state="cancelled")
        runner.stop("cancelled", "cancelled by the job owner")
        runner.join(timeout=20)
        return cpb.CancelJobResponse(state=self.store.job(job.job_id).state)

    @rpc_errors
    def GetLogs(self, request: cpb.GetLogsRequest, context: grpc.ServicerContext) -> cpb.GetLogsResponse:
        self._check_owner(context)
        self.store.job(request.job_id)  # NOT_FOUND for unknown ids
        records = self.store.log_records(request.job_id, after_seq=request.after_seq)
        lines = [_log_line(ts, kind, rec) for _, ts, kind, rec in records]
        last = records[-1][0] if records else request.after_seq
        return cpb.GetLogsResponse(lines=lines, last_seq=last)

    @rpc_errors
    def GetProfile(self, request: cpb.GetProfileRequest, context: grpc.ServicerContext) -> cpb.GetProfileResponse:
        """The model profile a job was planned with (job owners: the token). ``NOT_FOUND``
        until the job has been measured, and for jobs planned before this coordinator
        process started."""
        from fusion.errors import NotFoundError

        self._check_owner(context)
        self.store.job(request.job_id)  # NOT_FOUND for unknown ids
        with self._lock:
            view = self._job_profiles.get(request.job_id)
        profile = view.profile if view is not None else None
        if profile is None:
            raise NotFoundError(
                f"job {request.job_id} has no profile here yet: a job is profiled when it starts, "
                "and profiles are kept only while the coordinator runs"
            )
        return cpb.GetProfileResponse(
            nodes=[
                cpb.NodeProfile(
                    name=name,
                    forward_s=float(costs.get("fwd_time_s", 0.0)),
                    backward_s=float(costs.get("bwd_time_s", 0.0)),
                    saved_bytes=float(costs.get("saved_bytes", 0.0)),
                )
                for name, costs in profile.nodes.items()
            ],
            compute_factor=profile.compute_factor or 0.0,
            matmul_flops=profile.matmul_flops,
            optimizer_s_per_byte=profile.optimizer_s_per_byte,
            device_name=profile.device_name,
            overhead_step_s=profile.overhead_step_s or 0.0,
            overhead_micro_batch_s=profile.overhead_micro_batch_s or 0.0,
            calibrated=profile.compute_factor is not None and profile.overhead_step_s is not None,
        )

    @stream_errors
    def FetchOutputs(
        self, request: cpb.FetchOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[cpb.FetchOutputsResponse]:
        """A job's output files, chunked and digested (job owners: the token; ``fusion fetch``)."""
        self._check_owner(context)
        yield from stream_outputs(self.store.job(request.job_id), checkpoint=request.checkpoint)

    @rpc_errors
    def ProfileWorkers(
        self, request: cpb.ProfileWorkersRequest, context: grpc.ServicerContext
    ) -> cpb.ProfileWorkersResponse:
        """``fusion profile [--check]`` on the idle workers, run here: only the coordinator can
        sign executor calls with the workers' control keys. The workers are held (``busy``)
        for the duration so that no job starts on them meanwhile."""
        from fusion.coordinator.planning import Endpoint
        from fusion.coordinator.profile_check import profile_report
        from fusion.errors import RemoteError, StateError

        self._check_owner(context)
        spec = JobSpec.from_json(request.spec_json)
        validate_job(spec)
        hold = f"profile-{uuid.uuid4().hex[:8]}"
        with self._lock:
            if self._stop.is_set():
                raise StateError("the coordinator is shutting down")
            idle = self.store.workers("idle")
            if request.max_workers:
                idle = idle[: request.max_workers]
            if not idle:
                raise StateError("no idle workers: start some with fusion-worker, or wait for running jobs to end")
            for w in idle:
                self.store.set_worker_state(w.worker_id, "busy", hold)
        endpoints = [Endpoint.from_registration(w.name, w.address, w.resources) for w in idle]
        logger.info(
            "profiling %s on %d worker(s)%s", spec.name, len(endpoints), " with --check" if request.check else ""
        )
        try:
            doc = profile_report(
                spec,
                endpoints,
                pool=self.pool,
                check=request.check,
                steps=request.steps or 5,
                device=request.device or self.device,
            )
        except RemoteError as e:  # a worker failed, not the coordinator: not UNAVAILABLE (which clients retry)
            raise StateError(f"profiling on the workers failed: {e}") from e
        finally:
            with self._lock:
                for w in idle:
                    row = self.store.worker(w.worker_id)
                    if row.state == "busy" and row.job_id == hold:
                        self.store.set_worker_state(w.worker_id, "idle")
            self._wake.set()
        return cpb.ProfileWorkersResponse(result_json=json.dumps(doc))

    def status(self, job: JobRow, *, events: bool = True) -> dict[str, Any]:
        """The ``fusion status --json`` document of a job.

        ``waiting``: what a pending job waits for, in one line (``None`` otherwise);
        ``phase``: the planning step a job is in (``profiling``, ``probing links`` …; ``None``
        outside planning), ``phase_elapsed_s`` how long it has been in it."""
        with self._lock:
            runner = self._runners.get(job.job_id)
        return job_status(self.store, job, events=events, phase=runner.phase() if runner is not None else None)

    # ------------------------------------------------------------- background
    def _background(self) -> None:
        while not self._stop.is_set():
            try:
                self._reap_silent_workers()
                self._start_pending_jobs()
            except Exception:
                logger.exception("coordinator background loop failed; continuing")
            self._wake.wait(timeout=self.heartbeat_interval_s)
            self._wake.clear()

    def _reap_silent_workers(self) -> None:
        now = time.time()
        with self._lock:
            departing = set(self._departing)
        for w in self.store.workers("idle", "busy"):
            silent_s = now - w.last_heartbeat
            if silent_s <= self.heartbeat_timeout_s:
                continue
            if w.worker_id in departing and answering([w.address], self.pool, (1.0,))[0]:
                continue  # waiting in Deregister for its hand-off, and answering: not lost
            self.store.set_worker_state(w.worker_id, "gone")
            logger.warning("worker %s (%s) stopped heart-beating %.1fs ago; declared gone", w.name, w.address, silent_s)
            self._fail_jobs_of(
                w.worker_id,
                f"worker {w.name} ({w.address}) stopped heart-beating ({silent_s:.1f}s without a heartbeat)",
            )

    def _fail_jobs_of(self, worker_id: str, reason: str) -> None:
        """Tell the jobs using a worker that it is gone; they recover without it."""
        with self._lock:
            runners = [r for r in self._runners.values() if worker_id in r.worker_ids]
        for r in runners:
            r.worker_lost(worker_id, reason)

    def _claim_idle(self, runner: JobRunner) -> list[WorkerRow]:
        """Idle workers for a running job (late joiners), unless a pending job waits for them;
        a job that waits for workers itself (pending, its runner alive) takes them."""
        with self._lock:
            pending = self.store.jobs("pending")
            waiting = any(j.job_id == runner.job_id for j in pending)
            if self._stop.is_set() or (pending and not waiting):
                return []
            # A worker back under a name the job still holds (its old row, gone) waits
            # until the job has let the old row go: a plan never sees one name twice.
            held = {w.name for w in list(runner.workers)}
            idle = [w for w in self.store.workers("idle") if w.name not in held]
            for w in idle:
                self.store.set_worker_state(w.worker_id, "busy", runner.job_id)
            return idle

    def _release(self, runner: JobRunner, worker: WorkerRow, state: str) -> None:
        """A job let a worker go: ``gone`` (lost or left), ``excluded`` (poisoned) or ``idle``."""
        with self._lock:
            row = self.store.worker(worker.worker_id)
            if row.state in ("busy", "idle") or state == "excluded":
                self.store.set_worker_state(worker.worker_id, state, None)
        if state == "excluded":
            logger.warning("worker %s (%s) excluded by job %s", worker.name, worker.address, runner.job_id)

    def _start_pending_jobs(self) -> None:
        """Start pending jobs, oldest first, while enough idle workers exist; each job that
        still waits says what for (:meth:`Store.set_waiting`)."""
        with self._lock:
            pending = self.store.jobs("pending")
            for k, job in enumerate(pending):
                if job.job_id in self._runners:
                    # It waits for memory in its runner (which set its ``waiting``), and goes first.
                    for later in pending[k + 1 :]:
                        self._say_waiting(later, f"the job ahead of it ({job.job_id}) to resume first")
                    return
                idle = self.store.workers("idle")
                spec = JobSpec.from_json(job.spec_json)
                if len(idle) < spec.cluster.min_workers:
                    # Oldest first: a later job does not overtake one that waits for workers.
                    self._say_waiting(job, waiting_for_workers(spec.cluster.min_workers, self.store.workers()))
                    for later in pending[k + 1 :]:
                        self._say_waiting(later, f"the job ahead of it ({job.job_id}) to start first")
                    return
                for w in idle:
                    self.store.set_worker_state(w.worker_id, "busy", job.job_id)
                runner = JobRunner(
                    store=self.store,
                    job_id=job.job_id,
                    spec=spec,
                    workers=idle,
                    output_dir=job.output_dir,
                    pool=self.pool,
                    on_done=self._job_done,
                    device=self.device,
                    profiles=self._job_profiles.setdefault(job.job_id, JobProfileCache(self.profiles)),
                    links=self.links,
                    claim_idle=self._claim_idle,
                    release=self._release,
                    calibrate_s=self.calibrate_s,
                )
                self._runners[job.job_id] = runner
                runner.start()

    def _say_waiting(self, job: JobRow, text: str) -> None:
        if job.waiting != text:
            self.store.set_waiting(job.job_id, text)
            logger.info("job %s waits for %s", job.job_id, text)

    def _job_done(self, runner: JobRunner) -> None:
        with self._lock:
            self._runners.pop(runner.job_id, None)
            for w in runner.workers:
                row = self.store.worker(w.worker_id)
                if row.state == "busy" and row.job_id == runner.job_id:
                    self.store.set_worker_state(w.worker_id, "idle")
        logger.info("job %s ended: %s", runner.job_id, self.store.job(runner.job_id).state)
        self._wake.set()


def waiting_for_workers(min_workers: int, workers: list[WorkerRow]) -> str:
    """What a job that needs ``min_workers`` idle workers waits for, given every registered
    worker, e.g. ``1 more idle worker: 2 of 3 idle (min_workers = 3), 1 busy with job-1a2b``."""
    idle = sum(w.state == "idle" for w in workers)
    missing = min_workers - idle
    parts = [f"{idle} of {min_workers} idle (min_workers = {min_workers})"]
    busy: dict[str, int] = {}
    for w in workers:
        if w.state == "busy":
            busy[w.job_id or "?"] = busy.get(w.job_id or "?", 0) + 1
    for job_id, n in busy.items():
        doing = "profiling" if job_id.startswith("profile-") else f"with {job_id}"
        parts.append(f"{n} busy {doing}")
    excluded = sum(w.state == "excluded" for w in workers)
    if excluded:
        parts.append(f"{excluded} excluded")
    if not any(w.state in ("idle", "busy") for w in workers):
        parts.append("no worker is connected")
    return f"{missing} more idle worker{'s' if missing != 1 else ''}: " + ", ".join(parts)


def _create_output_dir(path: Path) -> Path:
    """Create a job's output directory at submit, so a directory the coordinator cannot
    write is refused to the submitter at once rather than found when the job starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output.dir: cannot create {path} on the coordinator ({e.strerror or e}); "
            "choose a directory the coordinator's user can write"
        ) from e
    return path


def _log_line(ts: float, kind: str, record: dict[str, Any]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    if kind == "metric":
        extra = f" tokens/s {record['tokens_per_s']:.0f}" if "tokens_per_s" in record else ""
        return (
            f"{stamp} step {record['step'] + 1}: loss {record['loss']:.4f}, {record['step_s']:.3f}s, "
            f"samples/s {record['samples_per_s']:.1f}{extra}"
        )
    return f"{stamp} {record.get('event', kind)}: {record.get('message', '')}"


#: Longest text a worker may report about itself (names, devices, its machine).
MAX_LABEL_CHARS = 255


def coordinator_handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """The Coordinator's methods, with requests that do not parse answered INVALID_ARGUMENT
    (gRPC's own deserialisation failure would say INTERNAL)."""
    from google.protobuf import message_factory

    from executor.access import Malformed, lenient

    desc = cpb.DESCRIPTOR.services_by_name["Coordinator"]
    handlers = {}
    for method in desc.methods:
        fn = getattr(service, method.name)

        def checked(request: Any, context: grpc.ServicerContext, fn: Any = fn, name: str = method.name) -> Any:
            if isinstance(request, Malformed):
                error = service.malformed(context, WireError(f"malformed {name} request: {request.reason}"))
                if isinstance(error, WireError):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                context.abort(status_code_of(error), f"{type(error).__name__}: {error}")
            return fn(request, context)

        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            checked,
            request_deserializer=lenient(message_factory.GetMessageClass(method.input_type).FromString),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(desc.full_name, handlers)


def start_coordinator_server(
    service: CoordinatorService, host: str, port: int, *, tls: ServerTls | None = None
) -> tuple[grpc.Server, int]:
    """Serve ``service`` on ``host:port`` (port 0 picks a free one), with TLS when given."""
    server, bound, _ = open_server(coordinator_handler(service), host, port, tls=tls)
    service.start()
    return server, bound

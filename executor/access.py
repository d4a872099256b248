"""Who may call which Executor RPC, checked before a handler reads its request.

Every call must carry a ``fusion-auth`` credential (:mod:`fusion.auth`) proving one of:

- the worker's **control key** (only the coordinator, or whoever started a bare executor,
  holds it): every RPC;
- the **job key** of the job the request names: ``Send`` and ``SendWhole`` (peers deliver
  activations and gradients) and RPCs this table does not list (new job-scoped RPCs: the
  request's ``job_id`` must match the key's job);
- a **probe key** the coordinator handed out for this worker: ``Probe`` and ``ProbeWhole`` only.
  Probe keys derive from the control key; when the worker registers again (a new control
  key: it was frozen or cut off past the heartbeat timeout) the probe keys its peers got
  from the old one stay valid until they expire (:data:`~fusion.auth.PROBE_KEY_TTL_S`): a
  link measurement under way when the worker woke must not fail for a key it could not know
  was replaced. They still reach nothing but ``Probe``.

The credential is checked first (a parse and an HMAC: cheap), and a call that proves a key
is served whatever its source address did before. Only failing calls (no credential, a
forged, stale, replayed or wrong-scheme one) are counted per source address
(:class:`~fusion.auth.RateLimiter`, a bounded table); once a source's failures exhaust its
budget, its failing calls are answered ``RESOURCE_EXHAUSTED`` naming the address instead of
``UNAUTHENTICATED``. Nobody sharing an address with a worker's peers (a NAT, a campus) can
lock them out by failing. A request that does not parse and carries no valid credential
fails authentication first, so it is counted too.

A call must have a deadline no longer than :data:`MAX_CALL_S`, and one credential may hold
at most ``max_streams_per_peer`` streaming calls at once from one address: a slow or silent
peer cannot pin the server's threads for ever, and only authenticated calls hold a slot. A
request that does not parse is answered ``INVALID_ARGUMENT`` (gRPC's own deserialisation
failure would say ``INTERNAL``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from fusion.auth import (
    PROBE_KEY_TTL_S,
    PROBE_METHODS,
    SCHEME_CONTROL,
    SCHEME_JOB,
    SCHEME_PROBE,
    SEND_METHODS,
    Claim,
    KeyRing,
    NonceCache,
    RateLimiter,
    metadata_value,
    parse,
    peer_host,
    probe_key,
    unwrap_job_key,
    verify,
)
from fusion.errors import AuthError, RateLimitError, StateError, WireError

logger = logging.getLogger(__name__)

#: Longest deadline a call may ask for: a transfer of the 8 GiB limit at 8 Mbps.
MAX_CALL_S = 3 * 3600.0

#: Replaced job keys remembered per job, and jobs remembered, to name a stale call as such.
RETIRED_KEYS_PER_JOB = 4
RETIRED_JOBS = 64
#: Replaced control keys whose probe keys are still honoured (:meth:`ExecutorAccess.set_control_key`).
RETIRED_CONTROL_KEYS = 4

#: Credentials each RPC accepts; unlisted RPCs accept the control key or the job key.
POLICY: dict[str, frozenset[str]] = {
    **{
        m: frozenset({SCHEME_CONTROL})
        for m in (
            "LoadStage",
            "SetState",
            "GetState",
            "RunStep",
            "WaitStep",
            "SyncTied",
            "ApplyStep",
            "Abort",
            "UnloadJob",
            "Ping",
            "ProfileModel",
            "ProbeLinks",
            "AdmitJob",
        )
    },
    **{m: frozenset({SCHEME_JOB, SCHEME_CONTROL}) for m in SEND_METHODS},
    **{m: frozenset({SCHEME_PROBE, SCHEME_CONTROL}) for m in PROBE_METHODS},
}
DEFAULT_POLICY = frozenset({SCHEME_CONTROL, SCHEME_JOB})


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request (or chunk) that did not deserialise."""

    reason: str


def lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserialiser that returns :class:`Malformed` instead of raising."""

    def run(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # protobuf's DecodeError, WireError from parse_chunk, ...
            return Malformed(f"{type(e).__name__}: {e}")

    return run


@dataclass(frozen=True)
class Principal:
    """Who an authenticated call is from: a credential scheme and its scope."""

    scheme: str
    scope: str


class ExecutorAccess:
    """The executor's keys, replay cache and limits."""

    def __init__(
        self,
        *,
        keyring: KeyRing,
        control_key: bytes | None = None,
        failure_burst: float = 30.0,
        failures_per_s: float = 0.5,
        max_streams_per_peer: int = 64,
    ) -> None:
        self.keyring = keyring
        self._control_key = control_key
        self.nonces = NonceCache()
        self.failures = RateLimiter(burst=failure_burst, per_s=failures_per_s)
        self.max_streams_per_peer = max_streams_per_peer
        self._streams: dict[tuple[str, str, str], int] = {}
        #: Job id -> keys of its replaced placements, newest last (:meth:`_stale`).
        self._retired: dict[str, list[bytes]] = {}
        #: Replaced control keys, oldest first, with when they were replaced (time.time()).
        self._retired_control: list[tuple[bytes, float]] = []
        self._lock = threading.Lock()
        self.num_refused = 0

    def set_control_key(self, key: bytes | None) -> None:
        """Install (or replace, after re-registering) the worker's control key.

        A replaced key keeps verifying probe credentials for :data:`~fusion.auth.PROBE_KEY_TTL_S`
        (the longest a probe key derived from it lives), and nothing else."""
        now = time.time()
        with self._lock:
            old = self._control_key
            if old is not None and old != key:
                kept = [(k, t) for k, t in self._retired_control if t + PROBE_KEY_TTL_S > now and k != key]
                self._retired_control = [*kept, (old, now)][-RETIRED_CONTROL_KEYS:]
            self._control_key = key

    def _probe_keys(self, expiry: int) -> list[bytes]:
        """Probe keys valid for a credential of ``expiry``: the current control key's, then
        those of replaced control keys retired less than :data:`~fusion.auth.PROBE_KEY_TTL_S` ago."""
        now = time.time()
        with self._lock:
            controls = [self._control_key] if self._control_key is not None else []
            controls += [k for k, t in reversed(self._retired_control) if t + PROBE_KEY_TTL_S > now]
        return [probe_key(control, expiry) for control in controls]

    @property
    def control_key(self) -> bytes | None:
        with self._lock:
            return self._control_key

    def add_job(self, job_id: str, wrapped: str) -> None:
        """Accept the job key delivered (wrapped) in a LoadStage request."""
        control = self.control_key
        if control is None:
            raise AuthError("this executor has no control key yet")
        key = unwrap_job_key(control, wrapped)
        existing = self.keyring.job(job_id)
        if existing is not None and existing != key:
            logger.info("job %s gets a new job key", job_id)
            self._retire(job_id, existing)
        self.keyring.set_job(job_id, key)

    def drop_job(self, job_id: str) -> None:
        existing = self.keyring.job(job_id)
        if existing is not None:
            self._retire(job_id, existing)
        self.keyring.drop_job(job_id)

    def _retire(self, job_id: str, key: bytes) -> None:
        """Remember a replaced job key: each placement of a job has its own (the driver's), so
        a call signed with an old one comes from a stage of a placement that was replaced."""
        with self._lock:
            keys = self._retired.pop(job_id, [])
            self._retired[job_id] = [k for k in keys if k != key][-(RETIRED_KEYS_PER_JOB - 1) :] + [key]
            while len(self._retired) > RETIRED_JOBS:
                self._retired.pop(next(iter(self._retired)))

    def retired_keys(self, job_id: str) -> list[bytes]:
        """The replaced job keys of ``job_id`` this executor remembers, oldest first."""
        with self._lock:
            return list(self._retired.get(job_id, ()))

    def _stale(self, claim: Claim, method: str) -> bool:
        """Whether a job credential that failed was signed with a replaced key of its job."""
        with self._lock:
            keys = list(self._retired.get(claim.scope, ()))
        for key in keys:
            try:
                verify(claim, key, method=method, nonces=self.nonces)
            except AuthError:
                continue
            return True
        return False

    # ------------------------------------------------------------- checks
    def _key_for(self, claim: Claim) -> bytes:
        if claim.scheme == SCHEME_CONTROL:
            key = self.control_key
            if key is None:
                raise AuthError("this executor has no control key yet (not registered with a coordinator)")
            return key
        if claim.scheme == SCHEME_JOB:
            key = self.keyring.job(claim.scope)
            if key is None:
                raise AuthError(f"no job {claim.scope!r} is loaded here; its job key is unknown")
            return key
        if self.control_key is None:
            raise AuthError("this executor has no control key yet")
        if not claim.scope.isdigit() or int(claim.scope) < time.time():
            raise AuthError("probe key expired")
        return probe_key(self.control_key, int(claim.scope))

    def _verify(self, claim: Claim, method: str) -> None:
        """Check ``claim`` against the key its scheme names; a probe credential may also
        prove a probe key of a recently replaced control key (:meth:`set_control_key`)."""
        key = self._key_for(claim)
        if claim.scheme != SCHEME_PROBE:
            verify(claim, key, method=method, nonces=self.nonces)
            return
        first: AuthError | None = None
        for candidate in self._probe_keys(int(claim.scope)):
            try:
                verify(claim, candidate, method=method, nonces=self.nonces)  # a wrong MAC records no nonce
                return
            except AuthError as e:
                first = first or e
        raise first or AuthError(f"wrong probe credential for {method}")

    def authenticate(self, method: str, context: grpc.ServicerContext) -> Principal:
        """Check the call's credential and deadline; ``AuthError``/``WireError`` otherwise, or
        ``RateLimitError`` (naming the address) for a failure from a source over its budget.

        A valid credential is accepted whatever the source's count of failures."""
        try:
            claim = parse(metadata_value(context.invocation_metadata()))
            allowed = POLICY.get(method, DEFAULT_POLICY)
            if claim.scheme not in allowed:
                raise AuthError(
                    f"{method} does not accept a {claim.scheme} credential (needs {'/'.join(sorted(allowed))})"
                )
            try:
                self._verify(claim, method)
            except AuthError as e:
                if claim.scheme == SCHEME_JOB and self._stale(claim, method):
                    # Not a forgery (not counted against the address): a stage of a replaced
                    # placement (its worker frozen or cut off past the heartbeat timeout, or
                    # a re-plan it missed) still sending. Refused; the current one is untouched.
                    raise StateError(
                        f"stale {method} for job {claim.scope!r}: it is signed with the job key of a placement "
                        "that was replaced (the sender missed a re-plan, e.g. it was frozen or cut off past the "
                        "heartbeat timeout); refused, the current placement is unchanged"
                    ) from e
                raise
        except AuthError as e:
            with self._lock:
                self.num_refused += 1
            host = peer_host(context.peer() or "")
            if self.failures.allow(host):
                raise
            raise RateLimitError(
                f"too many failed authentications from {host} ({e}); this address's failing calls are refused "
                "for a while, calls with a valid credential are still served"
            ) from e
        remaining = context.time_remaining()
        if remaining is None or remaining > MAX_CALL_S:
            raise WireError(f"{method} needs a deadline of at most {MAX_CALL_S:.0f}s")
        return Principal(scheme=claim.scheme, scope=claim.scope)

    @staticmethod
    def check_scope(principal: Principal, method: str, job_id: str | None) -> None:
        """A job credential only reaches its own job."""
        if principal.scheme != SCHEME_JOB:
            return
        if job_id is None:
            raise AuthError(f"{method} names no job; a job credential cannot call it")
        if job_id != principal.scope:
            raise AuthError(f"a credential of job {principal.scope!r} cannot reach job {job_id!r}")

    def stream_slot(self, host: str, principal: Principal) -> _StreamSlot:
        """A slot for one streaming call of ``principal`` from ``host``; a credential's
        streams do not count against another's (the coordinator's control streams and each
        job's peers have their own bounds, even behind one address)."""
        return _StreamSlot(self, host, principal)


class _StreamSlot:
    """Counts one streaming call of a credential from one address; refuses past the bound."""

    def __init__(self, access: ExecutorAccess, host: str, principal: Principal) -> None:
        self.access = access
        self.host = host
        self.principal = principal
        self._key = (host, principal.scheme, principal.scope)

    def __enter__(self) -> None:
        with self.access._lock:
            n = self.access._streams.get(self._key, 0)
            if n >= self.access.max_streams_per_peer:
                raise RateLimitError(
                    f"{self.host} already has {n} streaming calls open with this {self.principal.scheme} credential "
                    f"(at most {self.access.max_streams_per_peer}); wait for them to end"
                )
            self.access._streams[self._key] = n + 1

    def __exit__(self, *exc: object) -> None:
        with self.access._lock:
            n = self.access._streams.get(self._key, 1) - 1
            if n <= 0:
                self.access._streams.pop(self._key, None)
            else:
                self.access._streams[self._key] = n


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    if isinstance(error, RateLimitError):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{type(error).__name__}: {error}")
    if isinstance(error, AuthError):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"AuthError: {error}")
    if isinstance(error, StateError):  # a stale call of a replaced placement
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"StateError: {error}")
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(error).__name__}: {error}")


def job_id_of(item: Any) -> str | None:
    """The job a request or stream chunk names: its ``job_id``, or that of its ``header``
    (tensor chunks) or ``info`` (snapshot chunks); ``None`` if it names none."""
    for obj in (item, getattr(item, "header", None), getattr(item, "info", None)):
        if obj is None:
            continue
        try:
            return str(obj.job_id)
        except AttributeError:
            continue
    return None


def _checked_chunks(chunks: Iterator[Any], principal: Principal, method: str) -> Iterator[Any]:
    """Pass chunks through; a malformed one or a header of another job ends the stream."""
    first = True
    for chunk in chunks:
        if isinstance(chunk, Malformed):
            raise WireError(f"malformed chunk: {chunk.reason}")
        if first:
            ExecutorAccess.check_scope(principal, method, job_id_of(chunk))
            first = False
        yield chunk


def guard(method: str, fn: Callable[..., Any], access: ExecutorAccess, *, client_streaming: bool) -> Callable[..., Any]:
    """Wrap a servicer method with the access checks."""
    if client_streaming:

        def stream_handler(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                principal = access.authenticate(method, context)
                slot = access.stream_slot(peer_host(context.peer() or ""), principal)
                slot.__enter__()
            except (AuthError, RateLimitError, StateError, WireError) as e:
                _abort(context, e)
            try:
                return fn(_checked_chunks(request_iterator, principal, method), context)
            finally:
                slot.__exit__()

        return stream_handler

    def unary_handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            principal = access.authenticate(method, context)
            if isinstance(request, Malformed):
                raise WireError(f"malformed {method} request: {request.reason}")
            access.check_scope(principal, method, job_id_of(request))
        except (AuthError, RateLimitError, StateError, WireError) as e:
            _abort(context, e)
        return fn(request, context)

    return unary_handler

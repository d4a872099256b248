"""Errors across gRPC: fusion errors → status codes at the server, codes → errors at the client.

Servers wrap every handler with :func:`rpc_errors`, so a bad request gets a status code
and a message that names the problem, and the server thread survives. Clients call through
:func:`call_with_retry`, which sets a deadline on every call, retries only what is
retryable (the peer is unreachable for a moment) with exponential backoff, and raises
:class:`~fusion.errors.RemoteError` carrying the code and the peer otherwise.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from fusion.errors import (
    AuthError,
    CheckpointError,
    ConfigError,
    FusionError,
    GraphExportError,
    MemoryCapError,
    NotFoundError,
    PlanError,
    PoisonedInputError,
    RateLimitError,
    RemoteError,
    SplitError,
    StageError,
    StateError,
    WireError,
)

logger = logging.getLogger(__name__)

_CODES: list[tuple[type[FusionError], grpc.StatusCode]] = [
    (RateLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryCapError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (CheckpointError, grpc.StatusCode.DATA_LOSS),
    (WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (PoisonedInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (GraphExportError, grpc.StatusCode.FAILED_PRECONDITION),
    (SplitError, grpc.StatusCode.FAILED_PRECONDITION),
    (PlanError, grpc.StatusCode.FAILED_PRECONDITION),
    (StateError, grpc.StatusCode.FAILED_PRECONDITION),
    (StageError, grpc.StatusCode.INTERNAL),
    (RemoteError, grpc.StatusCode.UNAVAILABLE),
]

#: Trailing metadata naming the stage that sent a tensor a stage rejected as poisoned.
POISONED_SENDER_METADATA = "fusion-poisoned-sender"

#: Trailing metadata of a stage refused for memory: JSON of the :class:`MemoryCapError`'s fields.
MEMORY_CAP_METADATA = "fusion-memory-cap"

_CAP_FIELDS = ("worker", "stage_idx", "needed_bytes", "cap_bytes", "planned_bytes", "measured", "job_id")


def memory_cap_error(e: BaseException) -> MemoryCapError | None:
    """The :class:`MemoryCapError` a remote stage answered with (its trailing metadata), if any."""
    if isinstance(e, MemoryCapError):
        return e
    text = e.metadata.get(MEMORY_CAP_METADATA) if isinstance(e, RemoteError) else None
    if not text:
        return None
    try:
        fields = json.loads(text)
        return MemoryCapError(
            worker=str(fields["worker"]),
            stage_idx=int(fields["stage_idx"]),
            needed_bytes=int(fields["needed_bytes"]),
            cap_bytes=int(fields["cap_bytes"]),
            planned_bytes=int(fields.get("planned_bytes", 0)),
            measured=bool(fields.get("measured", False)),
            job_id=str(fields.get("job_id", "")),
        )
    except (ValueError, KeyError, TypeError) as bad:
        logger.warning("malformed %s metadata %r: %s", MEMORY_CAP_METADATA, text[:200], bad)
        return None


#: Codes worth retrying: the peer may be back in a moment.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})

F = TypeVar("F", bound=Callable[..., Any])


def status_code_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised while serving."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def rpc_errors(method: F) -> F:
    """Decorate a servicer method: map exceptions to status codes, never kill the server.

    Fusion errors are expected (bad input, unknown ids) and logged at INFO; anything else
    is a bug and is logged with its traceback before answering ``INTERNAL``.
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except FusionError as e:
            code = status_code_of(e)
            logger.info("%s refused: %s (%s)", method.__name__, e, code.name)
            if isinstance(e, PoisonedInputError):
                context.set_trailing_metadata(((POISONED_SENDER_METADATA, str(e.sender_stage)),))
            if isinstance(e, MemoryCapError):
                fields = {k: getattr(e, k) for k in _CAP_FIELDS}
                context.set_trailing_metadata(((MEMORY_CAP_METADATA, json.dumps(fields)),))
            context.abort(code, f"{type(e).__name__}: {e}")
        except Exception as e:
            if isinstance(e, grpc.RpcError) and hasattr(context, "_state") and context.code() is not None:
                raise  # already aborted by context.abort
            logger.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper  # type: ignore[return-value]


def remote_error(e: grpc.RpcError, *, peer: str, what: str) -> RemoteError:
    """Turn a gRPC failure into a :class:`RemoteError` naming the peer and the call."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    name = code.name if code is not None else None
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    metadata = {str(k): v if isinstance(v, str) else bytes(v).decode(errors="replace") for k, v in (trailing or ())}
    return RemoteError(f"{what} on {peer} failed with {name}: {details}", code=name, peer=peer, metadata=metadata)


def call_with_retry(
    fn: Callable[..., Any],
    request: Any,
    *,
    peer: str,
    what: str,
    timeout_s: float,
    attempts: int = 4,
    backoff_s: float = 0.2,
    retry_on: frozenset[grpc.StatusCode] = RETRYABLE,
) -> Any:
    """Call a unary or stream-unary stub method with a deadline and bounded retries.

    ``request`` may be a zero-argument callable returning a fresh request iterator, for
    client-streaming calls that must be replayed from the start on retry.
    """
    for attempt in range(attempts):
        try:
            req = request() if callable(request) else request
            return fn(req, timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code in retry_on and attempt + 1 < attempts:
                delay = backoff_s * (2**attempt)
                logger.debug("%s on %s: %s, retrying in %.2fs", what, peer, code, delay)
                time.sleep(delay)
                continue
            raise remote_error(e, peer=peer, what=what) from None
        except ValueError as e:  # grpc's "Cannot invoke RPC on closed channel!": the caller abandoned the peer
            if "closed channel" not in str(e):
                raise
            raise RemoteError(f"{what} on {peer}: abandoned ({e})", code="CANCELLED", peer=peer) from None
    raise AssertionError("unreachable")

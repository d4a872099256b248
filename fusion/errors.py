"""One error tree for fusion.

Every error a user can see derives from :class:`FusionError`. Messages say what failed,
the likely cause and what to change. Servers map these to gRPC status codes
(:mod:`executor.status`) and clients map the codes back, so a caller catches the same
types whether the failure happened locally or on a remote worker.
"""

from __future__ import annotations


class FusionError(Exception):
    """Base class of every error fusion raises on purpose."""


class ConfigError(FusionError):
    """A job file, model spec, data spec or command-line value is invalid."""


class GraphExportError(FusionError):
    """A model could not be captured as an OP-DAG (neither torch.fx nor torch.export)."""


class SplitError(FusionError):
    """A node-to-stage assignment cannot be turned into runnable stages (e.g. it is cyclic)."""


class PlanError(FusionError):
    """A plan is malformed, or no plan satisfies the constraints."""


class WireError(FusionError):
    """A message received from the network is malformed or does not match what is expected."""


class CompressionError(WireError):
    """Encoded tensor bytes are malformed or do not match their declared codec."""


class RemoteError(FusionError):
    """A remote peer answered with an error, or could not be reached.

    Attributes:
        code: the gRPC status code name (e.g. ``"UNAVAILABLE"``), or ``None`` if unknown.
        peer: the address of the peer, when known.
        metadata: trailing metadata of the failed call (structured details, e.g. which
            stage sent a poisoned tensor).
    """

    def __init__(
        self, message: str, *, code: str | None = None, peer: str | None = None, metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.peer = peer
        self.metadata = dict(metadata or {})


class StageError(FusionError):
    """A stage failed while computing (forward, backward or optimizer step)."""


class NotFoundError(FusionError):
    """A request names a job, stage, micro-batch or tensor that does not exist."""


class StateError(FusionError):
    """A request does not fit the current state (wrong step, stage not loaded, job aborted)."""


class CheckpointError(FusionError):
    """A snapshot or checkpoint is corrupt, incomplete, or does not belong to the stage it is
    restored into; it is never loaded."""


class AuthError(FusionError):
    """A peer did not prove it belongs to the job (wrong or missing token)."""


class RateLimitError(FusionError):
    """A peer sent too many requests (registrations, failed authentications, open streams)."""


class PoisonedInputError(FusionError):
    """A stage rejected an incoming activation or gradient: NaN/Inf, or a norm far outside
    the running statistics of its link. The sender is suspect; the coordinator may exclude it.

    Attributes:
        sender_stage: index of the stage that sent the tensor.
        reason: what was wrong with it.
        address: the sending worker's address, when known.
    """

    def __init__(self, sender_stage: int, reason: str, *, address: str | None = None) -> None:
        where = f" ({address})" if address else ""
        super().__init__(f"stage {sender_stage}{where} sent a poisoned tensor: {reason}")
        self.sender_stage = sender_stage
        self.reason = reason
        self.address = address

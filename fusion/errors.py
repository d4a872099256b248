"""One error tree for fusion.

Every error a user can see derives from :class:`FusionError`. Messages say what failed,
the likely cause and what to change. Servers map these to gRPC status codes
(:mod:`executor.status`) and clients map the codes back, so a caller catches the same
types whether the failure happened locally or on a remote worker.
"""

from __future__ import annotations

from fusion.memory import format_bytes


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


class InsufficientMemoryError(PlanError):
    """The workers cannot hold the job: what it needs against what they lend.

    Attributes:
        needed_bytes: the least memory the job needs (its parameters, gradients, optimizer
            state and activations), or more where the cuts fragment it.
        lent_bytes: the memory the workers planned over lend, in total.
        num_workers: how many workers lend it.
    """

    def __init__(self, message: str, *, needed_bytes: int, lent_bytes: int, num_workers: int) -> None:
        super().__init__(message)
        self.needed_bytes = int(needed_bytes)
        self.lent_bytes = int(lent_bytes)
        self.num_workers = int(num_workers)


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


class MemoryCapError(FusionError):
    """A stage does not fit the memory its worker lends (``fusion-worker --memory-gb``):
    refused at load for its planned peak, or its step failed for its measured peak.

    Attributes:
        worker: the worker's name.
        stage_idx: the stage.
        needed_bytes: the planned or measured peak of the stage.
        cap_bytes: what the worker lends (less what its other stages hold).
        planned_bytes: the stage's planned peak (0 when unknown).
        measured: whether ``needed_bytes`` was measured while training (else planned).
    """

    def __init__(
        self,
        *,
        worker: str,
        stage_idx: int,
        needed_bytes: int,
        cap_bytes: int,
        planned_bytes: int = 0,
        measured: bool = False,
        job_id: str = "",
    ) -> None:
        what = "its step peaked at" if measured else "it is planned to need"
        job = f" of job {job_id}" if job_id else ""
        super().__init__(
            f"worker {worker or '?'} cannot hold stage {stage_idx}{job}: {what} {needed_bytes} bytes "
            f"({format_bytes(needed_bytes)}) but the worker lends {cap_bytes} bytes ({format_bytes(cap_bytes)}); "
            "plan with more workers or smaller stages, or start the worker with a larger --memory-gb"
        )
        self.worker = worker
        self.stage_idx = int(stage_idx)
        self.needed_bytes = int(needed_bytes)
        self.cap_bytes = int(cap_bytes)
        self.planned_bytes = int(planned_bytes)
        self.measured = measured
        self.job_id = job_id

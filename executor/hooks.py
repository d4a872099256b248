"""Seams of the executor: a compute hook per stage and a channel factory.

The executor computes and sends; whoever starts it may wrap it with these seams to
observe or change how (``testbeds.worker`` stretches computations to stand in for slower
devices and routes traffic through link proxies; ``tests.support`` corrupts what a stage
sends):

- :class:`StageHooks`: called when a stage is loaded, around each forward and backward
  computation of a micro-batch, and on the tensors a stage is about to send. The defaults
  do nothing and cost one method call each.
- :data:`ChannelFactory`: how a :class:`~executor.client.ChannelPool` dials a peer
  (:func:`default_channel`: a plain gRPC channel, TLS when the process has a CA).

Both are passed to :class:`executor.server.ExecutorService` and :class:`fusion.worker.Worker`
as ``hooks=`` and ``channel_factory=``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import grpc
import torch

from fusion.tls import open_channel

logger = logging.getLogger(__name__)

#: The two computations of a micro-batch on a stage.
FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class StageInfo:
    """A loaded stage, as hooks see it."""

    job_id: str
    stage_idx: int
    nodes: tuple[str, ...]
    """The DAG nodes the stage computes (names as in the job's OpDag), in its order."""
    worker_name: str = ""
    """The name of the worker hosting it (``ExecutorService.worker_name``)."""


class StageHooks:
    """Calls the executor makes around a stage's work; every default does nothing.

    Contract for subclasses:

    - :meth:`stage_loaded` runs in the LoadStage handler before the stage is built. It may
      look things up (e.g. the job's profile from its coordinator) and raise a
      :class:`~fusion.errors.FusionError` to refuse the stage; the caller gets that error.
    - :meth:`compute` wraps exactly one forward (the stage module and the loss) or one
      backward (``torch.autograd.backward``) of one micro-batch, on the stage's compute
      thread. Time spent inside the context, including anything the hook adds when it
      exits (a sleep), is reported as the stage's compute time (``WaitStep.compute_s``).
      It must not touch the tensors: the numbers stay those of plain PyTorch.
    - :meth:`outgoing` sees the activations (``kind`` :data:`FORWARD`) or input gradients
      (``kind`` :data:`BACKWARD`) a stage is about to send to one destination stage, after
      the computation and before compression, and returns what is sent instead (the same
      mapping when it changes nothing). Scalars are not passed.

    Hooks are shared by every stage of a worker and are called from several threads (one
    compute thread per stage, gRPC handler threads): keep per-stage state keyed by
    ``(stage.job_id, stage.stage_idx)`` behind a lock.
    """

    def stage_loaded(self, stage: StageInfo) -> None:
        """A stage is about to be built on this worker."""

    def compute(self, stage: StageInfo, kind: str, step: int, micro_batch_idx: int) -> AbstractContextManager[None]:
        """A context around one computation (``kind``: :data:`FORWARD` or :data:`BACKWARD`)."""
        return contextlib.nullcontext()

    def outgoing(
        self, stage: StageInfo, kind: str, step: int, dst_stage_idx: int, tensors: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """The tensors to send to ``dst_stage_idx`` in place of ``tensors``."""
        return tensors


#: Dials a peer: ``(address, options, tls_ca) -> channel``. ``address`` is the peer's
#: ``HOST:PORT`` as the plan names it; ``options`` the gRPC channel options the pool needs
#: (message sizes); ``tls_ca`` the pool's CA bundle (``None``: the process's, if any). The
#: channel must reach the peer at ``address`` (a factory may route it elsewhere, e.g. to a
#: link proxy that forwards to it) and honour the options and the CA.
ChannelFactory = Callable[[str, Sequence[tuple[str, int | str]], bytes | None], grpc.Channel]


def default_channel(address: str, options: Sequence[tuple[str, int | str]], tls_ca: bytes | None) -> grpc.Channel:
    """The product's channel: straight to ``address``, TLS when a CA is given or set."""
    return open_channel(address, options=options, ca=tls_ca)

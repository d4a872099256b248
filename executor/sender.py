"""A stage's sends to its peers: asynchronous, in order per destination, paced by the link.

Waiting for each transfer's answer before the next leaves a link idle for a round trip per
transfer: on a 20 ms link a 32 KB activation took 23 ms to arrive and 23 ms more to be
answered, so a pipeline over it moved one micro-batch per 46 ms each way however fast its
stages were (a traced two-sites run). Where the coordinator measured the link's bandwidth
(``LoadStageRequest.link_bytes_per_s``), transfers to that destination are instead *paced*:
each may start once the bytes of the one before it should have left at that rate,
``start_{i+1} = max(ready_{i+1}, start_i + bytes_i / bandwidth)``, with up to
:data:`SEND_WINDOW` in flight. The bytes then follow each other on the wire in order, as one
stream's would, and the latency overlaps. Pacing rather than sending everything at once:
gRPC multiplexes concurrent calls on one HTTP/2 connection, and large messages sent
together share the link, so each arrives late (four 256 KB messages started at once on an
8 Mbps link all arrived at the end: the second after 1.13 s instead of 0.55 s).

The schedule follows the transfers' real starts, and a paced transfer also starts once
the one before it is answered, if that comes first: an answer back means its bytes have
left. So a bandwidth measured too low (a probe taken while the link was congested, a
volunteer's line that got faster since) never makes a stage slower than one transfer at a
time would be.

Where no bandwidth is known (a bare executor, the local test cluster), a destination gets
one transfer at a time, each until its answer: the safe order on any link.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.client import ChannelPool, ExecutorClient
from executor.stream_client import DataPlaneClient
from executor.trace import tracer
from fusion.errors import NotFoundError
from fusion.wire import tensor_pb2 as pb

#: Most transfers in flight to one destination over a paced link (each holds a thread
#: until its answer: a 150 ms link at 10 Gbps moves many small transfers per round trip).
SEND_WINDOW = 16


@dataclass
class _Paced:
    """One transfer on a paced link, for the one after it to start by."""

    size: int
    left: threading.Event = field(default_factory=threading.Event)
    left_at: float = 0.0
    """When it started (monotonic), once ``left`` is set."""
    answered: Future[tuple[int, float]] | None = None


class PeerSender:
    """Ordered, asynchronous sends from one stage to each destination stage.

    Args:
        job_id: the job the stage belongs to.
        addresses: the worker address of every stage.
        pool: channels (and keys) to the peers.
        link_bytes_per_s: measured bandwidth to the worker of each destination stage;
            sends to a stage listed here are paced at it (module docstring).
        data: the direct data plane (:mod:`executor.stream_client`): a transfer goes over
            it when the destination advertised a data port, else over gRPC.
    """

    def __init__(
        self,
        job_id: str,
        addresses: Mapping[int, str],
        pool: ChannelPool,
        *,
        link_bytes_per_s: Mapping[int, float] | None = None,
        data: DataPlaneClient | None = None,
    ) -> None:
        self.job_id = job_id
        self.data = data
        self.addresses = dict(addresses)
        self.pool = pool
        self.link_bytes_per_s = {d: float(bw) for d, bw in (link_bytes_per_s or {}).items() if bw > 0}
        self._queues: dict[int, ThreadPoolExecutor] = {}
        self._last: dict[int, _Paced] = {}  # paced destinations: the transfer queued last
        self._lock = threading.Lock()

    def __call__(
        self,
        dst: int,
        header: pb.TransferHeader,
        tensors: Mapping[str, torch.Tensor],
        scalars: Mapping[str, Any],
        encoded: Mapping[str, tuple[pb.TensorMeta, bytes]],
    ) -> Future[tuple[int, float]]:
        """Queue one transfer to stage ``dst``; the future gives (payload bytes, seconds
        from its start to its answer)."""
        address = self.addresses.get(dst)
        if address is None:
            raise NotFoundError(f"no address known for stage {dst}")
        bandwidth = self.link_bytes_per_s.get(dst)
        with self._lock:
            queue = self._queues.get(dst)
            if queue is None:
                workers = SEND_WINDOW if bandwidth is not None else 1
                queue = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"send-to-stage{dst}")
                self._queues[dst] = queue
            before, this = None, None
            if bandwidth is not None:
                size = sum(t.numel() * t.element_size() for t in tensors.values()) + sum(
                    len(b) for _, b in encoded.values()
                )
                before, this = self._last.get(dst), _Paced(size)
                self._last[dst] = this
            client = ExecutorClient(address, self.pool)
            data = self.data
            trace = tracer()

            def timed() -> tuple[int, float]:
                try:
                    if before is not None and bandwidth is not None:
                        before.left.wait()  # in order: after the one before has started
                        wait_s = before.left_at + before.size / bandwidth - time.monotonic()
                        if wait_s > 0 and before.answered is not None:  # its bytes gone, or its answer back
                            wait([before.answered], timeout=wait_s)
                finally:  # set even if the wait fails, so the one after never waits on this one forever
                    if this is not None:
                        this.left_at = time.monotonic()
                        this.left.set()
                if trace.enabled:
                    trace.event(
                        "leave",
                        job=header.job_id,
                        stage=header.src_stage_idx,
                        step=header.step,
                        kind=int(header.kind),
                        mb=header.micro_batch_idx,
                        dst=dst,
                    )
                t0 = time.perf_counter()
                sent = (
                    None
                    if data is None
                    else data.send(address, header, tensors, scalars, encoded=encoded, link_bytes_per_s=bandwidth)
                )
                if sent is None:
                    sent = client.send(header, tensors, scalars, encoded=encoded)
                return sent, time.perf_counter() - t0

            future = queue.submit(timed)
            if this is not None:
                this.answered = future  # under the lock: set before the next transfer can look
            return future

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.shutdown(wait=False, cancel_futures=True)
            self._queues.clear()
            self._last.clear()

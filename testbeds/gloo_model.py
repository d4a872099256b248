"""How long gloo takes: the all-reduce DDP runs and GPipe's point-to-point pipeline.

Pure functions of a topology and sizes, used by :mod:`testbeds.simulate` to price the
baselines. Both follow gloo's TCP transport as measured on the testbeds: a sender waits
for the receiver's ready notice before it sends (``NOTIFY_RECV_READY`` in its pair), so
what a transfer costs depends on how early the receive was posted: early in the ring
all-reduce (two segments in flight, latency hidden behind bytes), late in
``torch.distributed.pipelining`` (a receive is posted when the stage needs it, so every
micro-batch pays the round trip).
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.topology import Topology

#: One iteration of gloo's ring beyond the link's latency and bytes (its bookkeeping).
GLOO_STEP_OVERHEAD_S = 1e-4
#: DDP's gradient buckets: the first holds 1 MiB, the rest 25 MiB (``bucket_cap_mb``).
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


def ring_allreduce_s(topology: Topology, ranks: list[int], size_bytes: float) -> float:
    """Seconds of gloo's ring all-reduce of ``size_bytes`` over ``ranks`` (``gloo/allreduce.cc``).

    Rank ``r`` sends to rank ``r - 1``. The input is cut into ``2N`` segments of ``s`` bytes;
    reduce-scatter and all-gather each take ``2N - 2`` iterations with two segments in
    flight: the segment posted at one iteration must have arrived two iterations later, and
    gloo's sender waits for the receiver's ready notice before it sends (its TCP pair's
    ``NOTIFY_RECV_READY``), so a segment takes a round trip plus its bytes. On the worst
    ring edge an iteration lasts

        t = max(s / bw, (rtt + s / bw) / 2) + o,    T = 2 (2N − 2) · t

    A large all-reduce is bandwidth-bound (the latency hides behind the other segment in
    flight); a small one costs ``2 (N − 1)`` round trips. Measured on the two-sites testbed
    (4 ranks, 100 Mbps and 40 ms round trips across): 0.26 / 0.27 / 0.37 / 0.50 s for
    0.25 / 1 / 2.4 / 4 MB, against 0.26 / 0.30 / 0.39 / 0.48 s from this formula, with
    ``1.5 x`` the size crossing each ring edge as ``tc`` counted.
    """
    n = len(ranks)
    if n < 2 or size_bytes <= 0:
        return 0.0
    segment = size_bytes / (2 * n)
    ring = [(ranks[i], ranks[i - 1]) for i in range(n)]
    per_iteration = max(
        max(segment / topology.bandwidth_bytes_per_s[a][b], (topology.latency_s[a][b] + topology.latency_s[b][a] + segment / topology.bandwidth_bytes_per_s[a][b]) / 2)
        for a, b in ring
    )
    return 2 * (2 * n - 2) * (per_iteration + GLOO_STEP_OVERHEAD_S)


def ddp_buckets(param_bytes: float) -> int:
    """Gradient buckets DDP makes for ``param_bytes`` of parameters."""
    rest = max(0.0, param_bytes - DDP_FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / DDP_BUCKET_BYTES)


def gpipe_step_s(
    f: np.ndarray, b: np.ndarray, x: np.ndarray, g: np.ndarray, micro_batches: int, *,
    x_latency: np.ndarray | None = None, g_latency: np.ndarray | None = None, rendezvous: bool = False,
) -> float:
    """GPipe's step on a chain: every stage runs all its forwards, then all its backwards.

    ``f_s``, ``b_s``: a stage's seconds per micro-batch; ``x_j``, ``g_j``: seconds to move one
    micro-batch's activations over cut ``j`` (stage ``j`` → ``j + 1``) and its gradients back,
    latency included; ``x_latency``, ``g_latency``: those latencies (default 0), so that a
    cut carries one transfer's bytes at a time while latencies overlap. Event by event:
    stage ``s`` starts micro-batch ``i`` once it has finished ``i - 1`` and ``i``'s input
    has arrived. Without latencies this is the closed form

        T = Σ f + Σ x + (M − 1) · max(f, x)  +  Σ b + Σ g + (M − 1) · max(b, g)

    ``rendezvous``: gloo's sender waits for the receiver's ready notice before it sends
    (``NOTIFY_RECV_READY`` in its TCP pair), and ``torch.distributed.pipelining`` posts a
    receive only when the stage is about to need it, so a transfer leaves at
    ``max(sender done, receiver ready + the latency back)``: every micro-batch pays the
    cut's round trip, which no amount of pipelining hides.
    """
    m, n = micro_batches, len(f)
    zeros = np.zeros(max(n - 1, 0))
    x_lat = zeros if x_latency is None else x_latency
    g_lat = zeros if g_latency is None else g_latency

    def wave(cost: np.ndarray, order: list[int], cut_s: list[float], lat: list[float], back: list[float], start: list[float]) -> list[float]:
        """One wave through ``order``; ``cut_s[k]``/``lat[k]``/``back[k]`` price the hop into
        ``order[k + 1]``. Returns each stage's finish time (in ``order``)."""
        prev_done: list[float] = []
        finish = []
        for k, s in enumerate(order):
            done, depart = [], -math.inf
            ready = start[k]
            for i in range(m):
                if k == 0:
                    begin = ready
                else:
                    notice = ready + back[k - 1] if rendezvous else -math.inf
                    depart = max(prev_done[i], notice, depart + cut_s[k - 1] - lat[k - 1])
                    begin = max(ready, depart + cut_s[k - 1])
                ready = begin + float(cost[s])
                done.append(ready)
            prev_done = done
            finish.append(ready)
        return finish

    fwd_order = list(range(n))
    fwd_done = wave(f, fwd_order, list(x), list(x_lat), list(g_lat), [0.0] * n)
    bwd_order = fwd_order[::-1]
    bwd_done = wave(b, bwd_order, list(g[::-1]), list(g_lat[::-1]), list(x_lat[::-1]), fwd_done[::-1])
    return float(max(bwd_done))

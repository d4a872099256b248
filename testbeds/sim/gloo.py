"""How long gloo takes: the all-reduce DDP runs (bucket by bucket, step after step) and
GPipe's point-to-point pipeline.

Pure functions of a topology and sizes, used by :mod:`testbeds.sim.simulate` to price the
baselines. Both follow gloo's TCP transport as measured on the testbeds: a sender waits
for the receiver's ready notice before it sends (``NOTIFY_RECV_READY`` in its pair), so
what a transfer costs depends on how early the receive was posted: early in the ring
all-reduce (two segments in flight, latency hidden behind bytes), late in
``torch.distributed.pipelining`` (a receive is posted when the stage needs it, so every
micro-batch pays the round trip).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from scheduler.estimator import Workload
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
        max(
            segment / topology.bandwidth_bytes_per_s[a][b],
            (topology.latency_s[a][b] + topology.latency_s[b][a] + segment / topology.bandwidth_bytes_per_s[a][b]) / 2,
        )
        for a, b in ring
    )
    return 2 * (2 * n - 2) * (per_iteration + GLOO_STEP_OVERHEAD_S)


def ddp_buckets(param_bytes: float) -> int:
    """Gradient buckets DDP makes for ``param_bytes`` of parameters."""
    rest = max(0.0, param_bytes - DDP_FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / DDP_BUCKET_BYTES)


def gpipe_step_s(
    f: np.ndarray,
    b: np.ndarray,
    x: np.ndarray,
    g: np.ndarray,
    micro_batches: int,
    *,
    x_latency: np.ndarray | None = None,
    g_latency: np.ndarray | None = None,
    rendezvous: bool = False,
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

    def wave(
        cost: np.ndarray, order: list[int], cut_s: list[float], lat: list[float], back: list[float], start: list[float]
    ) -> list[float]:
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


#: ProcessGroupGloo's worker threads (its ``Options.threads`` default): DDP's bucket
#: all-reduces run on these, two at a time, in the order DDP issued them.
GLOO_THREADS = 2
#: Message events above which :func:`bucket_allreduce_done_s` is not replayed (a 256- or
#: 1,024-rank ring with tens of buckets): :func:`ring_allreduce_s` prices those instead.
MAX_REPLAY_MESSAGES = 400_000


def ddp_bucket_params(param_bytes: list[float]) -> list[list[int]]:
    """DDP's buckets over parameters in registration order (``param_bytes[i]``: parameter
    ``i``): filled from the last parameter backwards, the first closed once it holds 1 MiB,
    the rest at 25 MiB (``_compute_bucket_assignment_by_size``). Lists of parameter indices,
    in the order DDP all-reduces them."""
    buckets: list[list[int]] = [[]]
    size, limit = 0.0, DDP_FIRST_BUCKET_BYTES
    for i in reversed(range(len(param_bytes))):
        buckets[-1].append(i)
        size += param_bytes[i]
        if size >= limit:
            buckets.append([])
            size, limit = 0.0, DDP_BUCKET_BYTES
    return [b for b in buckets if b]


def _split(size_bytes: float, n: int, element: int = 4) -> tuple[int, int, int]:
    """gloo's ring split of ``size_bytes`` over ``n`` ranks (``allreduce.cc``): (bytes
    rounded to whole elements, segment bytes, segments: at least ``2n``, a multiple of ``n``)."""
    total = max(element, int(size_bytes) // element * element)
    seg = min((total + 2 * n - 1) // (2 * n), 1 << 20)
    seg = (seg + element - 1) // element * element
    num = max((total + seg - 1) // seg, 2 * n)
    return total, seg, (num + n - 1) // n * n


def _segments(size_bytes: float, n: int) -> tuple[int, list[list[float]], list[list[float]]]:
    """:func:`_split`'s segment count and, per rank and iteration, the bytes sent in
    reduce-scatter and in all-gather (0: nothing)."""
    total, seg, num = _split(size_bytes, n)
    per_rank = num // n

    def length(first: int, i: int) -> float:
        return float(max(0, min(seg, total - ((first * per_rank + i) * seg) % (num * seg))))

    scatter = [[length(r + 1, i) for i in range(num)] for r in range(n)]
    gather = [[length(r, i) for i in range(num)] for r in range(n)]
    return num, scatter, gather


def bucket_allreduce_done_s(
    topology: Topology, ranks: list[int], bucket_bytes: list[float], ready_s: list[list[float]]
) -> list[float]:
    """When each rank's last bucket all-reduce ends, replayed message by message.

    ``bucket_bytes[b]``: bucket ``b``'s size; ``ready_s[b][k]``: when rank ``ranks[k]``
    handed it to gloo (its gradients ready). Each bucket runs gloo's ring (``allreduce.cc``:
    ``2N``-segment reduce-scatter then all-gather, two segments in flight, an iteration
    waiting for the segment received and sent two iterations before) on one of the rank's
    :data:`GLOO_THREADS` threads. A send leaves once the receiver's ready notice has come
    back (``NOTIFY_RECV_READY``), and a pair's messages share its link first come, first
    served. So a rank whose gradients are ready early sends what it already has while a
    slower rank computes, and two buckets' bytes fill each other's gaps: what the closed
    form (:func:`ring_allreduce_s`) cannot show when the ranks start apart.
    """
    n = len(ranks)
    if n < 2 or not bucket_bytes:
        return [max((r[k] for r in ready_s), default=0.0) for k in range(n)]
    plans = [_segments(size, n) for size in bucket_bytes]
    bw, lat = topology.bandwidth_bytes_per_s, topology.latency_s
    link_free: dict[tuple[int, int], float] = {}
    known: dict[tuple, float] = {}
    waiting: dict[tuple, list[tuple[int, int]]] = {}
    cursor: dict[tuple[int, int], list[int]] = {}  # (bucket, rank) -> [phase, iteration]
    done = [[0.0] * n for _ in bucket_bytes]
    events: list[tuple[float, int, tuple]] = []
    seq = 0

    def push(t: float, event: tuple) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, event))
        seq += 1

    def start(b: int, k: int) -> None:
        begin = ready_s[b][k] if b < GLOO_THREADS else max(ready_s[b][k], done[b - GLOO_THREADS][k])
        cursor[(b, k)] = [0, 0]
        push(begin, ("advance", b, k))

    def settle(key: tuple, t: float) -> None:
        known[key] = t
        for b, k in waiting.pop(key, []):
            push(t, ("advance", b, k))

    for b in range(min(GLOO_THREADS, len(bucket_bytes))):
        for k in range(n):
            start(b, k)
    while events:
        now, _, event = heapq.heappop(events)
        kind = event[0]
        if kind == "advance":
            _, b, k = event
            num, scatter, gather = plans[b]
            phase, i = cursor[(b, k)]
            lengths = (scatter, gather)[phase]
            if i >= 2:
                needs = []
                if lengths[(k + 1) % n][i - 2] > 0:
                    needs.append(("arrive", b, phase, k, i - 2))
                if lengths[k][i - 2] > 0:
                    needs.append(("sent", b, phase, k, i - 2))
                missing = [key for key in needs if key not in known]
                if missing:
                    waiting.setdefault(missing[0], []).append((b, k))
                    continue
            if i < num - 2:
                up = (k + 1) % n  # the rank this one receives from: it waits for our notice
                if lengths[up][i] > 0:
                    push(now + lat[ranks[k]][ranks[up]], ("notice", b, phase, up, i))
                if lengths[k][i] > 0:
                    settle(("posted", b, phase, k, i), now)
                    if ("notice", b, phase, k, i) in known:
                        push(now, ("depart", b, phase, k, i))
            i += 1
            if i == num and phase == 0:
                phase, i = 1, 0
            if i == num:
                done[b][k] = now
                if b + GLOO_THREADS < len(bucket_bytes):
                    start(b + GLOO_THREADS, k)
                continue
            cursor[(b, k)] = [phase, i]
            push(now + GLOO_STEP_OVERHEAD_S, ("advance", b, k))
        elif kind == "notice":
            known[event] = now
            if ("posted",) + event[1:] in known:
                push(now, ("depart",) + event[1:])
        elif kind == "depart":
            _, b, phase, k, i = event
            size = (plans[b][1], plans[b][2])[phase][k][i]
            src, dst = ranks[k], ranks[(k - 1) % n]
            begin = max(now, link_free.get((src, dst), 0.0))
            end = begin + size / bw[src][dst]
            link_free[(src, dst)] = end
            push(end, ("sent", b, phase, k, i))
            push(
                max(end + lat[src][dst], begin + topology.transfer_s(src, dst, size)),
                ("arrive", b, phase, (k - 1) % n, i),
            )
        else:  # sent / arrive: the value is known from now on
            settle(event, now)
    return [max(done[b][k] for b in range(len(bucket_bytes))) for k in range(n)]


def replay_messages(n: int, bucket_bytes: list[float]) -> int:
    """Messages :func:`bucket_allreduce_done_s` replays (its cost)."""
    return sum(2 * n * _split(size, n)[2] for size in bucket_bytes)


def broadcast_done_s(topology: Topology, ranks: list[int], size_bytes: float, start_s: list[float]) -> list[float]:
    """When each rank's gloo broadcast from ``ranks[0]`` returns (``broadcast.cc``), each
    rank entering it at ``start_s[k]``.

    A binomial tree: in round ``i`` every rank that has the data sends it to the rank ``2^i``
    further on (virtual ranks), which posted its receive when it entered (it does nothing
    before its one receive). A send leaves once that notice is in and the sender has the
    data; a rank returns when it has received and all its sends are written. DDP runs one
    before every forward to copy rank 0's module buffers (BatchNorm's statistics) to the
    others, so its ranks leave it no earlier than a notice from the slowest-starting rank
    they send to can come back.
    """
    n = len(ranks)
    have = [math.inf] * n  # when each rank holds the data
    have[0] = start_s[0]
    end = list(start_s)
    bw, lat = topology.bandwidth_bytes_per_s, topology.latency_s
    for i in range(math.ceil(math.log2(n)) if n > 1 else 0):
        for src in range(1 << i):
            dst = src + (1 << i)
            if dst >= n:
                continue
            a, b = ranks[src], ranks[dst]
            depart = max(have[src], start_s[dst] + lat[b][a])
            have[dst] = depart + topology.transfer_s(a, b, size_bytes)
            end[src] = max(end[src], depart + size_bytes / bw[a][b])
            end[dst] = max(end[dst], have[dst])
    return end


def ddp_bucket_ready_s(wl: Workload) -> list[tuple[float, float]]:
    """DDP's buckets for ``wl``'s parameters: (bytes, seconds into one micro-batch's forward
    and backward at reference speed when the last of its gradients is ready). A parameter's
    gradient is complete once the backward has passed the first unit that reads it (tied
    parameters: their first reader), and parameters are in the order units first read them."""
    sizes: dict[int, float] = {}
    first: dict[int, int] = {}
    for u, unit in enumerate(wl.params):
        for pid, size in unit:
            sizes.setdefault(pid, float(size))
            first.setdefault(pid, u)
    order = sorted(sizes)
    done_at = float(wl.fwd_s.sum()) + np.cumsum(wl.bwd_s[::-1])[::-1]  # the backward has finished unit u
    return [
        (sum(sizes[order[i]] for i in bucket), max(float(done_at[first[order[i]]]) for i in bucket))
        for bucket in ddp_bucket_params([sizes[p] for p in order])
    ]


#: Steps of DDP the replay runs from a common start: each rank starts the next step when
#: its own all-reduce and optimizer step are done, so the ranks drift apart by a step's
#: skew and the period settles after one or two.
DDP_REPLAY_STEPS = 4


def ddp_replay_step_s(
    topology: Topology, ready: list[tuple[float, float]], scale: list[float], optimizer_s: float, buffer_bytes: int
) -> float:
    """Rank 0's step (what the DDP baseline times), replayed over :data:`DDP_REPLAY_STEPS`
    steps: the module's buffers broadcast from rank 0 as each rank enters its forward
    (:func:`broadcast_done_s`; DDP's ``broadcast_buffers``, when the
    model has any), each bucket handed to gloo ``ready[b][1] * scale[k]`` later on rank
    ``k`` and all-reduced (:func:`bucket_allreduce_done_s`), then the
    optimizer step. The median of rank 0's periods after the first step."""
    n = len(scale)
    ranks = list(range(n))
    end = [0.0] * n
    periods = []
    for _ in range(DDP_REPLAY_STEPS):
        start = broadcast_done_s(topology, ranks, buffer_bytes, end) if buffer_bytes else end
        done = bucket_allreduce_done_s(
            topology, ranks, [b for b, _ in ready], [[start[k] + t * scale[k] for k in ranks] for _, t in ready]
        )
        following = [d + optimizer_s for d in done]
        periods.append(following[0] - end[0])
        end = following
    return float(np.median(periods[1:])) if len(periods) > 1 else periods[0]

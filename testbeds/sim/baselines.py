"""The simulator's price of the gloo baselines: DDP (every host holds the model, gradients
ring all-reduced bucket by bucket) and GPipe (``torch.distributed.pipelining`` over the even
block split), with the models of gloo's messages in :mod:`testbeds.sim.gloo`."""

from __future__ import annotations

import numpy as np

from scheduler.estimator import OPTIMIZER_STATE_FACTOR, estimate
from scheduler.topology import GIB, Topology, WorkerSpec
from testbeds.sim.block_split import split_stages
from testbeds.sim.costs import JobCosts, SystemResult, slowest_link, with_throughput
from testbeds.sim.gloo import (
    DDP_REPLAY_STEPS,
    MAX_REPLAY_MESSAGES,
    ddp_bucket_ready_s,
    ddp_buckets,
    ddp_replay_step_s,
    gpipe_step_s,
    replay_messages,
    ring_allreduce_s,
)
from testbeds.sim.topologies import shared_cores_factor


def simulate_ddp(
    job: JobCosts, topology: Topology, *, cores: int | None = None, emulation: str = "wall"
) -> SystemResult:
    """Every host holds the model and runs ``B / N`` samples; gradients are ring all-reduced.

    ``cores``: on a one-machine testbed all ``N`` ranks compute at once on that many cores
    (one thread each), so compute takes ``max(1, N / cores)`` times longer
    (:func:`shared_cores_factor`, which counts a rank emulating a slower device by its share).
    ``emulation``: ``profile`` (:mod:`testbeds.emulation`): an emulated rank computes as
    here, that factor included, then sleeps ``slowdown - 1`` times the profile.
    """
    spec = job.spec
    n = len(topology)
    batch, mb = spec.data.batch_size, spec.micro_batch_size
    if batch < n:
        return SystemResult(name="ddp", step_s=None, note=f"n/a: batch {batch} < {n} ranks")
    wl = job.workload()
    per_mb_s = float(wl.fwd_s.sum() + wl.bwd_s.sum())  # whole model, one micro-batch, at reference speed
    per_rank_samples = batch / n
    param_bytes = float(wl.total_param_bytes)
    one = estimate(wl, np.zeros(len(wl), dtype=np.int64), [0], topology, micro_batches=1)
    factor = 2.0 + OPTIMIZER_STATE_FACTOR[wl.optimizer]
    activations = max(0.0, one.peak_memory_bytes[0] - factor * param_bytes) * per_rank_samples / mb
    need = factor * param_bytes + activations
    short = [w.name for w in topology.workers if w.memory_bytes is not None and need > w.memory_bytes]
    if short:
        return SystemResult(
            name="ddp", step_s=None, note=f"n/a: the whole model needs {need / GIB:.1f} GiB, more than {short[0]} has"
        )
    cores_factor = shared_cores_factor(topology.workers, cores)
    samples = per_rank_samples / mb  # micro-batches' worth of samples each rank computes
    scale = [_emulated_scale(job.reference_flops, w, cores_factor, emulation) * samples for w in topology.workers]
    compute_s = per_mb_s * max(scale)
    ready = ddp_bucket_ready_s(wl)
    buckets = len(ready) or ddp_buckets(param_bytes)
    # The optimizer step is not emulated (testbeds.emulation stretches forward and backward only).
    optimizer_s = (
        wl.step.optimizer_s_per_byte * param_bytes * job.reference_flops / min(w.flops for w in topology.workers)
    )
    if ready and DDP_REPLAY_STEPS * replay_messages(n, [size for size, _ in ready]) <= MAX_REPLAY_MESSAGES:
        step_s = ddp_replay_step_s(topology, ready, scale, optimizer_s, job.buffer_bytes)
        allreduce_s, model = step_s - compute_s - optimizer_s, "replay"
    else:
        # Too long to replay: one all-reduce of the whole gradient after the backward.
        allreduce_s, model = ring_allreduce_s(topology, list(range(n)), param_bytes), "closed form"
        step_s = compute_s + allreduce_s + optimizer_s
    ring_bytes = {(i, (i - 1) % n): 2 * (n - 1) / n * param_bytes for i in range(n)} if n > 1 else {}
    slow_bytes, slow_mbps = slowest_link(topology, ring_bytes)
    return with_throughput(
        SystemResult(
            name="ddp",
            step_s=step_s,
            slowest_link_bytes=slow_bytes,
            slowest_link_mbps=slow_mbps,
            hosts_used=n,
            detail={
                "compute_s": compute_s,
                "allreduce_s": allreduce_s,
                "optimizer_s": optimizer_s,
                "buckets": buckets,
                "allreduce_model": model,
                "buffer_bytes": job.buffer_bytes,
            },
        ),
        job,
    )


def gpipe_stages(job: JobCosts, num_stages: int) -> np.ndarray:
    """Stage of every compute unit under the even block split (:mod:`testbeds.sim.block_split`)."""

    paths = [node.module_path for node in job.dag.compute_nodes()]
    return np.array(split_stages(job.blocks, paths, num_stages), dtype=np.int64)


def _emulated_scale(reference_flops: float, w: WorkerSpec, contention: float, emulation: str) -> float:
    """Seconds per profiled second of a worker's compute on a testbed whose ranks share
    cores (``contention``): under ``wall`` emulation the whole stretched computation pays it,
    under ``profile`` only the part on the core, the sleep being ``slowdown - 1`` times the
    profile (:mod:`testbeds.emulation`)."""
    if emulation == "profile":
        return reference_flops / w.flops * contention + (w.slowdown - 1.0)
    return reference_flops / w.effective_flops * contention


def simulate_pipelining(
    job: JobCosts, topology: Topology, *, cores: int | None = None, emulation: str = "wall"
) -> SystemResult:
    """GPipe over the first ``min(N, blocks)`` hosts with the even split.

    ``cores``: the ranks share that many cores (one-machine testbed). In GPipe's steady state
    every stage computes at once, one micro-batch each, so with ``S`` ranks on fewer cores
    every stage computes ``S / cores`` times slower. Not because waiting ranks spin: a rank
    waiting in gloo's ``recv`` or a ``batch_isend_irecv`` handle uses under 1 % of a core
    (measured here, 0.007 CPU-s per s). A rank emulating a slower device counts in full too,
    which over-prices topologies where one waits on such a rank (volunteers: +6 to +25 %
    over two sets of runs), while counting it by the share of a core it holds (as DDP's
    :func:`shared_cores_factor` does) under-prices them (-18 to -39 %): the emulation
    stretches whatever contention the slow rank's bursts meet, and how often they meet the
    others' computations moves from run to run.
    """
    spec = job.spec
    num_stages = min(len(topology), len(job.blocks))
    if num_stages < 2:
        return SystemResult(
            name="pipelining", step_s=None, note=f"n/a: the model has {len(job.blocks)} block(s), a pipeline needs 2"
        )
    unit_stage = gpipe_stages(job, num_stages)
    wl = job.workload()
    contention = max(1.0, num_stages / cores) if cores else 1.0
    scale = np.array(
        [_emulated_scale(job.reference_flops, topology.workers[s], contention, emulation) for s in range(num_stages)]
    )
    # From the node profile, each node's backward timed on its own autograd nodes: the GPipe
    # program's own stages timed in isolation were the worse price (docs/benchmarks.md).
    fwd, bwd = wl.stage_seconds(unit_stage, num_stages)
    f, b = fwd * scale, bwd * scale
    act = np.zeros(num_stages - 1)
    grad = np.zeros(num_stages - 1)
    seen: set[tuple[int, int]] = set()
    for src, dst, size, gsize in wl.edges:
        a, c = int(unit_stage[src]), int(unit_stage[dst])
        if a == c or (src, c) in seen:
            continue
        seen.add((src, c))
        # A value that skips stages is relayed by every stage in between (a chain pipeline).
        for k in range(a, c):
            act[k] += size
            grad[k] += gsize
    x = np.array([topology.transfer_s(k, k + 1, act[k]) for k in range(num_stages - 1)])
    g = np.array([topology.transfer_s(k + 1, k, grad[k]) for k in range(num_stages - 1)])
    x_lat = np.array([topology.latency_s[k][k + 1] for k in range(num_stages - 1)])
    g_lat = np.array([topology.latency_s[k + 1][k] for k in range(num_stages - 1)])
    m = spec.train.micro_batches
    step_s = gpipe_step_s(f, b, x, g, m, x_latency=x_lat, g_latency=g_lat, rendezvous=True)
    stage_params: list[dict[int, int]] = [{} for _ in range(num_stages)]
    for u, unit in enumerate(wl.params):
        for pid, size in unit:
            stage_params[unit_stage[u]][pid] = size
    param_bytes = np.array([sum(p.values()) for p in stage_params], dtype=np.float64)
    raw = np.array(
        [job.reference_flops / topology.workers[s].flops for s in range(num_stages)]
    )  # optimizer: not emulated
    step_s += wl.step.optimizer_s_per_byte * float((param_bytes * raw).max())
    holders: dict[int, list[int]] = {}
    for s, p in enumerate(stage_params):
        for pid in p:
            holders.setdefault(pid, []).append(s)
    tied = {pid: ss for pid, ss in holders.items() if len(ss) > 1}
    tied_s = sum(ring_allreduce_s(topology, ss, stage_params[ss[0]][pid]) for pid, ss in tied.items())
    step_s += tied_s
    link_bytes = {(k, k + 1): m * (act[k] + grad[k]) for k in range(num_stages - 1)}
    slow_bytes, slow_mbps = slowest_link(topology, link_bytes)
    return with_throughput(
        SystemResult(
            name="pipelining",
            step_s=step_s,
            slowest_link_bytes=slow_bytes,
            slowest_link_mbps=slow_mbps,
            hosts_used=num_stages,
            detail={"stages": topology.names()[:num_stages], "tied_sync_s": tied_s},
        ),
        job,
    )

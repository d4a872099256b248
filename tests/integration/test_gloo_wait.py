"""What the simulator's GPipe model assumes of gloo (``testbeds.sim.baselines.simulate_pipelining``):
a rank waiting for a point-to-point message sleeps, it does not spin on a core."""

from __future__ import annotations

import os
import time
from multiprocessing.queues import SimpleQueue

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAIT_S = 2.0


def _rank(rank: int, world: int, port: int, pids: SimpleQueue, usage: SimpleQueue) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.zeros(1 << 16)
    try:
        if rank == 0:
            waiting = [psutil.Process(pid) for pid in pids.get()]
            time.sleep(0.5)  # the others are in their waits by now
            before = [sum(p.cpu_times()[:2]) for p in waiting]
            time.sleep(WAIT_S)
            usage.put([(sum(p.cpu_times()[:2]) - b) / WAIT_S for p, b in zip(waiting, before, strict=True)])
            for r in range(1, world):
                dist.send(t, dst=r)
        elif rank == 1:
            dist.recv(t, src=0)
        else:  # as torch.distributed.pipelining waits for its stage's inputs
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
                work.wait()
    finally:
        dist.destroy_process_group()


@pytest.mark.quiet
@pytest.mark.timeout(120)
def test_ranks_waiting_for_a_message_leave_the_core_free(port: int) -> None:
    ctx = mp.get_context("spawn")
    pids, usage = ctx.SimpleQueue(), ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, 3, port, pids, usage)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        pids.put([p.pid for p in procs[1:]])
        cpu_s_per_s = usage.get()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    # Measured here: 0.007 CPU-s per s. A spinning wait would take most of a core.
    assert all(u < 0.2 for u in cpu_s_per_s), cpu_s_per_s

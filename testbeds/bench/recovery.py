"""Checkpoint and recovery benchmark: snapshot overhead, replica volume, time to recover.

    python -m testbeds.bench.recovery                        # GPT-2 small, both parts
    python -m testbeds.bench.recovery --preset tiny --rounds 3 --skip-recover --json

- **Snapshot overhead** (local executor processes, no coordinator): blocks of
  ``replicate_every`` steps with and without a snapshot at the block's last step
  (replicated to the next worker, paced like the coordinator paces it), interleaved and
  repeated; the median ratio of block times is the overhead. Also the replica bytes each
  snapshot streams, per training step.
- **Time to recover** (a real coordinator and ``fusion-worker`` processes on loopback): a
  job on 3 stages plus one spare; one stage's worker is SIGKILLed mid-job; the time from
  the kill to the job's ``resumed_at_step`` event, and the recovery's own duration
  (failure noticed → training resumed) as the coordinator logs it.

These machines are noisy; the overhead is measured side by side in one run and reported
as a ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKEN = "bench-recovery"


def job_spec(preset: str, steps: int, batch: int, seq: int, micro: int, replicate_every: int) -> dict[str, Any]:
    return {
        "name": f"bench-recovery-{preset}",
        "model": {"name": "gpt2", "preset": preset},
        "data": {"batch_size": batch, "seq_len": seq},
        "train": {"steps": steps, "micro_batches": micro, "optimizer": "adamw", "seed": 0},
        "checkpoint": {"replicate_every": replicate_every, "durable_every": 1_000_000},
    }


def bench_overhead(
    preset: str, workers: int, rounds: int, batch: int, seq: int, micro: int, every: int
) -> dict[str, Any]:
    from executor.driver import PipelineDriver, SnapshotRequest
    from fusion.config import JobSpec
    from fusion.graph.export import capture
    from fusion.graph.split import split_stages
    from fusion.launch.executors import LocalCluster
    from fusion.training import (
        build_job_dataset,
        build_job_model,
        example_micro_batch,
        job_batch,
    )
    from scheduler.baselines import uniform_assignment

    job = JobSpec.from_dict(job_spec(preset, 1_000_000, batch, seq, micro, every))
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    x0, y0 = example_micro_batch(job, dataset)
    captured = capture(model, (x0,))
    stages = split_stages(captured.dag, uniform_assignment(captured.dag, workers))
    with LocalCluster(workers, torch_threads=max(1, 2 // workers)) as cluster:
        driver = PipelineDriver(
            job_id="bench-recovery",
            job=job,
            model=model,
            captured=captured,
            stages=stages,
            addresses=cluster.addresses,
            example_target=y0,
        )
        driver.load()
        buddies = {i: cluster.addresses[(i + 1) % workers] for i in range(workers)}
        step = 0

        def block(snapshot: bool) -> float:
            nonlocal step
            t0 = time.perf_counter()
            for k in range(every):
                x, y = job_batch(job, dataset, step)
                req = SnapshotRequest(buddies=buddies) if snapshot and k == every - 1 else None
                driver.train_step(step, (x,), y, snapshot=req)
                step += 1
            return time.perf_counter() - t0

        block(False)  # warm-up (first steps allocate)
        block(True)
        plain, snap = [], []
        for r in range(rounds):
            for with_snapshot in (False, True) if r % 2 == 0 else (True, False):
                (snap if with_snapshot else plain).append(block(with_snapshot))
        time.sleep(1.0)
        sizes = {}
        for i in range(workers):
            for info in driver.clients[i].list_snapshots(driver.job_id):
                if not info.replica:
                    sizes[info.stage_key] = max(sizes.get(info.stage_key, 0), int(info.size_bytes))
        driver.close()
    ratios = [s / p for s, p in zip(snap, plain, strict=False)]
    replica_bytes = sum(sizes.values())
    return {
        "preset": preset,
        "workers": workers,
        "replicate_every": every,
        "rounds": rounds,
        "block_s_plain": statistics.median(plain),
        "block_s_snapshot": statistics.median(snap),
        "step_s_plain": statistics.median(plain) / every,
        "overhead": statistics.median(ratios) - 1.0,
        "snapshot_bytes": replica_bytes,
        "replica_bytes_per_step": replica_bytes / every,
    }


def bench_recover(preset: str, batch: int, seq: int, micro: int, every: int, kill_after: int) -> dict[str, Any]:
    from fusion.config import JobSpec
    from fusion.coordinator.client import CoordinatorClient
    from fusion.errors import RemoteError
    from fusion.launch import Fleet

    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        base = Path(tmp)
        spec = job_spec(preset, kill_after + 4 * every, batch, seq, micro, every)
        if kill_after <= every:
            raise SystemExit(f"--kill-after must exceed --replicate-every ({every}) so a replica exists")
        spec["plan"] = {"strategy": "uniform"}
        spec["cluster"] = {"min_workers": 4, "spares": 1}
        spec["output"] = {"dir": str(base / "out")}
        with Fleet(base / "logs") as fleet:
            fleet.start_coordinator(
                token=TOKEN, state_dir=base / "state", heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0
            )
            for i in range(4):
                fleet.start_worker(f"w{i}", token=TOKEN, wait=False)
            fleet.wait_workers([f"w{i}" for i in range(4)])
            client = CoordinatorClient(fleet.coordinator_address, TOKEN, timeout_s=30.0)
            job_id = client.submit(JobSpec.from_dict(spec))
            print(f"job {job_id}: planning (profiling {preset} on a worker)...", flush=True)
            while True:
                s = client.status(job_id)
                if s["state"] in ("failed", "cancelled", "succeeded"):
                    raise SystemExit(f"job ended before the kill: {s}")
                if s["state"] == "running" and s["step"] >= kill_after:
                    break
                time.sleep(0.05)
            victim = s["plan"]["stages"][1]["worker"]
            step_s = s["elapsed_s"] / max(1, s["step"])
            fleet.workers[victim].kill()
            killed = time.time()
            print(f"killed {victim} at step {s['step']}", flush=True)
            while True:
                s = client.status(job_id)
                events = [e for e in s["events"] if e["event"] == "resumed_at_step"]
                if events or s["state"] in ("failed", "cancelled", "succeeded"):
                    break
                time.sleep(0.05)
            if not events:
                raise SystemExit(f"job did not resume: {s}")
            resumed = events[-1]
            # Training goes on after the recovery: wait for two more steps, then stop the job.
            final = client.status(job_id)
            while final["state"] == "running" and final["step"] < resumed["step"] + 2:
                time.sleep(0.2)
                final = client.status(job_id)
            trained_on = final["state"] == "running" or final["state"] == "succeeded"
            if final["state"] == "running":
                try:
                    client.cancel(job_id)
                except RemoteError as e:  # it may have ended since its status was read
                    if e.code != "FAILED_PRECONDITION":
                        raise
            client.close()
    return {
        "preset": preset,
        "victim": victim,
        "step_s": step_s,
        "kill_to_resumed_s": resumed["time"] - killed,
        "recover_s": resumed.get("recover_s"),
        "steps_redone": resumed.get("failed_step", 0) - resumed.get("step", 0),
        "message": resumed["message"],
        "trained_on_after": trained_on,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.bench.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="GPT-2 preset (default: small, 124M)")
    parser.add_argument("--workers", type=int, default=2, help="stages for the overhead part")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved block pairs for the overhead part")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--replicate-every", type=int, default=10)
    parser.add_argument("--kill-after", type=int, default=12, help="steps done before the kill (recover part)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-recover", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out: dict[str, Any] = {}
    if not args.skip_overhead:
        out["overhead"] = bench_overhead(
            args.preset,
            args.workers,
            args.rounds,
            args.batch_size,
            args.seq_len,
            args.micro_batches,
            args.replicate_every,
        )
        if not args.json:
            print_overhead(out["overhead"])
    if not args.skip_recover:
        out["recover"] = bench_recover(
            args.preset, args.batch_size, args.seq_len, args.micro_batches, args.replicate_every, args.kill_after
        )
        if not args.json:
            print_recover(out["recover"])
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


def print_overhead(o: dict[str, Any]) -> None:
    print(
        f"\nsnapshot overhead, GPT-2 {o['preset']} on {o['workers']} local workers, "
        f"a snapshot every {o['replicate_every']} steps\n"
        f"  step time without snapshots  {o['step_s_plain']:.3f} s "
        f"(median block of {o['replicate_every']}: {o['block_s_plain']:.2f} s)\n"
        f"  block time with a snapshot   {o['block_s_snapshot']:.2f} s\n"
        f"  overhead                     {100 * o['overhead']:+.1f} %   (target <= 3 %)\n"
        f"  snapshot (all stages)        {o['snapshot_bytes'] / 1e6:.1f} MB "
        f"-> replica traffic {o['replica_bytes_per_step'] / 1e6:.1f} MB per step"
    )


def print_recover(r: dict[str, Any]) -> None:
    print(
        textwrap.dedent(f"""
        time to recover, GPT-2 {r["preset"]}, 3 stages + 1 spare, {r["victim"]} SIGKILLed (step ~{r["step_s"]:.2f} s)
          kill -> training resumed     {r["kill_to_resumed_s"]:.2f} s   (target <= 10 s)
          recovery itself              {r["recover_s"]:.2f} s
          steps redone                 {r["steps_redone"]}
          {r["message"]}
          trained on after recovery    {r["trained_on_after"]}"""),
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())

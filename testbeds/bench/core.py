"""Core benchmark: pipeline step time against one process, and tensor throughput (gRPC and
the direct data plane) against a plain TCP socket copy, measured side by side in one run.

    python -m testbeds.bench_core                      # GPT-2 small on 2 and 4 workers
    python -m testbeds.bench_core --preset tiny --steps 3 --sizes-mib 1,16 --json

Both parts interleave the systems they compare and report medians, because these machines
are noisy and absolute numbers drift between runs; the ratios are the result.

- **Transport** (:mod:`testbeds.bench.transport`): one executor process receives tensors
  through the gRPC tensor path and through its data plane; a second process receives the
  same number of bytes over a raw TCP socket into a preallocated buffer. MB/s for each
  size, each path as a fraction of the socket (``ratio``: the data plane over TCP;
  ``unix_ratio``: over its local Unix socket), a 64 KiB round trip on each, and the CPU
  each side of the data plane and of the socket spends per transfer (``cpu_per_transfer``).
- **Step time** (:func:`bench_steps`): GPT-2 trained on one process and split over K local
  worker processes, no compression: evenly by node count (``uniform``) and as fusion's
  planner balances the profiled compute (``compute``, :func:`planned_split`), the systems
  taking turns over ``--rounds`` rounds. On one host the workers share its cores, so the
  ratio measures fusion's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from testbeds.bench.transport import measure_transport, wait_until_warm

logger = logging.getLogger(__name__)


def bench_steps(
    preset: str,
    workers: list[int],
    steps: int,
    batch_size: int,
    seq_len: int,
    micro_batches: int,
    device: str,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Median step seconds: one process against the job split over K local workers, evenly
    by node count (``uniform``) and as the planner balances it (``compute``).

    The systems take turns: each of ``rounds`` rounds runs every system once for ``steps``
    steps, in an order rotated from one round to the next, so that the machine's drift
    falls on all of them alike. The executors stay up across rounds (idle while another
    system runs) and each K's planned split is made once. A system's ``step_s`` is the
    median over rounds of each run's median step (its first step is warm-up); ``ratio`` is
    the median over rounds of that run's step over the single process's step in the same
    round; ``rounds_step_s`` and ``rounds_ratio`` list the rounds in the order they ran."""
    from contextlib import ExitStack

    from fusion.config import JobSpec
    from fusion.launch.executors import LocalCluster

    job = JobSpec.from_dict(
        {
            "model": {"name": "gpt2", "preset": preset},
            "data": {"batch_size": batch_size, "seq_len": seq_len},
            "train": {
                "steps": steps,
                "micro_batches": micro_batches,
                "optimizer": "adamw",
                "lr": 3e-4,
                "schedule": "1f1b",
            },
        }
    )
    with ExitStack() as stack:
        runs: list[tuple[str, Callable[[], tuple[float, int]], int]] = [
            ("single-process", lambda: _single_process_step(job, device), 1)
        ]
        for k in workers:
            cluster = stack.enter_context(LocalCluster(k))
            wait_until_warm([p.pid for p in cluster.processes])
            splits = {"uniform": (None, None), "compute": planned_split(job, cluster.addresses, device)}
            for name, split in splits.items():
                runs.append((f"fusion-{name}-{k}", partial(_split_step, job, cluster, split, name, device), k))
        step_s: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        link_bytes: dict[str, int] = {}
        for r in range(rounds):
            turn = r % len(runs)
            for name, run, _ in runs[turn:] + runs[:turn]:
                seconds, link_bytes[name] = run()
                step_s[name].append(seconds)
    single = step_s["single-process"]
    ratios = {name: [s / one for s, one in zip(times, single, strict=True)] for name, times in step_s.items()}
    return [
        {
            "system": name,
            "workers": k,
            "step_s": round(statistics.median(step_s[name]), 3),
            "ratio": round(statistics.median(ratios[name]), 3),
            "rounds_step_s": [round(s, 3) for s in step_s[name]],
            "rounds_ratio": [round(r, 3) for r in ratios[name]],
            **({"max_link_bytes_per_step": link_bytes[name]} if k > 1 else {}),
        }
        for name, _, k in runs
    ]


def _median_after_warmup(times: list[float]) -> float:
    """The median step time, the first step (warm-up) left out unless it is the only one."""
    return statistics.median(times[1:] or times)


def _single_process_step(job: Any, device: str) -> tuple[float, int]:
    """One plain PyTorch run of ``job``: its median step (the first step left out), and the
    bytes it sends between stages (none)."""
    from fusion.training import train_reference

    times: list[float] = []
    last = time.perf_counter()

    def tick(step: int, loss: float) -> None:
        nonlocal last
        now = time.perf_counter()
        times.append(now - last)
        last = now
        print(f"  single-process step {step}: loss {loss:.4f}, {times[-1]:.2f}s", file=sys.stderr)

    train_reference(job, device=device, on_step=tick)
    return _median_after_warmup(times), 0


def _split_step(
    job: Any, cluster: Any, split: tuple[dict[str, int] | None, list[int] | None], name: str, device: str
) -> tuple[float, int]:
    """One run of ``job`` over ``cluster``'s executors with ``split`` (node -> stage and each
    stage's executor, or ``None`` for the even split): its median step (the first left out),
    and the most bytes one link carried in its last step."""
    from fusion.launch.distributed import train_distributed

    assignment, stage_workers = split
    k = cluster.num_workers
    result = train_distributed(
        job,
        cluster.addresses,
        assignment=assignment,
        stage_workers=stage_workers,
        device=device,
        on_step=lambda s: print(
            f"  {name} over {k} workers step {s.step}: loss {s.loss:.4f}, {s.step_s:.2f}s"
            f" (stage compute {', '.join(f'{c:.2f}' for _, c in sorted(s.compute_s.items()))} s)",
            file=sys.stderr,
        ),
    )
    step_s = _median_after_warmup([s.step_s for s in result.stats])
    return step_s, max((b for s in result.stats[-1:] for b in s.sent_bytes.values()), default=0)


def planned_split(job: Any, addresses: list[str], device: str) -> tuple[dict[str, int], list[int]]:
    """The stages fusion's planner gives ``job`` over the executors at ``addresses`` with the
    ``compute`` strategy (every worker used, stages balanced by the profiled compute, as the
    coordinator measures and plans a job): node -> stage, and the address index of each stage.

    An even split by node count leaves GPT-2's last stage with the LM head, a fifth of the
    model's compute, and the step waits on it (``fusion-uniform``)."""
    from executor.client import ChannelPool
    from fusion.coordinator.planning import Endpoint, measure, plan_job
    from fusion.profiling import measure_device
    from fusion.training import build_job_dataset, build_job_model, capture_job_model, example_micro_batch

    flops = measure_device(device).matmul_flops
    endpoints = [
        Endpoint(name=f"w{i}", address=a, matmul_flops=flops, machine="this-host") for i, a in enumerate(addresses)
    ]
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    captured = capture_job_model(job, model, example_micro_batch(job, dataset)[0])
    pool = ChannelPool()
    try:
        plan = plan_job(job, measure(job, model, captured, dataset, endpoints, pool, device=device), strategy="compute")
    finally:
        pool.close()
    print(
        f"  planned (compute): {', '.join(f'{len(st.nodes)} nodes on {st.worker}' for st in plan.stages)}",
        file=sys.stderr,
    )
    index = {e.name: i for i, e in enumerate(endpoints)}
    return plan.assignment(), [index[st.worker] for st in plan.stages]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.bench_core", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="GPT-2 preset for the step-time part (default: small, 124M)")
    parser.add_argument("--workers", default="2,4", help="worker counts to compare, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="training steps per system (the first is warm-up)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of the step-time part, the systems taking turns in each"
    )
    parser.add_argument("--sizes-mib", default="1,16,64", help="tensor sizes for the transport part")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--cpu-sizes-kib", default="64,1024", help="transfer sizes whose CPU per transfer is measured (each side)"
    )
    parser.add_argument(
        "--cpu-seconds", type=float, default=2.0, help="seconds of back-to-back transfers per CPU measurement"
    )
    parser.add_argument("--skip-steps", action="store_true", help="only the transport part")
    parser.add_argument("--skip-transport", action="store_true", help="only the step-time part")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict[str, Any] = {}
    if not args.skip_transport:
        out.update(
            measure_transport(
                [int(s) for s in args.sizes_mib.split(",")],
                args.repeats,
                cpu_sizes_kib=[int(s) for s in args.cpu_sizes_kib.split(",") if s],
                cpu_seconds=args.cpu_seconds,
            )
        )
    if not args.skip_steps:
        out["steps"] = bench_steps(
            args.preset,
            [int(w) for w in args.workers.split(",")],
            args.steps,
            args.batch_size,
            args.seq_len,
            args.micro_batches,
            args.device,
            args.rounds,
        )
        out["steps_config"] = {
            "preset": args.preset,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "micro_batches": args.micro_batches,
            "device": args.device,
            "rounds": args.rounds,
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if "transport" in out:
        print("\ntensor transport on loopback (median of interleaved repeats)")
        print(
            f"{'size':>8} {'gRPC MB/s':>10} {'data MB/s':>10} {'unix MB/s':>10} {'socket MB/s':>12} "
            f"{'data/socket':>12} {'unix/socket':>12} {'gRPC/socket':>12}"
        )
        for r in out["transport"]:
            print(
                f"{r['size_mib']:>5} MiB {r['grpc_mb_per_s']:>10.1f} {r['data_plane_mb_per_s']:>10.1f} "
                f"{r['unix_mb_per_s']:>10.1f} {r['socket_mb_per_s']:>12.1f} {r['ratio']:>12.2f} "
                f"{r['unix_ratio']:>12.2f} {r['grpc_ratio']:>12.2f}"
            )
        rt = out["round_trip"]
        print(
            f"{rt['size_kib']} KiB round trip: gRPC {rt['grpc_ms']:.3f} ms, data plane {rt['data_plane_ms']:.3f} ms, "
            f"unix {rt['unix_ms']:.3f} ms, socket {rt['socket_ms']:.3f} ms"
        )
        print("\nper transfer, back to back (microseconds)")
        print(f"{'size':>9} {'path':>7} {'wall':>8} {'sender CPU':>11} {'receiver CPU':>13}")
        for r in out["cpu_per_transfer"]:
            print(
                f"{r['size_kib']:>5} KiB {r['path']:>7} {r['wall_us']:>8.0f} {r['sender_cpu_us']:>11.0f} "
                f"{r['receiver_cpu_us']:>13.0f}"
            )
    if "steps" in out:
        c = out["steps_config"]
        print(
            f"\nGPT-2 {c['preset']} step time (batch {c['batch_size']} x {c['seq_len']}, "
            f"{c['micro_batches']} micro-batches, {c['device']})"
        )
        print(f"{'system':>22} {'step s':>8} {'vs 1 proc':>10}  rounds (s)")
        for r in out["steps"]:
            rounds = ", ".join(f"{s:.3f}" for s in r["rounds_step_s"])
            print(f"{r['system']:>22} {r['step_s']:>8.3f} {r['ratio']:>10.2f}  {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

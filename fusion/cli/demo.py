"""``fusion demo``: a coordinator and a few workers on this machine train a small GPT-2.

Everything real: a ``fusion-coordinator`` process, ``--workers`` ``fusion-worker``
processes on loopback, a job submitted over gRPC, the model split into stages that run a
pipelined forward and a remote backward pass. The text is the Python standard library's
own source code (present on every Python install), read byte by byte. The demo shows the
job's progress (:class:`~fusion.cli.progress.JobProgress`: steps done, rate, ETA, loss;
what it waits for before it starts), stops every process it started (also on Ctrl-C or
an error), and prints where the trained model and the loss curve are.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fusion.cli.progress import JobProgress
from fusion.config import JobSpec, OutputSpec
from fusion.coordinator.client import CoordinatorClient
from fusion.coordinator.store import TERMINAL_STATES
from fusion.errors import ConfigError, FusionError
from fusion.launch import Fleet

#: The built-in demo job: a 4-layer GPT-2 on byte-level Python source.
DEMO_JOB = """
name = "demo-gpt2"

[model]
name = "gpt2"
preset = "tiny"
n_layer = 4
n_embd = 64
n_head = 4
block_size = 64

[data]
name = "pysource"
batch_size = 16
seq_len = 64
shuffle = true

[train]
steps = 400
micro_batches = 2
schedule = "1f1b"
optimizer = "adamw"
lr = 3e-3
weight_decay = 0.0
seed = 0

[cluster]
min_workers = 3

[plan]
# Split over every worker so the demo shows the pipeline at work. On one small machine
# OP-Fence (the default) would keep a model this small on a single worker.
strategy = "uniform"
"""


def add_demo_parser(sub: Any) -> None:
    """Register ``fusion demo`` on the ``fusion`` sub-command parser."""
    from fusion.cli.env import add_log_arg

    sp = sub.add_parser(
        "demo",
        help="train a small GPT-2 on local workers, end to end",
        description="Start a coordinator and a few workers on this machine and train a small GPT-2 on them, "
        "end to end; everything they start is stopped at the end (also on Ctrl-C).",
    )
    sp.add_argument("--workers", type=int, default=3, help="number of local worker processes (default: %(default)s)")
    sp.add_argument("--job", default=None, help="a job file to run instead of the built-in GPT-2 job")
    sp.add_argument("--out", default="fusion-demo", help="output directory (default: ./%(default)s)")
    sp.add_argument("--steps", type=int, default=None, help="override the job's step count")
    sp.add_argument("--device", default="cpu", help="device for every stage (cpu, cuda, cuda:N)")
    add_log_arg(sp)
    sp.set_defaults(func=run_demo)


def demo_job(args: argparse.Namespace, out: Path) -> JobSpec:
    from fusion.config import load_job

    spec = load_job(args.job) if args.job else JobSpec.from_toml(DEMO_JOB, source="built-in demo job")
    if args.steps is not None:
        spec = spec.replace(train={"steps": args.steps})
    if spec.cluster.min_workers > args.workers:
        spec = spec.replace(cluster={"min_workers": args.workers})
    return replace(spec, output=OutputSpec(dir=str(out)))


def run_demo(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    _check_device(args.device)
    out = Path(args.out).expanduser().resolve()
    spec = demo_job(args, out)
    token = secrets.token_urlsafe(16)
    state = out / "state"
    if state.exists():
        shutil.rmtree(state)  # a fresh coordinator each demo; job outputs stay
    t0 = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    print(
        f"fusion demo: {spec.model.name} ({spec.model.preset or 'custom'}), {spec.train.steps} steps, "
        f"{args.workers} workers; logs in {out / 'logs'}"
    )
    print(f"  plan strategy: {_strategy_note(spec, args.job)}")
    with Fleet(out / "logs") as fleet:
        address = fleet.start_coordinator(token=token, state_dir=state, device=args.device)
        print(f"  coordinator on {address}")
        names = [f"demo-worker-{i}" for i in range(args.workers)]
        for name in names:
            fleet.start_worker(
                name,
                token=token,
                torch_threads=threads,
                allow_code=args.job is not None,
                extra_args=["--device", args.device],
                wait=False,
            )
        fleet.wait_workers(names)
        print(f"  {args.workers} workers joined ({time.monotonic() - t0:.1f}s)")
        with CoordinatorClient(address, token) as client:
            job_id = client.submit(spec)
            print(f"  submitted job {job_id}")
            progress = JobProgress(spec.train.steps)
            try:
                while True:
                    status = client.status(job_id)
                    progress.update(status)
                    if status["state"] in TERMINAL_STATES:
                        break
                    time.sleep(0.5)
            except KeyboardInterrupt:
                progress.close()
                print("interrupted: cancelling the job and stopping the workers", file=sys.stderr)
                try:
                    client.cancel(job_id)
                except FusionError as e:  # it ended meanwhile
                    print(f"  {e}", file=sys.stderr)
                raise
            progress.close()
    wall = time.monotonic() - t0
    job_dir = Path(status["output_dir"])
    if status["state"] != "succeeded":
        print(f"job {job_id} {status['state']}: {status.get('reason')}", file=sys.stderr)
        return 1
    summary = _read_summary(job_dir)
    tail = _last_losses(job_dir, 20)
    smooth = f" (mean of the last {len(tail)} steps: {sum(tail) / len(tail):.3f})" if tail else ""
    print(
        f"done in {wall:.1f}s: loss {summary.get('first_loss', float('nan')):.3f} "
        f"-> {summary.get('final_loss', float('nan')):.3f}{smooth}"
    )
    print(f"  plan:    {_plan_line(status.get('plan'))}")
    if (status.get("plan") or {}).get("why"):
        print(f"  why:     {status['plan']['why']}")
    print(f"  model:   {job_dir / 'model.safetensors'}")
    print(f"  curve:   {job_dir / 'loss.png'}")
    print(f"  metrics: {job_dir / 'metrics.jsonl'}")
    return 0


def _strategy_note(spec: JobSpec, job_file: str | None) -> str:
    """The job's ``[plan] strategy`` and where it comes from, in a few words."""
    strategy = spec.plan.strategy
    if job_file is None:
        return (
            f"{strategy}, set by the demo's job to split the model over every worker; OP-Fence, the default, "
            "would keep a model this small on one worker of one machine"
        )
    return f"{strategy}, {'the default' if strategy == 'opfence' else 'from ' + job_file}"


def _plan_line(plan: dict[str, Any] | None) -> str:
    """``3 stages on demo-worker-1, demo-worker-2, demo-worker-0 (uniform)`` from a status' plan."""
    if not plan or not plan.get("stages"):
        return "-"
    workers = [str(s["worker"]) for s in plan["stages"]]
    n = len(workers)
    return f"{n} stage{'s' if n != 1 else ''} on {', '.join(workers)} ({plan.get('strategy', '?')})"


def _check_device(name: str) -> None:
    """Refuse a device this machine lacks before any process starts: the coordinator places
    every stage on it and each worker measures it when it joins."""
    from executor.build import parse_device

    try:
        parse_device(name)
    except ConfigError as e:
        why = "CUDA is not available on this machine" if name.startswith("cuda") else str(e)
        raise ConfigError(f"--device {name}: {why}; the demo runs every process here (use --device cpu)") from e


def _last_losses(job_dir: Path, n: int) -> list[float]:
    """The losses of the job's last ``n`` steps; the events between them (re-plans,
    recoveries, compression notes) carry no step loss and are skipped."""
    from fusion.coordinator.outputs import read_history

    return [loss for _, loss in read_history(job_dir / "metrics.jsonl", before=sys.maxsize)[-n:]]


def _read_summary(job_dir: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


__all__ = ["DEMO_JOB", "add_demo_parser", "run_demo"]

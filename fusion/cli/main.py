"""``fusion``: the job owner's command line.

fusion submit JOB.toml          # prints the job id as its last word
fusion status [JOB_ID] [--json]
fusion jobs [--json]
fusion cancel JOB_ID
fusion logs JOB_ID [--follow]
fusion workers [--all]
fusion plan JOB.toml --workers N [--json]
fusion demo [--workers 3] [--job FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fusion.cli.env import (
    add_connection_args,
    add_log_arg,
    env_tls_ca,
    remote_message,
    resolve_token,
    run_cli,
    setup_logging,
)
from fusion.config import JobSpec, OutputSpec, load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import ConfigError, RemoteError
from fusion.tls import set_client_ca


def _client(args: argparse.Namespace) -> CoordinatorClient:
    token = resolve_token(args.token, args.token_file)
    assert token is not None
    if getattr(args, "tls_ca", None):
        set_client_ca(args.tls_ca)
    return CoordinatorClient(args.coordinator, token)


def load_job_for_submit(path: str) -> JobSpec:
    """Read a job file; a relative ``[output] dir`` is taken relative to the current directory."""
    spec = load_job(path)
    out = Path(spec.output.dir).expanduser()
    if not out.is_absolute():
        spec = replace(spec, output=OutputSpec(dir=str(out.resolve())))
    return spec


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_job_for_submit(args.job)
    with _client(args) as c:
        try:
            job_id = c.submit(spec)
        except RemoteError as e:
            if e.code != "INVALID_ARGUMENT":
                raise
            # The coordinator's checks (models, presets, factories) name the file like the local ones.
            raise ConfigError(f"{args.job}: {remote_message(e)}") from e
    print(f"submitted {spec.name!r} ({spec.model.name}, {spec.train.steps} steps) as {job_id}")
    return 0


def _format_status(s: dict[str, Any]) -> str:
    loss = f"{s['loss']:.4f}" if s.get("loss") is not None else "-"
    rate = f"{s['samples_per_s']:.1f} samples/s" if s.get("samples_per_s") else "-"
    lines = [
        f"job {s['id']} ({s['name']}): {s['state']}" + (f" — {s['reason']}" if s.get("reason") else ""),
    ]
    if s.get("waiting"):
        lines.append(f"  {s['state']}: waits for {s['waiting']}")
    if s.get("phase"):
        elapsed = f" ({s['phase_elapsed_s']:.0f}s)" if s.get("phase_elapsed_s") is not None else ""
        lines.append(f"  {s['state']}: {s['phase']}{elapsed}")
    lines += [
        f"  step {s['step']}/{s['steps']}, loss {loss}, {rate}",
        f"  workers: {', '.join(s['workers']) or '-'}",
        f"  outputs: {s['output_dir']}",
    ]
    plan = s.get("plan")
    if plan:
        stages = ", ".join(
            f"{st['worker']} ({st['nodes']} node{'s' if st['nodes'] != 1 else ''})" for st in plan["stages"]
        )
        lines.append(f"  plan: {plan['strategy']}: {stages}")
        if plan.get("why"):
            lines.append(f"  why: {plan['why']}")
    if s.get("compression_note"):
        lines.append(f"  {s['compression_note']}")
    for e in s.get("events", [])[-5:]:
        lines.append(
            f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e.get('event')}: {e.get('message', '')}"
        )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.job_id:
            s = c.status(args.job_id)
            print(json.dumps(s, indent=2) if args.json else _format_status(s))
            return 0
        workers = c.workers()
        jobs = c.jobs()
    if args.json:
        print(
            json.dumps(
                {
                    "workers": [
                        {"name": w.name, "address": w.address, "state": w.state, "job_id": w.job_id} for w in workers
                    ],
                    "jobs": jobs,
                },
                indent=2,
            )
        )
        return 0
    live = [w for w in workers if w.state != "gone"]
    print(f"coordinator {args.coordinator}: {len(live)} worker(s), {len(jobs)} job(s)")
    for w in live:
        print(f"  worker {w.name} {w.address} {w.state}" + (f" ({w.job_id})" if w.job_id else ""))
    for j in jobs[:10]:
        print(f"  {j['id']} {j['state']:<10} step {j['step']}/{j['steps']} {j['name']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = c.jobs()
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print(f"{'id':<14} {'state':<10} {'step':>11} {'loss':>8}  name")
    for j in jobs:
        loss = f"{j['loss']:.4f}" if j.get("loss") is not None else "-"
        print(f"{j['id']:<14} {j['state']:<10} {j['step']:>5}/{j['steps']:<5} {loss:>8}  {j['name']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a pending, planning or running job; a job that already ended is an error (exit 1)."""
    with _client(args) as c:
        state = c.cancel(args.job_id)
    print(f"{args.job_id}: {state}")
    return 0


#: A metric line of ``GetLogs`` (the coordinator's ``_log_line``): ``DATE TIME step N: loss ...``.
_METRIC_LINE = re.compile(r"^\S+ \S+ step \d+: loss ")


def cmd_logs(args: argparse.Namespace) -> int:
    """Print a job's log; with ``--follow`` keep printing until it ends. On a terminal the
    per-step lines become one progress bar (events are still printed); elsewhere every
    line is printed as it is."""
    from fusion.cli.progress import JobProgress
    from fusion.coordinator.store import TERMINAL_STATES

    with _client(args) as c:
        progress: JobProgress | None = None
        if args.follow and sys.stdout.isatty():
            progress = JobProgress(int(c.status(args.job_id)["steps"]))

        def emit(lines: list[str]) -> None:
            for line in lines:
                if progress is None:
                    print(line, flush=True)
                elif not _METRIC_LINE.match(line):
                    progress.write(line)

        seq = 0
        try:
            while True:
                lines, seq = c.logs(args.job_id, seq)
                emit(lines)
                if not args.follow:
                    return 0
                status = c.status(args.job_id)
                if progress is not None:
                    progress.update(status)
                if status["state"] in TERMINAL_STATES:
                    emit(c.logs(args.job_id, seq)[0])
                    return 0
                time.sleep(1.0)
        finally:
            if progress is not None:
                progress.close()


def cmd_workers(args: argparse.Namespace) -> int:
    from fusion.cli.workers_table import format_workers

    with _client(args) as c:
        workers = c.workers()
    print(format_workers(workers, include_gone=args.all))
    return 0


def offline_dag(spec: JobSpec) -> tuple[Any, Any, Any]:
    """What ``fusion plan`` plans without workers: the job's model captured on the meta device
    (no weights), each node's saved bytes counted as the live profile counts them
    (:func:`fusion.saved_activations.with_static_saved_bytes`), an example micro-batch's
    input ``x`` (on the CPU) and the step's fixed costs (the target's bytes):
    ``(dag, x, step_costs)``."""
    import torch

    from fusion.models import build_model
    from fusion.saved_activations import with_static_saved_bytes
    from fusion.training import build_job_dataset, capture_job_model, example_micro_batch
    from scheduler.estimator import StepCosts

    torch.manual_seed(spec.train.seed)
    with torch.device("meta"):
        model = build_model(spec.model.name, spec.model.preset, **spec.model.kwargs)
    x, y = example_micro_batch(spec, build_job_dataset(spec))
    captured = capture_job_model(spec, model, x.to("meta"))
    dag = with_static_saved_bytes(captured.dag, captured.graph_module, (x.to("meta"),))
    return dag, x, StepCosts(target_bytes=y.numel() * y.element_size())


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan offline: the model is captured on the meta device (no weights are allocated)."""

    from fusion.training import build_job_dataset, capture_job_model
    from scheduler.planner import make_plan, request_for_job
    from scheduler.topology import Topology, WorkerSpec

    job_path = args.job_opt or args.job
    if not job_path:
        raise ConfigError("give the job file: fusion plan --job JOB.toml --topology TOPO.toml")
    spec = load_job(job_path)
    if args.topology:
        topology = Topology.load(args.topology)
        if args.driver:
            topology = topology.with_driver_at(topology.index(args.driver))
    else:
        n = args.workers
        workers = [WorkerSpec(name=f"worker-{i}", cluster="local") for i in range(n)]
        topology = Topology.from_measurements(workers, [[0.0] * n for _ in range(n)], [[1.25e9] * n for _ in range(n)])
    dag, x, costs = offline_dag(spec)
    request = request_for_job(spec, strategy=args.strategy, step_costs=costs)
    plan = make_plan(dag, topology, request)
    if spec.compression.mode != "none" and not args.no_calibrate:
        from compress.calibration import job_calibrator
        from fusion.coordinator.planning import calibrated
        from fusion.training import build_job_model

        dataset = build_job_dataset(spec)
        calibrator = job_calibrator(spec, capture_job_model(spec, build_job_model(spec), x), dataset)
        plan = calibrated(plan, dag, topology, request, calibrator)
    print(plan.to_json() if args.json else plan.table())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure a job on the coordinator's idle workers; with --check, run plans and compare.

    The coordinator does the measuring: the workers' executors only answer calls signed with
    keys that the coordinator holds and this CLI does not (SECURITY.md).
    """
    from fusion.coordinator.profile_check import format_report

    spec = load_job(args.job)
    what = "running plans and comparing them with the estimator" if args.check else "measuring"
    print(f"the coordinator is {what} on its idle workers; this takes a while", file=sys.stderr, flush=True)
    with _client(args) as c:
        doc = c.profile(spec, check=args.check, steps=args.steps, max_workers=args.workers, device=args.device)
    print(json.dumps(doc, indent=2) if args.json else format_report(doc))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusion", description="Submit and watch fusion training jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, connect: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if connect:
            add_connection_args(sp)
            sp.add_argument(
                "--tls-ca",
                default=env_tls_ca(),
                help="CA bundle that signed the coordinator's certificate: talk TLS (default: $FUSION_TLS_CA)",
            )
        add_log_arg(sp)
        return sp

    sp = command("submit", "submit a job file (TOML); prints the job id")
    sp.add_argument("job", help="path to the job file")
    sp.set_defaults(func=cmd_submit)
    sp = command("status", "show a job (or the coordinator's workers and jobs)")
    sp.add_argument("job_id", nargs="?", help="job id (omit for an overview)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_status)
    sp = command("jobs", "list jobs, newest first")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_jobs)
    sp = command("cancel", "cancel a job")
    sp.add_argument("job_id")
    sp.set_defaults(func=cmd_cancel)
    sp = command("logs", "print a job's events and per-step metrics")
    sp.add_argument("job_id")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    sp.set_defaults(func=cmd_logs)
    sp = command("workers", "list the live workers (name, id, state, device, speed, memory, job, heartbeat)")
    sp.add_argument("--all", action="store_true", help="also list gone and excluded workers")
    sp.set_defaults(func=cmd_workers)
    sp = command("plan", "plan a job offline on a topology file (or N equal workers)", connect=False)
    sp.add_argument("job", nargs="?", help="path to the job file (or --job)")
    sp.add_argument("--job", dest="job_opt", default=None, help="path to the job file")
    sp.add_argument("--topology", default=None, help="topology file (TOML, as in testbeds/topologies/)")
    sp.add_argument(
        "--driver",
        default=None,
        metavar="HOST",
        help="with --topology: the host the coordinator runs on "
        "(its feed and control links are priced; default: not priced)",
    )
    sp.add_argument(
        "--workers", type=int, default=2, help="without --topology: N equal workers on 10 Gbps (default: %(default)s)"
    )
    sp.add_argument(
        "--strategy",
        default=None,
        choices=["opfence", "uniform", "compute", "exhaustive"],
        help="override [plan] strategy",
    )
    sp.add_argument("--json", action="store_true", help="print the plan as JSON")
    sp.add_argument(
        "--no-calibrate",
        action="store_true",
        help="choose compression from the prior instead of measuring the codecs on the model (no weights built)",
    )
    sp.set_defaults(func=cmd_plan)
    sp = command("profile", "measure a job on the idle workers (model, links, executor overhead)")
    sp.add_argument("--job", required=True, help="path to the job file")
    sp.add_argument("--check", action="store_true", help="run several plans for real and compare with the estimator")
    sp.add_argument("--steps", type=int, default=5, help="timed steps per plan with --check (default: %(default)s)")
    sp.add_argument("--workers", type=int, default=0, help="use at most this many idle workers (default: all)")
    sp.add_argument("--device", default="cpu", help="device of the stages (cpu, cuda, cuda:N)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_profile)
    from fusion.cli.demo import add_demo_parser

    add_demo_parser(sub)
    from fusion.cli.fetch import add_fetch_parser

    add_fetch_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    return run_cli(lambda: int(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())

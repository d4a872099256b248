"""Load test: many volunteers heart-beating against one coordinator while a real job runs.

    python -m testbeds.bench.load_test --workers 64 --seconds 300

One real ``fusion-coordinator`` (default heartbeat interval 2 s, timeout 10 s), ``--real-workers``
real ``fusion-worker`` processes training a GPT-2 tiny job through it (the job's driver runs
inside the coordinator, so its CPU is part of what is measured), and ``--workers``
**lightweight workers**: small processes of this module (``lite-worker``) that register with
the token, then heart-beat with their session at the interval the coordinator hands out, and
nothing else. They import only gRPC and the generated messages (~35 MB each, no torch) and
serve no executor: the coordinator never calls an idle worker (it probes and loads only the
workers a job claims, and the job is told ``use_joiners = "never"``), so a ``Ping`` server
would never be called.

Measured: the coordinator's CPU (percent of one core) and resident memory, sampled every
second from ``/proc/PID/stat`` and ``/proc/PID/status``; every heartbeat each lightweight
worker sent, had acknowledged (``known = true``), had refused or that failed, and its
round-trip time; how stale the coordinator's view of each worker got (``ListWorkers``
every 5 s); whether the coordinator declared any worker gone; the job's steps in the window.
Results: a table on stdout, and ``testbeds/results/load-test/load-test.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from fusion.errors import RemoteError
from fusion.stop_signals import catch_stop_signals
from fusion.wire import coordinator_pb2 as cpb
from fusion.wire import coordinator_pb2_grpc as cgrpc

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results" / "load-test"
AUTH_METADATA = "fusion-auth"
#: A heartbeat not answered within this is counted as failed (the coordinator's default timeout).
HEARTBEAT_DEADLINE_S = 10.0
LITE_PREFIX = "lite-"


# ----------------------------------------------------------------- the lightweight worker
def lite_worker(coordinator: str, token: str, name: str, report: Path) -> int:
    """Register, heart-beat until SIGTERM, deregister, write a JSON report of every heartbeat."""
    stop = catch_stop_signals()
    t0 = time.monotonic()
    stats: dict[str, Any] = {
        "name": name,
        "register_attempts": 0,
        "sent": 0,
        "acked": 0,
        "unknown": 0,
        "failed": 0,
        "errors": {},
        "register_errors": {},
    }
    rtts: list[float] = []
    with grpc.insecure_channel(coordinator) as channel:
        stub = cgrpc.CoordinatorStub(channel)
        request = cpb.RegisterRequest(
            name=name,
            address=f"{name}.invalid:1",  # serves nothing; never dialled
            resources=cpb.WorkerResources(num_cores=1, device="cpu", device_name="lite"),
        )
        while not stop.is_set():
            stats["register_attempts"] += 1
            try:
                response = stub.Register(request, timeout=30, metadata=((AUTH_METADATA, token),))
                break
            except grpc.RpcError as e:  # RESOURCE_EXHAUSTED: the per-IP registration limit
                stats["register_errors"][e.code().name] = stats["register_errors"].get(e.code().name, 0) + 1
                stop.wait(1.0 + (os.getpid() % 10) / 10)
        else:
            return 0
        stats["worker_id"] = response.worker_id
        stats["register_s"] = time.monotonic() - t0
        interval_s = response.heartbeat_interval_s or 2.0
        metadata = ((AUTH_METADATA, response.session),)
        beat = cpb.HeartbeatRequest(worker_id=response.worker_id)
        last_ack = time.monotonic()
        max_gap_s = 0.0
        next_at = time.monotonic() + interval_s
        while not stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += interval_s
            stats["sent"] += 1
            start = time.monotonic()
            try:
                known = stub.Heartbeat(beat, timeout=HEARTBEAT_DEADLINE_S, metadata=metadata).known
            except grpc.RpcError as e:
                stats["failed"] += 1
                stats["errors"][e.code().name] = stats["errors"].get(e.code().name, 0) + 1
                continue
            now = time.monotonic()
            rtts.append(now - start)
            if known:
                stats["acked"] += 1
                max_gap_s = max(max_gap_s, now - last_ack)
                last_ack = now
            else:
                stats["unknown"] += 1
        try:
            stub.Deregister(
                cpb.DeregisterRequest(worker_id=response.worker_id, reason="load test over"),
                timeout=30,
                metadata=metadata,
            )
            stats["deregistered"] = True
        except grpc.RpcError as e:
            stats["deregistered"] = False
            stats["errors"][e.code().name] = stats["errors"].get(e.code().name, 0) + 1
    stats["interval_s"] = interval_s
    stats["max_gap_s"] = max_gap_s
    stats["rtt_s"] = rtts
    report.write_text(json.dumps(stats))
    return 0


# ----------------------------------------------------------------- the coordinator's footprint
class ProcSampler:
    """CPU (percent of one core) and RSS of one process, from /proc, every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 1.0) -> None:
        self.pid = pid
        self.period_s = period_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proc-sampler", daemon=True)
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")

    def _read(self) -> tuple[float, int, int]:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
        cpu_s = (int(fields[11]) + int(fields[12])) / self._ticks_per_s  # utime + stime
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines() if ":" in line
        )
        return cpu_s, int(status["VmRSS"].split()[0]) * 1024, int(status["Threads"])

    def _run(self) -> None:
        prev_cpu, _, _ = self._read()
        prev_t = time.monotonic()
        while not self._stop.wait(self.period_s):
            try:
                cpu_s, rss, threads = self._read()
            except (OSError, KeyError, ValueError):
                return  # the process ended
            now = time.monotonic()
            self.samples.append(
                {
                    "t": now,
                    "cpu_percent": 100 * (cpu_s - prev_cpu) / (now - prev_t),
                    "rss_bytes": rss,
                    "threads": threads,
                }
            )
            prev_cpu, prev_t = cpu_s, now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ----------------------------------------------------------------- the test
def _job_file(path: Path, out: Path, real_workers: int) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "load-test"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 1000000
        micro_batches = 2
        optimizer = "sgd"
        lr = 0.01
        [cluster]
        min_workers = {real_workers}
        use_joiners = "never"
        [plan]
        strategy = "uniform"
        [checkpoint]
        replicate_every = 50
        [output]
        dir = "{out}"
    """)
    )
    return path


def run_load(
    *,
    workers: int,
    seconds: float,
    work_dir: Path,
    real_workers: int = 2,
    heartbeat_interval_s: float = 2.0,
    heartbeat_timeout_s: float = 10.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the load test; returns the result document (see the module docstring)."""
    from fusion.config import load_job
    from fusion.coordinator.client import CoordinatorClient
    from fusion.launch import Fleet

    def say(msg: str) -> None:
        if progress:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    token = "load-test-token"
    reports = work_dir / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    lites: list[subprocess.Popen[bytes]] = []
    with Fleet(work_dir / "logs") as fleet:
        try:
            address = fleet.start_coordinator(
                token=token,
                state_dir=work_dir / "state",
                heartbeat_interval_s=heartbeat_interval_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
                extra_args=["--log-level", "WARNING"],
            )
            assert fleet.coordinator is not None
            client = CoordinatorClient(address, token)
            job_id = ""
            if real_workers:
                for i in range(real_workers):
                    fleet.start_worker(f"real-{i}", token=token, wait=False)
                fleet.wait_workers([f"real-{i}" for i in range(real_workers)])
                job_id = client.submit(load_job(_job_file(work_dir / "job.toml", work_dir / "out", real_workers)))
                deadline = time.monotonic() + 300
                while (s := client.status(job_id))["state"] != "running" or s["step"] < 1:
                    if s["state"] in ("failed", "cancelled", "succeeded") or time.monotonic() > deadline:
                        raise RuntimeError(f"the load test's job did not start: {s}")
                    time.sleep(0.5)
                say(f"job {job_id} running on {real_workers} real worker(s)")
            sampler = ProcSampler(fleet.coordinator.pid)
            sampler.start()
            t_spawn = time.monotonic()
            token_file = work_dir / "token"
            token_file.write_text(token)
            for i in range(workers):
                name = f"{LITE_PREFIX}{i:03d}"
                with open(work_dir / "logs" / f"{name}.log", "wb") as log:
                    lites.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "testbeds.bench.load_test",
                                "lite-worker",
                                "--coordinator",
                                address,
                                "--token-file",
                                str(token_file),
                                "--name",
                                name,
                                "--report",
                                str(reports / f"{name}.json"),
                            ],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=fleet.env,
                            start_new_session=True,
                        )
                    )
            while True:
                registered = [w for w in client.workers() if w.name.startswith(LITE_PREFIX)]
                if len(registered) >= workers:
                    break
                dead = [p for p in lites if p.poll() is not None]
                if dead or time.monotonic() - t_spawn > 300:
                    raise RuntimeError(
                        f"{len(registered)}/{workers} lightweight workers registered; {len(dead)} exited"
                    )
                time.sleep(1.0)
            all_registered_s = time.monotonic() - t_spawn
            say(f"{workers} lightweight workers registered in {all_registered_s:.1f}s; measuring for {seconds:.0f}s")
            step_start = client.status(job_id)["step"] if job_id else 0
            t_window = time.monotonic()
            window_first_sample = len(sampler.samples)
            max_age_s = 0.0
            gone: set[str] = set()
            views = 0
            while (elapsed := time.monotonic() - t_window) < seconds:
                time.sleep(min(5.0, max(0.0, seconds - elapsed)))
                for w in client.workers():
                    if w.name.startswith(LITE_PREFIX):
                        max_age_s = max(max_age_s, w.last_heartbeat_age_s)
                        if w.state == "gone":
                            gone.add(w.name)
                views += 1
                if progress and views % 6 == 0:
                    last = sampler.samples[-1] if sampler.samples else {"cpu_percent": 0.0, "rss_bytes": 0}
                    say(
                        f"{elapsed:.0f}s: coordinator {last['cpu_percent']:.0f}% CPU, "
                        f"{last['rss_bytes'] / 2**20:.0f} MiB; "
                        f"stalest heartbeat {max_age_s:.2f}s; gone {len(gone)}"
                    )
            window_s = time.monotonic() - t_window
            job_state = client.status(job_id) if job_id else {}
            samples = sampler.stop()
            for p in lites:
                p.terminate()
            for p in lites:
                p.wait(timeout=120)
            if job_id:
                try:
                    client.cancel(job_id)
                except RemoteError as e:  # it may have ended since its status was read
                    if e.code != "FAILED_PRECONDITION":
                        raise
            client.close()
            coordinator_log = fleet.log_of("coordinator")
        finally:
            for p in lites:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    per_worker = [json.loads((reports / f"{LITE_PREFIX}{i:03d}.json").read_text()) for i in range(workers)]
    rtts = [r for w in per_worker for r in w["rtt_s"]]
    window = samples[window_first_sample:]
    cpu = [s["cpu_percent"] for s in window]
    rss = [s["rss_bytes"] for s in window]
    sent = sum(w["sent"] for w in per_worker)
    acked = sum(w["acked"] for w in per_worker)
    result: dict[str, Any] = {
        "workers": workers,
        "real_workers": real_workers,
        "lite_worker": (
            "python -m testbeds.bench.load_test lite-worker: registers, heart-beats, deregisters; no executor, no torch"
        ),
        "heartbeat_interval_s": heartbeat_interval_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "window_s": round(window_s, 1),
        "all_registered_s": round(all_registered_s, 1),
        "register_attempts": sum(w["register_attempts"] for w in per_worker),
        "heartbeats_sent": sent,
        "heartbeats_acked": acked,
        "heartbeats_lost": sent - acked,
        "heartbeats_failed": sum(w["failed"] for w in per_worker),
        "heartbeats_unknown": sum(w["unknown"] for w in per_worker),
        "register_errors": {
            k: sum(w["register_errors"].get(k, 0) for w in per_worker)
            for k in sorted({k for w in per_worker for k in w["register_errors"]})
        },
        "heartbeat_errors": {
            k: sum(w["errors"].get(k, 0) for w in per_worker)
            for k in sorted({k for w in per_worker for k in w["errors"]})
        },
        "heartbeat_rtt_ms": {
            "p50": 1e3 * _percentile(rtts, 0.5),
            "p99": 1e3 * _percentile(rtts, 0.99),
            "max": 1e3 * max(rtts, default=0.0),
        },
        "max_gap_between_acks_s": max((w["max_gap_s"] for w in per_worker), default=0.0),
        "max_heartbeat_age_seen_by_coordinator_s": round(max_age_s, 3),
        "declared_gone": sorted(gone),
        "declared_gone_in_log": coordinator_log.count("declared gone"),
        "deregistered": sum(bool(w.get("deregistered")) for w in per_worker),
        "coordinator_cpu_percent": {
            "mean": statistics.fmean(cpu) if cpu else 0.0,
            "p95": _percentile(cpu, 0.95),
            "max": max(cpu, default=0.0),
        },
        "coordinator_rss_mib": {
            "start": rss[0] / 2**20 if rss else 0.0,
            "max": max(rss, default=0) / 2**20,
            "end": rss[-1] / 2**20 if rss else 0.0,
        },
        "coordinator_threads_max": max((int(s["threads"]) for s in window), default=0),
        "samples": len(window),
        "job": {
            "id": job_id,
            "state_at_end_of_window": job_state.get("state"),
            "steps_in_window": (job_state.get("step", 0) - step_start) if job_id else 0,
            "steps_per_s": round((job_state.get("step", 0) - step_start) / window_s, 2) if job_id else 0.0,
        },
        "cpu_count": os.cpu_count(),
    }
    return result


def format_table(r: dict[str, Any]) -> str:
    cpu, rss, rtt, job = r["coordinator_cpu_percent"], r["coordinator_rss_mib"], r["heartbeat_rtt_ms"], r["job"]
    rows = [
        ("lightweight workers / real workers", f"{r['workers']} / {r['real_workers']}"),
        (
            "window",
            (
                f"{r['window_s']:.0f} s (all registered after {r['all_registered_s']:.1f} s, "
                f"{r['register_attempts']} Register calls)"
            ),
        ),
        (
            "heartbeats sent / acknowledged / lost",
            f"{r['heartbeats_sent']} / {r['heartbeats_acked']} / {r['heartbeats_lost']}",
        ),
        ("heartbeat round trip p50 / p99 / max", f"{rtt['p50']:.1f} / {rtt['p99']:.1f} / {rtt['max']:.1f} ms"),
        (
            "longest gap between acks (interval)",
            f"{r['max_gap_between_acks_s']:.2f} s ({r['heartbeat_interval_s']:.1f} s)",
        ),
        (
            "stalest heartbeat seen by the coordinator",
            f"{r['max_heartbeat_age_seen_by_coordinator_s']:.2f} s (timeout {r['heartbeat_timeout_s']:.0f} s)",
        ),
        ("workers declared gone", f"{len(r['declared_gone'])} (log: {r['declared_gone_in_log']})"),
        ("coordinator CPU mean / p95 / max", f"{cpu['mean']:.1f} / {cpu['p95']:.1f} / {cpu['max']:.1f} % of one core"),
        ("coordinator RSS start / max / end", f"{rss['start']:.0f} / {rss['max']:.0f} / {rss['end']:.0f} MiB"),
        ("coordinator threads (max)", str(r["coordinator_threads_max"])),
        (
            "job during the window",
            f"{job['state_at_end_of_window']}, {job['steps_in_window']} steps ({job['steps_per_s']} steps/s)"
            if job["id"]
            else "none",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in [("metric", "value"), ("-" * width, "---"), *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.bench.load_test", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    lite = sub.add_parser("lite-worker", help="(internal) one lightweight worker")
    lite.add_argument("--coordinator", required=True)
    lite.add_argument("--token-file", required=True)
    lite.add_argument("--name", required=True)
    lite.add_argument("--report", required=True)
    p.add_argument("--workers", type=int, default=64, help="lightweight worker processes (default: %(default)s)")
    p.add_argument(
        "--seconds", type=float, default=300.0, help="measured window once all registered (default: %(default)s)"
    )
    p.add_argument(
        "--real-workers", type=int, default=2, help="real fusion-workers running a GPT-2 tiny job (0: no job)"
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=2.0,
        help="the coordinator's heartbeat interval (default: its own default, %(default)s)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="the coordinator's heartbeat timeout (default: %(default)s)",
    )
    p.add_argument("--work-dir", default=None, help="logs and state (default: a temporary directory)")
    p.add_argument(
        "--out", default=str(RESULTS_DIR / "load-test"), help="write OUT.json and OUT.md (default: %(default)s)"
    )
    args = p.parse_args(argv)
    if args.command == "lite-worker":
        return lite_worker(args.coordinator, Path(args.token_file).read_text().strip(), args.name, Path(args.report))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fusion-load-") as tmp:
        work = Path(args.work_dir or tmp)
        result = run_load(
            workers=args.workers,
            seconds=args.seconds,
            work_dir=work,
            real_workers=args.real_workers,
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
    table = format_table(result)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    command = (
        f"python -m testbeds.bench.load_test --workers {args.workers} --seconds {args.seconds:g} "
        f"--real-workers {args.real_workers}"
    )
    out.with_suffix(".md").write_text(
        f"# Coordinator load test\n\n`{command}` on {result['cpu_count']} CPU cores, "
        f"{time.strftime('%Y-%m-%d')}.\n\n{table}\n"
    )
    return 0 if result["heartbeats_lost"] == 0 and not result["declared_gone"] else 1


if __name__ == "__main__":
    sys.exit(main())

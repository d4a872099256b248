"""The chaos run's fleet on a testbed: a coordinator that can be killed and restarted with
its state dir, workers that can be killed, frozen, told to leave and replaced, and a status
poller.

Modelled on :class:`testbeds.net.launch.TestbedRun`, with what chaos needs on top: every
process the fleet starts is remembered (so the report can count what is still alive), the
coordinator restarts on the same address and state dir, and new workers join under new
names at any time. Everything runs through :meth:`Testbed.spawn`, so closing the testbed
reaps whatever the fleet leaves.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.launch import child_env
from fusion.profiling import measure_device
from testbeds.net.launch import run_fusion_cli
from testbeds.net.testbed import Testbed, TestbedError, stop_process_group, wait_for_line

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0


@dataclass
class FleetWorker:
    """One worker process the fleet started."""

    name: str
    host: str
    proc: subprocess.Popen
    log: Path
    gone: bool = False
    """Killed, told to leave, or otherwise no longer counted as live by the harness."""
    frozen: bool = False


class ChaosFleet:
    """A coordinator and workers on ``tb``; the harness's handle for hurting them."""

    def __init__(
        self,
        tb: Testbed,
        log_dir: Path,
        *,
        heartbeat_timeout_s: float,
        heartbeat_interval_s: float = 1.0,
        torch_threads: int = 1,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.tb = tb
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.torch_threads = torch_threads
        self.echo = echo
        self.env = child_env()
        self.token = secrets.token_urlsafe(18)
        self.token_file = self.log_dir / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.head = tb.hosts[0]
        self.coordinator = ""
        self.coordinator_proc: subprocess.Popen | None = None
        self.coordinator_starts = 0
        #: Each coordinator start: ``start``, ``pid``, ``spawned_at`` and ``listening_at`` (wall time).
        self.coordinator_spawns: list[dict[str, Any]] = []
        self.workers: list[FleetWorker] = []
        self.started: list[subprocess.Popen] = []
        self._port = 0
        self._machine_flops = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------- processes
    def _spawn_logged(self, host: str, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as f:
            proc = self.tb.spawn(host, [sys.executable, *argv], env=self.env, stdout=f, stderr=subprocess.STDOUT)
        with self._lock:
            self.started.append(proc)
        return proc, log

    def start_coordinator(self) -> None:
        """Start (or restart, on the same address and state dir) the coordinator; wait until it listens."""
        if not self._port:
            self._port = self.tb.free_port(self.head)
        self.coordinator_starts += 1
        log = self.log_dir / f"coordinator-{self.coordinator_starts}.log"
        argv = [
            "-m",
            "testbeds.coordinator",
            "--host",
            self.tb.address(self.head),
            "--port",
            str(self._port),
            "--token-file",
            str(self.token_file),
            "--state-dir",
            str(self.log_dir / "state"),
            "--heartbeat-interval",
            str(self.heartbeat_interval_s),
            "--heartbeat-timeout",
            str(self.heartbeat_timeout_s),
            "--log-level",
            "INFO",
        ]
        spawn = {"start": self.coordinator_starts, "spawned_at": time.time(), "listening_at": None}
        proc, log = self._spawn_logged(self.head, log.stem, argv)
        spawn["pid"] = proc.pid
        self.coordinator_spawns.append(spawn)
        self.coordinator_proc = proc
        m = wait_for_line(log, r"listening on (\S+:\d+)", proc, READY_TIMEOUT_S)
        spawn["listening_at"] = time.time()
        self.coordinator = m.group(1)

    def coordinator_logs(self) -> list[Path]:
        return [self.log_dir / f"coordinator-{k}.log" for k in range(1, self.coordinator_starts + 1)]

    def start_worker(self, host: str, name: str, *, wait: bool = True) -> FleetWorker:
        """Start a worker named ``name`` on ``host`` (its executor port exposed first)."""
        if not self._machine_flops:
            self._machine_flops = measure_device("cpu").matmul_flops  # once: every worker reports it
        port = self.tb.free_port(host)
        self.tb.expose(host, port)
        proc, log = self._spawn_logged(
            host,
            f"worker-{name}",
            [
                "-m",
                "testbeds.worker",
                "--coordinator",
                self.coordinator,
                "--token-file",
                str(self.token_file),
                "--name",
                name,
                "--listen",
                f"{self.tb.address(host)}:{port}",
                "--torch-threads",
                str(self.torch_threads),
                "--log-level",
                "INFO",
                "--machine-flops",
                str(self._machine_flops),
            ],
        )
        w = FleetWorker(name=name, host=host, proc=proc, log=log)
        with self._lock:
            self.workers.append(w)
        if wait:
            wait_for_line(log, r"fusion-worker ready", proc, READY_TIMEOUT_S)
        return w

    def live_workers(self) -> list[FleetWorker]:
        """Workers the harness has not killed or sent away, in start order (frozen ones included)."""
        with self._lock:
            return [w for w in self.workers if not w.gone and w.proc.poll() is None]

    def new_worker_name(self, host: str) -> str:
        with self._lock:
            return f"{host}-j{len(self.workers)}"

    def signal_worker(self, w: FleetWorker, sig: signal.Signals) -> None:
        """Send ``sig`` to the worker's process (``ip netns exec`` execs, so it is python itself)."""
        os.kill(w.proc.pid, sig)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (no SIGTERM first: it gets no chance to shut down cleanly)."""
        proc = self.coordinator_proc
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10.0)

    # ------------------------------------------------------------- the fusion CLI
    def fusion(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``fusion ARGS`` on the first host against the coordinator."""
        env = {**self.env, "FUSION_COORDINATOR": self.coordinator, "FUSION_TOKEN": self.token}
        return run_fusion_cli(self.tb, self.head, env, args, timeout_s=timeout_s)

    def submit(self, job_file: Path) -> str:
        r = self.fusion("submit", str(Path(job_file).resolve()))
        if r.returncode != 0:
            raise TestbedError(f"fusion submit failed: {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout.split()[-1]

    def start_poller(self, job_id: str, interval_s: float = 1.0) -> subprocess.Popen:
        """Start ``testbeds.chaos.poller`` on the first host: one status call a second, a JSON line each."""
        env = {**self.env, "FUSION_TOKEN": self.token}
        proc = self.tb.spawn(
            self.head,
            [
                sys.executable,
                "-m",
                "testbeds.chaos.poller",
                "--coordinator",
                self.coordinator,
                "--job",
                job_id,
                "--interval",
                str(interval_s),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        with self._lock:
            self.started.append(proc)
        return proc

    def alive_started(self) -> list[int]:
        """Pids of processes this fleet started that are still alive."""
        with self._lock:
            return [p.pid for p in self.started if p.poll() is None]

    def stop(self) -> None:
        """Stop every process this fleet started (frozen ones are thawed so SIGTERM lands)."""
        with self._lock:
            procs = list(self.started)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
        threads = [threading.Thread(target=stop_process_group, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15.0)

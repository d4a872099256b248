"""Run one fusion job on a testbed, the way users would run it on real machines.

``python -m testbeds.coordinator`` starts on the first host, one ``python -m testbeds.worker`` per host (or
``workers_per_host``) on every host, each listening on its host's address; every worker's
executor port is :meth:`~testbeds.net.testbed.Testbed.expose`-d before the worker starts, so that
every process's peer map already routes it over the emulated links when the first
channel is opened. The job is submitted with ``fusion submit`` from the first host and
followed with ``fusion logs --follow``; the final ``fusion status --json`` is the result.
Workers reach the coordinator directly (control traffic); executor traffic — the
coordinator's driver calls and every stage-to-stage transfer — crosses the emulated links.

Every worker computes at this machine's speed unless ``slowdowns`` names its host (a
host's ``slowdown``, or with ``python -m testbeds run --emulate-speeds`` the topology's speed
ratios: :func:`testbeds.sim.topologies.emulated_slowdowns`), whose workers then run
``testbeds.worker --emulate-slowdown`` — emulation of a slower device. Every worker
reports the machine's speed the launcher measured once (``--machine-flops``), and lends
its host's ``memory_gb`` (``--memory-gb``, shared by the host's workers), so that a model no
host can hold must be split across hosts. With ``allow_code`` the workers take job owners'
own models (``--allow-code``); every process gets this one's import path
(:func:`fusion.launch.child_env`), so a ``module:factory`` importable here is importable there.

With ``dilation`` ``D`` > 1 (time dilation, :mod:`testbeds.dilation`; the testbed must be
opened with the same ``D``, which dilates its links), every worker runs ``--dilate D`` and
the coordinator's heartbeat timeout is ``D`` times longer; the summary divides the times it
reports by ``D`` and says ``dilated xD``.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusion.config import load_job
from fusion.launch import child_env
from fusion.memory import GIB
from fusion.profiling import measure_device
from scheduler.topology import Topology
from testbeds.dilation import check_dilation, dilated_timeout_s, dilation_label
from testbeds.net.testbed import Testbed, TestbedError, wait_for_line

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0
#: The coordinator's heartbeat timeout on a testbed (seconds; times the dilation).
HEARTBEAT_TIMEOUT_S = 20.0
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


def host_memory_gb(topology: Topology, host: str, workers_per_host: int = 1) -> float | None:
    """What each of ``host``'s workers lends, in GB (GiB): the host's ``memory_gb`` shared by
    its ``workers_per_host`` workers; ``None`` where the topology gives the host no cap."""
    cap = topology.workers[topology.index(host)].memory_bytes
    return None if cap is None else cap / GIB / workers_per_host


def worker_command(
    *,
    coordinator: str,
    token_file: Path,
    name: str,
    listen: str,
    torch_threads: int,
    machine_flops: float,
    slowdown: float | None = None,
    emulation: str = "wall",
    memory_gb: float | None = None,
    allow_code: bool = False,
    dilation: float = 1.0,
    data_plane: bool = True,
) -> list[str]:
    """The arguments after ``python`` that start one testbed worker (``testbeds.worker``);
    ``data_plane=False``: tensors over gRPC only (``--no-data-plane``)."""
    return [
        "-m",
        "testbeds.worker",
        "--coordinator",
        coordinator,
        "--token-file",
        str(token_file),
        "--name",
        name,
        "--listen",
        listen,
        "--torch-threads",
        str(torch_threads),
        "--log-level",
        "INFO",
        "--machine-flops",
        str(machine_flops),
        *(["--memory-gb", repr(memory_gb)] if memory_gb is not None else []),
        *(["--allow-code"] if allow_code else []),
        *slowdown_args(slowdown, emulation=emulation),
        *(["--dilate", repr(dilation)] if dilation != 1.0 else []),
        *([] if data_plane else ["--no-data-plane"]),
    ]


def worker_names(tb: Testbed, workers_per_host: int) -> list[tuple[str, str]]:
    """``(host, worker name)`` for every worker: the host's name, or ``host-k`` with several."""
    return [(h, h if workers_per_host == 1 else f"{h}-{k}") for h in tb.hosts for k in range(workers_per_host)]


class TestbedRun:
    """A coordinator and workers started on a testbed, and jobs run through them."""

    __test__ = False

    def __init__(
        self,
        tb: Testbed,
        log_dir: Path,
        *,
        workers_per_host: int = 1,
        torch_threads: int = 1,
        echo: Callable[[str], None] = print,
        slowdowns: Mapping[str, float] | None = None,
        allow_code: bool = False,
        dilation: float = 1.0,
    ) -> None:
        if workers_per_host < 1:
            raise TestbedError(f"--workers-per-host must be at least 1, got {workers_per_host}")
        self.tb = tb
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers_per_host = workers_per_host
        self.torch_threads = torch_threads
        self.echo = echo
        self.slowdowns = dict(slowdowns or {})
        self.allow_code = allow_code
        self.dilation = check_dilation(dilation)
        self.env = child_env()
        self.token = secrets.token_urlsafe(18)
        self.token_file = self.log_dir / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.coordinator = ""
        self.head = tb.hosts[0]

    def _spawn_logged(self, host: str, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as f:
            proc = self.tb.spawn(host, [sys.executable, *argv], env=self.env, stdout=f, stderr=subprocess.STDOUT)
        return proc, log

    def start(self) -> None:
        """Start the coordinator and every worker; return once all joined."""
        tb = self.tb
        port = tb.free_port(self.head)
        proc, log = self._spawn_logged(
            self.head,
            "coordinator",
            [
                "-m",
                "testbeds.coordinator",
                "--host",
                tb.address(self.head),
                "--port",
                str(port),
                "--token-file",
                str(self.token_file),
                "--state-dir",
                str(self.log_dir / "state"),
                "--heartbeat-interval",
                "1",
                "--heartbeat-timeout",
                repr(dilated_timeout_s(HEARTBEAT_TIMEOUT_S, self.dilation)),
                "--log-level",
                "INFO",
            ],
        )
        m = wait_for_line(log, r"listening on (\S+:\d+)", proc, READY_TIMEOUT_S)
        self.coordinator = m.group(1)
        self.echo(f"coordinator on {self.head} at {self.coordinator} (log {log})")
        started = []
        machine_flops = measure_device("cpu").matmul_flops  # once: workers report it (testbeds.worker)
        for host, name in worker_names(tb, self.workers_per_host):
            port = tb.free_port(host)
            tb.expose(host, port)  # before it starts: every peer map routes it from the first channel
            proc, log = self._spawn_logged(
                host,
                f"worker-{name}",
                worker_command(
                    coordinator=self.coordinator,
                    token_file=self.token_file,
                    name=name,
                    listen=f"{tb.address(host)}:{port}",
                    torch_threads=self.torch_threads,
                    machine_flops=machine_flops,
                    slowdown=self.slowdowns.get(host),
                    memory_gb=host_memory_gb(tb.topology, host, self.workers_per_host),
                    allow_code=self.allow_code,
                    dilation=self.dilation,
                ),
            )
            started.append((name, proc, log))
        for _name, proc, log in started:
            wait_for_line(log, r"fusion-worker ready", proc, READY_TIMEOUT_S)
        self.echo(f"{len(started)} worker(s) joined: {', '.join(n for n, _, _ in started)}")

    def fusion(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``fusion ARGS`` on the first host against this run's coordinator."""
        env = {**self.env, "FUSION_COORDINATOR": self.coordinator, "FUSION_TOKEN": self.token}
        return run_fusion_cli(self.tb, self.head, env, args, timeout_s=timeout_s)

    def submit(self, job_file: Path) -> str:
        spec = load_job(job_file)
        num_workers = len(self.tb.hosts) * self.workers_per_host
        if spec.cluster.min_workers > num_workers:
            raise TestbedError(
                f"{job_file} needs min_workers = {spec.cluster.min_workers}; this testbed has {num_workers} worker(s)"
            )
        r = self.fusion("submit", str(Path(job_file).resolve()))
        if r.returncode != 0:
            raise TestbedError(f"fusion submit failed: {r.stderr.strip() or r.stdout.strip()}")
        self.echo(r.stdout.strip())
        return r.stdout.split()[-1]

    def follow(self, job_id: str, *, timeout_s: float) -> dict[str, Any]:
        """Echo the job's log lines until it ends; return its final ``fusion status --json``."""
        env = {**self.env, "FUSION_COORDINATOR": self.coordinator, "FUSION_TOKEN": self.token}
        proc = self.tb.spawn(
            self.head,
            [sys.executable, "-m", "fusion.cli.main", "logs", job_id, "--follow"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.echo(line.rstrip("\n"))

        reader = threading.Thread(target=pump, name="follow", daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TestbedError(f"job {job_id} did not finish within {timeout_s:.0f}s") from None
        finally:
            reader.join(5.0)
        deadline = time.monotonic() + 30.0
        while True:  # logs --follow ends at a terminal state; status confirms it
            r = self.fusion("status", job_id, "--json")
            if r.returncode != 0:
                raise TestbedError(f"fusion status failed: {r.stderr.strip()}")
            status = json.loads(r.stdout)
            if status["state"] in TERMINAL_STATES or time.monotonic() > deadline:
                return status
            time.sleep(1.0)


def slowdown_args(factor: float | None, flag: str = "--emulate-slowdown", emulation: str = "wall") -> list[str]:
    """Arguments for a process on a host emulated ``factor`` times slower (none at 1):
    ``testbeds.worker``'s flag by default, the baselines' ``--slowdown``; ``emulation``: what
    the factor multiplies (:data:`testbeds.emulation.EMULATIONS`)."""
    if not factor or factor <= 1.0:
        return []
    return [flag, str(factor), *(["--emulation", emulation] if emulation != "wall" else [])]


def summary_lines(status: dict[str, Any], dilation: float = 1.0) -> list[str]:
    """The end-of-run summary a user reads; on a testbed dilated ``dilation`` times, its rate
    in the emulated world's time, labelled so."""
    loss = f"{status['loss']:.4f}" if status.get("loss") is not None else "-"
    label = f" ({dilation_label(dilation)})" if dilation != 1.0 else ""
    rate = f", {status['samples_per_s'] * dilation:.1f} samples/s{label}" if status.get("samples_per_s") else ""
    lines = [
        f"job {status['id']}: {status['state']}" + (f" ({status['reason']})" if status.get("reason") else ""),
        f"  steps {status['step']}/{status['steps']}, final loss {loss}{rate}",
        f"  workers: {', '.join(status.get('workers') or []) or '-'}",
        f"  outputs: {status.get('output_dir', '-')}",
    ]
    plan = status.get("plan")
    if plan:
        lines.append(
            f"  plan ({plan['strategy']}): "
            + ", ".join(f"{st['worker']} ({st['nodes']} nodes)" for st in plan["stages"])
        )
    return lines


def run_job_on_testbed(
    tb: Testbed,
    job_file: str | Path,
    log_dir: Path,
    *,
    workers_per_host: int = 1,
    timeout_s: float = 3600.0,
    echo: Callable[[str], None] = print,
    slowdowns: Mapping[str, float] | None = None,
    allow_code: bool = False,
    dilation: float = 1.0,
) -> dict[str, Any]:
    """Start the fleet on ``tb``, run the job to its end, return its final status;
    ``allow_code``: the workers take the job owner's own model (``module:factory``);
    ``dilation``: the testbed's time dilation (``tb`` opened with it)."""
    job_file = Path(job_file)
    if not job_file.exists():
        raise TestbedError(f"no job file {job_file}")
    run = TestbedRun(
        tb,
        log_dir,
        workers_per_host=workers_per_host,
        echo=echo,
        slowdowns=slowdowns,
        allow_code=allow_code,
        dilation=dilation,
    )
    run.start()
    job_id = run.submit(job_file)
    status = run.follow(job_id, timeout_s=timeout_s)
    for line in summary_lines(status, dilation):
        echo(line)
    carried = {k: v for k, v in tb.link_bytes().items() if v}
    if carried:
        how = "htb counters, frames of all traffic" if tb.backend == "netns" else "user-space proxies"
        echo(
            f"  bytes over the emulated links ({how}): "
            + ", ".join(f"{s}->{d} {n:,}" for (s, d), n in sorted(carried.items()))
        )
    return status


def run_fusion_cli(
    tb: Any, host: str, env: dict[str, str], args: Sequence[str], *, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``fusion ARGS`` in ``host``'s namespace with ``env`` (which names the coordinator
    and the token) and return it finished; ``TestbedError`` when it outlasts ``timeout_s``."""
    proc = tb.spawn(
        host,
        [sys.executable, "-m", "fusion.cli.main", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise TestbedError(f"'fusion {' '.join(args)}' did not finish within {timeout_s:.0f}s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

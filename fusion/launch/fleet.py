"""A coordinator and fusion workers on this machine, as separate OS processes.

Used by ``fusion demo``, the integration tests and the testbeds. Each process runs
``python -m fusion.cli.…`` (the same code as the installed console scripts) in the fleet's
:class:`~fusion.launch.processes.ProcessGroup`, which logs it to ``LOG_DIR/NAME.log`` and
stops it by pid however the caller exits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from fusion.errors import FusionError
from fusion.launch.processes import Child, ProcessGroup

logger = logging.getLogger(__name__)

#: What a worker logs once it has joined its coordinator.
WORKER_READY = r"fusion-worker ready"
#: What the coordinator logs once it listens (the group is its HOST:PORT).
COORDINATOR_READY = r"listening on (\S+:\d+)"


class Fleet:
    """A coordinator and workers on this machine, started as separate processes."""

    def __init__(self, log_dir: str | Path, *, extra_pythonpath: Sequence[str] = ()) -> None:
        self.processes = ProcessGroup(log_dir, extra_pythonpath=extra_pythonpath)
        self.log_dir = self.processes.log_dir
        self.env = self.processes.env
        self.coordinator: Child | None = None
        self.coordinator_address = ""
        self.workers: dict[str, Child] = {}

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start_coordinator(
        self,
        *,
        token: str,
        state_dir: str | Path,
        port: int = 0,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 6.0,
        device: str = "cpu",
        extra_args: Sequence[str] = (),
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``fusion-coordinator``; returns its HOST:PORT once it listens. ``device``: what
        the jobs' stages run on (``--device``)."""
        token_file = self.log_dir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        args = [
            "-m",
            "fusion.cli.coordinator",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
            "--state-dir",
            str(state_dir),
            "--heartbeat-interval",
            str(heartbeat_interval_s),
            "--heartbeat-timeout",
            str(heartbeat_timeout_s),
            "--device",
            device,
            "--log-level",
            "INFO",
            *extra_args,
        ]
        proc = self.processes.spawn("coordinator", args)
        m = self.processes.wait_for("coordinator", COORDINATOR_READY, timeout_s)
        self.coordinator = proc
        self.coordinator_address = m.group(1)
        return self.coordinator_address

    def start_worker(
        self,
        name: str,
        *,
        token: str,
        allow_code: bool = False,
        torch_threads: int = 1,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        timeout_s: float = 120.0,
        module: str = "fusion.cli.worker",
    ) -> Child:
        """Start ``fusion-worker`` joining this fleet's coordinator (waits until it joined);
        ``module``: a wrapper of it to run instead, which takes its flags."""
        if not self.coordinator_address:
            raise FusionError("start the coordinator first")
        token_file = self.log_dir / f"token-{name}"
        token_file.write_text(token)
        token_file.chmod(0o600)
        args = [
            "-m",
            module,
            "--coordinator",
            self.coordinator_address,
            "--token-file",
            str(token_file),
            "--name",
            name,
            "--torch-threads",
            str(torch_threads),
            "--log-level",
            "INFO",
            *(["--allow-code"] if allow_code else []),
            *extra_args,
        ]
        proc = self.processes.spawn(f"worker-{name}", args)
        self.workers[name] = proc
        if wait:
            self.processes.wait_for(f"worker-{name}", WORKER_READY, timeout_s)
        return proc

    def wait_workers(self, names: Sequence[str], timeout_s: float = 120.0) -> None:
        """Wait until the named workers (started with ``wait=False``) joined."""
        for name in names:
            self.processes.wait_for(f"worker-{name}", WORKER_READY, timeout_s)

    def log_of(self, name: str) -> str:
        """The log of process ``name`` (``coordinator``, ``worker-NAME``)."""
        return self.processes.log_of(name)

    def stop(self, proc: Child, *, grace_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        return self.processes.stop(proc, grace_s=grace_s)

    def close(self) -> None:
        """Stop every process this fleet started (workers first, then the coordinator)."""
        self.processes.close()
        self.workers.clear()
        self.coordinator = None

"""Start a coordinator and workers as local OS processes, and stop every one of them.

Used by ``fusion demo``, the integration tests and the testbeds. Each process is started
with ``python -m fusion.cli.…`` (the same code as the installed console scripts), its
output goes to a log file, and :meth:`Fleet.close` stops them all by pid — SIGTERM, then
SIGKILL after a grace period — however the caller exits.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from fusion.errors import FusionError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent


def child_env(extra_pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """The environment for children: this interpreter's import path, unbuffered output."""
    env = dict(os.environ)
    paths = [*extra_pythonpath, str(REPO_ROOT), *[p for p in sys.path if p]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Fleet:
    """A coordinator and workers on this machine, started as separate processes."""

    def __init__(self, log_dir: str | Path, *, extra_pythonpath: Sequence[str] = ()) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = child_env(extra_pythonpath)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.coordinator_address = ""
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._all: list[subprocess.Popen[bytes]] = []
        self._log_start: dict[Path, int] = {}

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.log_dir / f"{name}.log"
        self._log_start[log] = log.stat().st_size if log.exists() else 0  # a restart appends
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._all.append(proc)
        return proc, log

    def _wait_for(self, proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            text = log.read_bytes()[self._log_start.get(log, 0) :].decode(errors="replace") if log.exists() else ""
            m = rx.search(text)
            if m:
                return m
            if proc.poll() is not None:
                raise FusionError(f"{log.stem} exited with code {proc.returncode}; its log ends with:\n{text[-2000:]}")
            time.sleep(0.05)
        raise FusionError(f"{log.stem} did not become ready within {timeout_s:.0f}s; see {log}")

    def start_coordinator(
        self,
        *,
        token: str,
        state_dir: str | Path,
        port: int = 0,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 6.0,
        extra_args: Sequence[str] = (),
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``fusion-coordinator``; returns its HOST:PORT once it listens."""
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
            "--log-level",
            "INFO",
            *extra_args,
        ]
        proc, log = self._spawn("coordinator", args)
        m = self._wait_for(proc, log, r"listening on (\S+:\d+)", timeout_s)
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
    ) -> subprocess.Popen[bytes]:
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
        proc, log = self._spawn(f"worker-{name}", args)
        self.workers[name] = proc
        if wait:
            self._wait_for(proc, log, r"fusion-worker ready", timeout_s)
        return proc

    def wait_workers(self, names: Sequence[str], timeout_s: float = 120.0) -> None:
        """Wait until the named workers (started with ``wait=False``) joined."""
        for name in names:
            self._wait_for(self.workers[name], self.log_dir / f"worker-{name}.log", r"fusion-worker ready", timeout_s)

    def log_of(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, proc: subprocess.Popen[bytes], *, grace_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return int(proc.returncode)

    def close(self) -> None:
        """Stop every process this fleet started (workers first, then the coordinator)."""
        for proc in reversed(self._all):
            if proc.poll() is None:
                proc.terminate()
        for proc in self._all:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._all.clear()
        self.workers.clear()
        self.coordinator = None

"""Child processes of this one: started the one way, logged to files, reaped by pid.

Every local launcher (:class:`~fusion.launch.fleet.Fleet`,
:class:`~fusion.launch.executors.LocalCluster`) starts its processes through a
:class:`ProcessGroup`: ``python ARGS`` in a session of its own (a Ctrl-C meant for the
caller does not reach it), with this interpreter's import path, stdout and stderr appended
to ``LOG_DIR/NAME.log``. Readiness is a line in that log (:meth:`ProcessGroup.wait_for`).
:meth:`ProcessGroup.close` stops every process it started by pid — SIGTERM, then SIGKILL
after a grace period — however the caller exits.

With ``FUSION_FORK_SERVER=1`` in the environment, ``python -m MODULE`` children are forked
from one warm interpreter that has already imported torch (:mod:`fusion.launch.forkserver`),
which spares each a few seconds of CPU; a test suite that starts hundreds of workers on a
small machine sets it. Either way a child is a real process of its own, stopped by pid.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from fusion.errors import FusionError
from fusion.launch.forkserver import ForkedChild, ForkServer

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The environment variable that has ``python -m`` children forked from a warm interpreter.
FORK_SERVER_ENV = "FUSION_FORK_SERVER"

#: A child process: started by :class:`subprocess.Popen`, or forked by the fork server.
Child = subprocess.Popen[bytes] | ForkedChild

_fork_server: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This process's fork server when :data:`FORK_SERVER_ENV` asks for one (started on first
    use, stopped at exit), else None."""
    global _fork_server
    if os.environ.get(FORK_SERVER_ENV, "") not in ("1", "true", "yes"):
        return None
    if _fork_server is None:
        import atexit

        _fork_server = ForkServer()
        atexit.register(stop_fork_server)
    return _fork_server


def fork_server_pid() -> int | None:
    """The pid of this process's fork server while it runs."""
    return None if _fork_server is None else _fork_server.pid


def stop_fork_server() -> None:
    """Stop this process's fork server, if it started one (the children it forked run on)."""
    if _fork_server is not None:
        _fork_server.close()


def child_env(extra_pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """The environment for children: this interpreter's import path, unbuffered output."""
    env = dict(os.environ)
    paths = [*extra_pythonpath, str(REPO_ROOT), *[p for p in sys.path if p]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ProcessGroup:
    """Processes started by this one, each logging to its own file in ``log_dir``.

    Without a ``log_dir`` the logs go to a temporary directory, removed by :meth:`close`.
    """

    def __init__(self, log_dir: str | Path | None = None, *, extra_pythonpath: Sequence[str] = ()) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fusion-processes-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = child_env(extra_pythonpath)
        """The environment every child gets (also for the caller's own subprocesses)."""
        self._all: list[Child] = []
        self._by_name: dict[str, Child] = {}
        self._log_start: dict[str, int] = {}

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def log_path(self, name: str) -> Path:
        """Where process ``name`` writes its output."""
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, args: Sequence[str]) -> Child:
        """Start ``python ARGS`` as process ``name``; a restart under the same name appends to its
        log. The log starts with the command line (``$ python ARGS``), which :meth:`wait_for` skips."""
        log = self.log_path(name)
        server = fork_server() if len(args) >= 2 and args[0] == "-m" else None
        proc: Child
        with open(log, "ab") as f:
            f.write(("$ " + shlex.join([sys.executable, *args]) + "\n").encode())
            f.flush()
            self._log_start[name] = f.tell()
            if server is not None:
                proc = server.spawn(args[1], args[2:], env=self.env, log=log)
            else:
                proc = subprocess.Popen(
                    [sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
                )
        self._all.append(proc)
        self._by_name[name] = proc
        return proc

    def wait_for(self, name: str, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait until process ``name``'s log (since its last start) matches ``pattern``.

        Raises :class:`FusionError` with the log's end if the process exits or the time runs out.
        """
        proc = self._by_name[name]
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while True:
            text = self._log_since_start(name)
            m = rx.search(text)
            if m:
                return m
            if proc.poll() is not None:
                raise FusionError(f"{name} exited with code {proc.returncode}; its log ends with:\n{text[-2000:]}")
            if time.monotonic() > deadline:
                raise FusionError(
                    f"{name} did not become ready within {timeout_s:.0f}s; its log ends with:\n{text[-2000:]}"
                )
            time.sleep(0.05)

    def _log_since_start(self, name: str) -> str:
        log = self.log_path(name)
        return log.read_bytes()[self._log_start.get(name, 0) :].decode(errors="replace") if log.exists() else ""

    def log_of(self, name: str) -> str:
        """Everything process ``name`` has written (over all its starts)."""
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    @staticmethod
    def stop(proc: Child, *, grace_s: float = 10.0) -> int:
        """SIGTERM, wait ``grace_s``, then SIGKILL; returns the exit code."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return int(proc.returncode)

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every process this group started (the newest first), then remove a temporary log dir."""
        for proc in reversed(self._all):
            if proc.poll() is None:
                proc.terminate()
        for proc in self._all:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._all.clear()
        self._by_name.clear()
        if self._tmp is not None:
            self._tmp.cleanup()

"""Shared fixtures: a pool of real executor processes, free ports, seeds, a reaper, and
the quiet lock. The processes tests start are forked from a warm interpreter
(``FUSION_FORK_SERVER``, :mod:`fusion.launch.forkserver`).

Every child process a test starts must be stopped by that test; the session-end reaper
is a safety net that kills any left over (and reports them), so a failed test never
leaves workers running.

The suite runs in two pytest-xdist workers (``addopts`` in ``pyproject.toml``). A test
marked ``quiet`` measures time or speed on this machine's shared cores; it runs while no
other test does (:func:`_quiet_lock`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from fusion.launch.executors import LocalCluster
from fusion.launch.processes import FORK_SERVER_ENV, fork_server_pid, stop_fork_server

logger = logging.getLogger(__name__)

# Coordinators the tests start calibrate each model for 0.3 s of compute, not the default
# 3 s (which averages a shared machine's speed phases for planning and the benchmarks):
# the tests check what calibration measures, not how steady the machine is, and a
# suite of some hundred jobs would pay the difference each time.
os.environ.setdefault("FUSION_CALIBRATE_S", "0.3")
# The coordinators, workers and executors the tests start are forked from a warm
# interpreter that has imported torch (fusion.launch.forkserver): each is spared some 3 s
# of CPU, and the suite starts hundreds of them on two cores.
os.environ.setdefault(FORK_SERVER_ENV, "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="device the parity tests train on, in the workers and the reference (cpu, cuda, cuda:N)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """A ``--device`` this machine lacks stops the run (it is a usage error, not a skip)."""
    name = str(config.getoption("--device"))
    try:
        kind = torch.device(name).type
    except RuntimeError as e:
        raise pytest.UsageError(f"--device {name}: {e}") from e
    if kind not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {name}: use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: CUDA is not available here")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The ``--device`` the parity tests run on."""
    return str(request.config.getoption("--device"))


class _QuietLock:
    """Across the xdist workers of one run, a ``quiet`` test holds the run's lock file
    exclusively and every other test holds it shared, so a quiet test waits for the test
    running beside it and nothing starts beside it. A second file is a turnstile that a
    waiting quiet test holds, so the other worker cannot keep the shared lock for ever. A
    quiet test keeps the lock for the next test when that one is quiet too (the quiet tests
    of a file run back to back, not each after one more test beside them)."""

    def __init__(self, base: Path) -> None:
        self._turnstile = open(f"{base}.turnstile", "a+b")  # held for the session
        self._lock = open(f"{base}.lock", "a+b")
        self._exclusive = False

    def enter(self, quiet: bool) -> None:
        if quiet and self._exclusive:
            return
        if self._exclusive:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        if quiet:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        if not quiet:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
        self._exclusive = quiet

    def leave(self) -> None:
        if not self._exclusive:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def close(self) -> None:
        self._lock.close()  # closing releases the lock
        self._turnstile.close()


@pytest.fixture(scope="session")
def _quiet_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_QuietLock | None]:
    """This worker's :class:`_QuietLock`, its files in the run's base temporary directory
    (each worker's is a folder of it); ``None`` without xdist, where nothing runs beside a
    test."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield None
        return
    lock = _QuietLock(tmp_path_factory.getbasetemp().parent / "quiet")
    yield lock
    lock.close()


@pytest.fixture(autouse=True)
def _quiet_lock(request: pytest.FixtureRequest, _quiet_files: _QuietLock | None) -> Iterator[None]:
    if _quiet_files is None:
        yield
        return
    _quiet_files.enter(request.node.get_closest_marker("quiet") is not None)
    try:
        yield
    finally:
        _quiet_files.leave()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files run longest first, so that two workers finish together: the testbed and
    integration files before the unit files, and last the files with ``quiet`` tests, which
    by then run nearly alone. (xdist takes the files in this order: ``--no-loadscope-reorder``.)"""
    quiet_files = {item.path for item in items if item.get_closest_marker("quiet") is not None}

    def rank(item: pytest.Item) -> int:
        if item.path in quiet_files:
            return 3
        return {"testbed": 0, "integration": 1}.get(item.path.parent.name, 2)

    items.sort(key=rank)  # stable: each file's tests stay together and in order


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Four executor processes on loopback, shared by the tests of a session."""
    with LocalCluster(4, torch_threads=1) as c:
        yield c


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Reap any child process a test forgot (and say so). Under xdist each worker reaps its
    own; the controller's children are the workers, which xdist stops itself."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    server = fork_server_pid()  # its children are the tests' too: they go first, then it
    leftovers = [c for c in psutil.Process().children(recursive=True) if c.pid != server]
    for child in leftovers:
        logger.warning("reaping leftover child process %d (%s)", child.pid, " ".join(child.cmdline()[:4]))
        child.kill()
    psutil.wait_procs(leftovers, timeout=10)
    stop_fork_server()

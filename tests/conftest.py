"""Shared fixtures: a pool of real executor processes, free ports, seeds, and a reaper.

Every child process a test starts must be stopped by that test; the session-end reaper
is a safety net that kills any left over (and reports them), so a failed test never
leaves workers running.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import psutil
import pytest
import torch

from fusion.launch.executors import LocalCluster

logger = logging.getLogger(__name__)

# Coordinators the tests start calibrate each model for 0.3 s of compute, not the default
# 3 s (which averages a shared machine's speed phases for planning and the benchmarks):
# the tests check what calibration measures, not how steady the machine is, and a
# suite of some hundred jobs would pay the difference each time.
os.environ.setdefault("FUSION_CALIBRATE_S", "0.3")


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
    """Reap any child process a test forgot (and say so)."""
    leftovers = psutil.Process().children(recursive=True)
    for child in leftovers:
        logger.warning("reaping leftover child process %d (%s)", child.pid, " ".join(child.cmdline()[:4]))
        child.kill()
    psutil.wait_procs(leftovers, timeout=10)

"""The fork server: children that run ``python -m MODULE`` as a fresh interpreter would,
with their own exit codes, sessions, environments and import paths."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.launch.forkserver import ForkedChild, ForkServer
from fusion.launch.processes import ProcessGroup, child_env

pytestmark = pytest.mark.timeout(120)

PROBE = textwrap.dedent("""
    import json, os, sys, time
    import torch
    if sys.argv[1:2] == ["sleep"]:
        print("sleeping", flush=True)
        time.sleep(60)
    print(json.dumps({
        "argv": sys.argv[1:],
        "name": __name__,
        "env": os.environ.get("PROBE_VALUE"),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "sid": os.getsid(0) == os.getpid(),
        "stdin": sys.stdin.read(),
        "torch_threads": torch.get_num_threads(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
""")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


@pytest.fixture
def probe_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = child_env([str(tmp_path)])
    env["PROBE_VALUE"] = "from-the-caller"
    return env


def _run(server: ForkServer, env: dict[str, str], log: Path, *args: str, cwd: Path | None = None) -> ForkedChild:
    return server.spawn("probe_mod", list(args), env=env, log=log, cwd=cwd)


def test_a_child_runs_the_module_as_main_with_its_env_args_cwd_and_exit_code(
    server: ForkServer, probe_env: dict[str, str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    probe_env["PROBE_EXIT"] = "3"
    child = _run(server, probe_env, tmp_path / "probe.log", "a", "b c", cwd=work)
    assert child.wait(timeout=60) == 3 and child.returncode == 3 and child.poll() == 3
    out, err_line = tmp_path.joinpath("probe.log").read_text().strip().splitlines()[-2:]
    seen = json.loads(out)
    assert seen["argv"] == ["a", "b c"] and seen["name"] == "__main__"
    assert seen["env"] == "from-the-caller" and seen["cwd"] == str(work) and seen["path0"] == str(work)
    assert seen["sid"] and seen["stdin"] == ""  # a session of its own; stdin is /dev/null
    assert err_line == "to stderr"
    assert child.pid != server.pid


def test_a_killed_child_reads_as_killed_and_wait_times_out_before(
    server: ForkServer, probe_env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "sleep.log"
    child = _run(server, probe_env, log, "sleep")
    deadline = time.monotonic() + 30
    while "sleeping" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # reaped: nothing is sent to a pid that may have been reused


def test_the_server_answers_a_malformed_request_and_keeps_serving(
    server: ForkServer, probe_env: dict[str, str], tmp_path: Path
) -> None:
    control = server._ensure_started(probe_env)
    mine, theirs = socket.socketpair()
    with mine:
        socket.send_fds(control, [b"{not json\n"], [theirs.fileno()])
        theirs.close()
        mine.settimeout(30)
        assert mine.recv(256).decode().startswith("error: a malformed request")
    assert _run(server, probe_env, tmp_path / "after.log").wait(timeout=60) == 0


def test_a_group_forks_its_python_children_when_the_environment_asks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FUSION_FORK_SERVER", "1")
    (tmp_path / "probe_mod.py").write_text(PROBE)
    with ProcessGroup(tmp_path / "logs", extra_pythonpath=[str(tmp_path)]) as group:
        child = group.spawn("probe", ["-m", "probe_mod", "x"])
        assert isinstance(child, ForkedChild)
        assert child.wait(timeout=60) == 0
        assert group.log_of("probe").startswith("$ ")  # the command line, as for any child
        assert '"argv": ["x"]' in group.log_of("probe")
        plain = group.spawn("plain", ["-c", "print('not a module')"])
        assert isinstance(plain, subprocess.Popen)  # only ``-m`` children are forked
        assert plain.wait(timeout=60) == 0


def test_a_child_outlives_a_server_that_stops_and_then_reads_as_killed(
    probe_env: dict[str, str], tmp_path: Path
) -> None:
    server = ForkServer()
    log = tmp_path / "orphan.log"
    child = _run(server, probe_env, log, "sleep")
    server.close()
    assert child.poll() is None  # the server is gone; its child runs on
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL

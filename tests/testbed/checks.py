"""Checks shared by the netns and proxy testbed tests: measured links, teardown, a job run.

Throughput and RTT are measured by processes started on the testbed's hosts
(``python -m testbeds.net.measure``), dialing the address :meth:`Testbed.expose` gives the
source host, so the bytes take the path fusion's own traffic takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from fusion.launch import child_env
from testbeds.net.leftovers import marked_processes
from testbeds.net.testbed import Testbed, wait_for_line

HERE = Path(__file__).resolve().parent
LINKS = HERE / "links.toml"
JOB_LINKS = HERE / "job_links.toml"
#: The pairs whose throughput is checked: 1 Gbps, 100 Mbps (both directions of b-c) and 8 Mbps.
PAIRS = [("a", "b"), ("a", "c"), ("b", "c"), ("c", "b")]
#: Seconds of data each transfer carries at the configured rate.
TRANSFER_S = 2.0
TOLERANCE = 0.10
#: Transfers a throughput check may take before it fails (see :func:`check_throughput`).
THROUGHPUT_TRIES = 4


def measure_throughput(tb: Testbed, src: str, dst: str, *, seconds: float = TRANSFER_S) -> float:
    """Payload bytes/s of one bulk TCP transfer ``src -> dst`` as the receiver saw it."""
    return _transfer(tb, src, dst, seconds)[0]


def _transfer(tb: Testbed, src: str, dst: str, seconds: float) -> tuple[float, float]:
    """One bulk transfer: (steady payload bytes/s at the receiver, the bytes the link's
    shaper counted per payload byte over the whole transfer; 1.0 where it cannot tell)."""
    bandwidth, _ = tb.link(src, dst)
    port = tb.free_port(dst)
    routes = tb.expose(dst, port)
    log = tb.workdir / f"sink-{src}-{dst}-{port}.log"
    env = child_env()
    with open(log, "w") as f:
        sink = tb.spawn(
            dst,
            [sys.executable, "-m", "testbeds.net.measure", "sink", "--listen", f"{tb.address(dst)}:{port}"],
            env=env,
            stdout=f,
        )
    wait_for_line(log, r"ready", sink, 30)
    before = tb.link_bytes().get((src, dst))
    sender = tb.spawn(
        src,
        [
            sys.executable,
            "-m",
            "testbeds.net.measure",
            "send",
            "--to",
            routes[src],
            "--bytes",
            str(int(bandwidth * seconds)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    assert sender.wait(timeout=seconds * 5 + 30) == 0
    assert sink.wait(timeout=30) == 0
    result = json.loads(log.read_text().splitlines()[-1])
    after = tb.link_bytes().get((src, dst))
    shaped_per_payload = (
        (after - before) / result["bytes"] if before is not None and after is not None and result["bytes"] else 1.0
    )
    return float(result["bytes_per_s"]), shaped_per_payload


def _cpu_steal_share() -> Callable[[], float]:
    """Start counting this VM's steal time; the returned call gives the share of the CPUs'
    time the hypervisor took since (0 where ``/proc/stat`` has no steal column)."""

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])  # guest time is inside user

    steal0, total0 = read()

    def share() -> float:
        steal1, total1 = read()
        return (steal1 - steal0) / (total1 - total0) if total1 > total0 else 0.0

    return share


def check_throughput(tb: Testbed, src: str, dst: str) -> float:
    """The link's shaped rate over its configured bandwidth; asserts within 10 %.

    The shaped rate is the receiver's steady payload rate times the bytes the shaper counted
    per payload byte, measured over the same transfer: ``htb`` shapes frames, so a 1 Gbps
    netns link carries 1448 payload bytes in each 1514-byte frame (0.956 Gbps of payload),
    while the proxy's token bucket counts payload (a factor of 1). A shared VM can only
    slow a transfer down (its CPU stalls and the hypervisor's steal time lose the shaper's
    tokens), never speed it past the shaper, so the best of up to ``THROUGHPUT_TRIES``
    transfers, a second apart, is judged; a shaper set wrong fails every try.
    """
    bandwidth, _ = tb.link(src, dst)
    tries: list[tuple[float, float, float]] = []  # (shaped over configured, payload over configured, steal share)
    for attempt in range(THROUGHPUT_TRIES):
        if attempt:
            time.sleep(1.0)  # out of the noisy moment, if that was it
        steal = _cpu_steal_share()
        payload_bytes_per_s, shaped_per_payload = _transfer(tb, src, dst, TRANSFER_S)
        tries.append((payload_bytes_per_s * shaped_per_payload / bandwidth, payload_bytes_per_s / bandwidth, steal()))
        if abs(tries[-1][0] - 1) <= TOLERANCE:
            break
    shown = ", ".join(f"shaped {r:.3f} (payload {p:.3f}, steal {s:.1%})" for r, p, s in tries)
    print(f"{tb.backend} {src}->{dst}: configured {bandwidth * 8 / 1e6:.0f} Mbps, measured/configured: {shown}")
    assert any(abs(r - 1) <= TOLERANCE for r, _, _ in tries), (
        f"{src}->{dst} at {bandwidth * 8 / 1e6:.0f} Mbps configured, measured/configured: {shown}"
    )
    return tries[-1][0]


def measure_rtt(tb: Testbed, src: str, dst: str) -> float:
    """Median one-byte ping-pong time ``src -> dst -> src`` (seconds)."""
    port = tb.free_port(dst)
    routes = tb.expose(dst, port)
    env = child_env()
    log = tb.workdir / f"echo-{dst}-{port}.log"
    with open(log, "w") as f:
        echo = tb.spawn(
            dst,
            [sys.executable, "-m", "testbeds.net.measure", "echo", "--listen", f"{tb.address(dst)}:{port}"],
            env=env,
            stdout=f,
        )
    wait_for_line(log, r"ready", echo, 30)
    r = tb.spawn(
        src,
        [sys.executable, "-m", "testbeds.net.measure", "rtt", "--to", routes[src], "--count", "10"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = r.communicate(timeout=60)
    assert r.returncode == 0
    echo.kill()
    return float(json.loads(out)["rtt_s"])


def check_rtt(tb: Testbed, src: str, dst: str) -> float:
    """RTT is the configured latency both ways, plus at most 5 ms and 10 % of overhead."""
    expected = tb.link(src, dst)[1] + tb.link(dst, src)[1]
    rtt = measure_rtt(tb, src, dst)
    print(f"{tb.backend} {src}<->{dst}: expected RTT {expected * 1e3:.1f} ms, measured {rtt * 1e3:.2f} ms")
    assert expected <= rtt <= expected * 1.1 + 0.005, (rtt, expected)
    return rtt


# --------------------------------------------------------------------------- teardown
def root_veths() -> set[str]:
    r = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], check=False, capture_output=True, text=True)
    return {line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if ":" in line}


def leftovers_of(pid: int) -> dict[str, list[str]]:
    """Everything that carries the testbed prefix of the process ``pid``."""
    rx = f"fz{pid}"

    def ours(name: str) -> bool:
        return name.startswith(rx) and name[len(rx)] in "-n"

    found: dict[str, list[str]] = {"processes": [str(p) for p, prefix in marked_processes().items() if ours(prefix)]}
    found["dirs"] = [d.name for d in Path(tempfile.gettempdir()).glob(f"{rx}*") if ours(d.name)]
    if os.geteuid() == 0:
        r = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
        found["namespaces"] = [
            line.split()[0] for line in r.stdout.splitlines() if line.strip() and ours(line.split()[0])
        ]
    return {k: v for k, v in found.items() if v}


HOLD_SCRIPT = textwrap.dedent("""
    import sys, time
    from testbeds.net.backend import open_testbed
    tb = open_testbed(sys.argv[1], backend=sys.argv[2])
    for h in tb.hosts:
        tb.spawn(h, ["sleep", "600"])
    print("held", tb.prefix, flush=True)
    time.sleep(600)
""")


def start_holder(backend: str, *, script: bool) -> subprocess.Popen[str]:
    """``python -m testbeds up`` (``script=False``) or a script that also spawns a process
    on every host; returns once the testbed is built."""
    argv = (
        [sys.executable, "-c", HOLD_SCRIPT, str(LINKS), backend]
        if script
        else [sys.executable, "-m", "testbeds", "up", str(LINKS), "--backend", backend]
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), start_new_session=True
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "held" in line or "testbed ready" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"testbed holder did not come up:\n{''.join(lines)}")


def check_sigint_leaves_nothing(backend: str) -> None:
    before = root_veths() if os.geteuid() == 0 else set()
    proc = start_holder(backend, script=False)
    assert leftovers_of(proc.pid), "the testbed should exist while up runs"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "testbed removed" in out
    assert leftovers_of(proc.pid) == {}
    if os.geteuid() == 0:
        assert root_veths() <= before


def check_sigint_during_build_leaves_nothing(backend: str) -> None:
    """``up`` started with SIGINT ignored (as a non-interactive shell starts a background
    job) and interrupted as soon as its first namespace or directory exists, mid-build."""
    before = root_veths() if os.geteuid() == 0 else set()
    argv = [sys.executable, "-m", "testbeds", "up", str(LINKS), "--backend", backend]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    stale = leftovers_of(proc.pid)  # an earlier process with this pid may have left some (not ours to judge)

    def made() -> dict[str, list[str]]:
        now = leftovers_of(proc.pid)
        return {k: sorted(set(v) - set(stale.get(k, []))) for k, v in now.items() if set(v) - set(stale.get(k, []))}

    try:
        deadline = time.monotonic() + 60
        while not made() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "up exited before it built anything"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"up did not stop on SIGINT; its output:\n{out}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, 130), out  # interrupted mid-build, or just after it was ready
    assert made() == {}, out
    if os.geteuid() == 0:
        assert root_veths() <= before


def check_sigkill_then_down(backend: str, *, script: bool) -> None:
    before = root_veths() if os.geteuid() == 0 else set()
    proc = start_holder(backend, script=script)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()  # type: ignore[union-attr]
    left = leftovers_of(proc.pid)
    assert left.get("dirs"), left
    if script:
        # One sleep per host outlived its owner (beside the netns backend's delay lines).
        sleeps = [
            p
            for p in left.get("processes", [])
            if b"testbeds.net.delayline" not in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(sleeps) == 3, left
    if backend == "netns":
        assert len(left.get("namespaces", [])) == 4, left  # three hosts and the switch
    down = subprocess.run(
        [sys.executable, "-m", "testbeds", "down"],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert down.returncode == 0, down.stderr
    assert "removed" in down.stdout, down.stdout
    assert leftovers_of(proc.pid) == {}
    if os.geteuid() == 0:
        assert root_veths() <= before


# --------------------------------------------------------------------------- a job
def check_job_runs(backend: str, tmp_path: Path) -> None:
    """``python -m testbeds run`` trains GPT-2 tiny on 3 hosts to success, over the links."""
    job = tmp_path / "job.toml"
    job.write_text(
        textwrap.dedent(f"""
        name = "testbed-{backend}"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 8
        seq_len = 32
        shuffle = false
        [train]
        steps = 3
        micro_batches = 2
        optimizer = "sgd"
        lr = 0.5
        [cluster]
        min_workers = 3
        [plan]
        strategy = "uniform"
        [output]
        dir = "{tmp_path / "out"}"
    """)
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbeds",
            "run",
            str(JOB_LINKS),
            "--job",
            str(job),
            "--backend",
            backend,
            "--logs",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(out)
    assert proc.returncode == 0, out
    assert ": succeeded" in out and "steps 3/3" in out
    assert f"backend {backend}" in out
    # Stage traffic crossed the emulated links, and the backend counted it.
    assert "bytes over the emulated links" in out, out
    assert leftovers_of(proc.pid) == {}

"""The transport part of ``python -m testbeds.bench_core``: one executor process receives the
same bytes three ways, interleaved per repeat, and each is timed from the first byte sent
to the receiver's answer:

- **gRPC**: the full gRPC tensor path (``ProbeWhole``, or the chunked ``Probe`` stream past
  one chunk: header validation, reassembly into one buffer);
- **data plane**: a ``TRANSFER_KIND_PROBE`` frame on the executor's data port over TCP
  (:mod:`executor.frames`: header MAC, replay check, payload received into a preallocated
  buffer under its Poly1305 tag), signed with a job key the executor was admitted with;
- **unix**: the same frames over the executor's local path, its Unix socket
  (:mod:`executor.local_socket`), which co-located stages use;
- **socket**: a second process that receives length-prefixed bytes over a raw TCP socket
  into a preallocated buffer and answers one byte -- the ceiling.

The throughput rows keep the contract ``{size_mib, ratio, grpc_mb_per_s, socket_mb_per_s}``;
``ratio`` is the data plane (TCP) against the socket (``grpc_ratio``: gRPC, ``unix_ratio``:
the local path, both against the same TCP socket). The round-trip row times a small
transfer (64 KiB) on each path, and the ``cpu_per_transfer`` rows what each side of the
data plane and of the socket spends per transfer, in CPU microseconds.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

_SINK = r"""
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(MAX); view = memoryview(buf)
while True:
    hdr = c.recv(8, socket.MSG_WAITALL)
    if len(hdr) < 8:
        break
    n = int.from_bytes(hdr, "little"); got = 0
    while got < n:
        got += c.recv_into(view[got:n])
    c.sendall(b"k")
"""


#: Seconds a new executor spends at least on its start-up imports (~3 s on 2 cores); then
#: :func:`wait_until_warm` waits until it idles.
EXECUTOR_WARM_UP_S = 2.0
#: The job the benchmark admits on its executor to sign data-plane frames with.
BENCH_JOB = "bench-transport"


class SocketSink:
    """A separate process that receives length-prefixed bytes into a preallocated buffer."""

    def __init__(self, max_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SINK.replace("MAX", str(max_bytes))], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: memoryview) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(len(data).to_bytes(8, "little"))
        self.sock.sendall(data)
        if self.sock.recv(1) != b"k":
            raise RuntimeError("socket sink did not acknowledge")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=10)


class _Paths:
    """The three paths to one executor, each timing one transfer of ``n`` bytes."""

    def __init__(self, address: str, control_key: bytes, max_bytes: int) -> None:
        from executor.client import ChannelPool, ExecutorClient
        from executor.stream_client import DataPlaneClient
        from fusion.auth import new_key, wrap_job_key
        from fusion.wire import executor_pb2 as epb

        self.pool = ChannelPool()
        self.client = ExecutorClient(address, self.pool)
        job_key = new_key()
        self.client.admit_job(epb.AdmitJobRequest(job_id=BENCH_JOB, auth=wrap_job_key(control_key, job_key)))
        self.pool.keyring.set_job(BENCH_JOB, job_key)
        self.address = address
        self.data = DataPlaneClient(self.pool.keyring, local_path=False)
        self.local = DataPlaneClient(self.pool.keyring, local_path=True)
        port = self.client.ping().data_port
        if not port:
            raise RuntimeError(f"the executor at {address} serves no data plane")
        self.data.learn(address, port)
        self.local.learn(address, port)
        self.sink = SocketSink(max_bytes)
        self.payloads: dict[int, torch.Tensor] = {}

    def _payload(self, n: int) -> torch.Tensor:
        if n not in self.payloads:
            self.payloads[n] = torch.zeros(n, dtype=torch.uint8)
        return self.payloads[n]

    def grpc(self, n: int) -> float:
        return self.client.probe(n)[0]

    def _frame(self, client: Any, n: int) -> float:
        from fusion.wire import tensor_pb2 as pb

        header = pb.TransferHeader(job_id=BENCH_JOB, kind=pb.TRANSFER_KIND_PROBE)
        t0 = time.perf_counter()
        if client.send(self.address, header, {"probe": self._payload(n)}) != n:
            raise RuntimeError("the data plane did not take the probe")
        return time.perf_counter() - t0

    def data_plane(self, n: int) -> float:
        return self._frame(self.data, n)

    def unix(self, n: int) -> float:
        return self._frame(self.local, n)

    def socket(self, n: int) -> float:
        return self.sink.send(memoryview(self._payload(n).numpy()))

    def close(self) -> None:
        self.sink.close()
        self.data.close()
        self.local.close()
        self.pool.close()


#: Pause after each gRPC call before the next path is timed: the executor's gRPC threads
#: finish the call (Python code, holding the GIL) after the answer has left, and the next
#: transfer to the same process would wait for them.
SETTLE_S = 0.02


#: The paths compared with the socket, in the order the first repeat times them.
COMPARED = ("data", "unix", "socket")


def interleaved_orders(repeats: int) -> list[list[str]]:
    """The order of the paths in each repeat: the compared paths (:data:`COMPARED`) rotated
    by one per repeat, then gRPC with its settle pause. The transfer timed right after the
    pause meets caches the pause has cooled and a core that has gone idle, and takes up to
    twice as long (``testbeds/results/transport/README.md``): that slot goes to each compared
    path in turn, and ``repeats`` is rounded up to a multiple of their number so that each
    gets it equally often. (A rotation of one cyclic order including gRPC would not do: it
    keeps the path after gRPC the same in every repeat but one.)"""
    n = len(COMPARED)
    rounded = -(-repeats // n) * n
    return [[*COMPARED[r % n :], *COMPARED[: r % n], "grpc"] for r in range(rounded)]


def _medians(paths: _Paths, n: int, repeats: int) -> dict[str, float]:
    """Median seconds per path over the repeats of :func:`interleaved_orders`."""
    runs: dict[str, Callable[[int], float]] = {
        "data": paths.data_plane,
        "unix": paths.unix,
        "socket": paths.socket,
        "grpc": paths.grpc,
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for order in interleaved_orders(repeats):
        for name in order:
            times[name].append(runs[name](n))
            if name == "grpc":
                time.sleep(SETTLE_S)
    return {k: statistics.median(v) for k, v in times.items()}


def wait_until_warm(pids: Sequence[int], *, idle_cpu_percent: float = 5.0, timeout_s: float = 120.0) -> None:
    """Wait until new executor processes have finished warming up: for their first seconds
    (many more on a loaded machine) a background thread imports torch's optimizer machinery
    (``executor.server._warm_imports``) and holds the GIL, which times every call they serve
    at several milliseconds more, and takes a core from whatever is timed beside them. At
    least :data:`EXECUTOR_WARM_UP_S`; then until each uses at most ``idle_cpu_percent`` of a
    core over a second (or ``timeout_s`` has passed)."""
    import psutil

    time.sleep(EXECUTOR_WARM_UP_S)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        proc = psutil.Process(pid)
        while proc.cpu_percent(interval=1.0) > idle_cpu_percent and time.monotonic() < deadline:
            pass


def _with_paths(max_bytes: int, body: Callable[[_Paths, int], Any]) -> Any:
    """Run ``body(paths, executor_pid)`` against one warm local executor."""
    from fusion.launch.executors import LocalCluster

    with LocalCluster(1, torch_threads=1) as cluster:
        paths = _Paths(cluster.addresses[0], cluster.control_keys[0], max_bytes)
        try:
            for warm in (paths.grpc, paths.data_plane, paths.unix, paths.socket):
                warm(1 << 20)
            if paths.local.num_frames["unix"] != 1 or paths.data.num_frames["tcp"] != 1:
                raise RuntimeError(
                    f"the data plane took the wrong paths: {paths.local.num_frames, paths.data.num_frames}"
                )
            wait_until_warm([cluster.processes[0].pid])
            return body(paths, cluster.processes[0].pid)
        finally:
            paths.close()


def _rates(paths: _Paths, sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes_mib:
        n = mib << 20
        m = _medians(paths, n, repeats)
        g, d, u, s = (n / m[k] / 1e6 for k in ("grpc", "data", "unix", "socket"))
        rows.append(
            {
                "size_mib": mib,
                "grpc_mb_per_s": round(g, 1),
                "data_plane_mb_per_s": round(d, 1),
                "unix_mb_per_s": round(u, 1),
                "socket_mb_per_s": round(s, 1),
                "ratio": round(d / s, 3),
                "grpc_ratio": round(g / s, 3),
                "unix_ratio": round(u / s, 3),
            }
        )
    return rows


def _round_trip(paths: _Paths, size_kib: int, repeats: int) -> dict[str, Any]:
    m = _medians(paths, size_kib << 10, repeats)
    return {
        "size_kib": size_kib,
        "grpc_ms": round(m["grpc"] * 1e3, 3),
        "data_plane_ms": round(m["data"] * 1e3, 3),
        "unix_ms": round(m["unix"] * 1e3, 3),
        "socket_ms": round(m["socket"] * 1e3, 3),
    }


def _cpu_costs(paths: _Paths, executor_pid: int, sizes_kib: list[int], seconds: float) -> list[dict[str, Any]]:
    """Microseconds per transfer, back to back on each path for at least ``seconds``: wall
    time, the sender's CPU (this process) and the receiver's (the executor, or the socket's
    sink process), for the data plane over TCP and the raw socket. A round trip waits on one
    side and then the other, so its wall time is about the two CPU times added; and CPU time
    moves far less with what else the machine runs than wall time does, so these rows show
    where the data plane's extra time goes when the ratios drift. The receiver's CPU is read
    from ``/proc`` in clock ticks (10 ms): a second of transfers keeps that within a few
    percent."""
    import psutil

    def cpu_s(proc: psutil.Process) -> float:
        t = proc.cpu_times()
        return t.user + t.system

    paths_by_name = {
        "data": (paths.data_plane, psutil.Process(executor_pid)),
        "socket": (paths.socket, psutil.Process(paths.sink.proc.pid)),
    }
    rows = []
    for kib in sizes_kib:
        for name, (run, receiver) in paths_by_name.items():
            count = 0
            r0, s0, w0 = cpu_s(receiver), time.process_time(), time.perf_counter()
            while (wall := time.perf_counter() - w0) < seconds or count == 0:
                run(kib << 10)
                count += 1
            sender, received = time.process_time() - s0, cpu_s(receiver) - r0
            rows.append(
                {
                    "size_kib": kib,
                    "path": name,
                    "transfers": count,
                    "wall_us": round(wall / count * 1e6, 1),
                    "sender_cpu_us": round(sender / count * 1e6, 1),
                    "receiver_cpu_us": round(received / count * 1e6, 1),
                }
            )
    return rows


def measure_transport(
    sizes_mib: list[int],
    repeats: int,
    *,
    round_trip_kib: int = 64,
    round_trip_repeats: int = 200,
    cpu_sizes_kib: Sequence[int] = (64, 1024),
    cpu_seconds: float = 2.0,
) -> dict[str, Any]:
    """``{"transport": [row per size], "round_trip": {...}, "cpu_per_transfer": [...]}`` from
    one executor: median MB/s of gRPC, the data plane (TCP and Unix socket) and a raw TCP
    socket per size, and the median round trip of a ``round_trip_kib`` KiB transfer on each,
    all interleaved per repeat (:func:`_medians`); then the CPU each side spends per transfer
    of ``cpu_sizes_kib`` on the data plane and the socket (:func:`_cpu_costs`)."""
    largest = max(max(sizes_mib) << 20, round_trip_kib << 10, max(cpu_sizes_kib, default=0) << 10)
    return _with_paths(
        largest,
        lambda paths, pid: {
            "transport": _rates(paths, sizes_mib, repeats),
            "round_trip": _round_trip(paths, round_trip_kib, round_trip_repeats),
            "cpu_per_transfer": _cpu_costs(paths, pid, list(cpu_sizes_kib), cpu_seconds),
        },
    )

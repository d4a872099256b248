"""Measure an emulated link from the hosts themselves: bulk TCP throughput and round-trip time.

Run on testbed hosts (``Testbed.spawn``), so that the bytes take the same path as fusion's:

    python -m testbeds.net.measure sink --listen IP:PORT           # prints "ready PORT", then one JSON line
    python -m testbeds.net.measure send --to IP:PORT --seconds 3   # blasts bytes for that long (or --bytes N)
    python -m testbeds.net.measure echo --listen IP:PORT           # echoes until killed
    python -m testbeds.net.measure rtt --to IP:PORT --count 20     # prints one JSON line
    python -m testbeds.net.measure answer --listen IP:PORT         # answers each message until killed
    python -m testbeds.net.measure transfers --to IP:PORT --sizes 1024,131072   # one JSON line

Throughput is what the receiver saw after the first half second (``--warm``) to the last
byte: the link's steady rate, without connection set-up and TCP's slow start, which over a
50 ms round trip takes a few hundred milliseconds to open the window to the link's
bandwidth-delay product on any link, shaped or real (``ramp_bytes_per_s`` reports the
whole transfer from its first chunk). RTT is the median of one-byte ping-pongs on an open
connection (the connect itself is reported separately). ``transfers`` times single
messages as a pipeline sends them, each after a pause and each until the receiver's
one-byte answer (:mod:`testbeds.net.link_times`).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

RECV_BYTES = 1 << 20
SEND_BYTES = 1 << 18
#: Seconds of a transfer the steady rate leaves out (slow start: ~6 round trips at 80 ms).
WARM_S = 0.5


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _listen(address: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(_split(address))
    s.listen(4)
    print(f"ready {s.getsockname()[1]}", flush=True)
    return s


def sink(address: str, *, warm_s: float = WARM_S) -> dict[str, float]:
    """Accept one connection, read to EOF, report bytes and the steady receive rate (after
    ``warm_s``; the whole transfer's when it was shorter than that)."""
    with _listen(address) as s:
        conn, _ = s.accept()
    with conn:
        total = first = 0
        t_first = t_last = 0.0
        warm_bytes, t_warm = 0, None
        while True:
            data = conn.recv(RECV_BYTES)
            if not data:
                break
            now = time.perf_counter()
            if not first:
                first, t_first = len(data), now
            elif t_warm is None and now - t_first >= warm_s:
                warm_bytes, t_warm = total + len(data), now  # counted up to now
            total += len(data)
            t_last = now
    span_s = t_last - t_first
    ramp = (total - first) / span_s if span_s > 0 else 0.0
    steady = (total - warm_bytes) / (t_last - t_warm) if t_warm is not None and t_last > t_warm else ramp
    return {
        "bytes": total,
        "seconds": span_s,
        "bytes_per_s": steady,
        "ramp_bytes_per_s": ramp,
        "mbps": steady * 8 / 1e6,
    }


def send(address: str, seconds: float, size_bytes: int | None = None) -> dict[str, float]:
    """Send zeros for ``seconds`` (or exactly ``size_bytes`` if given), then close."""
    buf = bytes(SEND_BYTES)
    total = 0
    with socket.create_connection(_split(address), timeout=30) as c:
        end = time.perf_counter() + seconds
        while (total < size_bytes) if size_bytes is not None else (time.perf_counter() < end):
            chunk = buf if size_bytes is None else buf[: size_bytes - total]
            c.sendall(chunk)
            total += len(chunk)
        c.shutdown(socket.SHUT_WR)
        c.recv(1)  # wait for the receiver to close: the bytes were delivered, not only buffered
    return {"bytes": total}


def echo(address: str) -> None:
    """Echo every connection's bytes back until killed (one connection at a time)."""
    with _listen(address) as s:
        while True:
            conn, _ = s.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(65536):
                    conn.sendall(data)


def rtt(address: str, count: int) -> dict[str, float]:
    """Median one-byte ping-pong time on one connection, and the TCP connect time."""
    t0 = time.perf_counter()
    with socket.create_connection(_split(address), timeout=30) as c:
        connect_s = time.perf_counter() - t0
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            t = time.perf_counter()
            c.sendall(b"x")
            if c.recv(1) != b"x":
                raise OSError("echo server closed the connection")
            times.append(time.perf_counter() - t)
    return {"rtt_s": statistics.median(times), "min_rtt_s": min(times), "connect_s": connect_s}


def _drain(conn: socket.socket, n: int, buf: bytearray) -> bool:
    """Read and drop ``n`` bytes (through ``buf``); False when the peer closed first."""
    view = memoryview(buf)
    while n:
        k = conn.recv_into(view, min(n, len(buf)))
        if not k:
            return False
        n -= k
    return True


def answer(address: str) -> None:
    """Answer every length-prefixed message with one byte once all of it arrived (one
    connection at a time, until killed)."""
    buf = bytearray(RECV_BYTES)
    with _listen(address) as s:
        while True:
            conn, _ = s.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while len(header := conn.recv(8, socket.MSG_WAITALL)) == 8:
                    if not _drain(conn, int.from_bytes(header, "little"), buf):
                        break
                    conn.sendall(b"k")


def transfers(
    address: str, sizes: list[int], *, repeats: int, idle_s: float, warm: int = 3, burst: int = 0
) -> dict[str, list[float]]:
    """Median seconds from sending a message of each size to the receiver's answer, each
    message after ``idle_s`` of quiet (as a pipeline stage sends after computing).

    Each size gets its own connection, warmed by ``warm`` messages of that size first: TCP's
    pacing and window after a pause depend on what the connection carried before (over a
    80 ms round trip, 128 KB messages after only small ones took 123 ms, after a 2 MB one
    90 ms), and a pipeline's connection carries one size again and again. With ``burst``,
    the connection first carries one message of that many bytes, as the executors' data
    plane warms a new connection over a long link (:mod:`executor.stream_client`).
    """
    medians = []
    for n in sizes:
        with socket.create_connection(_split(address), timeout=60) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if burst:
                _message(c, burst)
            times = []
            for _ in range(warm + repeats):
                time.sleep(idle_s)
                t = time.perf_counter()
                _message(c, n)
                times.append(time.perf_counter() - t)
            medians.append(statistics.median(times[warm:]))
    return {"sizes": list(sizes), "seconds": medians}


def _message(c: socket.socket, size: int) -> None:
    """Send one message of ``size`` bytes to :func:`answer` and wait for its answer."""
    c.sendall(size.to_bytes(8, "little") + bytes(size))
    if c.recv(1) != b"k":
        raise OSError("answer server closed the connection")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m testbeds.net.measure", description="Bulk throughput and RTT over a testbed link."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sk = sub.add_parser("sink", help="receive one bulk transfer, print its rate")
    sk.add_argument("--listen", required=True)
    sk.add_argument(
        "--warm", type=float, default=WARM_S, help="seconds left out of the steady rate (default: %(default)s)"
    )
    snd = sub.add_parser("send", help="send bytes for a while")
    snd.add_argument("--to", required=True)
    snd.add_argument("--seconds", type=float, default=3.0)
    snd.add_argument("--bytes", type=int, default=None, help="send exactly this many bytes instead")
    sub.add_parser("echo", help="echo server for rtt").add_argument("--listen", required=True)
    r = sub.add_parser("rtt", help="ping-pong round-trip time")
    r.add_argument("--to", required=True)
    r.add_argument("--count", type=int, default=20)
    sub.add_parser("answer", help="answer each length-prefixed message (for transfers)").add_argument(
        "--listen", required=True
    )
    t = sub.add_parser("transfers", help="time single messages of several sizes, each until its answer")
    t.add_argument("--to", required=True)
    t.add_argument("--sizes", required=True, help="bytes, comma-separated")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument(
        "--idle", type=float, default=0.1, help="seconds of quiet before each message (default: %(default)s)"
    )
    t.add_argument("--burst", type=int, default=0, help="bytes sent once on each new connection first (default: none)")
    args = p.parse_args(argv)
    if args.cmd == "answer":
        answer(args.listen)
    elif args.cmd == "transfers":
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        print(
            json.dumps(transfers(args.to, sizes, repeats=args.repeats, idle_s=args.idle, burst=args.burst)), flush=True
        )
    elif args.cmd == "sink":
        print(json.dumps(sink(args.listen, warm_s=args.warm)), flush=True)
    elif args.cmd == "send":
        print(json.dumps(send(args.to, args.seconds, args.bytes)), flush=True)
    elif args.cmd == "echo":
        echo(args.listen)
    else:
        print(json.dumps(rtt(args.to, args.count)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m testbeds.chaos.loris HOST:PORT``: hostile connections to a gRPC server.

``--mode trickle`` opens ``--connections`` TCP connections and sends the HTTP/2 client
preface one byte a second on each (a slow-loris); ``--mode no_read`` sends the preface and
an empty SETTINGS frame, then keeps the connections open and never reads what the server
sends. Either way it stops after ``--seconds`` and closes everything.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: An empty HTTP/2 SETTINGS frame: length 0, type 4, flags 0, stream 0 (RFC 9113, 6.5).
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.chaos.loris", description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--mode", choices=("trickle", "no_read"), default="trickle")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    socks: list[socket.socket] = []
    end = time.monotonic() + args.seconds
    for _ in range(args.connections):
        try:
            s = socket.create_connection((host, int(port)), timeout=5.0)
        except OSError as e:
            print(f"connect to {args.address} failed: {e}", file=sys.stderr)
            continue
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the server's sends stall
        socks.append(s)
    sent = 0
    while time.monotonic() < end and socks:
        for s in list(socks):
            try:
                if args.mode == "trickle":
                    if sent < len(PREFACE):
                        s.send(PREFACE[sent : sent + 1])
                    else:
                        s.send(b"\x00")
                elif sent == 0:
                    s.sendall(PREFACE + EMPTY_SETTINGS)
            except OSError:
                socks.remove(s)
        sent += 1
        time.sleep(1.0)
    for s in socks:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

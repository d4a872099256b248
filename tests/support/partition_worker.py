"""``python -m tests.support.partition_worker --cut-file PATH``: ``fusion-worker`` behind links
that a test cuts and heals (:mod:`tests.support.partition`). Tests only.

While ``PATH`` exists the worker is cut off from everyone: its coordinator link, the calls
made to its executor (it advertises a relay in front of it) and its own calls to peers
(through the executor's channel-factory seam, :mod:`executor.hooks`) are all held. Remove
``PATH`` and the links are back.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Sequence

import grpc

from executor.hooks import default_channel
from fusion.cli.worker import build_parser, run_worker
from tests.support.partition import Relay


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(prog="python -m tests.support.partition_worker")
    parser.add_argument("--cut-file", required=True, metavar="PATH", help="the links are cut while PATH exists")
    args = parser.parse_args(argv)

    def cut() -> bool:
        return os.path.exists(args.cut_file)

    args.coordinator = Relay(args.coordinator, cut).address
    with socket.socket() as s:  # the executor's own port, with a relay in front that peers dial
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.listen = f"127.0.0.1:{port}"
    args.advertise = Relay(args.listen, cut).address
    relays: dict[str, Relay] = {}
    lock = threading.Lock()

    def channel(address: str, options: Sequence[tuple[str, int | str]], tls_ca: bytes | None) -> grpc.Channel:
        with lock:
            relay = relays.get(address) or relays.setdefault(address, Relay(address, cut))
        return default_channel(relay.address, options, tls_ca)

    return run_worker(args, channel_factory=channel)


if __name__ == "__main__":
    sys.exit(main())

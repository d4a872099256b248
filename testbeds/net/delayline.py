"""Link latency for every packet where the kernel has no ``sch_netem``: a TUN delay line.

The netns backend runs one of these in each host namespace that has a link of 1 ms or
more (:data:`testbeds.net.netns.DIRECT_LATENCY_S`). The namespace routes the addresses of
those hosts into the TUN device ``dly0``; this process reads each IP packet from it,
holds it for the one-way latency of the link to the packet's destination, and writes it
back. A packet written to a TUN device arrives in the namespace as if received on it; a
policy rule (``iif dly0``) sends it on through ``eth0``, where ``htb`` shapes the link as
for any other packet. So TCP and everything else (gloo's all-reduce, a ping, gRPC) see
the same latency a ``netem`` leaf would give, not only fusion's peer-mapped gRPC path.

Packets to one destination share one delay, so a FIFO per destination keeps them in
order and costs O(1) per packet. The device is opened with a virtio-net header and TCP
segmentation offload, as a VM's tap is: the kernel hands over TCP super-segments of up to
64 KB and cuts them to the MTU after the delay, on the way out of ``eth0``, so Python
moves a 1 Gbps link in a few thousand reads a second instead of 83,000 (each one frame).
Links under 1 ms, where the hop would add as much delay as the link has, are routed past.

    python -m testbeds.net.delayline --tun dly0 --delay 10.77.0.3=0.02 --delay 10.77.0.4=0.15
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import ipaddress
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable, Sequence

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
#: TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6: checksums and TCP segmentation left to the kernel.
TUN_OFFLOADS = 0x01 | 0x02 | 0x04
#: struct virtio_net_hdr, in front of every packet read and written with IFF_VNET_HDR.
VNET_HDR_BYTES = 10
#: Larger than any packet the namespace sends (MTU 1500; reads are one packet each).
READ_SIZE = 65_536
#: Packets read per wake-up at most, so due packets are not held behind a long burst.
READ_BATCH = 256


class DelayLineError(Exception):
    """The TUN device could not be opened or a delay is malformed."""


def open_tun(name: str, *, offload: bool = True) -> tuple[int, int]:
    """Attach to the (persistent) TUN device ``name``: a non-blocking fd of IP packets, and
    the bytes of header in front of each (``VNET_HDR_BYTES`` with offload, else 0)."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    except OSError as e:
        raise DelayLineError(f"cannot open /dev/net/tun: {e}") from e
    try:
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
        if offload:
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_OFFLOADS)
    except OSError as e:
        os.close(fd)
        if offload:
            return open_tun(name, offload=False)  # a kernel without TUN offloads: one frame per read
        raise DelayLineError(f"cannot attach to TUN device {name}: {e}") from e
    return fd, VNET_HDR_BYTES if offload else 0


def parse_delay(text: str) -> tuple[bytes, float]:
    """``"10.77.0.3=0.02"`` → (the address's 4 bytes, 0.02 s)."""
    address, sep, seconds = text.partition("=")
    try:
        packed = ipaddress.IPv4Address(address).packed
        delay = float(seconds)
    except ValueError as e:
        raise DelayLineError(f"--delay {text!r}: expected IPV4=SECONDS ({e})") from e
    if not sep or not 0 <= delay < 60:
        raise DelayLineError(f"--delay {text!r}: expected IPV4=SECONDS with 0 <= SECONDS < 60")
    return packed, delay


class DelayLine:
    """Holds each packet read from ``fd`` for its destination's delay, then writes it back."""

    def __init__(
        self, fd: int, delays: dict[bytes, float], *, header: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fd = fd
        self.header = header
        self.delays = delays
        self.clock = clock
        self.queues: dict[bytes, collections.deque[tuple[float, bytes]]] = {d: collections.deque() for d in delays}
        self.packets = 0
        self.dropped = 0

    def accept(self, packet: bytes, now: float) -> None:
        """Queue one packet (after ``header`` bytes, IPv4, destination at bytes 16-20);
        anything else goes straight on."""
        h = self.header
        dst = packet[h + 16 : h + 20] if len(packet) >= h + 20 and packet[h] >> 4 == 4 else b""
        queue = self.queues.get(dst)
        if queue is None:
            self._write(packet)
        else:
            queue.append((now + self.delays[dst], packet))

    def release(self, now: float) -> float | None:
        """Write every packet that is due; seconds until the next one is (None: none held)."""
        wait: float | None = None
        for queue in self.queues.values():
            while queue and queue[0][0] <= now:
                self._write(queue.popleft()[1])
            if queue:
                left = queue[0][0] - now
                wait = left if wait is None else min(wait, left)
        return wait

    def _write(self, packet: bytes) -> None:
        try:
            os.write(self.fd, packet)
            self.packets += 1
        except OSError:  # EAGAIN included
            self.dropped += 1  # the namespace's backlog is full: a router drops it too

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT."""
        clock = self.clock
        while True:
            wait = self.release(clock())
            readable, _, _ = select.select([self.fd], [], [], 1.0 if wait is None else wait)
            if not readable:
                continue
            now = clock()
            for _ in range(READ_BATCH):
                try:
                    packet = os.read(self.fd, READ_SIZE)
                except BlockingIOError:
                    break
                self.accept(packet, now)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.net.delayline", description=__doc__.split("\n\n")[0])
    p.add_argument("--tun", required=True, help="the TUN device to serve (created beforehand, e.g. by ip tuntap)")
    p.add_argument(
        "--delay",
        action="append",
        default=[],
        metavar="IPV4=SECONDS",
        help="one-way delay to a destination (repeatable)",
    )
    args = p.parse_args(argv)
    try:
        delays = dict(parse_delay(d) for d in args.delay)
        fd, header = open_tun(args.tun)
    except DelayLineError as e:
        print(f"delayline: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(
        f"ready: {args.tun}, {len(delays)} delayed destinations, {'TCP offload' if header else 'one frame per read'}",
        flush=True,
    )
    try:
        DelayLine(fd, delays, header=header).run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

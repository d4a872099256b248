"""The TUN delay line's queueing (``testbeds.net.delayline``) on a datagram socket pair in place
of the TUN device: each packet held for its destination's delay, order kept, other
packets straight through. The real device path is tested in tests/testbed/test_netns.py."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import pytest

from testbeds.net.delayline import DelayLine, DelayLineError, main, parse_delay

B = ipaddress.IPv4Address("10.77.0.2").packed
C = ipaddress.IPv4Address("10.77.0.3").packed


def packet(dst: bytes, tag: bytes) -> bytes:
    """A minimal IPv4 header (version 4, destination at bytes 16-20) and a payload."""
    return bytes([0x45]) + bytes(15) + dst + tag


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def received(sock: socket.socket, *, header: int = 20) -> list[bytes]:
    """Packets written so far, less their first ``header`` bytes."""
    out = []
    while True:
        try:
            out.append(sock.recv(65536)[header:])
        except BlockingIOError:
            return out


def test_packets_wait_for_their_destinations_delay_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    line = DelayLine(pair[0].fileno(), {B: 0.020, C: 0.150})
    line.accept(packet(B, b"b1"), now=0.0)
    line.accept(packet(C, b"c1"), now=0.001)
    line.accept(packet(B, b"b2"), now=0.002)
    assert line.release(0.010) == pytest.approx(0.010)  # b1 is due at 0.020
    assert received(pair[1]) == []
    assert line.release(0.0215) == pytest.approx(0.0005)  # b1 gone; b2 due at 0.022
    assert received(pair[1]) == [b"b1"]
    assert line.release(0.100) == pytest.approx(0.051)  # c1 due at 0.151
    assert received(pair[1]) == [b"b2"]
    assert line.release(0.151) is None
    assert received(pair[1]) == [b"c1"]
    assert line.packets == 3 and line.dropped == 0


def test_undelayed_and_non_ipv4_packets_go_straight_on(pair: tuple[socket.socket, socket.socket]) -> None:
    line = DelayLine(pair[0].fileno(), {B: 0.020})
    other = ipaddress.IPv4Address("10.77.0.9").packed
    line.accept(packet(other, b"x"), now=0.0)
    ipv6 = bytes([0x60]) + bytes(39) + b"y"
    line.accept(ipv6, now=0.0)
    assert [p[-1:] for p in received(pair[1], header=0)] == [b"x", b"y"]
    assert line.release(0.0) is None


def test_the_virtio_header_is_skipped_and_kept(pair: tuple[socket.socket, socket.socket]) -> None:
    """With TCP offload every packet comes (and goes back) behind a 10-byte virtio-net header."""
    line = DelayLine(pair[0].fileno(), {B: 0.020}, header=10)
    vnet = bytes(range(1, 11))
    line.accept(vnet + packet(B, b"b1"), now=0.0)
    line.accept(vnet + packet(C, b"c1"), now=0.0)  # C is not delayed: straight on
    assert received(pair[1], header=0) == [vnet + packet(C, b"c1")]
    line.release(0.020)
    assert received(pair[1], header=0) == [vnet + packet(B, b"b1")]


def test_a_write_the_namespace_refuses_counts_as_a_drop(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.close()  # the reader is gone: writes fail
    line = DelayLine(a.fileno(), {})
    line.accept(packet(B, b"z"), now=0.0)
    assert line.dropped == 1 and line.packets == 0


@pytest.mark.parametrize("text", ["10.77.0.2", "10.77.0.2=x", "nohost=0.1", "10.77.0.2=-1", "10.77.0.2=600"])
def test_malformed_delays_are_refused_by_name(text: str) -> None:
    with pytest.raises(DelayLineError, match="IPV4=SECONDS"):
        parse_delay(text)


def test_parse_delay() -> None:
    assert parse_delay("10.77.0.3=0.15") == (C, 0.15)


def test_cli_reports_a_bad_delay_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tun", "dly0", "--delay", "10.77.0.2=abc"]) == 2
    assert "IPV4=SECONDS" in capsys.readouterr().err

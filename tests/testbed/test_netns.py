"""The netns backend (root): namespaces, htb per destination, latency, teardown, a job."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbeds.net.backend import open_testbed
from testbeds.net.testbed import Testbed, netns_available
from tests.testbed import checks

_ok, _why = netns_available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"netns backend unavailable: {_why}")


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with open_testbed(checks.LINKS, backend="netns") as t:
        yield t


@pytest.mark.quiet
@pytest.mark.parametrize("src,dst", checks.PAIRS)
def test_link_throughput_within_10_percent(tb: Testbed, src: str, dst: str) -> None:
    checks.check_throughput(tb, src, dst)


@pytest.mark.quiet
@pytest.mark.parametrize("src,dst", [("a", "c"), ("b", "c")])
def test_round_trip_time_is_both_latencies(tb: Testbed, src: str, dst: str) -> None:
    """With netem or the TUN delay line every packet is delayed; with neither, the
    peer-mapped path is (userspace)."""
    assert tb.latency_mode in ("netem", "tun", "userspace")
    checks.check_rtt(tb, src, dst)


def test_tun_mode_delays_traffic_without_a_peer_map(tb: Testbed) -> None:
    """In tun mode no process needs the peer map: each host dials the server's own address,
    and the route to a host 10 ms away goes through the delay line's TUN device (the RTT
    test above then measures both latencies on that direct path)."""
    if tb.latency_mode != "tun":
        pytest.skip(f"latency mode is {tb.latency_mode}, not tun")
    port = tb.free_port("c")
    assert tb.expose("c", port) == {h: f"{tb.address('c')}:{port}" for h in tb.hosts}
    assert tb.peer_map_env("a") == {}
    route = subprocess.run(
        ["ip", "-n", tb.namespace("a"), "route", "get", tb.address("c")], capture_output=True, text=True, check=True
    )  # type: ignore[attr-defined]
    assert "dev dly0" in route.stdout, route.stdout


@pytest.mark.quiet
def test_link_bytes_count_what_each_link_carried(tb: Testbed) -> None:
    """htb's class counters: a transfer a -> c shows on that link, frames and all, not on others."""
    before = tb.link_bytes()
    payload = int(tb.link("a", "c")[0] * 0.5)
    checks.measure_throughput(tb, "a", "c", seconds=0.5)
    after = tb.link_bytes()
    sent = after[("a", "c")] - before.get(("a", "c"), 0)
    assert payload <= sent <= payload * 1.1 + 100_000, (sent, payload)  # TCP/IP/Ethernet headers: ~5 %
    assert after[("b", "c")] - before.get(("b", "c"), 0) < 50_000


def test_hosts_live_in_their_own_namespaces(tb: Testbed) -> None:
    from testbeds.net.netns import namespace_pids

    proc = tb.spawn("b", ["sleep", "30"])
    try:
        # `ip netns exec` enters the namespace after it has started: the pid shows there
        # a moment after spawn returns, not at once.
        deadline = time.monotonic() + 5.0
        while proc.pid not in namespace_pids(tb.namespace("b")) and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        assert proc.pid in namespace_pids(tb.namespace("b"))  # type: ignore[attr-defined]
        assert proc.pid not in namespace_pids(tb.namespace("a"))  # type: ignore[attr-defined]
    finally:
        proc.kill()
        proc.wait()


def test_up_sigint_leaves_nothing() -> None:
    checks.check_sigint_leaves_nothing("netns")


def test_up_sigint_during_the_build_leaves_nothing() -> None:
    checks.check_sigint_during_build_leaves_nothing("netns")


def test_sigkilled_up_then_down_cleans_up() -> None:
    checks.check_sigkill_then_down("netns", script=False)


def test_sigkilled_owner_with_processes_then_down_cleans_up() -> None:
    checks.check_sigkill_then_down("netns", script=True)


@pytest.mark.timeout(240)
def test_fusion_job_runs_on_netns_testbed(tmp_path: Path) -> None:
    checks.check_job_runs("netns", tmp_path)


def test_sub_millisecond_links_skip_the_delay_proxy(tmp_path: Path) -> None:
    """Without netem, a 0.5 ms LAN link is not sent through the user-space delay (proxy or
    TUN delay line: it would add as much delay as the link has, and CPU); a 20 ms link is."""
    topo = tmp_path / "lan.toml"
    topo.write_text(
        '[[hosts]]\nname = "a"\n[[hosts]]\nname = "b"\n[[hosts]]\nname = "c"\n'
        '[[links]]\nfrom = "a"\nto = "b"\nbandwidth_mbps = 1000\nlatency_ms = 0.5\n'
        '[[links]]\nfrom = "c"\nto = "a"\nbandwidth_mbps = 100\nlatency_ms = 20\n'
        '[[links]]\nfrom = "c"\nto = "b"\nbandwidth_mbps = 100\nlatency_ms = 20\n'
    )
    with open_testbed(topo, backend="netns") as t:
        if t.latency_mode == "tun":

            def dev(src: str, dst: str) -> str:
                out = subprocess.run(
                    ["ip", "-n", t.namespace(src), "route", "get", t.address(dst)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout  # type: ignore[attr-defined]
                return out.split(" dev ")[1].split()[0]

            assert dev("a", "b") == dev("b", "a") == "eth0"  # 0.5 ms: htb alone
            assert dev("a", "c") == dev("c", "b") == "dly0"  # 20 ms: the delay line
            return
        if t.latency_mode != "userspace":
            pytest.skip("the kernel has sch_netem: no link uses a user-space delay")
        port = t.free_port("a")
        routes = t.expose("a", port)
        assert routes["b"] == f"{t.address('a')}:{port}"  # direct: htb shapes it, no proxy
        assert routes["c"] != f"{t.address('a')}:{port}"  # through the 20 ms delay proxy


@pytest.mark.quiet
def test_link_times_time_each_link_class(tb: Testbed) -> None:
    """``testbeds.net.link_times`` on the hosts themselves: a small message takes the round trip
    (as the RTT check allows), a larger one at least half its bytes' time longer, for every
    ordered pair of clusters."""
    from testbeds.net.link_times import link_classes, measure_testbed

    doc = measure_testbed(tb, sizes=(1024, 65536), echo=print)
    assert (doc["backend"], doc["latency_mode"]) == ("netns", tb.latency_mode)
    assert set(doc["links"]) == {f"{a}->{b}" for a, b in link_classes(tb.topology)}
    for key, v in doc["links"].items():
        src, dst = v["hosts"]
        rtt = tb.link(src, dst)[1] + tb.link(dst, src)[1]
        small, large = v["seconds"]
        assert rtt <= small <= rtt * 1.1 + 0.005, (key, small, rtt)
        bandwidth = tb.link(src, dst)[0]
        assert large >= small + 0.5 * (65536 - 1024) / bandwidth - 0.002, (key, v["seconds"])  # the bytes take time too

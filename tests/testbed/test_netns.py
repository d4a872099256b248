"""The netns backend (root): namespaces, htb per destination, latency, teardown, a job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbeds.net import Testbed, netns_available, open_testbed
from tests.testbed import checks

_ok, _why = netns_available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"netns backend unavailable: {_why}")


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with open_testbed(checks.LINKS, backend="netns") as t:
        yield t


@pytest.mark.parametrize("src,dst", checks.PAIRS)
def test_link_throughput_within_10_percent(tb: Testbed, src: str, dst: str) -> None:
    checks.check_throughput(tb, src, dst)


@pytest.mark.parametrize("src,dst", [("a", "c"), ("b", "c")])
def test_round_trip_time_is_both_latencies(tb: Testbed, src: str, dst: str) -> None:
    """With netem every packet is delayed; without it the peer-mapped path is (userspace)."""
    assert tb.latency_mode in ("netem", "userspace")
    checks.check_rtt(tb, src, dst)


def test_hosts_live_in_their_own_namespaces(tb: Testbed) -> None:
    from testbeds.netns import namespace_pids

    proc = tb.spawn("b", ["sleep", "30"])
    try:
        assert proc.pid in namespace_pids(tb.namespace("b"))  # type: ignore[attr-defined]
        assert proc.pid not in namespace_pids(tb.namespace("a"))  # type: ignore[attr-defined]
    finally:
        proc.kill()
        proc.wait()


def test_up_sigint_leaves_nothing() -> None:
    checks.check_sigint_leaves_nothing("netns")


def test_sigkilled_up_then_down_cleans_up() -> None:
    checks.check_sigkill_then_down("netns", script=False)


def test_sigkilled_owner_with_processes_then_down_cleans_up() -> None:
    checks.check_sigkill_then_down("netns", script=True)


@pytest.mark.timeout(240)
def test_fusion_job_runs_on_netns_testbed(tmp_path: Path) -> None:
    checks.check_job_runs("netns", tmp_path)

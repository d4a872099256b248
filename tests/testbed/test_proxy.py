"""The proxy backend (no root): shaped loopback links, teardown, a fusion job through it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbeds.net.backend import open_testbed
from testbeds.net.testbed import Testbed
from tests.testbed import checks


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with open_testbed(checks.LINKS, backend="proxy") as t:
        yield t


@pytest.mark.quiet
@pytest.mark.parametrize("src,dst", checks.PAIRS)
def test_link_throughput_within_10_percent(tb: Testbed, src: str, dst: str) -> None:
    checks.check_throughput(tb, src, dst)


@pytest.mark.quiet
@pytest.mark.parametrize("src,dst", [("a", "c"), ("b", "c")])
def test_round_trip_time_is_both_latencies(tb: Testbed, src: str, dst: str) -> None:
    assert tb.latency_mode == "userspace"
    checks.check_rtt(tb, src, dst)


def test_hosts_have_distinct_loopback_addresses(tb: Testbed) -> None:
    addresses = [tb.address(h) for h in tb.hosts]
    assert len(set(addresses)) == len(tb.hosts) and all(a.startswith("127.0.") for a in addresses)
    routes = tb.expose("b", 1)  # nothing listens: a proxy only dials on demand
    assert routes["b"] == f"{tb.address('b')}:1"
    assert routes["a"].startswith(tb.address("a") + ":") and routes["c"].startswith(tb.address("c") + ":")


def test_up_sigint_leaves_nothing() -> None:
    checks.check_sigint_leaves_nothing("proxy")


def test_up_sigint_during_the_build_leaves_nothing() -> None:
    checks.check_sigint_during_build_leaves_nothing("proxy")


def test_sigkilled_owner_then_down_cleans_up() -> None:
    checks.check_sigkill_then_down("proxy", script=True)


@pytest.mark.timeout(240)
def test_fusion_job_runs_on_proxy_testbed(tmp_path: Path) -> None:
    checks.check_job_runs("proxy", tmp_path)

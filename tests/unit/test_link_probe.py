"""Link fitting from timed transfers (``fusion.profiling.fit_link`` and ``probe_link``),
with a synthetic link so the expected fit is known exactly."""

from __future__ import annotations

import pytest

from fusion.profiling import PROBE_MAX_TRANSFER_S, fit_link, probe_link

SIZES = (1 << 10, 64 << 10, 512 << 10, 4 << 20)


def link(latency_s: float, bandwidth: float, calls: list[int]):
    def probe(size: int) -> float:
        calls.append(size)
        return latency_s + size / bandwidth

    return probe


def test_fit_recovers_latency_and_bandwidth() -> None:
    samples = [(s, 0.02 + s / 1e7) for s in SIZES]
    latency, bandwidth = fit_link(samples)
    assert latency == pytest.approx(0.02) and bandwidth == pytest.approx(1e7)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(1024, 0.1), (1024, 0.2)])


def test_a_fast_link_gets_every_size_and_every_repeat() -> None:
    calls: list[int] = []
    latency, bandwidth = probe_link(link(0.001, 1.25e9, calls), SIZES, repeats=5)
    assert latency == pytest.approx(0.001) and bandwidth == pytest.approx(1.25e9)
    assert calls == [s for s in SIZES for _ in range(5)]


def test_a_slow_link_skips_the_big_transfers_and_still_fits() -> None:
    calls: list[int] = []
    bandwidth = 8e6 / 8  # 8 Mbps
    latency, fitted = probe_link(link(0.3, bandwidth, calls), SIZES, repeats=5)
    assert latency == pytest.approx(0.3) and fitted == pytest.approx(bandwidth)
    assert 4 << 20 not in calls  # would take 4.5 s, over PROBE_MAX_TRANSFER_S
    assert 0.3 + (4 << 20) / bandwidth > PROBE_MAX_TRANSFER_S
    # Repeats stop once a size has used its time budget (a 0.82 s transfer runs twice).
    assert calls.count(512 << 10) == 2
    assert sum(0.3 + s / bandwidth for s in calls) < 5.0  # was 30 s with every size 5 times

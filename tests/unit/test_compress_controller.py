"""AdaTopK's ratio controller (``compress.AdaTopK``): the keep ratio per link follows its
bandwidth to fit the target time, clamps, goes dense where that fits, smooths per link, and
refuses bad settings and measurements."""

from __future__ import annotations

import pytest

from compress import AdaTopK, num_kept, topk_encoded_size

MIB = 1 << 20


def ask(ctl: AdaTopK, bandwidth: float, *, link: str = "a->b", numel: int = MIB, latency_s: float = 0.01) -> float:
    return ctl.ratio(
        link, numel=numel, dense_bytes=4 * numel, bandwidth_bytes_per_s=bandwidth, latency_s=latency_s, target_s=0.1
    )


def test_controller_ratio_rises_with_bandwidth_and_fits_the_target() -> None:
    ratios = [ask(AdaTopK(min_keep_ratio=0.001), bw) for bw in (1e4, 1e6, 4e6, 1.6e7, 2.4e7)]
    assert ratios == sorted(ratios) and ratios[0] == 0.001 and ratios[-1] < 1.0
    for bw, r in zip((1e6, 4e6, 1.6e7, 2.4e7), ratios[1:], strict=True):
        k = num_kept(MIB, r)
        assert 0.01 + topk_encoded_size(MIB, k) / bw <= 0.1 + 1e-9
        assert 0.01 + topk_encoded_size(MIB, k + 1) / bw > 0.1  # the largest that fits


def test_controller_clamps_and_goes_dense() -> None:
    assert ask(AdaTopK(min_keep_ratio=0.05), 1e3) == 0.05  # nothing fits: the floor
    assert ask(AdaTopK(min_keep_ratio=0.05), 1e9, latency_s=0.2) == 0.05  # latency alone misses the target
    assert ask(AdaTopK(min_keep_ratio=0.01, max_keep_ratio=0.2), 3e7) == 0.2
    assert ask(AdaTopK(min_keep_ratio=0.01), 1e9) == 1.0  # dense fits
    # Top-k of every entry (fp16 values + bitmap) fits where dense does not: still below 1.
    assert ask(AdaTopK(min_keep_ratio=0.01), 3.5e7) == (MIB - 1) / MIB
    assert ask(AdaTopK(min_keep_ratio=1.0), 1e6) == 1.0  # compression not allowed
    assert ask(AdaTopK(min_keep_ratio=0.01), 1e9, numel=0) == 1.0
    # An fp16 tensor near ratio 1: top-k would be larger than dense, so send it dense.
    ctl = AdaTopK(min_keep_ratio=0.99)
    assert ctl.ratio("x", numel=MIB, dense_bytes=2 * MIB, bandwidth_bytes_per_s=1e6, latency_s=0.0, target_s=0.1) == 1.0


def test_controller_smooths_per_link() -> None:
    fast, slow = 1.6e7, 2e6
    r_fast, r_slow = ask(AdaTopK(min_keep_ratio=0.001), fast), ask(AdaTopK(min_keep_ratio=0.001), slow)
    ctl = AdaTopK(min_keep_ratio=0.001, smoothing=0.5)
    assert ctl.last("a->b") is None
    assert ask(ctl, fast) == r_fast and ctl.last("a->b") == r_fast
    assert ask(ctl, slow, link="c->d") == r_slow  # links are independent
    second = ask(ctl, slow)
    assert second == pytest.approx(0.5 * r_slow + 0.5 * r_fast)
    third = ask(ctl, slow)
    assert third == pytest.approx(0.5 * r_slow + 0.5 * second) and r_slow < third < second
    assert ask(ctl, 1e9) == 1.0 and ctl.last("a->b") == 1.0
    ctl.reset()
    assert ctl.last("a->b") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_keep_ratio": 0.0},
        {"min_keep_ratio": 0.5, "max_keep_ratio": 0.4},
        {"min_keep_ratio": 0.1, "smoothing": 0.0},
    ],
)
def test_controller_refuses_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaTopK(**kwargs)


def test_controller_refuses_bad_measurements() -> None:
    ctl = AdaTopK(min_keep_ratio=0.1)
    with pytest.raises(ValueError, match="bandwidth"):
        ask(ctl, 0.0)
    with pytest.raises(ValueError, match="latency"):
        ask(ctl, 1e6, latency_s=-1.0)
    with pytest.raises(ValueError, match="target"):
        ctl.ratio("l", numel=10, dense_bytes=40, bandwidth_bytes_per_s=1.0, latency_s=0.0, target_s=0.0)

"""Sends from a stage to one destination (``executor.sender.PeerSender``): paced at the
link's bandwidth where it is known, one at a time until each answer where it is not.

The client's ``send`` is replaced by one that records when each transfer starts and takes
``ANSWER_S`` to be answered (the real path is exercised by every multi-process test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from executor import sender as sender_module
from executor.client import ChannelPool
from executor.sender import PeerSender
from fusion.errors import NotFoundError
from fusion.wire import tensor_pb2 as pb

ANSWER_S = 0.3
SIZE_BYTES = 100_000
BANDWIDTH = 1e6  # 0.1 s of bytes per transfer


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, float]]]:
    recorded: list[tuple[int, float]] = []
    lock = threading.Lock()

    def send(self: object, header: pb.TransferHeader, tensors: dict, scalars: dict, *, encoded: dict) -> int:
        with lock:
            recorded.append((header.micro_batch_idx, time.monotonic()))
        time.sleep(ANSWER_S)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    monkeypatch.setattr(sender_module.ExecutorClient, "send", send)
    yield recorded


def send_three(link_bytes_per_s: dict[int, float]) -> list[tuple[int, float]]:
    pool = ChannelPool()
    peer = PeerSender("job", {1: "127.0.0.1:1"}, pool, link_bytes_per_s=link_bytes_per_s)
    try:
        payload = {"x": torch.zeros(SIZE_BYTES, dtype=torch.uint8)}
        futures = [peer(1, pb.TransferHeader(micro_batch_idx=m), payload, {}, {}) for m in range(3)]
        return [f.result(timeout=10) for f in futures]
    finally:
        peer.close()
        pool.close()


def test_a_paced_link_starts_each_transfer_as_the_last_ones_bytes_leave(starts: list[tuple[int, float]]) -> None:
    results = send_three({1: BANDWIDTH})
    assert [m for m, _ in starts] == [0, 1, 2]  # in order
    t = [at for _, at in starts]
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    # Each starts a transfer's bytes at the link's rate after the one before really started
    # (or at its answer, which comes later here), so never faster than the link.
    assert all(g >= SIZE_BYTES / BANDWIDTH - 0.02 for g in gaps), gaps
    assert t[2] - t[0] >= 2 * SIZE_BYTES / BANDWIDTH - 0.02, gaps
    assert t[2] - t[0] < ANSWER_S, gaps  # and not waiting for answers: the third starts before the first is answered
    assert [size for size, _ in results] == [SIZE_BYTES] * 3
    assert all(seconds >= ANSWER_S for _, seconds in results)  # each timed from its own start


def test_an_unknown_link_gets_one_transfer_at_a_time(starts: list[tuple[int, float]]) -> None:
    send_three({})
    t = [at for _, at in starts]
    assert [m for m, _ in starts] == [0, 1, 2]
    assert all(b - a >= ANSWER_S - 0.005 for a, b in zip(t, t[1:], strict=False)), t  # each after the last one's answer


def test_a_bandwidth_measured_too_low_is_never_slower_than_one_at_a_time(starts: list[tuple[int, float]]) -> None:
    send_three({1: 1.0})  # 100,000 s per transfer at this rate: each starts at the last one's answer instead
    t = [at for _, at in starts]
    assert [m for m, _ in starts] == [0, 1, 2]
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert all(ANSWER_S - 0.005 <= g < ANSWER_S + 0.2 for g in gaps), gaps


def test_an_unknown_stage_is_refused() -> None:
    pool = ChannelPool()
    peer = PeerSender("job", {1: "127.0.0.1:1"}, pool)
    with pytest.raises(NotFoundError, match="stage 7"):
        peer(7, pb.TransferHeader(), {}, {}, {})
    peer.close()
    pool.close()

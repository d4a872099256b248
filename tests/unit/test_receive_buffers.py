"""Receive buffers are reused only once no tensor can see them, and the pool stays bounded."""

from __future__ import annotations

import torch

from executor.receive_buffers import MIN_POOLED_BYTES, ReceiveBuffers

N = MIN_POOLED_BYTES


def test_a_buffer_is_reused_only_when_nothing_refers_to_it() -> None:
    pool = ReceiveBuffers()
    a = pool.tensor(N)
    a.fill_(1)
    view = a.view(torch.float32)[5:].reshape(-1)  # a view keeps the memory alive too
    del a
    b = pool.tensor(N)
    assert b.data_ptr() != view.data_ptr() - 20 and pool.num_reused == 0
    ptr = view.data_ptr() - 20
    del view
    c = pool.tensor(N)
    assert c.data_ptr() == ptr and pool.num_reused == 1
    assert pool.tensor(N).data_ptr() not in (b.data_ptr(), c.data_ptr())


def test_small_buffers_are_not_pooled_and_the_pool_is_bounded() -> None:
    pool = ReceiveBuffers(max_bytes=2 * N)
    small = pool.tensor(1024)
    assert small.numel() == 1024 and pool._held_bytes == 0
    held = [pool.tensor(N) for _ in range(3)]  # the third does not fit: handed out, not kept
    assert pool._held_bytes == 2 * N
    del held
    bigger = pool.tensor(2 * N)  # evicts the free buffers of the other size
    assert pool._held_bytes == 2 * N and bigger.numel() == 2 * N

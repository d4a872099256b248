"""A stop signal that lands on a thread other than the main one still stops the wait
(:mod:`fusion.stop_signals`). Whether an untimed wait would have missed it depends on what
else wakes the main thread (under pytest-xdist something does);
``tests/integration/test_coordinator.py`` shows a real worker missing it before the fix."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from fusion.stop_signals import STOP_SIGNALS, catch_stop_signals, wait_for_stop


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("restored_handlers")
@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_signal_another_thread_receives_stops_the_wait(sig: signal.Signals) -> None:
    stop = catch_stop_signals()
    other = threading.Thread(target=time.sleep, args=(10.0,), name="takes-the-signal", daemon=True)
    other.start()
    signal.pthread_kill(other.ident, sig)  # as the kernel may deliver a process's signal
    t0 = time.monotonic()
    wait_for_stop(stop)
    assert stop.is_set() and time.monotonic() - t0 < 2.0


@pytest.mark.usefixtures("restored_handlers")
def test_the_wait_goes_on_until_a_stop_signal() -> None:
    stop = catch_stop_signals()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    wait_for_stop(stop)
    assert time.monotonic() - t0 >= 0.45

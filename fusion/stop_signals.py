"""Waiting for SIGINT or SIGTERM in a long-running process: a worker, the coordinator, a bare
executor, a testbed held up.

CPython runs a signal's Python handler in the main thread only, and only when that thread
executes bytecode. The kernel delivers a signal sent to a process to one of its threads, not
always the main one (gRPC's and torch's threads take signals too). The C-level handler then
only marks the signal pending, and a main thread blocked in an untimed
``threading.Event.wait()`` sleeps on. A volunteer's Ctrl-C was lost that way: the worker
kept serving and never deregistered, in about one run in twenty of
``tests/integration/test_memory_cap.py``'s graceful leave. So :func:`wait_for_stop` waits in
slices of :data:`POLL_S`, and between two slices the main thread runs any pending handler: a
stop signal takes effect within that time, whichever thread received it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

#: Longest wait between two chances for the main thread to run a pending signal handler.
POLL_S = 0.2
#: The signals that ask a long-running process to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def catch_stop_signals(signals: Sequence[signal.Signals] = STOP_SIGNALS) -> threading.Event:
    """An event that any of ``signals`` sets from now on. Call from the main thread, which
    is the only one that may install handlers."""
    stop = threading.Event()
    for sig in signals:
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event, *, poll_s: float = POLL_S) -> None:
    """Return once ``stop`` is set. Call from the main thread: it wakes every ``poll_s``
    seconds to run the handlers of signals another thread received (module docstring)."""
    while not stop.wait(poll_s):
        pass

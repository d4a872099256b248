"""Which backend builds a testbed: :func:`open_testbed`, the one entry point.

``netns`` (root, Linux: :mod:`testbeds.net.netns`) where it can run, else ``proxy``
(user-space link proxies on loopback: :mod:`testbeds.net.proxy`); both are a
:class:`~testbeds.net.testbed.Testbed`.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from fusion.errors import ConfigError
from scheduler.topology import Topology
from testbeds.dilation import check_dilation, dilate_topology, dilation_label
from testbeds.net.netns import NetnsTestbed
from testbeds.net.proxy import ProxyTestbed
from testbeds.net.testbed import BACKENDS, Testbed, netns_available, new_prefix, resolve_topology

logger = logging.getLogger(__name__)


def open_testbed(
    topology: str | Path | Topology, *, backend: str = "auto", prefix: str | None = None, dilation: float = 1.0
) -> Testbed:
    """Build a testbed for ``topology`` (a Topology, a TOML path or a shipped file's name).

    ``backend`` is ``"netns"``, ``"proxy"`` or ``"auto"`` (netns when root with iproute2,
    else proxy). ``prefix`` must look like ``fz<pid>-``; by default one is made from this
    process's pid. The caller owns the result: ``with open_testbed(...) as tb:`` (it is also
    closed at interpreter exit, and SIGTERM is turned into ``SystemExit`` if it had no
    handler, so the ``with`` block unwinds).

    ``dilation`` ``D`` > 1 (time dilation, :mod:`testbeds.dilation`): every link is built
    ``D`` times slower (bandwidth over ``D``, latency times ``D``); ``tb.topology`` is the
    dilated one, and the label says ``dilated xD``.
    """
    topo, label = resolve_topology(topology)
    if check_dilation(dilation) != 1.0:
        topo, label = dilate_topology(topo, dilation), f"{label}, {dilation_label(dilation)}"
    if backend not in (*BACKENDS, "auto"):
        raise ConfigError(f"unknown testbed backend {backend!r}; use netns, proxy or auto")
    if backend == "auto":
        ok, why = netns_available()
        backend = "netns" if ok else "proxy"
        if not ok:
            logger.info("netns backend unavailable (%s); using the proxy backend", why)
    prefix = prefix or new_prefix()
    _install_sigterm_exit()
    if backend == "netns":
        return NetnsTestbed(topo, prefix=prefix, label=label)
    return ProxyTestbed(topo, prefix=prefix, label=label)


def _install_sigterm_exit() -> None:
    """Make SIGTERM unwind (``SystemExit``) so ``with open_testbed(...)`` tears down; only when
    SIGTERM still has its default action and we are on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

        def _exit(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _exit)

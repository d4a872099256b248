"""Network emulation: a topology file becomes hosts and shaped links on this machine.

- :mod:`testbeds.net.testbed`: the :class:`~testbeds.net.testbed.Testbed` every backend is
  (spawn a host's processes, expose a port through the links, tear down);
- :mod:`testbeds.net.backend`: :func:`~testbeds.net.backend.open_testbed`, netns or proxy;
- :mod:`testbeds.net.netns`: network namespaces, veth pairs and ``tc`` shaping (root);
- :mod:`testbeds.net.proxy`: user-space link proxies on loopback (no root);
- :mod:`testbeds.net.delayline`: a TUN device that adds the links' latency where the kernel
  has no ``sch_netem``;
- :mod:`testbeds.net.launch`: a coordinator and its workers started on a testbed's hosts,
  one job run there (``python -m testbeds run``);
- :mod:`testbeds.net.leftovers`: what a dead testbed left behind (``python -m testbeds down``);
- :mod:`testbeds.net.measure` and :mod:`testbeds.net.link_times`: the links measured.
"""

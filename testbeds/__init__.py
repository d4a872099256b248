"""The lab around fusion: emulated WAN testbeds, the benchmarks and the at-scale simulator.

- :mod:`testbeds.net`: network emulation (namespaces, link proxies, the delay line, a
  fleet launched on a testbed, link measurement); ``python -m testbeds {up,down,run}``;
- :mod:`testbeds.bench`: the side-by-side benchmark and its baselines, its summary and
  report, and the other benchmarks (core, codecs, recovery, scheduler, convergence, load);
- :mod:`testbeds.sim`: the simulator, an event replay on the estimator's cost model.

Nothing here ships in the wheel: the product does not know it is emulated or measured.
"""

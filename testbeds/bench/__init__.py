"""The benchmarks: fusion against the baselines on a testbed, and the product's parts alone.

- :mod:`testbeds.bench.harness`: the side-by-side benchmark (``python -m testbeds.bench``),
  its baselines (:mod:`testbeds.bench.baselines`), :mod:`~testbeds.bench.report` (one run's
  table and chart) and :mod:`~testbeds.bench.summary` (a set's table and targets);
- :mod:`testbeds.bench.machine_probe`: this machine's costs beyond the profile, for the
  simulator's validation;
- :mod:`testbeds.bench.timeline`: an executor trace of a run, step by step and link by link;
- :mod:`~testbeds.bench.core` (transport and steps against one process),
  :mod:`~testbeds.bench.codecs`, :mod:`~testbeds.bench.recovery`,
  :mod:`~testbeds.bench.scheduler` (OP-Fence against the optimum),
  :mod:`~testbeds.bench.convergence` and :mod:`~testbeds.bench.load_test` (the coordinator).
"""

"""The simulator: fusion's plans and the baselines priced at scales one host cannot run.

- :mod:`testbeds.sim.simulate`: every system on one topology; :mod:`testbeds.sim.cli` its
  command (``python -m testbeds.simulate``);
- :mod:`testbeds.sim.replay`: an event replay of the executor's step on the estimator's
  cost model (:mod:`scheduler.estimator`);
- :mod:`testbeds.sim.costs`: a job's node costs, profiled or from FLOPs;
  :mod:`testbeds.sim.topologies`: generated paper-N topologies and a testbed as it runs;
- :mod:`testbeds.sim.baselines` and :mod:`testbeds.sim.gloo`: DDP and GPipe over gloo;
  :mod:`testbeds.sim.block_split`: the pipelining baseline's even split;
- :mod:`testbeds.sim.validation`: each benchmark run priced as it ran, next to what it
  measured, with one machine's costs (:mod:`testbeds.sim.machine`) and measured links
  (:mod:`testbeds.sim.measured_links`).
"""

"""Chaos soak: a job on a testbed under a seeded schedule of kills, freezes, cuts and worse.

``python -m testbeds.chaos`` (:mod:`testbeds.chaos.__main__`). :mod:`~testbeds.chaos.schedule`
draws the events, :mod:`~testbeds.chaos.injectors` does them, :mod:`~testbeds.chaos.fleet`
holds the processes, :mod:`~testbeds.chaos.run` runs the job with and without events,
:mod:`~testbeds.chaos.compare`, :mod:`~testbeds.chaos.leaks` and :mod:`~testbeds.chaos.report`
say what came of it. A testbed tool: the product never imports it.
"""

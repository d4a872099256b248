"""``python -m testbeds.sim``: the simulator's command (:mod:`testbeds.sim.cli`)."""

from __future__ import annotations

from testbeds.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m testbeds.simulate``: the simulator's command, kept at its documented name
(:mod:`testbeds.sim.cli`)."""

from __future__ import annotations

from testbeds.sim.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m testbeds.bench_core``: the core benchmark, kept at its documented name
(:mod:`testbeds.bench.core`)."""

from __future__ import annotations

from testbeds.bench.core import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())

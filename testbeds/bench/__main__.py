"""``python -m testbeds.bench``: the side-by-side benchmark (:mod:`testbeds.bench.harness`)."""

from __future__ import annotations

from testbeds.bench.harness import main

if __name__ == "__main__":
    raise SystemExit(main())

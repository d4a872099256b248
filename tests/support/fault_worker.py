"""``python -m tests.support.fault_worker``: ``fusion-worker`` whose stages send corrupted
tensors (``--fault KIND[@STEP]``, :mod:`tests.support.fault`). Tests only."""

from __future__ import annotations

import sys

from fusion.cli.worker import build_parser, run_worker
from tests.support.fault import FAULT_HELP, Fault, FaultyStages


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(prog="python -m tests.support.fault_worker")
    parser.add_argument("--fault", required=True, metavar="FAULT", help=FAULT_HELP)
    args = parser.parse_args(argv)
    fault = Fault.parse(args.fault)
    assert fault is not None
    return run_worker(args, hooks=FaultyStages(fault))


if __name__ == "__main__":
    sys.exit(main())

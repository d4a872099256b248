"""``python -m testbeds.coordinator``: ``fusion-coordinator`` on a testbed host.

The same flags as ``fusion-coordinator``, plus ``--peer-map FILE`` (default
``$FUSION_PEER_MAP``, which the testbed sets): the coordinator dials workers' executors
(link probes, calibration, the jobs' drivers) through the testbed's link proxies, by the
executor's channel factory seam (:mod:`testbeds.peer_map`), so that its traffic crosses
the emulated links as the workers' does.
"""

from __future__ import annotations

import argparse
import sys

from fusion.cli.coordinator import main as coordinator_main
from testbeds.peer_map import PeerMap, add_peer_map_arg, peer_map_channels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbeds.coordinator",
        description="fusion-coordinator with a testbed's peer map; every other flag is fusion-coordinator's "
        "(see fusion-coordinator --help).",
        add_help=False,
    )
    add_peer_map_arg(parser)
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
    peer_map = args.peer_map
    channels = (lambda: peer_map_channels(PeerMap(peer_map))) if peer_map else None
    return coordinator_main(rest, channels=channels)


if __name__ == "__main__":
    sys.exit(main())

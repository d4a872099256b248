"""``python -m testbeds.job_profile JOB_ID``: print the profile a job was planned with, as JSON.

Asks the coordinator (``$FUSION_COORDINATOR``, with ``$FUSION_TOKEN``) through its
``GetProfile`` RPC, and prints one line: the coordinator's model profile in the form the
simulator and the baselines read (:func:`profile_document`). The benchmark runs it on the
testbed's first host, where the coordinator is reachable. Exit status 1 (and ``null``)
when the job has no profile yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fusion.cli.env import add_connection_args, resolve_token
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import FusionError
from fusion.wire import coordinator_pb2 as cpb


def profile_document(profile: cpb.GetProfileResponse) -> dict[str, Any]:
    """``{"nodes": {name: {"fwd_time_s", "bwd_time_s", "saved_bytes"}}, "matmul_flops",
    "optimizer_s_per_byte", "device_name", "compute_factor", "overhead_step_s",
    "overhead_micro_batch_s"}``: the coordinator's profile as it caches it (node seconds
    as measured; uncalibrated values ``None``). Whole-graph entries (``__graph__``) carry
    no ``saved_bytes``."""
    nodes: dict[str, dict[str, float]] = {}
    for n in profile.nodes:
        nodes[n.name] = {"fwd_time_s": n.forward_s, "bwd_time_s": n.backward_s}
        if not n.name.startswith("__"):
            nodes[n.name]["saved_bytes"] = n.saved_bytes
    return {
        "nodes": nodes,
        "matmul_flops": profile.matmul_flops,
        "optimizer_s_per_byte": profile.optimizer_s_per_byte,
        "device_name": profile.device_name,
        "compute_factor": profile.compute_factor if profile.calibrated else None,
        "overhead_step_s": profile.overhead_step_s if profile.calibrated else None,
        "overhead_micro_batch_s": profile.overhead_micro_batch_s if profile.calibrated else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.job_profile", description=__doc__.splitlines()[0])
    add_connection_args(p)
    p.add_argument("job_id")
    args = p.parse_args(argv)
    token = resolve_token(args.token, args.token_file)
    assert token is not None
    with CoordinatorClient(args.coordinator, token) as client:
        try:
            doc = profile_document(client.get_profile(args.job_id))
        except FusionError as e:
            print(f"no profile of job {args.job_id}: {e}", file=sys.stderr)
            print("null")
            return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m testbeds.simulate``: the simulator's command.

    python -m testbeds.simulate --topology testbeds/topologies/paper-48.toml --job job.toml
    python -m testbeds.simulate --topology paper-1024 --job job.toml --costs flops --json
    python -m testbeds.simulate --validate testbeds/results/bench/bench-*-*.json

Prices every system on each topology (:func:`testbeds.sim.simulate.simulate`), or with
``--validate`` prices each benchmark run as it ran next to what it measured
(:mod:`testbeds.sim.validation`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from fusion.config import load_job
from fusion.errors import FusionError
from scheduler.estimator import StepCosts
from testbeds.sim.costs import SYSTEMS, job_costs
from testbeds.sim.simulate import markdown_table, simulate
from testbeds.sim.topologies import load_topology, testbed_topology
from testbeds.sim.validation import print_validation, validate

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m testbeds.simulate",
        description="The at-scale simulator: predicted step time of fusion and the baselines on any topology.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--topology", action="append", default=[], help="TOML path, shipped name or paper-N; repeat for several"
    )
    p.add_argument("--job", default=None, help="job file (TOML)")
    p.add_argument(
        "--validate",
        nargs="+",
        default=None,
        metavar="BENCH_JSON",
        help="instead: simulate the runs of these `testbeds.bench --json` results and compare with what they measured",
    )
    p.add_argument(
        "--driver",
        default=None,
        help="host of fusion's coordinator, whose control path is then priced (default: the first host with "
        "--compute testbed, as testbeds.bench runs it; else none: the driver sits with the first stage)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=None,
        help="with --compute testbed: cores the hosts share (default: this machine's)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from %(default)s")
    p.add_argument(
        "--costs",
        choices=("profile", "flops"),
        default="profile",
        help="node costs: profiled here, or FLOPs / host speed",
    )
    p.add_argument(
        "--compute",
        choices=("topology", "testbed"),
        default="topology",
        help="host speeds from the file, or all at this machine's",
    )
    p.add_argument(
        "--no-latency", action="store_true", help="zero every link latency (a testbed without latency emulation)"
    )
    p.add_argument("--step-costs", default=None, help="JSON file of StepCosts fields (control_s, micro_batch_s, ...)")
    p.add_argument(
        "--time-budget", type=float, default=None, help="OP-Fence search budget in seconds (default: the planner's)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--out", default=None, help="also write PATH.md and PATH.json")
    args = p.parse_args(argv)
    command = "python -m testbeds.simulate " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if args.validate:
        return print_validation(
            validate([Path(v) for v in args.validate]), out=args.out, as_json=args.json, command=command
        )
    if not args.job or not args.topology:
        p.error("give --job and at least one --topology (or --validate)")
    try:
        spec = load_job(args.job)
        step = StepCosts(**json.loads(Path(args.step_costs).read_text())) if args.step_costs else None
        job = job_costs(spec, costs=args.costs, step=step)
        reports = {}
        for name in args.topology:
            topology = load_topology(name)
            if args.compute == "testbed" or args.no_latency:
                flops = job.reference_flops if args.compute == "testbed" else None
                topology = testbed_topology(topology, flops, latency=not args.no_latency)
            if args.driver in (None, "none"):
                driver = 0 if args.driver is None and args.compute == "testbed" else None
            else:
                driver = topology.index(args.driver)
            cores = (args.cores or os.cpu_count() or 1) if args.compute == "testbed" else None
            reports[Path(name).stem] = simulate(
                job, topology, systems, time_budget_s=args.time_budget, driver=driver, cores=cores
            )
    except FusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {
        "job": spec.to_dict(),
        "compute": args.compute,
        "step_costs": dataclasses.asdict(job.step),
        "reference_flops": job.reference_flops,
        "topologies": reports,
    }
    text = "\n".join(
        markdown_table(f"{name} ({r['num_hosts']} hosts, {job.costs} costs, {args.compute} speeds)", r)
        for name, r in reports.items()
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
        Path(args.out + ".md").write_text(f"# Simulated step times\n\n`{command}`\n\n{text}")
    print(json.dumps(doc, indent=2, default=float) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

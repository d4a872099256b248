"""``python -m testbeds.chaos``: run a job on a testbed while a seeded schedule hurts it.

    python -m testbeds.chaos --topology two-sites --job job.toml --minutes 5 --seed 1 \
        [--events-per-minute 2] [--json OUT] [--steps N] [--kinds kill,freeze,...]

Prints each event as it happens with what the job did about it, then the end report
(:mod:`testbeds.chaos.report`); ``--json OUT`` writes all of it. Exit status 0 when the
job finished with the uninterrupted run's model and nothing was left behind, 1 otherwise,
130 on Ctrl-C (after tearing everything down).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from testbeds.chaos.report import report_lines, summarise
from testbeds.chaos.run import ChaosOptions, run_chaos
from testbeds.chaos.schedule import KINDS

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--topology", required=True, help="topology file or shipped name")
    p.add_argument("--job", required=True, type=Path, help="job TOML")
    p.add_argument("--minutes", type=float, required=True, help="length of the injection window")
    p.add_argument("--seed", type=int, required=True, help="seed of the event schedule")
    p.add_argument("--events-per-minute", type=float, default=2.0)
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the whole report here")
    p.add_argument("--steps", type=int, default=None, help="override the job's train.steps")
    p.add_argument("--backend", default="auto", choices=("auto", "netns", "proxy"))
    p.add_argument("--heartbeat-timeout", type=float, default=6.0, help="the coordinator's (seconds)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated event kinds to draw from")
    p.add_argument(
        "--job-timeout", type=float, default=900.0, help="seconds to wait for the job's end after the events"
    )
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run (no model comparison)")
    p.add_argument(
        "--reference-model",
        type=Path,
        default=None,
        metavar="SAFETENSORS",
        help="compare with this model of the same job run elsewhere without events, instead of a reference run",
    )
    p.add_argument("--disk-mb", type=int, default=64, help="size of the tmpfs under the output directory")
    p.add_argument("--log-dir", type=Path, default=None, help="logs and outputs (default: /tmp/fusion-chaos-SEED-TIME)")
    p.add_argument("--schedule-only", action="store_true", help="print the schedule and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    opts = ChaosOptions(
        topology=args.topology,
        job=args.job,
        minutes=args.minutes,
        seed=args.seed,
        events_per_minute=args.events_per_minute,
        backend=args.backend,
        steps=args.steps,
        heartbeat_timeout_s=args.heartbeat_timeout,
        reference=not args.no_reference,
        reference_model=args.reference_model,
        log_dir=args.log_dir or Path(f"/tmp/fusion-chaos-{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"),
        disk_mb=args.disk_mb,
        job_timeout_s=args.job_timeout,
        kinds=kinds,
    )
    if args.schedule_only:
        from testbeds.chaos.schedule import ScheduleConfig, make_schedule  # noqa: PLC0415

        cfg = ScheduleConfig(minutes=args.minutes, events_per_minute=args.events_per_minute, kinds=kinds,
                             heartbeat_timeout_s=args.heartbeat_timeout)  # fmt: skip
        for e in make_schedule(args.seed, cfg):
            print(json.dumps(e.to_dict()))
        return 0

    def echo(line: str) -> None:
        print(line, flush=True)

    doc = run_chaos(opts, echo)
    doc["command"] = "python -m testbeds.chaos " + shlex.join(argv if argv is not None else sys.argv[1:])
    summary = summarise(doc)
    print()
    for line in report_lines(doc):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"  report: {args.json}")
    if doc.get("interrupted"):
        return 130
    ok = summary["finished"] and summary["model_equal"] is not False and summary["leftovers_clean"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m testbeds {up, down, run}``: emulated WAN testbeds from topology files.

    python -m testbeds up TOPOLOGY [--backend netns|proxy|auto] [--expose HOST:PORT ...]
    python -m testbeds down [--all] [--dry-run]
    python -m testbeds run TOPOLOGY --job JOB.toml [--backend ...] [--workers-per-host 1] [--allow-code]
        [--dilate D]

TOPOLOGY is a path or the name of a shipped file in ``testbeds/topologies``. Each host's
workers lend its ``memory_gb`` (``fusion-worker --memory-gb``). ``--dilate D`` runs the
testbed in dilated time (:mod:`testbeds.dilation`): compute and links ``D`` times slower,
the times reported divided by ``D`` and labelled ``dilated xD``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from pathlib import Path

from fusion.cli.env import add_log_arg, run_cli, setup_logging
from fusion.stop_signals import catch_stop_signals, wait_for_stop
from testbeds.net.backend import open_testbed
from testbeds.net.testbed import TOPOLOGY_DIR

logger = logging.getLogger(__name__)

#: Printed by ``up`` once the testbed is built (tests and scripts wait for it).
UP_READY = "testbed ready"


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in TOPOLOGY_DIR.glob("*.toml")))


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help=f"topology TOML file, or a shipped name ({_shipped()})")
    p.add_argument(
        "--backend",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="netns (root: namespaces + tc), proxy (no root: loopback + user-space link proxies), "
        "auto: netns when root (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m testbeds",
        description="Emulated WAN testbeds: a topology file's hosts and links on this machine.",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{up,down,run}")
    up = sub.add_parser(
        "up",
        help="build a testbed and keep it until Ctrl-C",
        description="Build the topology, print each host's address and how to run a command on it, "
        "keep it up until Ctrl-C (or SIGTERM), then tear it down.",
    )
    _add_topology_args(up)
    up.add_argument(
        "--expose",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="route a server you will run on HOST at PORT over the emulated links (repeatable); "
        "prints the address each host dials",
    )
    add_log_arg(up)
    down = sub.add_parser(
        "down",
        help="remove leftovers of testbeds whose owner died",
        description="Remove every leftover fusion testbed namespace (with its veths and bridge), "
        "spawned process and temp dir whose owning process is gone.",
    )
    down.add_argument("--all", action="store_true", help="also remove testbeds whose owner is still running")
    down.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    add_log_arg(down)
    run = sub.add_parser(
        "run",
        help="run a fusion job on a testbed",
        description="Build the topology, start fusion-coordinator on the first host and fusion-worker(s) "
        "on every host, submit the job, follow it to the end, print the summary, tear down.",
    )
    _add_topology_args(run)
    run.add_argument("--job", required=True, help="job TOML file (fusion submit format)")
    run.add_argument(
        "--workers-per-host", type=int, default=1, help="fusion-worker processes per host (default: %(default)s)"
    )
    run.add_argument(
        "--logs", default=None, help="directory for the coordinator's and workers' logs (default: a temp dir, kept)"
    )
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the job (default: %(default)s)")
    run.add_argument(
        "--emulate-speeds",
        action="store_true",
        help="emulate the topology's device speeds: workers on hosts slower than its fastest (flops / slowdown) "
        "compute that many times slower (testbeds.worker --emulate-slowdown); without it, only hosts with a "
        "slowdown are",
    )
    run.add_argument(
        "--allow-code",
        action="store_true",
        help="let the workers run the job's own model (module:factory, importable with this PYTHONPATH); "
        "each host's workers lend its memory_gb either way",
    )
    run.add_argument(
        "--dilate",
        type=float,
        default=1.0,
        metavar="D",
        help="time dilation: every host computes and every link carries D times slower, so that the hosts "
        "rarely compete for this machine's cores; reported times are divided by D (default: %(default)s, none)",
    )
    add_log_arg(run)
    return p


def _interrupt_the_build() -> None:
    """Let SIGINT stop ``up`` and ``run`` while they build, too: a process started as a
    background job of a non-interactive shell inherits SIGINT ignored, so an interrupt that
    came before ``up`` waited for it was lost and the testbed stayed up. As
    ``KeyboardInterrupt`` it unwinds the build, which removes what it made (SIGTERM does
    the same through :func:`testbeds.net.backend.open_testbed`)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_up(args: argparse.Namespace) -> int:
    _interrupt_the_build()
    with open_testbed(args.topology, backend=args.backend) as tb:
        print(tb.describe(), flush=True)
        for spec in args.expose:
            host, _, port = spec.rpartition(":")
            routes = tb.expose(host, int(port))
            print(
                f"{host}:{port} is reached as: " + ", ".join(f"{src} -> {via}" for src, via in routes.items()),
                flush=True,
            )
        # Caught before ``up`` says it is ready: an interrupt sent as soon as the ready line
        # is read (as a script or test does) then stops the wait, instead of landing between
        # the line and the handlers as a ``KeyboardInterrupt`` that tore the testbed down but
        # exited as interrupted.
        stop = catch_stop_signals()
        print(f"{UP_READY}: {tb.prefix} (Ctrl-C tears it down)", flush=True)
        wait_for_stop(stop)
        print("tearing down", flush=True)
    print("testbed removed", flush=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from testbeds.net.leftovers import sweep

    found = sweep(everything=args.all, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if not found:
        print("no testbed leftovers")
        return 0
    for what, items in (("namespace(s)", found.namespaces), ("process(es)", found.pids), ("temp dir(s)", found.dirs)):
        if items:
            print(f"{verb} {len(items)} {what}: {' '.join(map(str, items))}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from testbeds.dilation import check_dilation, dilation_label
    from testbeds.net.launch import run_job_on_testbed
    from testbeds.sim.topologies import emulated_slowdowns, slowdowns_label

    dilation = check_dilation(args.dilate)
    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="fusion-testbed-logs-"))
    _interrupt_the_build()
    with open_testbed(args.topology, backend=args.backend, dilation=dilation) as tb:
        print(tb.describe(), flush=True)
        print(f"logs in {log_dir}", flush=True)
        slowdowns = emulated_slowdowns(tb.topology, speeds=args.emulate_speeds)
        if slowdowns:
            print(f"emulating slower devices: {slowdowns_label(slowdowns)}", flush=True)
        if dilation != 1.0:
            print(f"{dilation_label(dilation)}: compute and links {dilation:g}x slower, times divided by {dilation:g}")
        status = run_job_on_testbed(
            tb,
            args.job,
            log_dir,
            workers_per_host=args.workers_per_host,
            timeout_s=args.timeout,
            echo=lambda s: print(s, flush=True),
            slowdowns=slowdowns,
            allow_code=args.allow_code,
            dilation=dilation,
        )
    print("testbed removed", flush=True)
    return 0 if status["state"] == "succeeded" else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    return run_cli({"up": lambda: cmd_up(args), "down": lambda: cmd_down(args), "run": lambda: cmd_run(args)}[args.cmd])


if __name__ == "__main__":
    sys.exit(main())

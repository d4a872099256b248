"""The side-by-side benchmark: fusion and its baselines on one emulated WAN, interleaved.

    python -m testbeds.bench --topology two-sites --job job.toml \
        --systems fusion,uniform,ddp,pipelining --steps 8 --repeats 2 --out testbeds/results/bench/bench-two-sites-gpt2

One testbed (:func:`testbeds.net.backend.open_testbed`, the ``netns`` backend: gloo cannot cross a
user-space proxy) runs every system on the same hosts and links; the systems take turns,
``--repeats`` rounds of each, so drift on a shared machine hits them alike. The systems:

- ``fusion``: a real ``fusion-coordinator`` (on the first host: the job owner sits at one
  site, and the driver's traffic crosses that host's links) and one ``fusion-worker`` per
  host, the job submitted with ``[plan] strategy = "opfence"`` and the job's own
  ``[compression]``; numbers come from the job's ``metrics.jsonl`` and ``summary.json``. Each
  worker lends its host's ``memory_gb`` (``--memory-gb``); with ``--allow-code`` the workers
  take the job's own ``module:factory`` model, importable with this process's path.
- ``fusion-dense``, ``uniform``, ``compute``: the same fleet, OP-Fence without compression,
  the naive even split in join order, and the compute-balanced split blind to links.
- ``fusion-grpc`` (only when named): ``fusion`` on a second coordinator and workers that
  run ``--no-data-plane``, so every tensor goes over gRPC: the data plane's before and after.
- ``ddp``: :mod:`testbeds.bench.baselines.ddp`, one rank per host; reported infeasible
  (with the bytes it needs per host) when a whole replica exceeds a host's ``memory_gb``.
- ``pipelining``: :mod:`testbeds.bench.baselines.pipelining`, GPipe over the first ``min(N,
  blocks)`` hosts; ``pipelining-best``: the same over the hosts a skilled user picks
  (:func:`testbeds.bench.systems.best_pipeline_hosts`).
- ``fsdp``: :mod:`testbeds.bench.baselines.fsdp`, FSDP2 with one rank per host.

:mod:`testbeds.bench.systems` defines them; :mod:`testbeds.bench.split_metrics` adds each
system's time to the target loss and its hosts' peak memory against their caps. The target
is a dense system's final loss over ``--steps``; with ``--overrun F`` every other system
runs ``ceil(steps * (1 + F))`` steps, so that a compressed run whose loss trails dense's at
the last shared step is timed to the target rather than reported as never reaching it.

Per system: the step seconds of each round, a mean over its timed steps with the extremes
trimmed (the first ``--warmup`` steps of a run are left out; this VM switches between
speeds in phases of a few seconds, 1 s windows 0.79-1.63x their median, and a median of a
fast system's steps falls in one such phase where a mean weighs them as a long run meets
them), the median of the rounds, samples (and tokens) per second, the bytes per step
on the slowest link it sends over (lowest configured bandwidth; both directions), its final
loss, fusion's speed-up over it, and, for fusion, its **efficiency**: the estimator's
predicted step time for the plan fusion ran (``predicted_step_s``, priced with the costs the
coordinator measured: profiled nodes, probed links, calibrated executor overheads, and the
bytes of the codecs AdaTopK chose where it chose any) divided by the measured step time,
the median over rounds of each round's own ratio (every round probes and plans afresh, and
may run another plan). 1.0 means the run is as fast as the model of its own plan says it
can be; below, the executor loses time the model does not see.

A host with a ``slowdown`` ``k`` (the topology file's testbed emulation factor) stretches
each computation of every system to ``k`` times its length (:mod:`testbeds.emulation`;
fusion's workers report the emulated speed, so its planner sees it). With
``--emulate-speeds`` the hosts keep the topology's device speed ratios instead: ``k`` is how
many times slower than the fastest host each is by ``flops / slowdown``. The table says so.

With ``--simulate`` the table also gets the simulator's prediction for each system
(:mod:`testbeds.sim.simulate` in testbed mode: this machine's speed on every host, its own
profile of the model, the coordinator's calibrated executor overheads) and its error.

With ``FUSION_TRACE_DIR`` set, the coordinator and the workers inherit it and write an
executor timeline of fusion's and uniform's runs (:mod:`executor.trace`; read it with
``python -m testbeds.bench.timeline DIR``).

Latency: this kernel has no ``sch_netem``; the netns backend adds every link's latency to
every packet with a TUN delay line per host (``latency_mode = "tun"``), so gloo's traffic
(ddp, pipelining) is delayed as fusion's is. Where TUN devices are missing too, latency is
added on fusion's gRPC path only (``"userspace"``). The JSON says which.

With ``--bandwidth-floor MBPS`` every link carries at least that bandwidth at its own
latency (:mod:`testbeds.free_bytes`): a dense run there shows how much of the step the
bandwidth costs, the most a codec could save.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fusion.config import load_job
from fusion.errors import FusionError
from fusion.profiling import measure_device, trimmed_mean
from scheduler.topology import Topology
from testbeds.bench.fusion_fleet import FusionFleet, write_profiled
from testbeds.bench.rank_runs import caps_of, run_baseline
from testbeds.bench.report import markdown, write_chart, write_loss_chart
from testbeds.bench.runs import Run
from testbeds.bench.split_metrics import add_split_metrics, overrun_steps, target_system
from testbeds.bench.systems import (
    EXTRA_SYSTEMS,
    FLEET_SYSTEMS,
    GRPC_ONLY_SYSTEMS,
    RANK_MODULES,
    SYSTEMS,
    system_job,
)
from testbeds.dilation import check_dilation, dilated_slowdowns, dilation_label, undilate_row
from testbeds.emulation import EMULATIONS
from testbeds.free_bytes import floor_bandwidth, floor_label
from testbeds.sim.topologies import MBPS, PACED_SENDS, emulated_slowdowns, slowdowns_label

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- job files
# ---------------------------------------------------------------- summary
def slowest_link_bytes(topology: Topology, bytes_per_link: dict[str, float]) -> tuple[int, float | None]:
    """(bytes over the lowest-bandwidth host pair used, both directions, the busiest such
    pair if several are as slow; its Mbit/s)."""
    names = topology.names()
    pairs: dict[frozenset[str], float] = {}
    bw: dict[frozenset[str], float] = {}
    for key, size in bytes_per_link.items():
        a, b = key.split("->")
        if a == b or size <= 0 or a not in names or b not in names:
            continue
        pair = frozenset((a, b))
        pairs[pair] = pairs.get(pair, 0.0) + size
        i, j = names.index(a), names.index(b)
        bw[pair] = min(topology.bandwidth_bytes_per_s[i][j], topology.bandwidth_bytes_per_s[j][i])
    if not pairs:
        return 0, None
    slowest = min(bw.values())
    return int(max(v for p, v in pairs.items() if bw[p] == slowest)), slowest / MBPS


def summarize(runs: list[Run], topology: Topology, *, warmup: int) -> dict[str, Any]:
    """One system's rounds → its row: trimmed means over timed steps, medians over rounds."""
    per_round = []
    predicted_rounds = []  # each round's prediction, for the rounds with a measurement
    for run in runs:
        timed = [r for r in run.records if r["step"] >= warmup] or run.records
        if timed:
            per_round.append(trimmed_mean([r["step_s"] for r in timed]))
            if run.predicted_step_s:
                predicted_rounds.append((run.predicted_step_s, per_round[-1]))
    last = runs[-1]
    row: dict[str, Any] = {
        "note": next((r.note for r in runs if r.note), ""),
        "rounds": len(per_round),
        "hosts_used": last.hosts_used,
        "peak_memory_bytes": {h: max(r.peak_memory_bytes.get(h, 0) for r in runs) for h in last.peak_memory_bytes},
        "memory_cap_bytes": dict(last.memory_cap_bytes),
    }
    if not per_round:
        row.update(samples_per_s=None, step_s=None, slowest_link_bytes=None, final_loss=None, losses=[])
        return row
    step_s = statistics.median(per_round)
    batch = last.records[0]["samples_per_s"] * last.records[0]["step_s"]
    timed = [r for r in last.records if r["step"] >= warmup] or last.records
    links: dict[str, float] = {}
    for r in timed:
        for k, v in r.get("bytes_per_link", {}).items():
            links[k] = links.get(k, 0.0) + v / len(timed)
    slow_bytes, slow_mbps = slowest_link_bytes(topology, links)
    row.update(
        samples_per_s=batch / step_s,
        step_s=step_s,
        step_s_rounds=per_round,
        slowest_link_bytes=slow_bytes,
        slowest_link_mbps=slow_mbps,
        final_loss=last.final_loss,
        losses=[r["loss"] for r in last.records],
    )
    if "tokens_per_s" in last.records[0]:
        tokens = last.records[0]["tokens_per_s"] * last.records[0]["step_s"]
        row["tokens_per_s"] = tokens / step_s
    if last.predicted_step_s:
        row["predicted_step_s"] = last.predicted_step_s
    if predicted_rounds:
        # Every round plans afresh from its own probes, and may pick another plan: each
        # round's prediction is set against that round's measurement.
        row["predicted_step_s_rounds"] = [predicted for predicted, _ in predicted_rounds]
        row["efficiency"] = statistics.median(predicted / measured for predicted, measured in predicted_rounds)
    if last.plan_stages:
        row["plan"] = last.plan_stages
    computed = [r["compute_s"] for r in timed if r.get("compute_s")]
    if computed:  # measured compute seconds per step on each stage's worker (fusion, uniform)
        row["compute_s"] = {w: trimmed_mean([c.get(w, 0.0) for c in computed]) for w in computed[-1]}
    ratios = [r["compression"] for r in timed if r.get("compression")]
    if ratios:
        row["keep_ratios"] = {k: statistics.median(x[k]["keep_ratio"] for x in ratios if k in x) for k in ratios[-1]}
    return row


def report(rows: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON contract: systems, fusion's speed-up over each baseline, its efficiency."""
    fusion = rows.get("fusion", {})
    speedup = {}
    for name, row in rows.items():
        if name != "fusion":
            speedup[name] = row["step_s"] / fusion["step_s"] if fusion.get("step_s") and row.get("step_s") else None
    efficiency = fusion.get("efficiency")
    return {**meta, "systems": rows, "speedup": speedup, "efficiency": efficiency}


def run_steps(systems: list[str], steps: int, overrun: float) -> dict[str, int]:
    """Steps each system runs: ``steps`` for the target system (whose final loss over them is
    the target), ``ceil(steps * (1 + overrun))`` for the others (module docstring)."""
    if overrun < 0:
        raise FusionError(f"--overrun must be 0 or more, got {overrun:g}")
    target = target_system(systems)
    return {s: steps if s == target else overrun_steps(steps, overrun) for s in systems}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from testbeds.net.backend import open_testbed
    from testbeds.net.testbed import resolve_topology

    spec = load_job(args.job)
    steps = args.steps or spec.train.steps
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS + EXTRA_SYSTEMS]
    if unknown:
        raise FusionError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    topology, label = resolve_topology(args.topology)
    if args.bandwidth_floor is not None:
        topology, label = (
            floor_bandwidth(topology, args.bandwidth_floor),
            f"{label}, {floor_label(args.bandwidth_floor)}",
        )
    dilation = check_dilation(args.dilate)
    slowdowns = emulated_slowdowns(topology, speeds=args.emulate_speeds)
    rank_slowdowns = dilated_slowdowns(slowdowns, topology.names(), dilation)
    emulation = args.emulation
    if slowdowns:
        print(f"emulating slower devices ({emulation}): {slowdowns_label(slowdowns)}", file=sys.stderr, flush=True)
    if slowdowns and emulation == "profile":
        fleet_at = min((i for i, s in enumerate(systems) if s in FLEET_SYSTEMS), default=len(systems))
        if any(s in RANK_MODULES for s in systems[:fleet_at]):
            raise FusionError(
                "--emulation profile prices the emulated computations from fusion's coordinator profile: "
                "list fusion or uniform before ddp and pipelining in --systems"
            )
    steps_of = run_steps(systems, steps, args.overrun)
    runs: dict[str, list[Run]] = {s: [] for s in systems}
    fleet_costs = None
    fleet_profile: dict[str, Any] | None = None
    with open_testbed(topology, backend=args.backend, dilation=dilation) as tb:
        workdir = Path(tb.workdir)
        # A fleet per data path its systems need (the data plane's, gRPC only), every worker
        # reporting one speed measured once here.
        data_paths = {s not in GRPC_ONLY_SYSTEMS for s in systems if s in FLEET_SYSTEMS}
        machine_flops = measure_device("cpu").matmul_flops if data_paths else None
        fleets = {
            data_plane: FusionFleet(
                tb,
                workdir if data_plane else workdir / "grpc-fleet",
                slowdowns=slowdowns,
                emulation=emulation,
                allow_code=args.allow_code,
                dilation=dilation,
                data_plane=data_plane,
                machine_flops=machine_flops,
            )
            for data_plane in data_paths
        }
        fleet = fleets.get(True) or fleets.get(False)
        profiled: Path | None = None
        for round_idx in range(args.repeats):
            for system in systems:
                logger.info("round %d: %s", round_idx + 1, system)
                t0 = time.monotonic()
                job = system_job(spec, system, steps=steps_of[system], num_hosts=len(tb.hosts), out_dir=workdir / "out")
                if system in FLEET_SYSTEMS:
                    run = fleets[system not in GRPC_ONLY_SYSTEMS].run_as_advised(job, system, timeout_s=args.timeout)
                else:
                    if rank_slowdowns and emulation == "profile" and profiled is None:
                        assert fleet is not None
                        profiled = write_profiled(fleet, spec, len(tb.hosts), workdir / "profiled.json")
                    run = run_baseline(
                        tb,
                        system,
                        job,
                        steps=steps_of[system],
                        workdir=workdir,
                        timeout_s=args.timeout,
                        slowdowns=rank_slowdowns,
                        emulation=emulation,
                        profiled=profiled,
                    )
                run_s = time.monotonic() - t0
                print(
                    f"  round {round_idx + 1} {system}: {len(run.records)} steps in {run_s:.1f}s {run.note}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[system].append(run)
        if fleet is not None:
            fleet_costs = fleet.step_costs()
            fleet_profile = fleet.model_profile()
        backend, latency_mode = tb.backend, tb.latency_mode
    rows = {s: undilate_row(summarize(runs[s], topology, warmup=args.warmup), dilation) for s in systems}
    target_name, target_loss = add_split_metrics(rows, caps_of(topology))
    meta = {
        "dilation": dilation,
        "topology": label,
        "job_name": spec.name or Path(args.job).stem,
        "num_hosts": len(topology),
        "backend": backend,
        "latency_mode": latency_mode,
        "step_statistic": "trimmed-mean",
        "sends": PACED_SENDS,
        "emulated_slowdown": slowdowns,
        "emulation": emulation,
        "emulate_speeds": bool(args.emulate_speeds),
        "steps": steps,
        "overrun": args.overrun,
        "warmup": args.warmup,
        "target_system": target_name,
        "target_loss": target_loss,
        "repeats": args.repeats,
        "command": "python -m testbeds.bench " + " ".join(sys.argv[1:]),
        "step_costs": fleet_costs,
        "job": spec.to_dict(),
        # The node costs the coordinator profiled: the simulator replays exactly these.
        "profile": None
        if fleet_profile is None
        else {
            k: fleet_profile.get(k)
            for k in ("nodes", "matmul_flops", "optimizer_s_per_byte", "device_name", "compute_factor")
        },
        # What fusion's coordinator measured before planning (speeds, machines, link fits).
        "measured": next((r.measured for r in runs.get("fusion", []) if r.measured), None),
    }
    doc = report(rows, meta)
    if args.simulate:
        from testbeds.sim.validation import add_simulation

        add_simulation(doc, Path(args.out).parent if args.out else Path("."))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m testbeds.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topology", help="topology file or shipped name (two-sites, three-continents, volunteers, ...)")
    p.add_argument("--job", help="job file (TOML)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated (default: %(default)s; also: {', '.join(EXTRA_SYSTEMS)})",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the job's)")
    p.add_argument(
        "--overrun",
        type=float,
        default=0.0,
        metavar="F",
        help="let every system but the target (pipelining-best, else fusion-dense) run F times more steps, "
        "to time a compressed run that reaches the target loss after the target's last step (default: %(default)s)",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="first steps of a run left out of the timing (default: %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--backend", default="netns", help="testbed backend (default: %(default)s; gloo needs netns)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default: %(default)s)")
    p.add_argument(
        "--emulate-speeds",
        action="store_true",
        help="emulate the topology's device speeds: hosts slower than its fastest (by flops / slowdown) compute "
        "that many times slower, in every system (each computation is followed by a sleep; labelled in the output). "
        "Without it, only hosts with a slowdown are emulated",
    )
    p.add_argument(
        "--emulation",
        choices=EMULATIONS,
        default="wall",
        help="what an emulated host's factor multiplies: each computation's wall time on this machine, or its "
        "seconds in fusion's coordinator profile, so that what this machine adds to a computation is paid once, "
        "not factor times (default: %(default)s; testbeds.emulation)",
    )
    p.add_argument(
        "--allow-code",
        action="store_true",
        help="let fusion's workers run the job's own model (module:factory, importable with this PYTHONPATH); "
        "each host's worker lends its memory_gb either way",
    )
    p.add_argument(
        "--dilate",
        type=float,
        default=1.0,
        metavar="D",
        help="time dilation: every host computes and every link carries D times slower; times reported are "
        "divided by D and labelled 'dilated xD' (default: %(default)s, none; testbeds.dilation)",
    )
    p.add_argument(
        "--bandwidth-floor",
        type=float,
        default=None,
        metavar="MBPS",
        help="raise every link's bandwidth to at least MBPS, latencies kept: a dense system's step there shows "
        "how much of the cell's step the bandwidth costs (testbeds.free_bytes; labelled in the output)",
    )
    p.add_argument("--simulate", action="store_true", help="add the simulator's prediction per system")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--out", default=None, help="write OUT.md, OUT.json and OUT.png")
    p.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="instead of running: re-render a result (with --simulate: re-simulate it)",
    )
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if not args.render and not (args.topology and args.job):
        p.error("give --topology and --job (or --render RESULT.json)")
    try:
        if args.render:
            doc = json.loads(Path(args.render).read_text())
            if "target_loss" in doc:  # a split-regime result: its targets as this code reads them
                doc["target_system"], doc["target_loss"] = add_split_metrics(doc["systems"], {})
            if args.simulate:
                from testbeds.sim.validation import add_simulation

                add_simulation(doc, Path(args.render).parent)
        else:
            doc = bench(args)
    except FusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(doc)
    if doc.get("dilation", 1.0) != 1.0:
        d = doc["dilation"]
        text = f"Times {dilation_label(d)}: measured on a testbed {d:g}x slower, divided by {d:g}.\n\n{text}"
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
        Path(f"{out}.md").write_text(text)
        write_chart(doc, Path(f"{out}.png"))
        write_loss_chart(doc, Path(f"{out}-loss.png"))
    print(json.dumps(doc, indent=2, default=_json_default) if args.json else text)
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (set, frozenset, tuple)):
        return list(v)
    return str(v)


if __name__ == "__main__":
    raise SystemExit(main())

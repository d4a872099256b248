"""The simulator against the testbed: each ``testbeds.bench`` run simulated as it ran, next
to what it measured (``python -m testbeds.simulate --validate BENCH_JSON...``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.config import JobSpec
from scheduler.estimator import StepCosts
from testbeds.sim.costs import job_costs
from testbeds.sim.machine import (
    PauseCost,
    TransferInterference,
    TransferPathCost,
    interference_beside,
    pause_cost_beside,
    transfer_path_beside,
)
from testbeds.sim.measured_links import with_link_times
from testbeds.sim.simulate import simulate, simulate_plan
from testbeds.sim.topologies import (
    PACED_SENDS,
    TCP_PAYLOAD_SHARE,
    load_topology,
    testbed_topology,
)


def validate(bench_results: list[Path], *, cores: int | None = None) -> list[dict[str, Any]]:
    """Simulate each benchmark run (same job, same topology, testbed speeds) next to what it measured.

    The testbed is priced as it ran: every host at this machine's speed on ``cores`` shared
    cores, fusion's coordinator on the first host with the executor overheads it calibrated
    (``step_costs`` in the result), and latency where the testbed emulated it: on fusion's
    path in ``userspace`` mode, everywhere with ``netem`` or ``tun``, nowhere with ``none``;
    netns links at the TCP payload share of their rate (``htb`` counts frames). fusion and
    uniform are priced on the plans they ran (recorded in the result), so this checks the
    step-time model, not the planner's choice on noisy device measurements. Where the
    links' message times were measured on the testbed (``links-<topology>.json`` beside
    the result, :mod:`testbeds.net.link_times`), pipelining's transfers take those; where the
    machine's pause cost was measured (``pause-cost.json`` beside it,
    :mod:`testbeds.bench.machine_probe`), fusion's and uniform's stages pay it after each wait, and
    each of their computations the transfers its process makes while it runs
    (:mod:`testbeds.sim.machine`).

    The machine is shared, so its speed during a run differs from its speed while profiling
    here (by 3x under load). A second prediction, ``calibrated``, replaces the profiled
    compute with what the run itself measured, to check the rest of the model (links,
    schedule, driver) on its own: each host of fusion's and uniform's plans computes as
    many times slower than profiled as the compute seconds it recorded (``compute_s``) are
    over the profile's for its stages; ddp and pipelining, which record no compute time,
    take the mean of fusion's and uniform's factors. (In a pipeline of several processes on
    the testbed's shared cores a stage's forward and backward take 1.3-2x the profile's
    time, on-CPU time included, while a whole model on one worker matches it, so one mean
    factor fits neither.)
    """
    rows = []
    for path in bench_results:
        doc = json.loads(path.read_text())
        rows.extend(
            validate_doc(
                doc,
                path.stem,
                cores=cores,
                links=link_times_beside(doc, path.parent),
                pause=pause_cost_beside(path.parent),
                transfer_path=transfer_path_beside(path.parent),
                interference=interference_beside(path.parent),
            )
        )
    return rows


def link_times_beside(doc: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """The testbed's measured link times (:mod:`testbeds.net.link_times`) when
    ``links-<topology>.json`` sits in ``directory`` and was measured on the run's backend
    and latency mode; else ``None`` (links priced as configured)."""
    path = directory / f"links-{doc['topology']}.json"
    if not path.exists():
        return None
    links = json.loads(path.read_text())
    if (links.get("backend"), links.get("latency_mode")) != (doc["backend"], doc["latency_mode"]):
        return None
    return links


def validate_doc(
    doc: dict[str, Any],
    label: str,
    *,
    cores: int | None = None,
    links: dict[str, Any] | None = None,
    pause: PauseCost | None = None,
    transfer_path: TransferPathCost | None = None,
    interference: TransferInterference | None = None,
) -> list[dict[str, Any]]:
    """:func:`validate` for one benchmark result document; ``links``: the testbed's measured
    link times (:func:`link_times_beside`), which then price the gloo baselines' transfers
    between the clusters they cover (each row's ``links`` says whether they did);
    ``pause``: the machine's pause cost, which fusion's and uniform's stages then pay in the
    profiled prediction (not in the calibrated one: the compute a run measured includes it;
    the gloo baselines are priced without it, as they were validated);
    ``transfer_path``: the executors' own work per transfer on this machine, which fusion's
    and uniform's transfers between stages then pay in both predictions; ``interference``:
    what a transfer costs a computation it overlaps in its process, which fusion's and
    uniform's computations then pay in the profiled prediction (like the pause cost, the
    compute a run measured includes it)."""
    sims = simulate_doc(
        doc, cores=cores, links=links, pause=pause, transfer_path=transfer_path, interference=interference
    )
    rows = []
    for name, step_s in ((n, r.get("step_s")) for n, r in doc["systems"].items()):
        sim = sims.profiled.get(name, {}).get("step_s")
        cal = sims.calibrated.get(name, {}).get("step_s")
        rows.append(
            {
                "bench": label,
                "system": name,
                "measured_step_s": step_s,
                "simulated_step_s": sim,
                "error": (sim - step_s) / step_s if sim and step_s else None,
                "compute_factor": sims.compute_factor,
                "calibrated_step_s": cal,
                "calibrated_error": (cal - step_s) / step_s if cal and step_s else None,
                "links": "measured" if links else "configured",
                "pause_cost": pause is not None and name in ("fusion", "uniform"),
                "transfer_path": transfer_path is not None and name in ("fusion", "uniform"),
                "interference": interference is not None and name in ("fusion", "uniform"),
                "driver_links": "measured"
                if sims.driver_links_measured and name in ("fusion", "uniform")
                else "configured",
            }
        )
    return rows


@dataclass(frozen=True)
class SimulatedRun:
    """Every system of one benchmark run as the simulator prices it (``SystemResult.to_dict()``
    by name, ``detail`` included: the replay's per-stage figures for fusion and uniform)."""

    profiled: dict[str, dict[str, Any]]
    calibrated: dict[str, dict[str, Any]]
    compute_factor: float
    """The mean factor of the compute the run measured over the profile's (1.0: none measured)."""
    driver_links_measured: bool
    """fusion's and uniform's driver calls took the round trips the run's coordinator measured
    (:func:`measured_driver_links`), not the configured links alone."""


def simulate_doc(
    doc: dict[str, Any],
    *,
    cores: int | None = None,
    links: dict[str, Any] | None = None,
    pause: PauseCost | None = None,
    transfer_path: TransferPathCost | None = None,
    interference: TransferInterference | None = None,
) -> SimulatedRun:
    """The two predictions :func:`validate_doc` compares (its arguments, the same meaning)."""
    cores = cores or os.cpu_count() or 1
    spec = JobSpec.from_dict(doc["job"]).replace(train={"steps": doc["steps"]})
    step = StepCosts(**doc["step_costs"]) if doc.get("step_costs") else None
    job = job_costs(spec, step=step, profile=doc.get("profile"))
    topology = load_topology(doc["topology"])
    mode = doc["latency_mode"]
    measured = set(doc["systems"])
    driver_links = measured_driver_links(doc, topology)
    emulation = doc.get("emulation", "wall")  # runs before --emulation stretched by the wall time

    def run_all(
        speed: float,
        host_factors: dict[str, dict[str, float]] | None = None,
        unseen_compute: bool = False,
    ) -> dict[str, dict[str, Any]]:
        """Every measured system; ``host_factors``: per system, hosts whose compute the run
        measured that many times the profile's (fusion and uniform, stage by stage);
        ``unseen_compute``: charge the compute a profile does not see but a run's measured
        compute includes (the pause cost and the transfer interference)."""
        share = TCP_PAYLOAD_SHARE if doc["backend"] == "netns" else 1.0
        emulated = doc.get("emulated_slowdown")  # hosts the run made slower (--emulate-speeds)
        host_factors = host_factors or {}

        def topo(with_latency: bool, name: str) -> Any:
            return testbed_topology(
                topology,
                speed,
                latency=with_latency,
                payload_share=share,
                emulated=emulated,
                compute_factors=host_factors.get(name),
                paced_sends=doc.get("sends") == PACED_SENDS,
            )

        # The measured message times are gloo's pattern (a receiver silent until the whole
        # message is in); fusion's gRPC transfers are priced at the configured links (see
        # testbeds.net.link_times for why they differ).
        sims: dict[str, dict[str, Any]] = {}
        for name in ("ddp", "pipelining"):
            if name in measured:
                gloo = topo(mode in ("netem", "tun"), name)
                gloo = with_link_times(gloo, links) if links and mode in ("netem", "tun") else gloo
                sims.update(simulate(job, gloo, (name,), cores=cores, emulation=emulation)["systems"])
        for name, strategy, compression in (("fusion", "opfence", "adatopk"), ("uniform", "uniform", "none")):
            if name in measured:
                given = doc["systems"][name].get("plan")
                sims[name] = simulate_plan(
                    job,
                    topo(mode != "none", name),
                    strategy=strategy,
                    compression=compression,
                    driver=0,
                    given=given,
                    cores=cores,
                    pause_cost=pause if unseen_compute else None,
                    transfer_cost=transfer_path,
                    interference=interference if unseen_compute else None,
                    driver_links=driver_links,
                    emulation=emulation,
                ).to_dict()
        return sims

    raw = run_all(job.reference_flops, unseen_compute=True)
    host_factors = {
        name: f
        for name in ("fusion", "uniform")
        if (f := _stage_factors(doc, name, raw.get(name), spec.train.micro_batches))
    }
    mean = [float(np.mean(list(f.values()))) for f in host_factors.values()]
    factor = float(np.mean(mean)) if mean else 1.0
    # ddp and pipelining record no compute time: they take the mean factor of fusion's and uniform's.
    if mean:
        calibrated = run_all(
            job.reference_flops / factor, {n: {h: v / factor for h, v in f.items()} for n, f in host_factors.items()}
        )
    else:  # nothing measured to calibrate on: the profile's compute, still without the pause cost
        calibrated = run_all(job.reference_flops) if pause is not None or interference is not None else raw
    return SimulatedRun(
        profiled=raw,
        calibrated=calibrated,
        compute_factor=factor,
        driver_links_measured=driver_links is not None,
    )


def measured_driver_links(doc: dict[str, Any], topology: Any) -> list[tuple[float, float]] | None:
    """The driver's ``(round_trip_s, bandwidth_bytes_per_s)`` to each host of ``topology``
    (the driver on its first host): the configured links plus, on every round trip, the
    gRPC round trip fusion's coordinator measured to the worker on its own host before
    planning (``measured`` in a bench result: its ``measured.json``); ``None`` where the
    result has none.

    The calibrated executor overheads (``step_costs``) leave out the driver's path at the
    measured round trip (:func:`fusion.coordinator.planning.calibrate_executor`), so the
    replay must put it back: priced from the configured links alone, the driver's calls to
    a worker on its own host would be free, where each is a gRPC round trip of ~2 ms on
    this machine (several per step). The links' latency and bandwidth stay as configured
    (the probe's fit of a slow link's bandwidth is the noisier figure)."""
    measured_topology = (doc.get("measured") or {}).get("topology") or {}
    links = measured_topology.get("driver_links")
    names = [w.get("name") for w in measured_topology.get("workers", [])]
    host = topology.names()[0]
    if not links or len(links) != len(names) or host not in names:
        return None
    local_rtt_s = float(links[names.index(host)][0])
    configured = topology.with_driver_at(0).driver_links
    return [(rtt + local_rtt_s, bw) for rtt, bw in configured]


def _stage_factors(doc: dict[str, Any], name: str, sim: dict[str, Any] | None, micro_batches: int) -> dict[str, float]:
    """Per host of ``name``'s plan: the compute the run measured there (``compute_s``) over
    what the profile predicts for the stages it ran ({} when the run recorded none). Under
    ``profile`` emulation an emulated host's sleep is the profile's by construction, so the
    factor is that of the part on the core."""
    got = doc["systems"].get(name, {}).get("compute_s") or {}
    detail = (sim or {}).get("detail", {})
    predicted: dict[str, float] = {}
    for host, stage_s in zip(detail.get("stages", []), detail.get("stage_compute_s", []), strict=False):
        predicted[host] = predicted.get(host, 0.0) + micro_batches * stage_s
    slowdown = (doc.get("emulated_slowdown") or {}) if doc.get("emulation") == "profile" else {}
    factors = {}
    for h, p in predicted.items():
        k = float(slowdown.get(h, 1.0))
        on_core = got.get(h, 0.0) - p * (k - 1.0) / k
        if on_core > 0 and p > 0:
            factors[h] = on_core / (p / k)
    return factors


def add_simulation(doc: dict[str, Any], directory: Path) -> None:
    """Write into a ``testbeds.bench`` result the simulator's step time for each system and
    its error against the measured one (:func:`validate_doc`: the plans fusion and uniform
    ran, the run's profile, and the same with compute calibrated on the run; the testbed's
    measured link times and the machine's pause costs where ``directory`` holds them)."""
    pause, path, interference = (
        pause_cost_beside(directory),
        transfer_path_beside(directory),
        interference_beside(directory),
    )
    doc["sim_pause_cost"], doc["sim_transfer_path"] = pause is not None, path is not None
    doc["sim_interference"] = interference is not None
    for v in validate_doc(
        doc,
        doc["topology"],
        links=link_times_beside(doc, directory),
        pause=pause,
        transfer_path=path,
        interference=interference,
    ):
        row = doc["systems"][v["system"]]
        row["simulated_step_s"], row["sim_error"] = v["simulated_step_s"], v["error"]
        row["calibrated_step_s"], row["calibrated_error"] = v["calibrated_step_s"], v["calibrated_error"]
        doc["compute_factor"] = v["compute_factor"]
        doc["sim_links"] = v["links"]
        if v["system"] in ("fusion", "uniform"):
            doc["sim_driver_links"] = v["driver_links"]


def print_validation(
    rows: list[dict[str, Any]], *, out: str | None = None, as_json: bool = False, command: str = ""
) -> int:
    """Print (and with ``out``, write ``out.md``, headed by ``command``, and ``out.json``) the
    comparison and its summary."""
    summary: dict[str, Any] = {"rows": rows}
    for key in ("error", "calibrated_error"):
        errors = [float(abs(r[key])) for r in rows if r.get(key) is not None]
        summary[key] = {
            "within_10pct": sum(e <= 0.10 for e in errors),
            "compared": len(errors),
            "median_abs": float(np.median(errors)) if errors else None,
        }
    lines = [
        "| run | system | measured s | simulated s | error | compute x | calibrated s | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        lines.append(
            f"| {r['bench']} | {r['system']} | {f(r['measured_step_s'], '.4g')} | {f(r['simulated_step_s'], '.4g')} | "
            f"{f(r['error'], '+.0%')} | {f(r['compute_factor'], '.2f')} | {f(r['calibrated_step_s'], '.4g')} | "
            f"{f(r['calibrated_error'], '+.0%')} |"
        )
    for key, label in (
        ("error", "profiled here"),
        ("calibrated_error", "compute calibrated on the run"),
    ):
        s_ = summary[key]
        if s_["compared"]:
            lines.append(
                f"\n{label}: {s_['within_10pct']} of {s_['compared']} within 10 %; "
                f"median |error| {f(s_['median_abs'], '.0%')}"
            )
    measured = sorted({r["bench"] for r in rows if r.get("links") == "measured"})
    lines.append(
        "\nDDP's and pipelining's messages priced from the links' measured message times "
        f"(`testbeds/net/link_times.py`) in: {', '.join(measured) or 'none'}; "
        "fusion's and uniform's gRPC transfers at the configured links; DDP's gradient buckets all-reduced "
        "as each rank's backward makes them ready, gloo's ring replayed message by message (`testbeds/sim/gloo.py`)"
    )
    paused = sorted({r["bench"] for r in rows if r.get("pause_cost")})
    pathed = sorted({r["bench"] for r in rows if r.get("transfer_path")})
    interfered = sorted({r["bench"] for r in rows if r.get("interference")})
    lines.append(
        "\nfusion's and uniform's stages pay the machine's measured cost of computing after a pause "
        f"(`testbeds/bench/machine_probe.py`, profiled column only) in: {', '.join(paused) or 'none'}; "
        f"and their transfers the executors' measured transfer path (both columns) in: {', '.join(pathed) or 'none'}; "
        "their computations the measured cost of the transfers their process makes meanwhile "
        f"(`testbeds/sim/machine.py`, profiled column only) in: {', '.join(interfered) or 'none'}"
    )
    driven = sorted({r["bench"] for r in rows if r.get("driver_links") == "measured"})
    lines.append(
        "\nfusion's and uniform's driver calls pay the gRPC round trip the coordinator measured to the worker "
        f"on its own host, on top of the configured links, in: {', '.join(driven) or 'none'}"
    )
    text = "\n".join(lines) + "\n"
    if out:
        Path(out + ".json").write_text(json.dumps(summary, indent=2) + "\n")
        Path(out + ".md").write_text(f"# Simulator vs testbed\n\n`{command}`\n\n{text}")
    print(json.dumps(summary, indent=2) if as_json else text)
    return 0

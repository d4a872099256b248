"""The simulator against the testbed: each ``testbeds.bench`` run simulated as it ran, next
to what it measured (``python -m testbeds.simulate --validate BENCH_JSON...``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fusion.config import JobSpec
from scheduler.estimator import StepCosts
from testbeds.sim_topologies import TCP_PAYLOAD_SHARE, load_topology, testbed_topology
from testbeds.simulate import job_costs, simulate, simulate_plan


def validate(bench_results: list[Path], *, cores: int | None = None) -> list[dict[str, Any]]:
    """Simulate each benchmark run (same job, same topology, testbed speeds) next to what it measured.

    The testbed is priced as it ran: every host at this machine's speed on ``cores`` shared
    cores, fusion's coordinator on the first host with the executor overheads it calibrated
    (``step_costs`` in the result), and latency where the testbed emulated it: on fusion's
    path in ``userspace`` mode, everywhere with ``netem`` or ``tun``, nowhere with ``none``;
    netns links at the TCP payload share of their rate (``htb`` counts frames). fusion and
    uniform are priced on the plans they ran (recorded in the result), so this checks the
    step-time model, not the planner's choice on noisy device measurements.

    The machine is shared, so its speed during a run differs from its speed while profiling
    here (by 3x under load). A second prediction, ``calibrated``, rescales the profiled
    compute by what the run itself measured: the stages' compute seconds fusion and uniform
    recorded (``compute_s``) over what the profile predicts for the same stages; ddp and
    pipelining, which record no compute time, take the mean factor of the two.
    """
    rows = []
    for path in bench_results:
        rows.extend(validate_doc(json.loads(path.read_text()), path.stem, cores=cores))
    return rows


def validate_doc(doc: dict[str, Any], label: str, *, cores: int | None = None) -> list[dict[str, Any]]:
    """:func:`validate` for one benchmark result document."""
    rows = []
    cores = cores or os.cpu_count() or 1
    spec = JobSpec.from_dict(doc["job"]).replace(train={"steps": doc["steps"]})
    step = StepCosts(**doc["step_costs"]) if doc.get("step_costs") else None
    job = job_costs(spec, step=step, profile=doc.get("profile"))
    topology = load_topology(doc["topology"])
    mode = doc["latency_mode"]
    measured = {n: r.get("step_s") for n, r in doc["systems"].items()}

    def run_all(speed: float) -> dict[str, dict[str, Any]]:
        share = TCP_PAYLOAD_SHARE if doc["backend"] == "netns" else 1.0
        emulated = doc.get("emulated_slowdown")  # hosts the run made slower (--emulate-speeds)
        fusion_topo = testbed_topology(topology, speed, latency=mode != "none", payload_share=share, emulated=emulated)
        gloo_topo = testbed_topology(topology, speed, latency=mode in ("netem", "tun"), payload_share=share, emulated=emulated)
        sims = simulate(job, gloo_topo, tuple(n for n in ("ddp", "pipelining") if n in measured), cores=cores)["systems"]
        for name, strategy, compression in (("fusion", "opfence", "adatopk"), ("uniform", "uniform", "none")):
            if name in measured:
                given = doc["systems"][name].get("plan")
                sims[name] = simulate_plan(
                    job, fusion_topo, strategy=strategy, compression=compression, driver=0, given=given, cores=cores
                ).to_dict()
        return sims

    raw = run_all(job.reference_flops)
    factors = []
    for name in ("fusion", "uniform"):
        got = doc["systems"].get(name, {}).get("compute_s")
        sim_row = raw.get(name, {})
        if got and sim_row.get("detail", {}).get("stage_compute_s"):
            predicted = spec.train.micro_batches * sum(sim_row["detail"]["stage_compute_s"])
            if predicted > 0:
                factors.append(sum(got.values()) / predicted)
    factor = float(np.mean(factors)) if factors else 1.0
    calibrated = run_all(job.reference_flops / factor) if factors else raw
    for name, step_s in measured.items():
        sim = raw.get(name, {}).get("step_s")
        cal = calibrated.get(name, {}).get("step_s")
        rows.append({
            "bench": label, "system": name, "measured_step_s": step_s, "simulated_step_s": sim,
            "error": (sim - step_s) / step_s if sim and step_s else None,
            "compute_factor": factor, "calibrated_step_s": cal,
            "calibrated_error": (cal - step_s) / step_s if cal and step_s else None,
        })
    return rows


def print_validation(rows: list[dict[str, Any]], *, out: str | None = None, as_json: bool = False) -> int:
    """Print (and with ``out``, write ``out.md`` and ``out.json``) the comparison and its summary."""
    summary: dict[str, Any] = {"rows": rows}
    for key in ("error", "calibrated_error"):
        errors = [float(abs(r[key])) for r in rows if r[key] is not None]
        summary[key] = {
            "within_10pct": sum(e <= 0.10 for e in errors), "compared": len(errors),
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
            f"{f(r['error'], '+.0%')} | {f(r['compute_factor'], '.2f')} | {f(r['calibrated_step_s'], '.4g')} | {f(r['calibrated_error'], '+.0%')} |"
        )
    for key, label in (("error", "profiled here"), ("calibrated_error", "compute calibrated on the run")):
        s_ = summary[key]
        lines.append(f"\n{label}: {s_['within_10pct']} of {s_['compared']} within 10 %; median |error| {f(s_['median_abs'], '.0%')}")
    text = "\n".join(lines) + "\n"
    if out:
        Path(out + ".json").write_text(json.dumps(summary, indent=2) + "\n")
        Path(out + ".md").write_text(f"# Simulator vs testbed\n\n`{' '.join(sys.argv)}`\n\n{text}")
    print(json.dumps(summary, indent=2) if as_json else text)
    return 0

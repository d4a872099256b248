"""How a side-by-side benchmark result reads: its markdown table and its PNG charts.

Both are made from the result document alone (``python -m testbeds.bench --json``'s), so a
committed result can be re-rendered (``--render RESULT.json``) without running anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testbeds.bench.split_metrics import dash, overrun_steps, split_lines
from testbeds.sim.topologies import slowdowns_label


def markdown(doc: dict[str, Any]) -> str:
    """The table (and the notes) as markdown."""
    statistic = (
        "trimmed means of the steps, medians of the rounds"
        if doc.get("step_statistic") == "trimmed-mean"
        else "medians"
    )
    lines = [
        f"# {doc['topology']}: {doc['job_name']}",
        "",
        f"`{doc['command']}`",
        "",
        (
            f"Testbed: {doc['backend']} backend, latency {doc['latency_mode']}; {doc['num_hosts']} hosts; "
            f"{doc['steps']} steps per run{_overrun_words(doc)} ({doc['warmup']} warm-up), "
            f"{doc['repeats']} interleaved rounds; "
            f"{statistic}."
        ),
        "",
        *emulation_lines(doc),
        (
            "| system | samples/s | tokens/s | step s | slowest link used | bytes/step on it | final loss | fusion x "
            "| simulated s | err | calibrated s | err | note |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in doc["systems"].items():
        sp = doc["speedup"].get(name)
        sim, err = r.get("simulated_step_s"), r.get("sim_error")
        cal, cal_err = r.get("calibrated_step_s"), r.get("calibrated_error")
        link = f"{r['slowest_link_mbps']:g} Mbps" if r.get("slowest_link_mbps") else "none"
        lines.append(
            f"| {name} | {dash(r.get('samples_per_s'), '.4g')} | {dash(r.get('tokens_per_s'), '.4g')} | "
            f"{dash(r.get('step_s'), '.4g')} | {link} | "
            f"{dash(r.get('slowest_link_bytes'), ',')} | {dash(r.get('final_loss'), '.4f')} | "
            f"{'-' if name == 'fusion' else dash(sp, '.2f')} | "
            f"{dash(sim, '.4g')} | {'-' if err is None else f'{err:+.0%}'} | "
            f"{dash(cal, '.4g')} | {'-' if cal_err is None else f'{cal_err:+.0%}'} | "
            f"{r.get('note', '')} |"
        )
    lines.append("")
    eff = doc.get("efficiency")
    fusion = doc["systems"].get("fusion", {})
    lines.append(
        f"fusion efficiency (predicted {f_or(fusion.get('predicted_step_s'))} s "
        f"/ measured {f_or(fusion.get('step_s'))} s): "
        f"{'-' if eff is None else f'{eff:.2f}'}; fusion ran on {', '.join(fusion.get('hosts_used', [])) or '-'}"
        + (f"; AdaTopK keep ratios {fusion['keep_ratios']}" if fusion.get("keep_ratios") else "")
    )
    lines.extend(split_lines(doc))
    if "compute_factor" in doc:
        costs = "the node costs the coordinator profiled in this run" if doc.get("profile") else "this machine profile"
        lines.append(
            "\nsimulated: `testbeds.simulate` on this testbed (plans as run, driver on the first host, "
            f"{doc['latency_mode']} latency), with {costs}; "
            + "calibrated: the same with each host of fusion's and uniform's plans computing "
            "what it measured in this run, and ddp's and pipelining's compute scaled by "
            f"{doc['compute_factor']:.2f}, the mean of those factors."
            + " ddp's gradient buckets are all-reduced as each rank's backward makes them ready, "
            "gloo's ring replayed message by message."
            + (
                " ddp's and pipelining's messages take the links' measured message times "
                f"(`links-{doc['topology']}.json`, `testbeds/net/link_times.py`)."
                if doc.get("sim_links") == "measured"
                else ""
            )
            + (
                " fusion's and uniform's stages pay this machine's measured cost of computing after a pause "
                "(`pause-cost.json`, `testbeds/bench/machine_probe.py`) in the simulated column."
                if doc.get("sim_pause_cost")
                else ""
            )
            + (
                " Their transfers between stages pay the executors' measured transfer path (the same file) in both."
                if doc.get("sim_transfer_path")
                else ""
            )
            + (
                " Their computations pay the measured cost of the transfers their process makes meanwhile "
                "(the same file, `testbeds/sim/machine.py`) in the simulated column."
                if doc.get("sim_interference")
                else ""
            )
            + (
                " Their driver's calls pay the gRPC round trip the coordinator measured to the worker on its own host, "
                "on top of the configured links."
                if doc.get("sim_driver_links") == "measured"
                else ""
            )
        )
    lines += [
        f"\n{name}'s bytes on the slowest link: {r['slowest_link_bytes_note']}"
        for name, r in doc["systems"].items()
        if r.get("slowest_link_bytes_note")
    ]
    return "\n".join(lines) + "\n"


def _overrun_words(doc: dict[str, Any]) -> str:
    overrun = doc.get("overrun") or 0.0
    if not overrun:
        return ""
    return f" for {doc.get('target_system') or 'the target'}, {overrun_steps(doc['steps'], overrun)} for the others"


def emulation_lines(doc: dict[str, Any]) -> list[str]:
    """The table's label for a run with emulated slower devices (none without)."""
    slowdowns = doc.get("emulated_slowdown")
    if not slowdowns:
        return []
    hosts = slowdowns_label(slowdowns)
    why = (
        "the topology's device speed ratios, `--emulate-speeds`"
        if doc.get("emulate_speeds")
        else "the hosts' `slowdown`"
    )
    measure = (
        "their seconds in fusion's coordinator profile (`--emulation profile`)"
        if doc.get("emulation") == "profile"
        else "their length"
    )
    return [
        f"**Emulated slower devices** ({why}): {hosts}; every system's computations there are followed by a sleep of "
        f"(factor - 1) times {measure} (`testbeds.emulation`).",
        "",
    ]


def f_or(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def write_chart(doc: dict[str, Any], path: Path) -> None:
    """A PNG: samples/s per system (bars), fusion's speed-up over each written above its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in doc["systems"].items()]
    values = [doc["systems"][n].get("samples_per_s") or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    bars = ax.bar(names, values, color=["#2a7" if n == "fusion" else "#888" for n in names])
    for bar, name in zip(bars, names, strict=False):
        r = doc["systems"][name]
        sp = doc["speedup"].get(name)
        label = "n/a" if not r.get("samples_per_s") else (f"fusion {sp:.1f}x" if sp else f"{r['samples_per_s']:.3g}/s")
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("samples / s")
    ax.set_title(f"{doc['topology']}: {doc['job_name']} ({doc['backend']}, {doc['repeats']} rounds)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_loss_chart(doc: dict[str, Any], path: Path) -> bool:
    """A PNG of each system's loss against wall time (step ``i`` at ``(i + 1) * step_s``,
    the clock ``time_to_target_s`` uses), with the target loss as a dashed line: how a
    compressed run's faster steps weigh against its slower learning. Returns ``False``
    (and writes nothing) when no system has a loss curve."""
    curves = {
        name: (r["losses"], r["step_s"])
        for name, r in doc["systems"].items()
        if len(r.get("losses") or []) > 1 and r.get("step_s")
    }
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for name, (losses, step_s) in curves.items():
        ax.plot([(i + 1) * step_s for i in range(len(losses))], losses, label=name, linewidth=1)
    if doc.get("target_loss") is not None:
        ax.axhline(doc["target_loss"], color="#444", linestyle="--", linewidth=0.8, label="target")
    ax.set_xlabel("wall time s (steps x measured step time)")
    ax.set_ylabel("loss")
    ax.set_title(f"{doc['topology']}: {doc['job_name']}, loss against time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True

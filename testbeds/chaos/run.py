"""One chaos run: the job under the schedule's events, then the same job uninterrupted, compared.

:func:`run_chaos` builds the testbed, mounts a small tmpfs as the job's output directory
(root only; without it ``disk_full`` events are reported as not injected), runs the job on
a :class:`~testbeds.chaos.fleet.ChaosFleet` while it injects the schedule's events, then
runs the same job on a fresh fleet of the same testbed without events, and returns the
report's document (:mod:`testbeds.chaos.report`). Everything it started is reaped on the
way out, on success, failure or Ctrl-C alike, and the report says whether anything was left.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.config import load_job
from testbeds.chaos import leaks
from testbeds.chaos.compare import compare_models
from testbeds.chaos.fleet import ChaosFleet
from testbeds.chaos.injectors import INJECTORS, NotInjected
from testbeds.chaos.observe import Poller, attribute_reactions, liveness
from testbeds.chaos.schedule import KINDS, Event, ScheduleConfig, make_schedule
from testbeds.net.backend import open_testbed
from testbeds.net.testbed import TestbedError

logger = logging.getLogger(__name__)

TERMINAL_STATES = ("succeeded", "failed", "cancelled")
#: A checkpoint the coordinator could not write (``fusion.coordinator.durable_writer`` logs it).
CHECKPOINT_FAILED = re.compile(r"durable checkpoint at step \d+ failed: .*")


@dataclass(frozen=True, kw_only=True)
class ChaosOptions:
    """What one chaos run does."""

    topology: str
    job: Path
    minutes: float
    seed: int
    events_per_minute: float = 2.0
    backend: str = "auto"
    steps: int | None = None
    """Overrides the job's ``train.steps``."""
    heartbeat_timeout_s: float = 6.0
    reference: bool = True
    """Also run the job without events and compare the models."""
    reference_model: Path | None = None
    """Compare with this ``model.safetensors`` of the same job run elsewhere without events
    (e.g. on loopback, while the chaos run goes on) instead of running the reference after."""
    log_dir: Path = Path("/tmp/fusion-chaos")
    disk_mb: int = 64
    kinds: tuple[str, ...] = KINDS
    job_timeout_s: float = 900.0
    """How long the job may run after the injection window before the run gives up."""


def _job_file(src: Path, dst: Path, out_dir: Path, steps: int | None) -> Path:
    """``src`` with its output dir (and step count) replaced, written to ``dst``."""
    doc = tomllib.loads(src.read_text())
    doc.setdefault("output", {})["dir"] = str(out_dir)
    if steps is not None:
        doc.setdefault("train", {})["steps"] = steps
    dst.write_text(_toml(doc))
    load_job(dst)  # fails here, with the job loader's message, if the edit broke it
    return dst


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _toml(doc: dict[str, Any], table: str = "") -> str:
    """A job document (tables of scalars, lists and sub-tables) as TOML."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    out = ([f"[{table}]"] if table and lines else []) + lines
    for k, v in doc.items():
        if isinstance(v, dict):
            out.append(_toml(v, f"{table}.{k}" if table else k))
    return "\n".join(out) + "\n"


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _wait_state(poller: Poller, states: tuple[str, ...], timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = poller.state()
        if s in states or s in TERMINAL_STATES:
            return s
        time.sleep(0.2)
    return poller.state()


def _checkpoint_failures(fleet: ChaosFleet, seen: set[str]) -> list[str]:
    """New 'durable checkpoint ... failed' lines in the coordinator logs."""
    new = []
    for log in fleet.coordinator_logs():
        if log.exists():
            for m in CHECKPOINT_FAILED.finditer(log.read_text(errors="replace")):
                if m.group(0) not in seen:
                    seen.add(m.group(0))
                    new.append(m.group(0))
    return new


def _start_fleet(fleet: ChaosFleet, echo: Callable[[str], None]) -> None:
    fleet.start_coordinator()
    for host in fleet.tb.hosts:
        fleet.start_worker(host, host, wait=False)
    for w in fleet.workers:
        from testbeds.net.testbed import wait_for_line  # noqa: PLC0415

        wait_for_line(w.log, r"fusion-worker ready", w.proc, 180.0)
    echo(f"coordinator at {fleet.coordinator}; {len(fleet.workers)} worker(s): {', '.join(fleet.tb.hosts)}")


def _inject(fleet: ChaosFleet, ev: Event, poller: Poller, disk_dir: Path | None, echo: Callable[[str], None],
            stop_at: float, ckpt_seen: set[str]) -> dict[str, Any]:  # fmt: skip
    """Start ``ev``, wait its duration, end it; what happened, as a report entry."""
    rec: dict[str, Any] = {**ev.to_dict(), "injected": False}
    inj = INJECTORS[ev.kind](fleet, ev, disk_dir=disk_dir)
    t = time.time() - poller.t0
    rec["started_s"] = round(t, 1)
    try:
        rec["did"] = inj.start()
        rec["injected"] = True
    except NotInjected as e:
        rec["not_injected"] = str(e)
    except (OSError, TestbedError) as e:
        rec["not_injected"] = f"{type(e).__name__}: {e}"
    rec["target"] = inj.target
    echo(f"[{t:7.1f}s] #{ev.idx} {ev.kind}: " + (rec.get("did") or f"NOT INJECTED ({rec['not_injected']})"))
    if rec["injected"]:
        end_at = time.monotonic() + ev.duration_s
        while time.monotonic() < min(end_at, stop_at) and poller.state() not in TERMINAL_STATES:
            time.sleep(0.2)
        try:
            undone = inj.end()
        except (OSError, TestbedError, NotInjected) as e:
            undone = f"ending it failed: {type(e).__name__}: {e}"
        rec["ended_s"] = round(time.time() - poller.t0, 1)
        if undone:
            rec["undone"] = undone
            echo(f"[{rec['ended_s']:7.1f}s] #{ev.idx} {ev.kind} ends: {undone}")
    for line in _checkpoint_failures(fleet, ckpt_seen):
        echo(f"      coordinator: {line}")
        poller.job_events.append({"time": time.time(), "event": "checkpoint_failed", "message": line})
    return rec


def _run_job(fleet: ChaosFleet, job_file: Path, echo: Callable[[str], None], events: list[Event] | None,
             opts: ChaosOptions, disk_dir: Path | None) -> dict[str, Any]:  # fmt: skip
    """Start the fleet, run the job (injecting ``events`` if given); the phase's findings."""
    _start_fleet(fleet, echo)
    job_id = fleet.submit(job_file)
    echo(f"submitted {job_id}")
    poller = Poller(fleet.start_poller(job_id), time.time(), echo)
    out: dict[str, Any] = {"job_id": job_id}
    state = _wait_state(poller, ("running",), 600.0)
    poller.t0 = time.time()
    out["training_started"] = state == "running"
    before = leaks.snapshot(fleet.alive_started(), fleet.coordinator_proc.pid if fleet.coordinator_proc else None)
    records: list[dict[str, Any]] = []
    sampler = leaks.CoordinatorSampler(
        lambda: fleet.coordinator_proc.pid if fleet.coordinator_proc else None, poller.state
    ).start()
    if events is not None and state == "running":
        echo(f"training started; {len(events)} event(s) over {opts.minutes:g} min (times from now)")
        stop_at = time.monotonic() + opts.minutes * 60.0 + 60.0
        ckpt_seen: set[str] = set()
        poller.live = True
        for ev in events:
            while time.monotonic() < stop_at and time.time() - poller.t0 < ev.at_s:
                if poller.state() in TERMINAL_STATES:
                    break
                time.sleep(0.2)
            if poller.state() in TERMINAL_STATES or time.monotonic() >= stop_at:
                echo(f"job {poller.state()}: the remaining {len(events) - len(records)} event(s) were not run")
                break
            records.append(_inject(fleet, ev, poller, disk_dir, echo, stop_at, ckpt_seen))
    final = _wait_state(poller, TERMINAL_STATES, opts.job_timeout_s)
    time.sleep(3.0)  # the coordinator settles after the job's end (threads exit, files close)
    after = leaks.snapshot(fleet.alive_started(), fleet.coordinator_proc.pid if fleet.coordinator_proc else None)
    samples = [{**x, "t_s": round(x["t"] - poller.t0, 1)} for x in sampler.stop()]
    last = poller.last_ok() or {}
    reason = last.get("reason")
    if final not in TERMINAL_STATES:
        reason = f"still {final} {opts.job_timeout_s:.0f}s after the events ended: the harness stopped waiting"
    out.update(
        state=final,
        finished=final == "succeeded",
        reason=reason,
        step=last.get("step"),
        loss=last.get("loss"),
        events=records,
        before=before,
        after=after,
        coordinator_starts=fleet.coordinator_starts,
        coordinator_samples=samples,
        restart_baseline=leaks.restart_baseline(samples, (after.get("coordinator") or {}).get("pid")),
        liveness=liveness(poller.records, records, poller.t0, fleet.coordinator_spawns),
        events_before_first=attribute_reactions(poller.job_events, records, poller.t0),
    )
    status = fleet.fusion("status", job_id, "--json") if fleet.coordinator_proc else None
    if status is not None and status.returncode == 0:
        out["output_dir"] = json.loads(status.stdout).get("output_dir")
    fleet.stop()
    out["alive_after_stop"] = fleet.alive_started()
    return out


def run_chaos(opts: ChaosOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole run; returns the report's document (even when the job or the harness failed)."""
    spec = load_job(opts.job)
    cfg = ScheduleConfig(
        minutes=opts.minutes,
        events_per_minute=opts.events_per_minute,
        heartbeat_timeout_s=opts.heartbeat_timeout_s,
        kinds=opts.kinds,
        min_workers=spec.cluster.min_workers,
    )
    log_dir = Path(opts.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": None,
        "topology": opts.topology,
        "job": str(opts.job),
        "seed": opts.seed,
        "minutes": opts.minutes,
        "events_per_minute": opts.events_per_minute,
        "heartbeat_timeout_s": opts.heartbeat_timeout_s,
        "compression": spec.compression.mode,
        "log_dir": str(log_dir),
    }
    disk_dir = log_dir / "out-chaos"
    mounted: list[str] = []
    tb = None
    try:
        tb = open_testbed(opts.topology, backend=opts.backend)
        doc["backend"], doc["prefix"], doc["hosts"] = tb.backend, tb.prefix, list(tb.hosts)
        echo(tb.describe())
        events = make_schedule(opts.seed, ScheduleConfig(**{**cfg.__dict__, "num_workers": len(tb.hosts)}))
        doc["schedule"] = [e.to_dict() for e in events]
        if _mount_tmpfs(disk_dir, opts.disk_mb):
            mounted.append(str(disk_dir))
            doc["disk"] = f"tmpfs of {opts.disk_mb} MiB at {disk_dir}"
        else:
            doc["disk"] = "no tmpfs (not root): disk_full events are not injected"
        chaos_job = _job_file(opts.job, log_dir / "job-chaos.toml", disk_dir, opts.steps)
        fleet = ChaosFleet(tb, log_dir / "chaos", heartbeat_timeout_s=opts.heartbeat_timeout_s, echo=echo)
        try:
            doc["chaos"] = _run_job(fleet, chaos_job, echo, events, opts, disk_dir if mounted else None)
        finally:
            fleet.stop()
        chaos_model = log_dir / "model-chaos.safetensors"
        out_dir = doc["chaos"].get("output_dir")
        if out_dir and (Path(out_dir) / "model.safetensors").exists():
            shutil.copy(Path(out_dir) / "model.safetensors", chaos_model)
        if opts.reference_model is not None:
            echo(f"reference: {opts.reference_model} (the same job, run elsewhere without events)")
            doc["reference"] = {"model": str(opts.reference_model), "ran": "elsewhere"}
            doc["model"] = compare_models(
                chaos_model,
                opts.reference_model,
                compressed=spec.compression.mode != "none",
                loss=doc["chaos"].get("loss"),
                reference_loss=None,
            )
        elif opts.reference:
            echo("reference: the same job on the same testbed, no events")
            ref_job = _job_file(opts.job, log_dir / "job-reference.toml", log_dir / "out-reference", opts.steps)
            ref = ChaosFleet(tb, log_dir / "reference", heartbeat_timeout_s=opts.heartbeat_timeout_s, echo=echo)
            try:
                doc["reference"] = _run_job(ref, ref_job, echo, None, opts, None)
            except (TestbedError, OSError) as e:  # the chaos run's findings stand; say why there is no reference
                doc["reference"] = {"error": f"{type(e).__name__}: {e}"}
                echo(f"reference run failed: {doc['reference']['error']}")
            finally:
                ref.stop()
            ref_dir = doc["reference"].get("output_dir")
            doc["model"] = compare_models(
                chaos_model,
                Path(ref_dir) / "model.safetensors" if ref_dir else None,
                compressed=spec.compression.mode != "none",
                loss=doc["chaos"].get("loss"),
                reference_loss=doc["reference"].get("loss"),
            )
    except BaseException as e:  # Ctrl-C and SIGTERM included: tear down, then report what happened
        doc["error"] = f"{type(e).__name__}: {e}"
        doc["interrupted"] = not isinstance(e, Exception)
        echo(f"chaos run failed: {doc['error']}")
        if isinstance(e, Exception):
            logger.debug("chaos run failed", exc_info=True)
    finally:
        if tb is not None:
            try:
                tb.close()
            except TestbedError as e:
                doc.setdefault("teardown_error", str(e))
        for m in mounted:
            _umount(Path(m))
        if tb is not None:
            doc["leftovers"] = leaks.leftovers(tb.prefix, mounted)
    return doc

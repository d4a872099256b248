"""fusion's side of the side-by-side benchmark (:mod:`testbeds.bench.harness`): a real
``fusion-coordinator`` on the testbed's first host and one ``fusion-worker`` per host, each
lending its host's ``memory_gb``; a system's job is submitted to it and its outputs read back
as a :class:`~testbeds.bench.runs.Run`."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fusion.config import JobSpec
from fusion.errors import FusionError
from fusion.launch import child_env
from fusion.profiling import measure_device
from scheduler.partition import MORE_MICRO_BATCHES
from testbeds.bench.runs import Run, job_toml, read_jsonl, step_records
from testbeds.bench.split_metrics import fleet_peak_memory
from testbeds.dilation import dilated_timeout_s
from testbeds.net.launch import host_memory_gb, worker_command


class FusionFleet:
    """A coordinator on the first host and a worker on every host of a testbed."""

    def __init__(
        self,
        tb: Any,
        workdir: Path,
        *,
        torch_threads: int = 1,
        slowdowns: Mapping[str, float] | None = None,
        emulation: str = "wall",
        allow_code: bool = False,
        dilation: float = 1.0,
        data_plane: bool = True,
        machine_flops: float | None = None,
    ) -> None:
        """Each host's worker lends the host's ``memory_gb``; ``allow_code``: the workers take
        job owners' own models, importable with this process's path (``child_env``);
        ``dilation``: the testbed's time dilation (workers ``--dilate``, heartbeats waited for
        longer); ``data_plane=False``: the workers move tensors over gRPC only
        (``--no-data-plane``); ``machine_flops``: the speed every worker reports (default:
        measured here once)."""
        self.tb = tb
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        env = child_env()
        self.token = secrets.token_hex(16)
        self.host0 = tb.hosts[0]
        #: The last job this fleet submitted (whose profile :meth:`model_profile` asks for).
        self.last_job_id: str | None = None
        #: Micro-batches a system ran with after its planner's advice (:meth:`run_as_advised`).
        self.advised_micro_batches: dict[str, int] = {}
        from testbeds.net.testbed import wait_for_line

        port = tb.free_port(self.host0)
        tb.expose(self.host0, port)
        self.coordinator = f"{tb.address(self.host0)}:{port}"
        (workdir / "token").write_text(self.token)
        log = workdir / "coordinator.log"
        proc = tb.spawn(
            self.host0,
            [
                sys.executable,
                "-m",
                "testbeds.coordinator",
                "--host",
                tb.address(self.host0),
                "--port",
                str(port),
                "--token-file",
                str(workdir / "token"),
                "--state-dir",
                str(workdir / "state"),
                "--log-level",
                "INFO",
                *(["--heartbeat-timeout", repr(dilated_timeout_s(10.0, dilation))] if dilation != 1.0 else []),
            ],
            env=env,
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,  # noqa: SIM115 - the child owns it
        )
        wait_for_line(log, r"listening on", proc, 60.0)
        # One worker at a time: each measures its matmul speed at start-up, and workers that
        # start together on one machine's cores would each measure a random share of it; and
        # each reports the machine's speed measured once here (testbeds.worker --machine-flops).
        self.machine_flops = machine_flops if machine_flops is not None else measure_device("cpu").matmul_flops
        for host in tb.hosts:
            wport = tb.free_port(host)
            tb.expose(host, wport)
            wlog = workdir / f"worker-{host}.log"
            p = tb.spawn(
                host,
                [
                    sys.executable,
                    *worker_command(
                        coordinator=self.coordinator,
                        token_file=workdir / "token",
                        name=host,
                        listen=f"{tb.address(host)}:{wport}",
                        torch_threads=torch_threads,
                        machine_flops=self.machine_flops,
                        slowdown=(slowdowns or {}).get(host),
                        emulation=emulation,
                        memory_gb=host_memory_gb(tb.topology, host),
                        allow_code=allow_code,
                        dilation=dilation,
                        data_plane=data_plane,
                    ),
                ],
                env=env,
                stdout=open(wlog, "ab"),
                stderr=subprocess.STDOUT,  # noqa: SIM115
            )
            wait_for_line(wlog, r"fusion-worker ready", p, 120.0)

    def run(self, spec: JobSpec, system: str, *, timeout_s: float) -> Run:
        """Submit the job from the first host, wait for its summary, read its metrics."""
        job_file = self.workdir / f"{system}-{time.monotonic_ns()}.toml"
        job_file.write_text(job_toml(spec))
        env = {"FUSION_COORDINATOR": self.coordinator, "FUSION_TOKEN": self.token}
        t0 = time.monotonic()
        out = self._cli(["submit", str(job_file)], env)
        job_id = out.split()[-1]
        self.last_job_id = job_id
        job_dir = Path(spec.output.dir) / job_id
        summary_path = job_dir / "summary.json"
        while not summary_path.exists():
            if time.monotonic() - t0 > timeout_s:
                self._cli(["cancel", job_id], env, check=False)
                raise FusionError(f"{system} job {job_id} did not finish within {timeout_s:.0f}s")
            time.sleep(0.5)
        summary = json.loads(summary_path.read_text())
        run = Run(system=system, records=step_records(job_dir / "metrics.jsonl"), wall_s=time.monotonic() - t0)
        if summary.get("state") != "succeeded":
            run.note = f"{summary.get('state')}: {summary.get('reason')}"
        run.note = "; ".join(filter(None, [run.note, compression_said(summary, job_dir / "metrics.jsonl")]))
        run.final_loss = summary.get("final_loss")
        measured_path = job_dir / "measured.json"
        if measured_path.exists():
            run.measured = json.loads(measured_path.read_text())
            run.peak_memory_bytes, run.memory_cap_bytes = fleet_peak_memory(run.measured)
        plan_path = job_dir / "plan.json"
        if plan_path.exists():
            plan = json.loads(plan_path.read_text())
            run.predicted_step_s = planned_step_s(plan)
            run.hosts_used = [s["worker"] for s in plan.get("stages", [])]
            run.plan_stages = [{"worker": s["worker"], "nodes": s["nodes"]} for s in plan.get("stages", [])]
        return run

    def run_as_advised(self, spec: JobSpec, system: str, *, timeout_s: float) -> Run:
        """:meth:`run`, and while the plan is refused for memory with the advice to use more
        micro-batches (``uniform`` plans blind to the caps), again with twice as many, as
        long as they divide the batch: what a user does after that error. The count that
        fits is kept for the system's later rounds and said in the run's note."""
        job_mb = spec.train.micro_batches
        mb = self.advised_micro_batches.get(system, job_mb)
        while True:
            run = self.run(spec.replace(train={"micro_batches": mb}), system, timeout_s=timeout_s)
            refused = run.note.startswith("failed") and MORE_MICRO_BATCHES in run.note
            if not refused or spec.data.batch_size % (2 * mb):
                break
            mb *= 2
        if mb != job_mb:
            self.advised_micro_batches[system] = mb
            run.note = f"{mb} micro-batches (the job's {job_mb} did not fit the caps); {run.note}".rstrip("; ")
        return run

    def _cli(self, args: list[str], env: dict[str, str], *, check: bool = True, module: str = "fusion.cli.main") -> str:
        proc = self.tb.spawn(
            self.host0,
            [sys.executable, "-m", module, *args],
            env={**child_env(), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = proc.communicate(timeout=120)
        if check and proc.returncode != 0:
            raise FusionError(f"fusion {' '.join(args)} failed: {out.strip()[-1000:]}")
        return out

    def model_profile(self) -> dict[str, Any] | None:
        """The calibrated model profile the coordinator planned this fleet's last job with
        (its ``GetProfile``, asked from the first host: :mod:`testbeds.job_profile`)."""
        if self.last_job_id is None:
            return None
        env = {"FUSION_COORDINATOR": self.coordinator, "FUSION_TOKEN": self.token}
        out = self._cli([self.last_job_id], env, check=False, module="testbeds.job_profile")
        lines = out.strip().splitlines()
        p = json.loads(lines[-1]) if lines else None
        if p is None or p.get("overhead_step_s") is None:
            return None
        return p

    def step_costs(self) -> dict[str, float] | None:
        """The executor overheads the coordinator calibrated."""
        p = self.model_profile()
        if p is None:
            return None
        return {
            "control_s": p["overhead_step_s"],
            "micro_batch_s": p["overhead_micro_batch_s"],
            "optimizer_s_per_byte": p["optimizer_s_per_byte"],
        }


def write_profiled(fleet: FusionFleet, spec: JobSpec, num_hosts: int, path: Path) -> Path:
    """The baselines' profiled seconds (:mod:`testbeds.bench.baselines.profiled`) from the profile
    the fleet's coordinator measured, written to ``path``."""
    from fusion.training import build_job_model
    from scheduler.estimator import StepCosts
    from testbeds.bench.baselines.profiled import reference_document
    from testbeds.sim.block_split import num_pipeline_stages
    from testbeds.sim.costs import job_costs

    profile, costs = fleet.model_profile(), fleet.step_costs()
    if profile is None or costs is None:
        raise FusionError("profile emulation: fusion's coordinator has no profile yet for the baselines to stretch by")
    job = job_costs(spec, step=StepCosts(**costs), profile=profile)
    doc = reference_document(job, num_pipeline_stages(build_job_model(spec), num_hosts))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def planned_step_s(plan: Mapping[str, Any]) -> float | None:
    """The step a ``plan.json`` predicts for the run: with the chosen codecs' bytes where
    AdaTopK compresses (``extra.compression.step_s``), else the plan's dense prediction."""
    chosen = (plan.get("extra") or {}).get("compression") or {}
    return chosen.get("step_s") or plan.get("predicted_step_s")


def compression_said(summary: dict[str, Any], metrics: Path) -> str | None:
    """What a finished job said of its compression: that it compressed nothing (its plan's
    note, or the codec trial's verdict of dense: the summary's ``compression_note``), else
    the codec trial's verdict to keep its codecs (:mod:`executor.codec_trial`); None when it
    said neither."""
    if summary.get("compression_note"):
        return str(summary["compression_note"])
    trial = [r["message"] for r in read_jsonl(metrics) if r.get("event") == "codec_trial"]
    return f"codec trial at {trial[-1]}" if trial else None

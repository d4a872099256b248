"""The baselines' side of the side-by-side benchmark (:mod:`testbeds.bench.harness`): one
``torch.distributed`` rank per testbed host (:mod:`testbeds.bench.baselines`), rendezvous on
the first, started in each host's namespace, retried when a rank crashes, and read back
as a :class:`~testbeds.bench.runs.Run`; a system whose replica does not fit a host's
``memory_gb`` is reported infeasible instead of run."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fusion.config import JobSpec
from fusion.errors import FusionError
from scheduler.topology import Topology
from testbeds.bench.runs import Run, job_toml, read_jsonl
from testbeds.bench.split_metrics import rank_peak_memory
from testbeds.bench.systems import RANK_MODULES
from testbeds.net.launch import slowdown_args

logger = logging.getLogger(__name__)


def run_ranks(
    tb: Any,
    module: str,
    spec_file: Path,
    hosts: list[str],
    *,
    steps: int,
    workdir: Path,
    timeout_s: float,
    slowdowns: Mapping[str, float] | None = None,
    emulation: str = "wall",
    profiled: Path | None = None,
) -> list[dict[str, Any]]:
    """Start one ``module`` rank per host (rank 0 on the first) and return rank 0's records;
    ``profiled``: the seconds ranks emulating by the profile stretch by
    (:mod:`testbeds.bench.baselines.profiled`)."""
    master = f"{tb.address(hosts[0])}:{tb.free_port(hosts[0])}"
    metrics = workdir / f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.jsonl"
    procs = []
    for rank, host in enumerate(hosts):
        log = workdir / f"{module.rsplit('.', 1)[-1]}-rank{rank}.log"
        procs.append(
            tb.spawn(
                host,
                [
                    sys.executable,
                    "-X",
                    "faulthandler",  # a rank killed by SIGABRT dumps its Python threads to its log
                    "-m",
                    module,
                    "--job",
                    str(spec_file),
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(len(hosts)),
                    "--master",
                    master,
                    "--address",
                    tb.address(host),
                    "--steps",
                    str(steps),
                    "--metrics",
                    str(metrics),
                    *_rank_emulation_args((slowdowns or {}).get(host), emulation, profiled),
                ],
                stdout=open(log, "wb"),
                stderr=subprocess.STDOUT,  # noqa: SIM115
            )
        )
    deadline = time.monotonic() + timeout_s
    try:
        for rank, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                cause = _last_line(_rank_log(module, workdir, rank))
                error = RankCrashed if p.returncode < 0 or _transient(cause) else FusionError
                raise error(
                    f"{module} rank {rank} exited with {p.returncode}: {cause}\n{_log_tails(module, workdir, procs)}"
                )
    except subprocess.TimeoutExpired as e:
        raise FusionError(f"{module} did not finish within {timeout_s:.0f}s") from e
    finally:
        from testbeds.net.testbed import stop_process_group

        for p in procs:
            if p.poll() is None:
                stop_process_group(p)
    return read_jsonl(metrics)


def _log_tails(module: str, workdir: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    """The end of every rank's log, each headed by its rank and exit status: a rank that
    crashes often does so because another one did."""
    tails = []
    for rank, p in enumerate(procs):
        tails.append(f"[rank {rank}, exit {p.poll()}] {_rank_log(module, workdir, rank)[-1500:]}")
    return "\n".join(tails)


def _rank_log(module: str, workdir: Path, rank: int) -> str:
    return (workdir / f"{module.rsplit('.', 1)[-1]}-rank{rank}.log").read_text(errors="replace")


def _last_line(log: str) -> str:
    """The last non-blank line of a rank's log: its exception, where it raised one."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(its log is empty)"


#: What a rank's last line says when its peer, not its own code, failed it: gloo's TCP pairs
#: and the rendezvous store on this VM's shared cores drop now and then.
TRANSIENT_MARKERS = (
    "DistNetworkError",
    "DistBackendError",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
)


def _transient(cause: str) -> bool:
    return any(marker in cause for marker in TRANSIENT_MARKERS)


def _rank_emulation_args(factor: float | None, emulation: str, profiled: Path | None) -> list[str]:
    args = slowdown_args(factor, "--slowdown", emulation)
    if args and emulation == "profile":
        if profiled is None:
            raise FusionError("profile emulation: no profiled seconds for the baselines' ranks")
        args += ["--profiled", str(profiled)]
    return args


class RankCrashed(FusionError):
    """A baseline rank was killed by a signal or lost its peers, not by its own error (on this
    VM gloo aborts a rank with SIGABRT now and then: "terminate called without an active
    exception", and a pair's connection is reset now and then: :data:`TRANSIENT_MARKERS`)."""


#: Tries of a rank system before a crash fails it. CI once saw two crashes in a row (stop
#: 36); every try starts fresh processes on a fresh rendezvous port.
RANK_TRIES = 3

#: How the note of a system whose crashed rank was run again begins.
RERUN_NOTE = "run again after"


def _run_ranks_retrying(
    tb: Any, module: str, spec_file: Path, hosts: list[str], **kwargs: Any
) -> tuple[list[dict[str, Any]], str]:
    """:func:`run_ranks`, again while a rank crashed (at most :data:`RANK_TRIES` tries); the
    records and a note naming the crashes."""
    crashes: list[str] = []
    while True:
        try:
            records = run_ranks(tb, module, spec_file, hosts, **kwargs)
        except RankCrashed as e:
            crashes.append(str(e).splitlines()[0][:200])
            if len(crashes) >= RANK_TRIES:
                raise
            logger.warning("%s; running it again", crashes[-1])
            continue
        times = "a crash" if len(crashes) == 1 else f"{len(crashes)} crashes"
        note = f"{RERUN_NOTE} {times} ({crashes[0]})" if crashes else ""
        return records, note


def run_baseline(
    tb: Any,
    system: str,
    spec: JobSpec,
    *,
    steps: int,
    workdir: Path,
    timeout_s: float,
    slowdowns: Mapping[str, float] | None = None,
    emulation: str = "wall",
    profiled: Path | None = None,
) -> Run:
    """A rank system (:data:`~testbeds.bench.systems.RANK_MODULES`) on the testbed (a
    :class:`Run` with a note when it does not apply, or when a crashed rank made it run again)."""
    from fusion.training import build_job_model
    from testbeds.bench.systems import best_pipeline_hosts, ddp_infeasible, state_bytes
    from testbeds.sim.block_split import num_pipeline_stages

    spec_file = workdir / f"{system}.toml"
    spec_file.write_text(job_toml(spec))
    hosts = list(tb.hosts)
    t0 = time.monotonic()
    rank_args: dict[str, Any] = {
        "steps": steps,
        "workdir": workdir,
        "timeout_s": timeout_s,
        "slowdowns": slowdowns,
        "emulation": emulation,
        "profiled": profiled,
    }
    model = build_job_model(spec)
    needed = state_bytes(spec, model)
    if system in ("ddp", "fsdp"):
        if spec.data.batch_size < len(hosts):
            return Run(system=system, note=f"n/a: batch {spec.data.batch_size} < {len(hosts)} ranks")
        topology = getattr(tb, "topology", None)  # a testbed without one: no caps to check
        infeasible = ddp_infeasible(needed, topology) if system == "ddp" and topology is not None else None
        if infeasible:
            run = Run(system=system, note=infeasible, hosts_used=hosts)
            run.memory_cap_bytes = {h: c for h, c in caps_of(topology).items() if c is not None}
            run.peak_memory_bytes = {h: needed for h in hosts}  # what each host would need
            return run
        try:
            records, note = _run_ranks_retrying(tb, RANK_MODULES[system], spec_file, hosts, **rank_args)
        except FusionError as e:
            if system == "ddp":
                raise
            return Run(system=system, note=f"n/a: {str(e).splitlines()[0][:300]}")
    else:
        num_stages = num_pipeline_stages(model, len(hosts))
        if num_stages < 2:
            return Run(system=system, note="n/a: the model has fewer than 2 blocks to split")
        if system == "pipelining-best":
            hosts = best_pipeline_hosts(tb.topology, needed, num_stages)
        else:
            hosts = hosts[:num_stages]
        try:
            records, note = _run_ranks_retrying(tb, RANK_MODULES[system], spec_file, hosts, **rank_args)
            while system == "pipelining-best" and len(hosts) < num_stages and _over_cap(tb, records, hosts):
                # As a user would: a stage peaked over its host's cap, so take one more host of the chain.
                hosts = best_pipeline_hosts(tb.topology, needed, num_stages, min_stages=len(hosts) + 1)
                records, note = _run_ranks_retrying(tb, RANK_MODULES[system], spec_file, hosts, **rank_args)
        except FusionError as e:
            return Run(system=system, note=f"n/a: {str(e).splitlines()[0][:300]}")
    # Ranks name links by rank; the table names hosts.
    for r in records:
        r["bytes_per_link"] = {
            f"{hosts[int(a)]}->{hosts[int(b)]}": v
            for a, b, v in ((*k.split("->"), v) for k, v in r.get("bytes_per_link", {}).items())
        }
    return Run(
        system=system,
        records=records,
        final_loss=records[-1]["loss"] if records else None,
        hosts_used=hosts,
        wall_s=time.monotonic() - t0,
        note=note,
        peak_memory_bytes=rank_peak_memory(records, hosts),
    )


def _over_cap(tb: Any, records: list[dict[str, Any]], hosts: list[str]) -> bool:
    """Whether a rank's measured peak exceeded its host's ``memory_gb``."""
    caps = caps_of(tb.topology)
    peaks = rank_peak_memory(records, hosts)
    return any(caps.get(h) is not None and peak > caps[h] for h, peak in peaks.items())


def caps_of(topology: Topology) -> dict[str, int | None]:
    return {w.name: w.memory_bytes for w in topology.workers}

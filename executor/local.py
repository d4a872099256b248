"""Run a job over K local worker processes on loopback: for tests, benchmarks and demos.

:class:`LocalCluster` starts ``python -m executor.server`` processes (real processes, real
gRPC) and stops them, by pid, however the caller exits. :func:`train_distributed` captures
the job's model, cuts it (an explicit assignment or an even split), loads the stages and
runs the steps, returning the losses and the trained ``state_dict`` under the original
names — the same shape of result as :func:`fusion.training.train_reference`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import torch

from executor.client import ChannelPool
from executor.compression import CutSetting, RatioController
from executor.driver import PipelineDriver, StepStats
from executor.server import READY_PREFIX
from fusion.auth import new_key, process_keyring
from fusion.config import JobSpec
from fusion.errors import FusionError
from fusion.graph.export import capture
from fusion.graph.ir import OpDag
from fusion.graph.split import StageSpec, split_stages
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch
from scheduler.baselines import uniform_assignment

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent


class LocalCluster:
    """``num_workers`` executor processes on 127.0.0.1, each on a free port."""

    def __init__(
        self,
        num_workers: int,
        *,
        allow_code: bool = True,
        torch_threads: int | None = None,
        start_timeout_s: float = 120.0,
        extra_args: Sequence[str] = (),
        module: str = "executor.server",
    ) -> None:
        """``module``: what each process runs, ``python -m executor.server`` or a wrapper
        of it that takes its flags (e.g. a test's executor with hooks)."""
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self.allow_code = allow_code
        self.torch_threads = torch_threads or max(1, (os.cpu_count() or 1) // num_workers)
        self.start_timeout_s = start_timeout_s
        self.extra_args = list(extra_args)
        self.module = module
        self.processes: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []
        #: Control key of each executor (its calls are signed with it via the process keyring).
        self.control_keys: list[bytes] = []
        self._log_dir = tempfile.TemporaryDirectory(prefix="fusion-workers-")

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def log_path(self, worker_idx: int) -> Path:
        """Where worker ``worker_idx`` writes its log (stderr)."""
        return Path(self._log_dir.name) / f"worker{worker_idx}.log"

    def start(self) -> None:
        """Start the processes and wait until each listens; on any failure stop them all."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *[p for p in sys.path if p], env.get("PYTHONPATH", "")])
        try:
            for i in range(self.num_workers):
                # Each executor gets its own control key; this process signs its calls with it.
                key = new_key()
                self.control_keys.append(key)
                key_file = Path(self._log_dir.name) / f"worker{i}.key"
                key_file.touch(mode=0o600)
                key_file.write_text(key.hex())
                cmd = [
                    sys.executable,
                    "-m",
                    self.module,
                    "--listen",
                    "127.0.0.1:0",
                    "--name",
                    f"local-{i}",
                    "--torch-threads",
                    str(self.torch_threads),
                    "--control-key-file",
                    str(key_file),
                    *(["--allow-code"] if self.allow_code else []),
                    *self.extra_args,
                ]
                log = open(self.log_path(i), "w")  # noqa: SIM115 - owned by the process
                self.processes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env))
                log.close()
            for i, proc in enumerate(self.processes):
                self.addresses.append(f"127.0.0.1:{self._read_port(i, proc)}")
                process_keyring().set_control(self.addresses[-1], self.control_keys[i])
        except BaseException:
            self.close()
            raise

    def _read_port(self, i: int, proc: subprocess.Popen[str]) -> int:
        assert proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(READY_PREFIX):
                return int(line.split()[1])
            if not line and proc.poll() is not None:
                break
        tail = self.log_path(i).read_text()[-2000:] if self.log_path(i).exists() else ""
        raise FusionError(f"local worker {i} did not start (exit code {proc.poll()}); its log ends with:\n{tail}")

    def kill(self, worker_idx: int) -> None:
        """SIGKILL one worker (a crash, for tests)."""
        proc = self.processes[worker_idx]
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after a grace period."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        for address in self.addresses:
            process_keyring().drop_control(address)
        self.processes.clear()
        self.addresses.clear()
        self.control_keys.clear()
        self._log_dir.cleanup()


@dataclass
class DistributedResult:
    """What a distributed run produced."""

    losses: list[float] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients of the last step before its optimizer update (canonical names), if asked for."""
    stats: list[StepStats] = field(default_factory=list)
    dag: OpDag | None = None
    stages: list[StageSpec] = field(default_factory=list)


def train_distributed(
    job: JobSpec,
    addresses: Sequence[str],
    *,
    assignment: Mapping[str, int] | None = None,
    stage_workers: Sequence[int] | None = None,
    steps: int | None = None,
    leaf_modules: Sequence[str] = (),
    device: str = "cpu",
    collect_gradients: bool = False,
    pool: ChannelPool | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    cut_settings: Mapping[tuple[int, int], CutSetting] | None = None,
    ratio_controller: RatioController | None = None,
    link_bytes_per_s: Mapping[tuple[int, int], float] | None = None,
) -> DistributedResult:
    """Train ``job`` with its model split over the executors at ``addresses``.

    Args:
        job: the job (model, data, training settings).
        addresses: executor addresses; by default stage ``i`` runs on ``addresses[i]``.
        assignment: compute node → stage index; default: an even split into
            ``len(addresses)`` stages.
        stage_workers: which address index hosts each stage (several stages may share one).
        steps: number of steps (default ``job.train.steps``).
        leaf_modules: module paths to keep whole during capture.
        device: device of every stage (``cpu``, ``cuda``, ``cuda:N``).
        collect_gradients: also return the last step's gradients (costs one fetch per step).
        pool: gRPC channels to reuse.
        on_step: called after every step with its statistics.
        cut_settings: codecs of compressed cuts, by (src stage, dst stage).
        ratio_controller: AdaTopK's per-step ratio updates for those cuts.
        link_bytes_per_s: bandwidth between the workers of two stages, by (src, dst) stage:
            the stages pace their sends at it (:mod:`executor.sender`); unlisted pairs send
            one transfer at a time.
    """
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    example_x, example_y = example_micro_batch(job, dataset)
    captured = capture(model, (example_x,), leaf_modules=leaf_modules)
    if assignment is None:
        assignment = uniform_assignment(captured.dag, len(addresses))
    stages = split_stages(captured.dag, assignment)
    workers = list(stage_workers) if stage_workers is not None else list(range(len(stages)))
    if len(workers) != len(stages) or any(not 0 <= w < len(addresses) for w in workers):
        raise FusionError(
            f"stage_workers must give a worker index in [0, {len(addresses)}) for each of {len(stages)} stages"
        )
    driver = PipelineDriver(
        job_id=f"local-{uuid.uuid4().hex[:8]}",
        job=job,
        model=model,
        captured=captured,
        stages=stages,
        addresses=[addresses[w] for w in workers],
        example_target=example_y,
        leaf_modules=leaf_modules,
        device=device,
        pool=pool,
        cut_settings=cut_settings,
        ratio_controller=ratio_controller,
        link_bytes_per_s=link_bytes_per_s,
    )
    result = DistributedResult(dag=captured.dag, stages=stages)
    try:
        driver.load()
        for step in range(job.train.steps if steps is None else steps):
            x, y = job_batch(job, dataset, step)
            t0 = time.perf_counter()
            stats = driver.forward_backward(step, (x,), y)
            driver.sync_tied_gradients(step)
            if collect_gradients:
                result.gradients = driver.gradients()
            driver.apply(step)
            stats.step_s = time.perf_counter() - t0
            result.losses.append(stats.loss)
            result.stats.append(stats)
            if on_step is not None:
                on_step(stats)
        result.state_dict = driver.state_dict()
    finally:
        driver.close()
    return result

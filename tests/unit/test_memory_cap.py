"""Memory caps: the planner never plans over one, the executor refuses and fails what does not fit.

The planner on GPT-2 tiny with workers that each lend less than the model needs; the
executor in this process (a real gRPC server, its calls signed as the coordinator signs
them), loaded by a real :class:`~executor.driver.PipelineDriver`: a stage planned over the
cap is refused at ``LoadStage``, and a step whose measured peak outgrows the cap fails with
the same kind of error, which the driver hands back as a :class:`MemoryCapError`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from executor.client import ChannelPool
from executor.driver import PipelineDriver
from executor.server import ExecutorService, start_server
from fusion.auth import new_key, process_keyring
from fusion.config import JobSpec
from fusion.coordinator.memory_ledger import MARGIN, MemoryLedger
from fusion.errors import InsufficientMemoryError, MemoryCapError, PlanError
from fusion.graph.export import capture
from fusion.graph.ir import OpDag
from fusion.graph.split import split_stages
from fusion.memory import format_bytes, gb_to_bytes, shortfall_text
from fusion.models import build_model
from fusion.profiling import lent_memory_bytes
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch
from scheduler.baselines import uniform_assignment
from scheduler.planner import PlanRequest, make_plan
from scheduler.topology import Topology, WorkerSpec

pytestmark = pytest.mark.timeout(120)

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 2, "optimizer": "adamw", "lr": 0.001},
    }
)


def topology(caps: list[int | None]) -> Topology:
    n = len(caps)
    workers = [WorkerSpec(name=f"w{i}", cluster="lab", flops=1e12, memory_bytes=c) for i, c in enumerate(caps)]
    return Topology.from_measurements(workers, np.full((n, n), 1e-4), np.full((n, n), 1.25e9))


@pytest.fixture(scope="module")
def tiny_dag() -> OpDag:
    torch.manual_seed(0)
    return capture(build_model("gpt2", "tiny"), (torch.randint(0, 256, (2, 16)),)).dag  # (B, T)


@pytest.fixture(scope="module")
def whole_peak(tiny_dag: OpDag) -> int:
    """The predicted peak of the whole model on one uncapped worker."""
    plan = make_plan(tiny_dag, topology([None]), PlanRequest(micro_batches=2))
    assert len(plan.stages) == 1
    return int(plan.stages[0].peak_memory_bytes or 0)


# ----------------------------------------------------------------- the planner


@pytest.mark.parametrize("strategy", ["opfence", "compute"])
def test_no_stage_is_planned_over_its_workers_cap(tiny_dag: OpDag, whole_peak: int, strategy: str) -> None:
    cap = int(whole_peak * 0.6)  # no worker can hold the model: it must be split
    t = topology([cap] * 4)
    plan = make_plan(tiny_dag, t, PlanRequest(strategy=strategy, micro_batches=2))
    assert len(plan.stages) >= 2
    for s in plan.stages:
        assert s.peak_memory_bytes is not None and 0 < s.peak_memory_bytes <= cap, (s.worker, s.peak_memory_bytes)


def test_a_memory_scale_plans_as_if_every_peak_were_that_much_larger(tiny_dag: OpDag, whole_peak: int) -> None:
    cap = int(whole_peak * 1.2)  # one worker holds the model, but not once peaks are 1.5x the prediction
    plain = make_plan(tiny_dag, topology([cap] * 4), PlanRequest(micro_batches=2))
    assert len(plain.stages) == 1
    scaled = make_plan(tiny_dag, topology([cap] * 4), PlanRequest(micro_batches=2, memory_scale=1.5))
    assert len(scaled.stages) >= 2
    assert all((s.peak_memory_bytes or 0) <= cap for s in scaled.stages)


def test_a_job_no_plan_fits_names_the_memory_needed_and_lent(tiny_dag: OpDag, whole_peak: int) -> None:
    cap = whole_peak // 10
    with pytest.raises(InsufficientMemoryError) as info:
        make_plan(tiny_dag, topology([cap, cap]), PlanRequest(micro_batches=2))
    e = info.value
    assert isinstance(e, PlanError)
    assert e.lent_bytes == 2 * cap and e.num_workers == 2 and e.needed_bytes > e.lent_bytes
    assert format_bytes(2 * cap) in str(e), str(e)
    print(e)


def test_uniform_over_the_caps_is_refused_naming_the_worker_and_bytes(tiny_dag: OpDag, whole_peak: int) -> None:
    cap = int(whole_peak * 0.3)  # uniform's halves do not fit; it does not search, so it is refused
    with pytest.raises(InsufficientMemoryError, match=r"uniform plan needs .* on worker w\d, which lends") as info:
        make_plan(tiny_dag, topology([cap, cap]), PlanRequest(strategy="uniform", micro_batches=2))
    assert f"> {cap} bytes" in str(info.value)


def test_the_advice_to_fit_a_uniform_plan_is_true(tiny_dag: OpDag) -> None:
    """Under 1F1B a stage holds at most one micro-batch per stage from it to the last, each
    1/m of the batch: the refusal says to use more micro-batches, and more do fit (the
    message used to say fewer, which never lowers the peak)."""

    def peaks(micro_batches: int, caps: list[int | None]) -> list[int]:
        torch.manual_seed(0)  # the batch of 4, captured at its micro-batch size
        dag = capture(build_model("gpt2", "tiny"), (torch.randint(0, 256, (4 // micro_batches, 16)),)).dag
        request = PlanRequest(strategy="uniform", micro_batches=micro_batches)
        return [int(s.peak_memory_bytes or 0) for s in make_plan(dag, topology(caps), request).stages]

    whole, quarters = max(peaks(1, [None] * 3)), max(peaks(4, [None] * 3))
    assert quarters < max(peaks(2, [None] * 3)) <= whole
    cap = (whole + quarters) // 2
    with pytest.raises(InsufficientMemoryError, match="use more micro-batches"):
        peaks(1, [cap] * 3)
    assert max(peaks(4, [cap] * 3)) <= cap


def test_memory_words() -> None:
    assert format_bytes(1.4 * 2**30) == "1.40 GiB"
    assert format_bytes(12 * 2**20) == "12.00 MiB"
    assert gb_to_bytes(0.5) == 2**29
    assert shortfall_text(3 << 29, 1 << 29, 2) == "needs 1.50 GiB of worker memory, has 0.50 GiB (2 workers)"
    assert lent_memory_bytes(free_bytes=5, total_bytes=100, cap_bytes=None) == 5
    assert lent_memory_bytes(free_bytes=5, total_bytes=100, cap_bytes=40) == 40
    assert lent_memory_bytes(free_bytes=5, total_bytes=100, cap_bytes=400) == 100


def test_the_ledger_scales_predictions_by_what_was_measured() -> None:
    ledger = MemoryLedger()
    ledger.placed([100, 200], [("a", 150), ("b", 250)])
    ledger.observe({0: 90, 1: 120})
    scale = ledger.outgrown(
        MemoryCapError(worker="b", stage_idx=1, needed_bytes=300, cap_bytes=250, planned_bytes=200, measured=True)
    )
    assert scale == pytest.approx(1.5 * MARGIN)
    doc = ledger.to_dict()
    assert doc["stages"][1] == {
        "stage": 1,
        "worker": "b",
        "cap_bytes": 250,
        "planned_peak_bytes": 200,
        "measured_peak_bytes": 300,
    }
    assert doc["exceeded"][0]["measured_peak_bytes"] == 300


# ----------------------------------------------------------------- the executor


class Executors:
    """Executors in this process, each lending ``cap_bytes``, with the coordinator's keys."""

    def __init__(self, n: int, cap_bytes: int) -> None:
        self.services, self.servers, self.addresses = [], [], []
        for i in range(n):
            service = ExecutorService(worker_name=f"vol-{i}", allow_code=False, memory_cap_bytes=cap_bytes)
            key = new_key()
            service.access.set_control_key(key)
            server, port = start_server(service, "127.0.0.1:0")
            address = f"127.0.0.1:{port}"
            process_keyring().set_control(address, key)
            self.services.append(service)
            self.servers.append(server)
            self.addresses.append(address)

    def close(self) -> None:
        for server, service, address in zip(self.servers, self.services, self.addresses, strict=True):
            server.stop(grace=0.5).wait()
            service.close()
            process_keyring().drop_control(address)


@pytest.fixture(scope="module")
def job_parts() -> tuple[torch.nn.Module, object, torch.Tensor, object]:
    model = build_job_model(JOB)
    dataset = build_job_dataset(JOB)
    x, y = example_micro_batch(JOB, dataset)
    return model, capture(model, (x,)), y, dataset


def driver_on(executors: Executors, parts: tuple, planned: list[int], job_id: str) -> PipelineDriver:
    model, captured, y, _ = parts
    stages = split_stages(captured.dag, uniform_assignment(captured.dag, len(executors.addresses)))
    return PipelineDriver(
        job_id=job_id,
        job=JOB,
        model=model,
        captured=captured,
        stages=stages,
        addresses=executors.addresses,
        example_target=y,
        pool=ChannelPool(),
        planned_peak_memory_bytes=planned,
    )


@pytest.fixture
def small_executors() -> Iterator[Executors]:
    e = Executors(2, cap_bytes=64 << 10)  # 64 KiB: less than a stage of GPT-2 tiny holds
    yield e
    e.close()


def test_a_stage_planned_over_the_cap_is_refused_at_load(small_executors: Executors, job_parts: tuple) -> None:
    driver = driver_on(small_executors, job_parts, [1000, 5_000_000], "over-cap-at-load")
    try:
        with pytest.raises(MemoryCapError) as info:
            driver.load()
    finally:
        driver.close()
    e = info.value
    assert (e.worker, e.stage_idx, e.needed_bytes, e.cap_bytes, e.measured) == ("vol-1", 1, 5_000_000, 65536, False)
    text = str(e)
    assert "worker vol-1" in text and "stage 1" in text and "5000000 bytes" in text and "65536 bytes" in text
    print(text)


def test_a_step_that_peaks_over_the_cap_fails_with_the_measured_bytes(
    small_executors: Executors, job_parts: tuple
) -> None:
    # Planned within the cap (an estimate that was too low): loads, then the step measures more.
    driver = driver_on(small_executors, job_parts, [1000, 1000], "over-cap-in-step")
    try:
        driver.load()
        x, y = job_batch(JOB, job_parts[3], 0)
        with pytest.raises(MemoryCapError) as info:
            driver.forward_backward(0, (x,), y)
    finally:
        driver.close()
    e = info.value
    assert e.measured and e.needed_bytes > e.cap_bytes == 65536 and e.planned_bytes == 1000
    assert e.worker in ("vol-0", "vol-1") and "its step peaked at" in str(e)
    print(e)


def test_a_stage_within_the_cap_trains_and_reports_its_peak(job_parts: tuple) -> None:
    executors = Executors(2, cap_bytes=1 << 30)
    driver = driver_on(executors, job_parts, [1 << 20, 1 << 20], "within-cap")
    try:
        driver.load()
        x, y = job_batch(JOB, job_parts[3], 0)
        stats = driver.forward_backward(0, (x,), y)  # measured though not asked: the stage is capped
        assert all(0 < stats.peak_memory_bytes[s] < 1 << 30 for s in (0, 1)), stats.peak_memory_bytes
        assert executors.services[0].stage_cap("another-job", 0, (1 << 30) - (1 << 20)) == (1 << 30) - (1 << 20)
        with pytest.raises(MemoryCapError):  # the other stage's planned peak is held for it
            executors.services[0].stage_cap("another-job", 0, 1 << 30)
    finally:
        driver.close()
        executors.close()

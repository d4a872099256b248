"""Parity: a model split over real worker processes trains exactly like one process.

The heart of fusion's contract. Each case runs one step over 2–4 executor processes on
loopback and compares loss and every parameter gradient with single-process PyTorch;
longer runs compare the parameters after 5 SGD and 5 AdamW steps. ``pytest --device cuda``
runs them all on a GPU (stages and reference alike).
"""

from __future__ import annotations

import pytest

from fusion.config import JobSpec
from fusion.graph.export import capture
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch
from scheduler.baselines import uniform_assignment
from tests.support.parity import assert_parity, skip_assignment

GPT2 = {"model": {"name": "gpt2", "preset": "tiny"}, "data": {"batch_size": 8, "seq_len": 16}}
RESNET = {
    "model": {"name": "resnet", "preset": "tiny", "num_classes": 4},
    "data": {"batch_size": 8, "image_size": 16, "num_classes": 4, "num_samples": 64},
}
# Residual branches: GPT-2's first attention sub-block, ResNet's first basic block.
BRANCH = {"gpt2": r"transformer\.h\.0\.(ln_1|attn)", "resnet": r"layer1\.0\.(conv|bn)"}


def make_job(base: dict, **train: object) -> JobSpec:
    train = {"steps": 1, "optimizer": "sgd", "lr": 0.1, **train}
    return JobSpec.from_dict({**base, "train": train})


def dag_of(job: JobSpec):
    model = build_job_model(job)
    x, _ = example_micro_batch(job, build_job_dataset(job))
    return capture(model, (x,)).dag


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("cut", ["chain-2", "chain-3", "chain-4", "skip-3", "skip-4"])
@pytest.mark.parametrize("family", ["gpt2", "resnet"])
def test_one_step_gradients_match(
    cluster: LocalCluster, device: str, family: str, cut: str, schedule: str, micro_batches: int
) -> None:
    base = GPT2 if family == "gpt2" else RESNET
    job = make_job(base, micro_batches=micro_batches, schedule=schedule)
    kind, k = cut.split("-")
    num_stages = int(k)
    assignment = skip_assignment(dag_of(job), BRANCH[family], num_stages) if kind == "skip" else None
    # BatchNorm sees micro-batches (as in every pipeline system): with M > 1 the reference
    # accumulates gradients over the same micro-batches.
    result = assert_parity(
        job, cluster.addresses[:num_stages], assignment=assignment, accumulate=family == "resnet", device=device
    )
    assert len(result.stages) == num_stages
    if kind == "skip":
        consumers_of_skip = [dsts for s in result.stages for _, dsts in s.outputs if len(dsts) > 1]
        assert consumers_of_skip, "the skip cut should send one value to two stages"
        assert any(src == 0 for s in result.stages if s.stage_idx == 2 for _, src in s.inputs), (
            "residual should jump from stage 0 to 2"
        )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("family", ["gpt2", "resnet"])
def test_five_steps_parameters_match(cluster: LocalCluster, device: str, family: str, optimizer: str) -> None:
    base = GPT2 if family == "gpt2" else RESNET
    lr = 0.05 if optimizer == "sgd" else 3e-3
    extra = {"momentum": 0.9} if optimizer == "sgd" else {}
    job = make_job(base, steps=5, optimizer=optimizer, lr=lr, micro_batches=2 if family == "gpt2" else 1, **extra)
    assignment = skip_assignment(dag_of(job), BRANCH[family], 4)
    assert_parity(job, cluster.addresses, steps=5, assignment=assignment, device=device)


@pytest.mark.parametrize("family", ["gpt2", "resnet"])
def test_paced_sends_change_nothing_computed(cluster: LocalCluster, device: str, family: str) -> None:
    """Stages that pace their sends at a link's bandwidth (several transfers in flight, none
    waiting for the answer before) train exactly as one process: 4 stages with a skip, 1F1B,
    4 micro-batches, every pair paced at 20 MB/s (a few ms per transfer here), and the
    driver's feed of inputs and targets paced too."""
    base = GPT2 if family == "gpt2" else RESNET
    job = make_job(base, steps=2, micro_batches=4, schedule="1f1b")
    links = {(a, b): 20e6 for a in range(4) for b in range(4) if a != b}
    assignment = skip_assignment(dag_of(job), BRANCH[family], 4)
    assert_parity(
        job,
        cluster.addresses,
        steps=2,
        assignment=assignment,
        accumulate=family == "resnet",
        device=device,
        link_bytes_per_s=links,
        feed_bytes_per_s=dict.fromkeys(range(4), 20e6),
    )


def test_tied_embeddings_on_different_stages(cluster: LocalCluster, device: str) -> None:
    job = make_job(GPT2, steps=3, micro_batches=2)
    result = assert_parity(job, cluster.addresses[:3], steps=3, device=device)
    holders = [
        s.stage_idx for s in result.stages if "transformer.wte.weight" in s.params or "lm_head.weight" in s.params
    ]
    assert holders == [0, 2], holders
    assert (result.state_dict["lm_head.weight"] == result.state_dict["transformer.wte.weight"]).all()


def test_control_flow_model_falls_back_to_export(cluster: LocalCluster, device: str) -> None:
    base = {
        "model": {"name": "tests.support.models:control_flow_net"},
        "data": {"name": "shapes", "batch_size": 8, "image_size": 8, "num_classes": 4, "num_samples": 64},
    }
    job = make_job(base, steps=3, micro_batches=4, optimizer="adamw", lr=1e-3)
    assert dag_of(job).capture == "export"
    # AdamW divides by sqrt(v): near-zero gradients amplify fp32 summation-order noise, so
    # compare with the same micro-batches accumulated in one process.
    assert_parity(job, cluster.addresses[:3], steps=3, accumulate=True, device=device)


def test_two_stages_on_one_worker(cluster: LocalCluster, device: str) -> None:
    job = make_job(GPT2, steps=2, micro_batches=2)
    assignment = uniform_assignment(dag_of(job), 3)
    assert_parity(job, cluster.addresses[:2], steps=2, assignment=assignment, stage_workers=[0, 1, 0], device=device)

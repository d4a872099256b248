"""Compression on a cut, end to end over real workers.

- The backward through a top-k-sparsified activation is exact: it equals the gradient of
  the same model where the activation is replaced by its sparsified value, computed in
  one process (gradient flows only where values were kept).
- Gradient compression keeps error-feedback residuals as stage state, and training still
  converges; AdaTopK moves the ratio with the link.
"""

from __future__ import annotations

import torch

from compress import AdaTopK, get_compressor
from executor.client import ChannelPool, ExecutorClient
from executor.compression import CutSetting, RatioController
from fusion.config import JobSpec
from fusion.graph.export import capture
from fusion.graph.split import build_stage_module, split_stages
from fusion.launch.distributed import train_distributed
from fusion.launch.executors import LocalCluster
from fusion.losses import get_loss
from fusion.training import (
    build_job_dataset,
    build_job_model,
    example_micro_batch,
    job_batch,
)
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb
from scheduler.baselines import uniform_assignment

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 1, "optimizer": "sgd", "lr": 0.1},
    }
)
CUT = (1, 2)
KEEP = 0.25


def reference_gradients_with_sparse_cut(job: JobSpec) -> dict[str, torch.Tensor]:
    """One process: run the three stages in order, sparsify what crosses stage 1 -> 2 with
    the same codec, and back-propagate only through the kept positions."""
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    x, y = job_batch(job, dataset, 0)
    ex, _ = example_micro_batch(job, dataset)
    captured = capture(model, (ex,))
    specs = split_stages(captured.dag, uniform_assignment(captured.dag, 3))
    modules = [build_stage_module(captured.graph_module, s) for s in specs]
    # Share parameters with `model` so the gradients land in one place.
    for mod in modules:
        for name, _p in list(mod.named_parameters(remove_duplicate=False)):
            owner, _, attr = name.rpartition(".")
            setattr(mod.get_submodule(owner) if owner else mod, attr, model.get_parameter(name))
    codec = get_compressor(pb.CODEC_TOPK)
    env: dict[str, object] = {captured.dag.input_names()[0]: x}
    masks: dict[str, torch.Tensor] = {}
    out = None
    for spec, mod in zip(specs, modules, strict=False):
        args = []
        for name, src in spec.inputs:
            v = env[name]
            if (src, spec.stage_idx) == CUT and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                enc = codec.encode(v.detach(), keep_ratio=KEEP)
                sparse = codec.decode(enc.data, dtype=v.dtype, shape=tuple(v.shape))
                mask = enc.mask.view(v.shape).to(v.dtype)
                masks[name] = mask
                # Value: the sparsified tensor; gradient: only through kept positions.
                v = sparse + (v - v.detach()) * mask
            args.append(v)
        res = mod(*args)
        for (name, _), value in zip(spec.outputs, res, strict=False):
            env[name] = value
        if spec.is_loss_stage:
            out = res[-1]
    loss = get_loss(job.train.loss)(out, y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_backward_through_sparse_activation_is_exact(cluster: LocalCluster) -> None:
    settings = {CUT: CutSetting(codec=pb.CODEC_TOPK, keep_ratio=KEEP, activations=True, gradients=False)}
    got = train_distributed(JOB, cluster.addresses[:3], cut_settings=settings, collect_gradients=True)
    assert got.stats[0].sent_bytes[CUT] < 0.6 * got.stats[0].dense_bytes[CUT]
    ref = reference_gradients_with_sparse_cut(JOB)
    dense = train_distributed(JOB, cluster.addresses[:3], collect_gradients=True)
    differs = False
    for name, g in ref.items():
        torch.testing.assert_close(got.gradients[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        differs |= not torch.allclose(dense.gradients[name], g, rtol=1e-3, atol=1e-4)
    assert differs, "sparsifying the cut should change some gradients"


def test_gradient_compression_keeps_residuals_and_converges(cluster: LocalCluster) -> None:
    job = JOB.replace(train={"steps": 12, "micro_batches": 2, "optimizer": "adamw", "lr": 3e-3}, data={"batch_size": 8})
    settings = {CUT: CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.1, activations=True, gradients=True)}
    # A very slow link (0.8 Mbps): AdaTopK must squeeze the cut below the starting ratio.
    controller = RatioController(
        AdaTopK(min_keep_ratio=0.02), link_of=lambda a, b: (0.04, 1e5) if (a, b) == CUT else None
    )
    seen: list[float] = []
    result = train_distributed(
        job,
        cluster.addresses[:3],
        cut_settings=settings,
        ratio_controller=controller,
        on_step=lambda s: seen.append(s.keep_ratios[CUT]),
    )
    assert result.losses[-1] < result.losses[0]
    assert seen[0] == 0.1 and seen[-1] < 0.1, seen  # AdaTopK squeezed the slow cut
    assert all(s.sent_bytes[(2, 1)] < s.dense_bytes[(2, 1)] for s in result.stats)  # gradients compressed too


def test_residuals_are_stage_state(cluster: LocalCluster) -> None:
    """The consumer of a gradient-compressed cut holds error-feedback residuals."""
    from executor.driver import PipelineDriver

    job = JOB.replace(train={"steps": 2, "micro_batches": 2}, data={"batch_size": 8})
    model = build_job_model(job)
    dataset = build_job_dataset(job)
    ex, ey = example_micro_batch(job, dataset)
    captured = capture(model, (ex,))
    stages = split_stages(captured.dag, uniform_assignment(captured.dag, 3))
    pool = ChannelPool()
    driver = PipelineDriver(
        job_id="residuals",
        job=job,
        model=model,
        captured=captured,
        stages=stages,
        addresses=cluster.addresses[:3],
        example_target=ey,
        pool=pool,
        cut_settings={CUT: CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.1, activations=False, gradients=True)},
    )
    try:
        driver.load()
        x, y = job_batch(job, dataset, 0)
        driver.train_step(0, (x,), y)
        residuals = ExecutorClient(cluster.addresses[2], pool).get_state("residuals", 2, epb.STATE_KIND_RESIDUALS)
        assert len(residuals) >= 2  # one per (value, micro-batch slot)
        assert any(r.abs().sum() > 0 for r in residuals.values())
        assert not ExecutorClient(cluster.addresses[0], pool).get_state("residuals", 0, epb.STATE_KIND_RESIDUALS)
    finally:
        driver.close()
        pool.close()

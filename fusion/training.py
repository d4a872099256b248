"""The parts of a job that every runner shares, and the single-process reference loop.

The "Determinism" contract in DESIGN.md lives here: the model is built as
``torch.manual_seed(train.seed)`` then the factory; the data set is built from ``[data]``;
step ``s`` uses the batch :func:`fusion.data.batch_for_step` gives. The distributed driver,
the coordinator and :func:`train_reference` all call these functions, so "same job, same
result" holds by construction and the parity tests compare like with like.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusion.config import JobSpec
from fusion.data import batch_for_step, build_dataset
from fusion.devices import use_exact_fp32
from fusion.errors import ConfigError
from fusion.graph.export import CapturedModel, capture
from fusion.losses import get_loss
from fusion.models import build_model, context_length, default_dataset
from fusion.optim import build_optimizer

logger = logging.getLogger(__name__)


def build_job_model(job: JobSpec) -> torch.nn.Module:
    """The job's model, seeded: ``torch.manual_seed(train.seed)`` then the factory, in train mode."""
    torch.manual_seed(job.train.seed)
    model = build_model(job.model.name, job.model.preset, **job.model.kwargs)
    model.train()
    return model


def capture_job_model(job: JobSpec, model: torch.nn.Module, example_x: torch.Tensor) -> CapturedModel:
    """Capture the job's model as workers do, keeping ``[model] leaf_modules`` whole.

    Raises:
        ConfigError: ``model.leaf_modules`` names a submodule the model does not have.
        GraphExportError: the model cannot be captured.
    """
    names = {name for name, _ in model.named_modules()}
    unknown = [m for m in job.model.leaf_modules if m not in names]
    if unknown:
        raise ConfigError(
            f"model.leaf_modules names {unknown}, not submodules of {type(model).__name__}; "
            f"use names from model.named_modules(), e.g. {sorted(names - {''})[:5]}"
        )
    return capture(model, (example_x,), leaf_modules=job.model.leaf_modules)


def dataset_name(job: JobSpec) -> str:
    """``[data] name``, or the model family's built-in default."""
    name = job.data.name or default_dataset(job.model.name)
    if name is None:
        raise ConfigError(f"data.name is required for model {job.model.name!r} (it has no built-in data set)")
    return name


def build_job_dataset(job: JobSpec) -> torch.utils.data.Dataset:
    """The job's data set from ``[data]`` (``name`` and keyword arguments).

    Sequences longer than the model's context are refused here, by name, rather than as
    an ``IndexError`` from the position embedding in the middle of a step.
    """
    seq_len = job.data.kwargs.get("seq_len")
    limit = context_length(job.model.name, job.model.preset, **job.model.kwargs)
    if isinstance(seq_len, int) and limit is not None and seq_len > limit:
        raise ConfigError(
            f"data.seq_len {seq_len} is longer than {job.model.name} (preset {job.model.preset}) takes: "
            f"its block_size is {limit}; shorten seq_len or set model.block_size"
        )
    return build_dataset(dataset_name(job), seed=job.train.seed, **job.data.kwargs)


def job_batch(job: JobSpec, dataset: torch.utils.data.Dataset, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of training step ``step``."""
    return batch_for_step(dataset, step, job.data.batch_size, shuffle=job.data.shuffle, seed=job.train.seed)


def example_micro_batch(job: JobSpec, dataset: torch.utils.data.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The first micro-batch of step 0: the example inputs for capture and wire shapes."""
    x, y = job_batch(job, dataset, 0)
    mb = job.micro_batch_size
    return x[:mb], y[:mb]


@dataclass
class ReferenceResult:
    """What single-process training produced."""

    losses: list[float] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients of the last step, before its optimizer update (by parameter name)."""


def train_reference(
    job: JobSpec,
    *,
    steps: int | None = None,
    device: str = "cpu",
    accumulate: bool = False,
    on_step: Callable[[int, float], None] | None = None,
) -> ReferenceResult:
    """Plain PyTorch training of the job on one process: the parity baseline.

    The loss of a step is the mean over the whole batch. With ``accumulate`` the batch is
    run as ``train.micro_batches`` chunks with gradient accumulation (loss of each chunk
    divided by their number) — identical for most models, and the right reference for
    models whose forward sees the micro-batch, such as BatchNorm in training mode.
    """
    use_exact_fp32(device)
    model = build_job_model(job).to(device)
    dataset = build_job_dataset(job)
    loss_fn = get_loss(job.train.loss)
    optimizer = build_optimizer(job.train, model.parameters())
    result = ReferenceResult()
    for step in range(job.train.steps if steps is None else steps):
        x, y = job_batch(job, dataset, step)
        optimizer.zero_grad(set_to_none=True)
        chunks = job.train.micro_batches if accumulate else 1
        total = 0.0
        for xm, ym in zip(torch.chunk(x, chunks), torch.chunk(y, chunks), strict=False):
            loss = loss_fn(model(xm.to(device)), ym.to(device)) / chunks
            loss.backward()
            total += float(loss.detach())
        result.gradients = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        result.losses.append(total)
        if on_step is not None:
            on_step(step, result.losses[-1])
    result.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return result

"""Datasets by name, and the batch a given training step uses.

Every worker must feed the same samples to the same step without talking to the others,
so batches are a pure function of ``(dataset, step, batch_size, shuffle, seed)``: see
:func:`batch_for_step`. No DataLoader, no sampler state to checkpoint.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from fusion.data.images import Cifar10Binary, GeneratedShapes
from fusion.data.text import PySourceText
from fusion.errors import ConfigError
from fusion.models import check_arguments, load_factory

logger = logging.getLogger(__name__)

__all__ = ["Cifar10Binary", "GeneratedShapes", "PySourceText", "batch_for_step", "build_dataset", "dataset_names"]


class SizedDataset(Protocol):
    """What :func:`batch_for_step` needs: a length and integer indexing."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Any: ...


def dataset_names() -> list[str]:
    """Names of the bundled datasets (a ``"package.module:factory"`` name is also accepted)."""
    return ["cifar10", "pysource", "shapes"]


def build_dataset(name: str, *, seed: int = 0, **kwargs: Any) -> Dataset[Any]:
    """Build a dataset of ``(input, target)`` samples.

    Args:
        name: ``"pysource"`` (:class:`PySourceText`), ``"shapes"`` (:class:`GeneratedShapes`),
            ``"cifar10"`` (:class:`Cifar10Binary`, needs ``path=``), or
            ``"package.module:factory"`` for a user dataset.
        seed: seed of generated data (``"shapes"``); the other bundled datasets are fixed
            files and a user factory gets only ``kwargs``.
        **kwargs: constructor arguments of the dataset, or of the factory.

    Returns:
        The dataset.

    Raises:
        ConfigError: the name or a keyword is unknown, the data cannot be read, or a user
            factory does not return something with ``__len__`` and ``__getitem__``.
    """
    if name == "pysource":
        check_arguments(PySourceText, kwargs, name)
        dataset: Any = PySourceText(**kwargs)
    elif name == "shapes":
        check_arguments(GeneratedShapes, {**kwargs, "seed": seed}, name)
        dataset = GeneratedShapes(seed=seed, **kwargs)
    elif name == "cifar10":
        check_arguments(Cifar10Binary, kwargs, name)
        dataset = Cifar10Binary(**kwargs)
    elif ":" in name:
        factory = load_factory(name, kind="dataset")
        check_arguments(factory, kwargs, name)
        dataset = factory(**kwargs)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(
                f"dataset factory {name!r} returned {type(dataset).__name__}, which lacks __len__ or "
                "__getitem__; return a map-style torch.utils.data.Dataset"
            )
    else:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {dataset_names()} or give 'package.module:factory'")
    logger.info("built dataset %s with %d samples", name, len(dataset))
    return dataset


def batch_for_step(
    dataset: SizedDataset,
    step: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that training step ``step`` uses.

    Step ``s`` takes the samples at positions ``[s * B, (s + 1) * B)`` of an endless stream
    made of consecutive epochs, where position ``p`` is in epoch ``p // N`` (N =
    ``len(dataset)``). Without shuffling, position ``p`` is sample ``p % N``; with shuffling,
    each epoch visits the samples in its own permutation, drawn from ``(seed, epoch)``. A
    batch may therefore straddle two epochs, and every sample is seen once per epoch.

    Args:
        dataset: map-style dataset of ``(input, target)`` samples.
        step: zero-based training step.
        batch_size: samples per batch, at most ``len(dataset)``.
        shuffle: whether each epoch is permuted.
        seed: seed of the permutations.

    Returns:
        ``(inputs, targets)``, each the samples' tensors stacked on a new first dimension
        of size ``batch_size``; python ``int`` targets become an int64 tensor.

    Raises:
        ConfigError: the dataset is empty, ``batch_size`` is not in ``[1, len(dataset)]``,
            or ``step`` is negative.
    """
    num_samples = len(dataset)
    if num_samples == 0:
        raise ConfigError("the dataset is empty; check its path and options")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= num_samples:
        raise ConfigError(
            f"batch_size={batch_size!r} must be an integer in [1, {num_samples}] (the dataset size); "
            "lower the batch size or use a larger dataset"
        )
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step}")

    positions = torch.arange(step * batch_size, (step + 1) * batch_size)  # (B,)
    indices = positions % num_samples  # (B,)
    if shuffle:
        epochs = positions // num_samples  # (B,)
        for epoch in epochs.unique().tolist():
            in_epoch = epochs == epoch
            indices[in_epoch] = _epoch_permutation(num_samples, seed, epoch)[indices[in_epoch]]

    inputs, targets = zip(*(dataset[idx] for idx in indices.tolist()), strict=True)
    return _collate(inputs, "input"), _collate(targets, "target")


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of ``range(num_samples)`` determined by ``(seed, epoch)``; do not modify."""
    generator = torch.Generator().manual_seed(_mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


_MASK_64 = (1 << 64) - 1


def _mix_seed(seed: int, epoch: int) -> int:
    """Hash ``(seed, epoch)`` to one 64-bit seed with SplitMix64 (Steele et al., 2014).

    Needed because torch's CPU generator keeps only the low 32 bits of a seed, so simple
    combinations such as ``(seed << 32) + epoch`` would collide; the SplitMix64 finaliser
    spreads every input bit over the low bits.
    """
    z = (seed * 0x9E3779B97F4A7C15 + epoch) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def _collate(values: Sequence[Any], what: str) -> torch.Tensor:
    """Stack per-sample tensors, or turn python ints/floats into one tensor."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(values))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.float32)
    raise ConfigError(
        f"cannot batch sample {what}s of type {type(first).__name__}; a dataset must return tensors or numbers"
    )

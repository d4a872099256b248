"""The sections of a job file: one frozen, self-validating dataclass per TOML table
(``[model]``, ``[data]``, ``[train]``, ``[cluster]``, ``[plan]``, ``[compression]``,
``[checkpoint]``, ``[output]``), so the whole file format reads in one place.

:class:`~fusion.config.JobSpec` assembles them into a job; import them from
:mod:`fusion.config`. Like it, this module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from fusion.config_checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_kwargs,
    check_str,
    kind_of,
    unknown_key_error,
)
from fusion.errors import ConfigError

BUILTIN_MODELS: tuple[str, ...] = ("gpt2", "resnet")
"""Model names resolved by the built-in model zoo; anything else is ``package.module:factory``."""

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
PLAN_STRATEGIES: tuple[str, ...] = ("opfence", "uniform", "compute", "exhaustive")
COMPRESSION_MODES: tuple[str, ...] = ("none", "topk", "adatopk", "quant", "topk-quant")
COMPRESSION_CUTS: tuple[str, ...] = ("slow", "all")
COMPRESSION_BITS: tuple[int, ...] = (4, 8)
USE_JOINERS: tuple[str, ...] = ("if_faster", "always", "never")
COMPRESSION_DIRECTIONS: tuple[str, ...] = ("activations", "gradients")
#: The settings ``(codec, keep_ratio, bits)`` AdaTopK chooses among and the calibration
#: measures (bits 0: not quantized): dense, top-k at several keep ratios, 8- and 4-bit block
#: quantization, and top-k with quantized values.
COMPRESSION_CANDIDATES: tuple[tuple[str, float, int], ...] = (
    ("none", 1.0, 0),
    ("topk", 0.5, 0),
    ("topk", 0.25, 0),
    ("topk", 0.1, 0),
    ("topk", 0.03, 0),
    ("topk", 0.01, 0),
    ("quant", 1.0, 8),
    ("quant", 1.0, 4),
    ("topk-quant", 0.5, 8),
    ("topk-quant", 0.25, 8),
    ("topk-quant", 0.1, 8),
    ("topk-quant", 0.25, 4),
    ("topk-quant", 0.1, 4),
)

# --------------------------------------------------------------------------------------
# Sections.


class Section:
    """Shared TOML-table parsing and printing of one job section.

    A subclass sets ``section`` (its TOML table name). Sections with keyword arguments
    (``[model]``, ``[data]``) have a ``kwargs`` field that collects every key that is not
    another field; every other section rejects unknown keys.
    """

    section: ClassVar[str]

    @classmethod
    def _field_names(cls) -> list[str]:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return [f.name for f in fields if f.name != "kwargs"]

    @classmethod
    def _has_kwargs(cls) -> bool:
        return any(f.name == "kwargs" for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> Self:
        """Builds the section from its TOML table (a mapping of key to value).

        Args:
            table: the section's keys as they appear in the job file. ``None`` values
                mean "not given" (JSON has null, TOML does not).

        Returns:
            The validated section.

        Raises:
            ConfigError: a key is unknown or a value is invalid.
        """
        if not isinstance(table, Mapping):
            raise ConfigError(f"{cls.section} must be a table ([{cls.section}]), got {kind_of(table)}")
        names = cls._field_names()
        fixed: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in table.items():
            if key in names:
                if value is not None:
                    fixed[key] = value
            elif cls._has_kwargs():
                if value is not None:
                    extra[key] = value
            else:
                raise unknown_key_error(cls.section, key, names)
        if cls._has_kwargs():
            fixed["kwargs"] = extra
        return cls(**fixed)

    def to_dict(self) -> dict[str, Any]:
        """Returns the section as its TOML table: plain JSON-able values, ``None`` and empty arrays left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "kwargs":
                out.update(json.loads(json.dumps(value)))
            elif isinstance(value, tuple):
                if value:
                    out[f.name] = list(value)
            elif value is not None:
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class ModelSpec(Section):
    """``[model]``: which model to build and with which arguments.

    Workers build the model as ``torch.manual_seed(train.seed)`` then the factory, so the
    spec alone (no code, no pickle) fixes the initial parameters.
    """

    section: ClassVar[str] = "model"

    name: str
    """``"gpt2"``, ``"resnet"`` (see :data:`BUILTIN_MODELS`) or ``"package.module:factory"``."""

    preset: str | None = None
    """A named size of a built-in model (e.g. ``"tiny"``); ``None`` for the zoo's default."""

    leaf_modules: tuple[str, ...] = ()
    """Dotted submodule names (as in ``model.named_modules()``) that capture keeps whole, one
    node each, for blocks neither tracer captures; not passed to the factory."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of ``[model]``: keyword arguments of the model factory (TOML scalars
    or arrays of them)."""

    def __post_init__(self) -> None:
        allowed = f"one of {', '.join(repr(m) for m in BUILTIN_MODELS)} or an import path 'package.module:factory'"
        check_str("model.name", self.name, what=allowed)
        if self.name not in BUILTIN_MODELS and not _is_import_path(self.name):
            raise ConfigError(f"model.name must be {allowed}, got {kind_of(self.name)}")
        if self.preset is not None:
            check_str("model.preset", self.preset, what="a non-empty string or left out")
        object.__setattr__(self, "leaf_modules", _check_leaf_modules(self.leaf_modules))
        object.__setattr__(self, "kwargs", check_kwargs("model", self.kwargs, ("name", "preset", "leaf_modules")))

    @property
    def is_builtin(self) -> bool:
        """Whether ``name`` is resolved by the built-in model zoo (not an import path)."""
        return self.name in BUILTIN_MODELS

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> Self:
        """Builds ``[model]`` from its table; ``name`` is required.

        Args:
            table: the ``[model]`` keys as in the job file.

        Returns:
            The validated model spec.

        Raises:
            ConfigError: ``model.name`` is missing or a value is invalid.
        """
        if isinstance(table, Mapping) and table.get("name") is None:
            raise ConfigError(
                "model.name is required: set it to one of "
                f"{', '.join(repr(m) for m in BUILTIN_MODELS)} or 'package.module:factory'"
            )
        return super().from_dict(table)


def _check_leaf_modules(value: object) -> tuple[str, ...]:
    what = 'an array of dotted submodule names, e.g. ["blocks.0.attn"]'
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"model.leaf_modules must be {what}, got {kind_of(value)}")
    for item in value:
        if not isinstance(item, str) or not all(p.isidentifier() or p.isdigit() for p in item.split(".")):
            raise ConfigError(f"model.leaf_modules must be {what}, got {kind_of(item)}")
    return tuple(value)


def _is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return False
    return all(p.isidentifier() for p in module.split(".")) and all(p.isidentifier() for p in attr.split("."))


@dataclass(frozen=True, kw_only=True)
class DataSpec(Section):
    """``[data]``: the data set and how batches are drawn from it.

    With ``shuffle = false``, step ``s`` uses samples ``[s * batch_size, (s + 1) * batch_size)``.
    """

    section: ClassVar[str] = "data"

    name: str | None = None
    """The data set; ``None`` means the model's default data set (resolved by the data zoo)."""

    batch_size: int = 8
    """Samples per optimizer step (the whole batch, split into ``train.micro_batches``)."""

    shuffle: bool = False
    """Whether to draw samples in a seeded random order instead of file order."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of ``[data]`` (e.g. ``seq_len``, ``image_size``, ``path``): keyword
    arguments of the data set factory."""

    def __post_init__(self) -> None:
        if self.name is not None:
            check_str("data.name", self.name, what="a non-empty string or left out")
        check_int("data.batch_size", self.batch_size, minimum=1)
        check_bool("data.shuffle", self.shuffle)
        if "seed" in self.kwargs:
            raise ConfigError(
                "[data] seed is not a key: the data set and its shuffle order are seeded by [train] seed; "
                "move the value there"
            )
        object.__setattr__(self, "kwargs", check_kwargs("data", self.kwargs, ("name", "batch_size", "shuffle")))


@dataclass(frozen=True, kw_only=True)
class TrainSpec(Section):
    """``[train]``: the optimization loop and the optimizer."""

    section: ClassVar[str] = "train"

    steps: int = 100
    """Number of optimizer steps."""

    micro_batches: int = 1
    """Micro-batches per step in the pipeline; must divide ``data.batch_size``."""

    schedule: str = "1f1b"
    """Pipeline schedule: ``"gpipe"`` (all forwards then all backwards) or ``"1f1b"``."""

    optimizer: str = "adamw"
    """``"sgd"`` (``torch.optim.SGD``) or ``"adamw"`` (``torch.optim.AdamW``)."""

    lr: float = 1e-3
    """Learning rate, > 0."""

    weight_decay: float | None = None
    """Weight decay, >= 0; ``None`` keeps the optimizer's PyTorch default (SGD 0, AdamW 0.01)."""

    momentum: float = 0.0
    """SGD momentum, >= 0; only for ``optimizer = "sgd"``."""

    betas: tuple[float, float] | None = None
    """AdamW ``(beta1, beta2)``, each in [0, 1); ``None`` keeps PyTorch's (0.9, 0.999)."""

    eps: float | None = None
    """AdamW epsilon, > 0; ``None`` keeps PyTorch's 1e-8."""

    seed: int = 0
    """Seed of ``torch.manual_seed`` before the model is built, and of data shuffling."""

    loss: str = "cross_entropy"
    """Name of the loss function, applied as the mean over the whole batch."""

    def __post_init__(self) -> None:
        check_int("train.steps", self.steps, minimum=1)
        check_int("train.micro_batches", self.micro_batches, minimum=1)
        check_choice("train.schedule", self.schedule, SCHEDULES)
        check_choice("train.optimizer", self.optimizer, OPTIMIZERS)
        object.__setattr__(self, "lr", check_float("train.lr", self.lr, gt=0.0))
        if self.weight_decay is not None:
            object.__setattr__(self, "weight_decay", check_float("train.weight_decay", self.weight_decay, ge=0.0))
        object.__setattr__(self, "momentum", check_float("train.momentum", self.momentum, ge=0.0))
        if self.momentum != 0.0 and self.optimizer != "sgd":
            raise ConfigError(
                f"train.momentum applies only to train.optimizer = 'sgd' (got "
                f"{self.optimizer!r}); remove it or set it to 0"
            )
        if self.betas is not None:
            object.__setattr__(self, "betas", _check_betas(self.betas))
        if self.eps is not None:
            object.__setattr__(self, "eps", check_float("train.eps", self.eps, gt=0.0))
        for key in ("betas", "eps"):
            if getattr(self, key) is not None and self.optimizer != "adamw":
                raise ConfigError(
                    f"train.{key} applies only to train.optimizer = 'adamw' (got {self.optimizer!r}); remove it"
                )
        check_int("train.seed", self.seed, minimum=0)
        check_str("train.loss", self.loss)


def _check_betas(value: object) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(
            f"train.betas must be an array of 2 numbers in [0, 1), e.g. [0.9, 0.999], got {kind_of(value)}"
        )
    return (
        check_float("train.betas", value[0], ge=0.0, lt=1.0),
        check_float("train.betas", value[1], ge=0.0, lt=1.0),
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec(Section):
    """``[cluster]``: the workers a job needs."""

    section: ClassVar[str] = "cluster"

    min_workers: int = 1
    """Workers that must be registered before the job is planned and started."""

    spares: int = 0
    """Workers the job holds but leaves out of its plan, ready to replace a lost one at once
    (no re-plan). They also hold replicas."""

    use_joiners: str = "if_faster"
    """What to do with a worker that joins while the job runs: ``"if_faster"`` re-plans
    with it when the estimator predicts a step at least 10 % faster, ``"always"`` re-plans
    with it, ``"never"`` leaves it to other jobs (it still replaces lost workers)."""

    def __post_init__(self) -> None:
        check_int("cluster.min_workers", self.min_workers, minimum=1)
        check_int("cluster.spares", self.spares, minimum=0)
        check_choice("cluster.use_joiners", self.use_joiners, USE_JOINERS)
        if self.spares >= self.min_workers:
            raise ConfigError(
                f"cluster.spares ({self.spares}) must be smaller than cluster.min_workers ({self.min_workers})"
            )


@dataclass(frozen=True, kw_only=True)
class PlanSpec(Section):
    """``[plan]``: how the model is cut into stages and placed on workers."""

    section: ClassVar[str] = "plan"

    strategy: str = "opfence"
    """``"opfence"`` (bandwidth-aware), ``"uniform"`` (equal node counts), ``"compute"``
    (compute-balanced, ignores bandwidth) or ``"exhaustive"`` (optimal, small instances)."""

    def __post_init__(self) -> None:
        check_choice("plan.strategy", self.strategy, PLAN_STRATEGIES)


@dataclass(frozen=True, kw_only=True)
class CompressionSpec(Section):
    """``[compression]``: compression of the tensors crossing the plan's slow (or all) cuts."""

    section: ClassVar[str] = "compression"

    mode: str = "none"
    """``"none"`` (dense), ``"topk"`` (fixed ratio), ``"adatopk"`` (ratio adapts per link),
    ``"quant"`` (every entry in ``bits`` bits, a scale per block) or ``"topk-quant"`` (top-k
    at ``keep_ratio`` with ``bits``-bit values)."""

    keep_ratio: float = 0.1
    """Fraction of entries kept, in (0, 1]: the fixed ratio of ``topk``, the starting ratio
    of ``adatopk``."""

    min_keep_ratio: float = 0.01
    """Lowest fraction ``adatopk`` may go down to, in (0, 1]."""

    bits: int = 8
    """Bits per value of ``quant`` and ``topk-quant``: 8 or 4."""

    cuts: str = "slow"
    """Which cuts a fixed mode (``topk``, ``quant``, ``topk-quant``) compresses: ``"slow"``
    (those whose transfer outlasts the slowest stage's compute) or ``"all"``."""

    directions: tuple[str, ...] = COMPRESSION_DIRECTIONS
    """Which tensors are compressed: a non-empty subset of ``"activations"`` (forward) and
    ``"gradients"`` (backward), stored in that order."""

    def __post_init__(self) -> None:
        check_choice("compression.mode", self.mode, COMPRESSION_MODES)
        check_choice("compression.cuts", self.cuts, COMPRESSION_CUTS)
        if isinstance(self.bits, bool) or self.bits not in COMPRESSION_BITS:
            raise ConfigError(f"compression.bits must be 4 or 8, got {kind_of(self.bits)}")
        object.__setattr__(
            self,
            "keep_ratio",
            check_float("compression.keep_ratio", self.keep_ratio, gt=0.0, le=1.0),
        )
        object.__setattr__(
            self,
            "min_keep_ratio",
            check_float("compression.min_keep_ratio", self.min_keep_ratio, gt=0.0, le=1.0),
        )
        object.__setattr__(self, "directions", _check_directions(self.directions))


def _check_directions(value: object) -> tuple[str, ...]:
    allowed = ", ".join(repr(d) for d in COMPRESSION_DIRECTIONS)
    what = f"a non-empty array of distinct values from {allowed}"
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"compression.directions must be {what}, got {kind_of(value)}")
    for item in value:
        if item not in COMPRESSION_DIRECTIONS or not isinstance(item, str):
            raise ConfigError(f"compression.directions must be {what}, got {kind_of(item)}")
    if len(set(value)) != len(value):
        raise ConfigError(f"compression.directions must be {what}, got duplicates {list(value)!r}")
    return tuple(d for d in COMPRESSION_DIRECTIONS if d in value)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec(Section):
    """``[checkpoint]``: how often stage state is snapshotted, replicated and written."""

    section: ClassVar[str] = "checkpoint"

    replicate_every: int = 10
    """Steps between replications of each worker's snapshot to its buddy worker."""

    durable_every: int = 50
    """Steps between durable checkpoints written by the coordinator."""

    keep: int = 3
    """Number of durable checkpoints kept on disk (oldest deleted first)."""

    replicate_share: float = 0.5
    """Replica streams are paced to this share of the measured link bandwidth, so they
    stay below training traffic."""

    def __post_init__(self) -> None:
        check_float("checkpoint.replicate_share", self.replicate_share, gt=0.0, le=1.0)
        check_int("checkpoint.replicate_every", self.replicate_every, minimum=1)
        check_int("checkpoint.durable_every", self.durable_every, minimum=1)
        check_int("checkpoint.keep", self.keep, minimum=1)


@dataclass(frozen=True, kw_only=True)
class OutputSpec(Section):
    """``[output]``: where the job's results go."""

    section: ClassVar[str] = "output"

    dir: str = "fusion-out"
    """Directory for ``model.safetensors``, ``metrics.jsonl``, ``loss.png``, ``plan.json``
    and ``summary.json``; relative paths are relative to the coordinator's working dir."""

    def __post_init__(self) -> None:
        check_str("output.dir", self.dir)

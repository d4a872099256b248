"""The job specification: what to train, on what data, how, and where to write it.

A job is written as TOML (the "Job file" contract in ``DESIGN.md``)::

    name = "tiny-gpt"

    [model]
    name = "gpt2"             # "gpt2", "resnet" or "package.module:factory"
    preset = "tiny"
    n_layer = 2               # any other key is a keyword argument of the model factory

    [data]
    batch_size = 8
    seq_len = 64              # any other key is a keyword argument of the data set factory

    [train]
    steps = 100
    micro_batches = 4
    optimizer = "adamw"
    lr = 3e-4

and parsed into a :class:`JobSpec`, a tree of frozen dataclasses that validate themselves
on construction. ``JobSpec.to_dict()`` gives back the same shape as the TOML (keyword
arguments merged back into their sections, ``None`` values left out because TOML has no
null), so ``JobSpec.from_dict(spec.to_dict()) == spec`` and the JSON form travels to
workers and into ``summary.json``.

Every error is a :class:`~fusion.errors.ConfigError` whose message names the offending
key as ``section.key`` and says which values are allowed.

This module must stay importable without torch: the coordinator CLI and the scheduler read
job specs too. It is longer than most modules because it holds one documented dataclass per
job-file section, so the whole file format reads in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODELS",
    "CheckpointSpec",
    "ClusterSpec",
    "CompressionSpec",
    "DataSpec",
    "JobSpec",
    "ModelSpec",
    "OutputSpec",
    "PlanSpec",
    "TrainSpec",
    "load_job",
]

BUILTIN_MODELS: tuple[str, ...] = ("gpt2", "resnet")
"""Model names resolved by the built-in model zoo; anything else is ``package.module:factory``."""

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
PLAN_STRATEGIES: tuple[str, ...] = ("opfence", "uniform", "compute", "exhaustive")
COMPRESSION_MODES: tuple[str, ...] = ("none", "topk", "adatopk")
USE_JOINERS: tuple[str, ...] = ("if_faster", "always", "never")
COMPRESSION_DIRECTIONS: tuple[str, ...] = ("activations", "gradients")

# A factory keyword argument is one TOML scalar or an array of them; datetimes are left out
# because they have no JSON form.
_SCALAR_TYPES: tuple[type, ...] = (str, int, float, bool)


# --------------------------------------------------------------------------------------
# Value checks. Each takes the dotted key it reports and returns the normalised value.


def _kind(value: object) -> str:
    """Names the TOML/JSON kind of ``value`` for error messages."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"boolean {value!r}"
    if isinstance(value, int):
        return f"integer {value!r}"
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "table"
    return type(value).__name__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(key: str, value: object, *, minimum: int) -> int:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {_kind(value)}")
    return int(value)  # type: ignore[arg-type]


def _check_float(
    key: str,
    value: object,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> float:
    """Checks a finite number within bounds; integers are accepted and become floats."""
    bounds = []
    if gt is not None:
        bounds.append(f"> {gt:g}")
    if ge is not None:
        bounds.append(f">= {ge:g}")
    if lt is not None:
        bounds.append(f"< {lt:g}")
    if le is not None:
        bounds.append(f"<= {le:g}")
    allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not _is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ConfigError(f"{key} must be {allowed}, got {_kind(value)}")
    number = float(value)  # type: ignore[arg-type]
    if (
        (gt is not None and not number > gt)
        or (ge is not None and not number >= ge)
        or (lt is not None and not number < lt)
        or (le is not None and not number <= le)
    ):
        raise ConfigError(f"{key} must be {allowed}, got {_kind(value)}")
    return number


def _check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {_kind(value)}")
    return value


def _check_str(key: str, value: object, *, what: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} must be {what}, got {_kind(value)}")
    return value


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key} must be one of {allowed}, got {_kind(value)}")
    return value


def _check_kwargs(section: str, kwargs: object, reserved: tuple[str, ...]) -> dict[str, Any]:
    """Checks factory keyword arguments and returns a private deep copy of them."""
    if not isinstance(kwargs, Mapping):
        raise ConfigError(
            f"{section}.kwargs must be a table of keyword arguments, got {_kind(kwargs)}"
        )
    checked: dict[str, Any] = {}
    for name, value in kwargs.items():
        key = f"{section}.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"{key} cannot be passed to a factory: keys other than "
                f"{', '.join(reserved)} must be Python identifiers (letters, digits, '_')"
            )
        if name in reserved:
            raise ConfigError(
                f"{key} is a field of [{section}], not a keyword argument; set it directly"
            )
        checked[name] = _check_kwarg_value(key, value)
    return checked


def _check_kwarg_value(key: str, value: object) -> Any:
    allowed = "a string, integer, float, boolean or an array of these"
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple)):
                raise ConfigError(f"{key} must be {allowed}, got a nested array")
        return [_check_kwarg_value(key, item) for item in value]
    if not isinstance(value, _SCALAR_TYPES):
        raise ConfigError(f"{key} must be {allowed}, got {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be {allowed} (finite), got {_kind(value)}")
    return value


def _unknown_key_error(section: str, key: object, allowed: list[str]) -> ConfigError:
    dotted = f"{section}.{key}" if section else str(key)
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    where = f"[{section}]" if section else "the top level of a job"
    return ConfigError(
        f"unknown key {dotted}{hint}; keys allowed in {where}: {', '.join(allowed)}"
    )


# --------------------------------------------------------------------------------------
# Sections.


class _Section:
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
            raise ConfigError(
                f"{cls.section} must be a table ([{cls.section}]), got {_kind(table)}"
            )
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
                raise _unknown_key_error(cls.section, key, names)
        if cls._has_kwargs():
            fixed["kwargs"] = extra
        return cls(**fixed)

    def to_dict(self) -> dict[str, Any]:
        """Returns the section as its TOML table: plain JSON-able values, ``None`` left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "kwargs":
                out.update(json.loads(json.dumps(value)))
            elif isinstance(value, tuple):
                out[f.name] = list(value)
            elif value is not None:
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class ModelSpec(_Section):
    """``[model]``: which model to build and with which arguments.

    Workers build the model as ``torch.manual_seed(train.seed)`` then the factory, so the
    spec alone (no code, no pickle) fixes the initial parameters.
    """

    section: ClassVar[str] = "model"

    name: str
    """``"gpt2"``, ``"resnet"`` (see :data:`BUILTIN_MODELS`) or ``"package.module:factory"``."""

    preset: str | None = None
    """A named size of a built-in model (e.g. ``"tiny"``); ``None`` for the zoo's default."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of ``[model]``: keyword arguments of the model factory (TOML scalars
    or arrays of them)."""

    def __post_init__(self) -> None:
        allowed = (
            f"one of {', '.join(repr(m) for m in BUILTIN_MODELS)} "
            "or an import path 'package.module:factory'"
        )
        _check_str("model.name", self.name, what=allowed)
        if self.name not in BUILTIN_MODELS and not _is_import_path(self.name):
            raise ConfigError(f"model.name must be {allowed}, got {_kind(self.name)}")
        if self.preset is not None:
            _check_str("model.preset", self.preset, what="a non-empty string or left out")
        object.__setattr__(self, "kwargs", _check_kwargs("model", self.kwargs, ("name", "preset")))

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


def _is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return False
    return all(p.isidentifier() for p in module.split(".")) and all(
        p.isidentifier() for p in attr.split(".")
    )


@dataclass(frozen=True, kw_only=True)
class DataSpec(_Section):
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
            _check_str("data.name", self.name, what="a non-empty string or left out")
        _check_int("data.batch_size", self.batch_size, minimum=1)
        _check_bool("data.shuffle", self.shuffle)
        object.__setattr__(
            self, "kwargs", _check_kwargs("data", self.kwargs, ("name", "batch_size", "shuffle"))
        )


@dataclass(frozen=True, kw_only=True)
class TrainSpec(_Section):
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
        _check_int("train.steps", self.steps, minimum=1)
        _check_int("train.micro_batches", self.micro_batches, minimum=1)
        _check_choice("train.schedule", self.schedule, SCHEDULES)
        _check_choice("train.optimizer", self.optimizer, OPTIMIZERS)
        object.__setattr__(self, "lr", _check_float("train.lr", self.lr, gt=0.0))
        if self.weight_decay is not None:
            object.__setattr__(
                self, "weight_decay", _check_float("train.weight_decay", self.weight_decay, ge=0.0)
            )
        object.__setattr__(self, "momentum", _check_float("train.momentum", self.momentum, ge=0.0))
        if self.momentum != 0.0 and self.optimizer != "sgd":
            raise ConfigError(
                f"train.momentum applies only to train.optimizer = 'sgd' (got "
                f"{self.optimizer!r}); remove it or set it to 0"
            )
        if self.betas is not None:
            object.__setattr__(self, "betas", _check_betas(self.betas))
        if self.eps is not None:
            object.__setattr__(self, "eps", _check_float("train.eps", self.eps, gt=0.0))
        for key in ("betas", "eps"):
            if getattr(self, key) is not None and self.optimizer != "adamw":
                raise ConfigError(
                    f"train.{key} applies only to train.optimizer = 'adamw' (got "
                    f"{self.optimizer!r}); remove it"
                )
        _check_int("train.seed", self.seed, minimum=0)
        _check_str("train.loss", self.loss)


def _check_betas(value: object) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(
            f"train.betas must be an array of 2 numbers in [0, 1), e.g. [0.9, 0.999], "
            f"got {_kind(value)}"
        )
    return (
        _check_float("train.betas", value[0], ge=0.0, lt=1.0),
        _check_float("train.betas", value[1], ge=0.0, lt=1.0),
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec(_Section):
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
        _check_int("cluster.min_workers", self.min_workers, minimum=1)
        _check_int("cluster.spares", self.spares, minimum=0)
        _check_choice("cluster.use_joiners", self.use_joiners, USE_JOINERS)
        if self.spares >= self.min_workers:
            raise ConfigError(f"cluster.spares ({self.spares}) must be smaller than cluster.min_workers ({self.min_workers})")


@dataclass(frozen=True, kw_only=True)
class PlanSpec(_Section):
    """``[plan]``: how the model is cut into stages and placed on workers."""

    section: ClassVar[str] = "plan"

    strategy: str = "opfence"
    """``"opfence"`` (bandwidth-aware), ``"uniform"`` (equal node counts), ``"compute"``
    (compute-balanced, ignores bandwidth) or ``"exhaustive"`` (optimal, small instances)."""

    def __post_init__(self) -> None:
        _check_choice("plan.strategy", self.strategy, PLAN_STRATEGIES)


@dataclass(frozen=True, kw_only=True)
class CompressionSpec(_Section):
    """``[compression]``: sparsification of tensors on the cuts the plan marks as slow."""

    section: ClassVar[str] = "compression"

    mode: str = "none"
    """``"none"`` (dense), ``"topk"`` (fixed ratio) or ``"adatopk"`` (ratio adapts per link)."""

    keep_ratio: float = 0.1
    """Fraction of entries kept, in (0, 1]: the fixed ratio of ``topk``, the starting ratio
    of ``adatopk``."""

    min_keep_ratio: float = 0.01
    """Lowest fraction ``adatopk`` may go down to, in (0, 1]."""

    directions: tuple[str, ...] = COMPRESSION_DIRECTIONS
    """Which tensors are compressed: a non-empty subset of ``"activations"`` (forward) and
    ``"gradients"`` (backward), stored in that order."""

    def __post_init__(self) -> None:
        _check_choice("compression.mode", self.mode, COMPRESSION_MODES)
        object.__setattr__(
            self,
            "keep_ratio",
            _check_float("compression.keep_ratio", self.keep_ratio, gt=0.0, le=1.0),
        )
        object.__setattr__(
            self,
            "min_keep_ratio",
            _check_float("compression.min_keep_ratio", self.min_keep_ratio, gt=0.0, le=1.0),
        )
        object.__setattr__(self, "directions", _check_directions(self.directions))


def _check_directions(value: object) -> tuple[str, ...]:
    allowed = ", ".join(repr(d) for d in COMPRESSION_DIRECTIONS)
    what = f"a non-empty array of distinct values from {allowed}"
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"compression.directions must be {what}, got {_kind(value)}")
    for item in value:
        if item not in COMPRESSION_DIRECTIONS or not isinstance(item, str):
            raise ConfigError(f"compression.directions must be {what}, got {_kind(item)}")
    if len(set(value)) != len(value):
        raise ConfigError(f"compression.directions must be {what}, got duplicates {list(value)!r}")
    return tuple(d for d in COMPRESSION_DIRECTIONS if d in value)


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec(_Section):
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
        _check_float("checkpoint.replicate_share", self.replicate_share, gt=0.0, le=1.0)
        _check_int("checkpoint.replicate_every", self.replicate_every, minimum=1)
        _check_int("checkpoint.durable_every", self.durable_every, minimum=1)
        _check_int("checkpoint.keep", self.keep, minimum=1)


@dataclass(frozen=True, kw_only=True)
class OutputSpec(_Section):
    """``[output]``: where the job's results go."""

    section: ClassVar[str] = "output"

    dir: str = "fusion-out"
    """Directory for ``model.safetensors``, ``metrics.jsonl``, ``loss.png``, ``plan.json``
    and ``summary.json``; relative paths are relative to the coordinator's working dir."""

    def __post_init__(self) -> None:
        _check_str("output.dir", self.dir)


# --------------------------------------------------------------------------------------
# The job.

_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSpec,
    "data": DataSpec,
    "train": TrainSpec,
    "cluster": ClusterSpec,
    "plan": PlanSpec,
    "compression": CompressionSpec,
    "checkpoint": CheckpointSpec,
    "output": OutputSpec,
}

_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_TOML_END = re.compile(r"\s*\(at end of document\)$")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A whole job: one model, one data set, one training loop, and how to run it."""

    name: str = "job"
    """Human-readable job name (top-level ``name`` key)."""

    model: ModelSpec
    """``[model]``: required."""

    data: DataSpec = field(default_factory=DataSpec)
    """``[data]``."""

    train: TrainSpec = field(default_factory=TrainSpec)
    """``[train]``."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    """``[cluster]``."""

    plan: PlanSpec = field(default_factory=PlanSpec)
    """``[plan]``."""

    compression: CompressionSpec = field(default_factory=CompressionSpec)
    """``[compression]``."""

    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """``[checkpoint]``."""

    output: OutputSpec = field(default_factory=OutputSpec)
    """``[output]``."""

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        for section, cls in _SECTIONS.items():
            value = getattr(self, section)
            if not isinstance(value, cls):
                raise ConfigError(
                    f"{section} must be a {cls.__name__} (the [{section}] table), got "
                    f"{type(value).__name__}"
                )
        batch_size = self.data.batch_size
        micro_batches = self.train.micro_batches
        if micro_batches > batch_size:
            raise ConfigError(
                f"train.micro_batches ({micro_batches}) must be <= data.batch_size "
                f"({batch_size}): each micro-batch needs at least one sample"
            )
        if batch_size % micro_batches != 0:
            raise ConfigError(
                f"data.batch_size ({batch_size}) must be divisible by train.micro_batches "
                f"({micro_batches}): pick a train.micro_batches that divides data.batch_size"
            )

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch: ``data.batch_size // train.micro_batches``."""
        return self.data.batch_size // self.train.micro_batches

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        """Builds a job from the nested mapping a TOML or JSON job file parses into.

        Args:
            d: top-level ``name`` plus one table per section; ``[model]`` is required and
                every other section is optional (defaults apply).

        Returns:
            The validated job.

        Raises:
            ConfigError: a section or key is unknown, a value is invalid, or
                ``[model]``/``model.name`` is missing.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"a job must be a table of sections, got {_kind(d)}")
        allowed = ["name", *_SECTIONS]
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key == "name":
                if value is not None:
                    kwargs["name"] = value
            elif key in _SECTIONS:
                if value is not None:
                    kwargs[key] = _SECTIONS[key].from_dict(value)
            else:
                raise _unknown_key_error("", key, allowed)
        if "model" not in kwargs:
            raise ConfigError(
                "model.name is required: add a [model] section with name = one of "
                f"{', '.join(repr(m) for m in BUILTIN_MODELS)} or 'package.module:factory'"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Returns the job in the shape of its TOML file, as plain JSON-able values.

        Keyword arguments are merged back into ``[model]`` and ``[data]``; ``None`` values
        are left out. ``JobSpec.from_dict(spec.to_dict()) == spec``.
        """
        out: dict[str, Any] = {"name": self.name}
        for section in _SECTIONS:
            out[section] = getattr(self, section).to_dict()
        return out

    def to_json(self, *, indent: int | None = 2) -> str:
        """Returns :meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        """Parses JSON text written by :meth:`to_json`.

        Raises:
            ConfigError: the text is not JSON or does not describe a valid job.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"invalid job JSON at line {e.lineno}, column {e.colno}: {e.msg}"
            ) from e
        return cls.from_dict(data)

    @classmethod
    def from_toml(cls, text: str, *, source: str | None = None) -> JobSpec:
        """Parses a job file's text.

        Args:
            text: TOML text.
            source: the file name to put in front of error messages, if any.

        Returns:
            The validated job.

        Raises:
            ConfigError: TOML syntax error (with line and column) or an invalid job.
        """
        where = source if source is not None else "<string>"
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(_toml_error_message(e, text, where)) from e
        if source is None:
            return cls.from_dict(data)
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e

    def replace(self, **overrides: Mapping[str, Any] | _Section | str) -> JobSpec:
        """Returns a validated copy with some keys changed.

        Example: ``spec.replace(train={"steps": 3}, name="smoke")``.

        Args:
            **overrides: ``name=...`` and, per section, either a mapping of keys to merge
                into that section's table (a value of ``None`` removes the key, restoring
                its default; for ``model`` and ``data`` other keys set factory keyword
                arguments) or a whole section object that replaces it.

        Returns:
            A new, validated job; this one is unchanged.

        Raises:
            ConfigError: an override names an unknown section or key, or gives an invalid
                value, or the result fails a cross-section check.
        """
        d = self.to_dict()
        for key, value in overrides.items():
            if key == "name":
                d["name"] = value
            elif key not in _SECTIONS:
                raise _unknown_key_error("", key, ["name", *_SECTIONS])
            elif isinstance(value, _Section):
                if not isinstance(value, _SECTIONS[key]):
                    raise ConfigError(
                        f"{key} must be a {_SECTIONS[key].__name__} or a mapping, got "
                        f"{type(value).__name__}"
                    )
                d[key] = value.to_dict()
            elif isinstance(value, Mapping):
                table = dict(d[key])
                for k, v in value.items():
                    if v is None:
                        table.pop(k, None)
                    else:
                        table[k] = v
                d[key] = table
            else:
                raise ConfigError(
                    f"{key} override must be a mapping of [{key}] keys, got {_kind(value)}"
                )
        return JobSpec.from_dict(d)


def _toml_error_message(e: tomllib.TOMLDecodeError, text: str, where: str) -> str:
    message = str(e)
    line: int | None = getattr(e, "lineno", None)  # set by Python >= 3.14
    column: int | None = getattr(e, "colno", None)
    if (m := _TOML_POSITION.search(message)) is not None:
        line, column = int(m.group(1)), int(m.group(2))
        message = message[: m.start()]
    elif (m := _TOML_END.search(message)) is not None:
        line, column = text.count("\n") + 1, None
        message = message[: m.start()] + " at end of file"
    if line is None:
        return f"{where}: invalid TOML: {message}"
    position = f"{line}:{column}" if column is not None else f"{line}"
    return f"{where}:{position}: invalid TOML: {message}"


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    """Reads and validates a TOML job file.

    Args:
        path: the job file.

    Returns:
        The validated job.

    Raises:
        ConfigError: the file cannot be read, is not valid TOML (the message gives the file
            name and line), or does not describe a valid job (the message gives the file
            name and the ``section.key``).
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise ConfigError(f"{name}: job file not found; check the path") from e
    except OSError as e:
        raise ConfigError(f"{name}: cannot read job file: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: job file is not UTF-8 text (TOML must be UTF-8)") from e
    return JobSpec.from_toml(text, source=name)

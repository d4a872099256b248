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
job specs too. The sections' dataclasses live in :mod:`fusion.job_sections` (re-exported
here), the value checks they share in :mod:`fusion.config_checks`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fusion.config_checks import (
    check_str,
    kind_of,
    unknown_key_error,
)
from fusion.errors import ConfigError
from fusion.job_sections import (
    BUILTIN_MODELS,
    CheckpointSpec,
    ClusterSpec,
    CompressionSpec,
    DataSpec,
    ModelSpec,
    OutputSpec,
    PlanSpec,
    Section,
    TrainSpec,
)

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

# --------------------------------------------------------------------------------------
# The job.

_SECTIONS: dict[str, type[Section]] = {
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
        check_str("name", self.name)
        for section, cls in _SECTIONS.items():
            value = getattr(self, section)
            if not isinstance(value, cls):
                raise ConfigError(
                    f"{section} must be a {cls.__name__} (the [{section}] table), got {type(value).__name__}"
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
            raise ConfigError(f"a job must be a table of sections, got {kind_of(d)}")
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
                raise unknown_key_error("", key, allowed)
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
            raise ConfigError(f"invalid job JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
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

    def replace(self, **overrides: Mapping[str, Any] | Section | str) -> JobSpec:
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
                raise unknown_key_error("", key, ["name", *_SECTIONS])
            elif isinstance(value, Section):
                if not isinstance(value, _SECTIONS[key]):
                    raise ConfigError(
                        f"{key} must be a {_SECTIONS[key].__name__} or a mapping, got {type(value).__name__}"
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
                raise ConfigError(f"{key} override must be a mapping of [{key}] keys, got {kind_of(value)}")
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

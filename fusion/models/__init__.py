"""Model zoo: build a model by name, preset and overrides.

``build_model("gpt2", "small")`` and ``build_model("resnet", "50", num_classes=100)`` build the
bundled models; ``build_model("my_pkg.models:make_net", hidden=256)`` imports
``my_pkg.models`` and calls ``make_net(hidden=256)``, so a job file can name any model that
is importable on every worker.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fusion.errors import ConfigError
from fusion.models import gpt2, resnet

logger = logging.getLogger(__name__)

__all__ = [
    "build_model",
    "check_arguments",
    "check_model",
    "context_length",
    "default_dataset",
    "load_factory",
    "model_names",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BuiltinModel:
    """How to turn a preset name and keyword overrides into one of the bundled models."""

    config_cls: type
    """Frozen config dataclass; its fields are the accepted keyword overrides."""

    model_cls: Callable[[Any], nn.Module]
    """Model class, called with the config."""

    presets: Mapping[str, Mapping[str, object]]
    """Preset name to config keyword arguments."""

    preset_aliases: Mapping[str, str]
    """Other accepted preset names, mapped to their key in ``presets``."""

    default_dataset: str
    """Name of the dataset from :mod:`fusion.data` this model trains on by default."""


_BUILTIN: dict[str, _BuiltinModel] = {
    "gpt2": _BuiltinModel(
        config_cls=gpt2.GPT2Config,
        model_cls=gpt2.GPT2,
        presets=gpt2.PRESETS,
        preset_aliases={},
        default_dataset="pysource",
    ),
    "resnet": _BuiltinModel(
        config_cls=resnet.ResNetConfig,
        model_cls=resnet.ResNet,
        presets=resnet.PRESETS,
        preset_aliases=resnet.PRESET_ALIASES,
        default_dataset="shapes",
    ),
}


def model_names() -> list[str]:
    """Names of the bundled models (a ``"package.module:factory"`` name is also accepted)."""
    return sorted(_BUILTIN)


def build_model(name: str, preset: str | None = None, **kwargs: Any) -> nn.Module:
    """Build a model.

    Args:
        name: ``"gpt2"``, ``"resnet"``, or ``"package.module:factory"`` for a user model.
        preset: a named configuration (see ``gpt2.PRESETS`` and ``resnet.PRESETS``). For a
            bundled model, ``None`` means every required config field comes from ``kwargs``.
            For a user factory it is passed on as ``preset=`` when not ``None``.
        **kwargs: config fields overriding the preset (bundled models) or keyword arguments
            of the factory (user models).

    Returns:
        The model, on the current default device, with freshly initialised parameters.

    Raises:
        ConfigError: the name, preset or a keyword is unknown, a value is invalid, the
            factory cannot be imported, or it does not return an ``nn.Module``.
    """
    if name in _BUILTIN:
        return _build_builtin(name, _BUILTIN[name], preset, kwargs)
    if ":" in name:
        return _build_from_factory(name, preset, kwargs)
    raise ConfigError(f"unknown model {name!r}; choose one of {model_names()} or give 'package.module:factory'")


def default_dataset(model_name: str) -> str | None:
    """Name of the dataset a bundled model trains on by default, or ``None`` for other models."""
    builtin = _BUILTIN.get(model_name)
    return builtin.default_dataset if builtin is not None else None


def check_model(name: str, preset: str | None = None, **kwargs: Any) -> None:
    """Raise :class:`ConfigError` for what :func:`build_model` would reject, without building.

    Bundled models get their config validated; user factories get imported and their
    signature checked against ``kwargs``. Cheap for any model size (used at job submit).
    """
    if name in _BUILTIN:
        _builtin_config(name, _BUILTIN[name], preset, kwargs)
        return
    if ":" in name:
        factory = load_factory(name, kind="model")
        check_arguments(factory, {**kwargs, **({"preset": preset} if preset is not None else {})}, name)
        return
    raise ConfigError(f"unknown model {name!r}; choose one of {model_names()} or give 'package.module:factory'")


def context_length(name: str, preset: str | None = None, **kwargs: Any) -> int | None:
    """The longest sequence a bundled model takes (GPT-2's ``block_size``); ``None`` if unbounded or unknown."""
    builtin = _BUILTIN.get(name)
    if builtin is None:
        return None
    return getattr(_builtin_config(name, builtin, preset, kwargs), "block_size", None)


def _build_builtin(name: str, builtin: _BuiltinModel, preset: str | None, kwargs: dict[str, Any]) -> nn.Module:
    config = _builtin_config(name, builtin, preset, kwargs)
    logger.info("building %s (preset %s): %s", name, preset, config)
    return builtin.model_cls(config)


def _builtin_config(name: str, builtin: _BuiltinModel, preset: str | None, kwargs: dict[str, Any]) -> Any:
    field_names = [field.name for field in dataclasses.fields(builtin.config_cls)]
    unknown = sorted(set(kwargs) - set(field_names))
    if unknown:
        raise ConfigError(f"unknown {name} option(s) {unknown}; valid options are {field_names}")

    config_kwargs: dict[str, Any] = {}
    if preset is not None:
        key = builtin.preset_aliases.get(preset, preset)
        if key not in builtin.presets:
            raise ConfigError(f"unknown {name} preset {preset!r}; choose one of {list(builtin.presets)}")
        config_kwargs.update(builtin.presets[key])
    config_kwargs.update(kwargs)

    required = [
        field.name
        for field in dataclasses.fields(builtin.config_cls)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    ]
    missing = [field_name for field_name in required if field_name not in config_kwargs]
    if missing:
        raise ConfigError(
            f"{name} without a preset needs the option(s) {missing}; give them, "
            f"or pick a preset from {list(builtin.presets)}"
        )
    return builtin.config_cls(**config_kwargs)


def _build_from_factory(name: str, preset: str | None, kwargs: dict[str, Any]) -> nn.Module:
    factory = load_factory(name, kind="model")
    if preset is not None:
        kwargs = {**kwargs, "preset": preset}
    check_arguments(factory, kwargs, name)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module; make it return the model"
        )
    logger.info("built %s from factory %s", type(model).__name__, name)
    return model


def load_factory(spec: str, *, kind: str) -> Callable[..., Any]:
    """Import ``"package.module:attribute"`` and return the callable it names.

    Args:
        spec: the import path and attribute, separated by one colon.
        kind: what the factory builds (``"model"``, ``"dataset"``), for error messages.

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported, or the attribute
            is missing or not callable.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{kind} factory {spec!r} is not of the form 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"cannot import module {module_name!r} for {kind} factory {spec!r}: {e}; "
            "check the name and that it is on the Python path of every process"
        ) from e
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"module {module_name!r} has no callable {attribute!r} (from {kind} factory {spec!r})")
    return factory


def check_arguments(factory: Callable[..., Any], kwargs: Mapping[str, Any], spec: str) -> None:
    """Raise :class:`ConfigError` if ``factory`` cannot be called with ``kwargs``.

    Checking the signature first, rather than catching ``TypeError`` from the call, keeps a
    bug inside the factory from being reported as a bad option.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # Some builtins have no signature; let the call itself fail.
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"cannot call {spec!r} with options {sorted(kwargs)}: {e}; it accepts {list(signature.parameters)}"
        ) from e

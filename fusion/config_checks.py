"""Value checks for job-file keys: each takes the dotted key it reports (``train.lr``) and
returns the normalised value, or raises :class:`~fusion.errors.ConfigError` naming the key,
what it got and what is allowed.

Split from :mod:`fusion.config`, whose section dataclasses call these in ``__post_init__``;
like it, this module imports only the standard library (the coordinator CLI and the
scheduler read job specs without torch).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from fusion.errors import ConfigError

# A factory keyword argument is one TOML scalar or an array of them; datetimes are left out
# because they have no JSON form.
SCALAR_TYPES: tuple[type, ...] = (str, int, float, bool)


# --------------------------------------------------------------------------------------
# Value checks. Each takes the dotted key it reports and returns the normalised value.


def kind_of(value: object) -> str:
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(key: str, value: object, *, minimum: int) -> int:
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {kind_of(value)}")
    return int(value)  # type: ignore[arg-type]


def check_float(
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
    if not is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ConfigError(f"{key} must be {allowed}, got {kind_of(value)}")
    number = float(value)  # type: ignore[arg-type]
    if (
        (gt is not None and not number > gt)
        or (ge is not None and not number >= ge)
        or (lt is not None and not number < lt)
        or (le is not None and not number <= le)
    ):
        raise ConfigError(f"{key} must be {allowed}, got {kind_of(value)}")
    return number


def check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {kind_of(value)}")
    return value


def check_str(key: str, value: object, *, what: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} must be {what}, got {kind_of(value)}")
    return value


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key} must be one of {allowed}, got {kind_of(value)}")
    return value


def check_kwargs(section: str, kwargs: object, reserved: tuple[str, ...]) -> dict[str, Any]:
    """Checks factory keyword arguments and returns a private deep copy of them."""
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{section}.kwargs must be a table of keyword arguments, got {kind_of(kwargs)}")
    checked: dict[str, Any] = {}
    for name, value in kwargs.items():
        key = f"{section}.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"{key} cannot be passed to a factory: keys other than "
                f"{', '.join(reserved)} must be Python identifiers (letters, digits, '_')"
            )
        if name in reserved:
            raise ConfigError(f"{key} is a field of [{section}], not a keyword argument; set it directly")
        checked[name] = check_kwarg_value(key, value)
    return checked


def check_kwarg_value(key: str, value: object) -> Any:
    allowed = "a string, integer, float, boolean or an array of these"
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple)):
                raise ConfigError(f"{key} must be {allowed}, got a nested array")
        return [check_kwarg_value(key, item) for item in value]
    if not isinstance(value, SCALAR_TYPES):
        raise ConfigError(f"{key} must be {allowed}, got {kind_of(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be {allowed} (finite), got {kind_of(value)}")
    return value


def unknown_key_error(section: str, key: object, allowed: list[str]) -> ConfigError:
    dotted = f"{section}.{key}" if section else str(key)
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    where = f"[{section}]" if section else "the top level of a job"
    return ConfigError(f"unknown key {dotted}{hint}; keys allowed in {where}: {', '.join(allowed)}")

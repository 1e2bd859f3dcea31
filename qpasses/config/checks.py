"""The checks every config block shares: problems gathered into one line, numbers, booleans,
dataclasses built from mappings with unknown keys named."""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers

from ..errors import ConfigError
from .ort_spellings import ORT_NAMES


class Problems(list):
    """Problems found while checking a config; reported together as one one-line ConfigError."""

    def raise_if_any(self, where: str = "") -> None:
        if self:
            exc = ConfigError((f"{where}: " if where else "") + "; ".join(self))
            exc.problems = list(self)
            raise exc

    def take(self, exc: ConfigError) -> None:
        """Add the problems of a ConfigError raised by a nested check."""
        self.extend(getattr(exc, "problems", None) or [str(exc)])


def number(problems: list, key: str, value, ok, expected: str):
    """``value`` as a float when it is a finite real number that passes ``ok``; else a problem."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and ok(float(value)):
        return float(value)
    problems.append(f"{key}: expected {expected}, got {value!r}")
    return value


def boolean(problems: list, obj, key: str, prefix: str = "") -> None:
    value = getattr(obj, key)
    if type(value).__name__ in ("bool", "bool_"):
        setattr(obj, key, bool(value))
    else:
        problems.append(f"{prefix}{key}: expected true or false, got {value!r}")


def build(cls, data: dict, prefix: str, problems: list):
    """``cls(**data)`` with unknown keys and bad values added to ``problems`` (None if it cannot be built)."""
    names = [f.name for f in dataclasses.fields(cls)]
    known = {}
    for key, value in data.items():
        if key in names:
            known[key] = value
        else:
            problems.append(_unknown_key(key, names + (list(ORT_NAMES) if not prefix else []), prefix))
    try:
        return cls(**known)
    except ConfigError as exc:
        problems.take(exc)
        return None


def _unknown_key(key, names: list[str], prefix: str) -> str:
    if not isinstance(key, str):
        return f"unknown key {key!r} (keys are names)"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    return f"unknown key '{prefix}{key}'{hint}"

"""Pass registry: kebab-case name -> pass class. Registering a name twice is an error."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from ..ir.analyses import Analysis, Part

_PASSES: dict[str, type] = {}
_builtins_loaded = False


def register(cls):
    """Class decorator: make the pass a dataclass (its options) and register it under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not name or name != name.lower() or "_" in name or " " in name:
        raise ValueError(f"pass {cls.__qualname__} needs a kebab-case 'name'")
    if not (cls.__doc__ or "").strip():
        raise ValueError(f"pass {name} needs a one-line docstring")
    if name in _PASSES and _PASSES[name].__qualname__ != cls.__qualname__:
        raise ValueError(f"pass name '{name}' registered twice ({_PASSES[name].__qualname__}, {cls.__qualname__})")
    if not all(isinstance(x, (Part, Analysis)) for x in getattr(cls, "unchanged", ())):
        raise ValueError(f"pass {name}: 'unchanged' holds parts of the model (ir.analyses.Part) and analyses only")
    if "__dataclass_fields__" not in cls.__dict__:
        cls = dataclasses.dataclass(cls)
    _PASSES[name] = cls
    return cls


def _load_builtin_passes() -> None:
    from .. import passes

    for info in pkgutil.iter_modules(passes.__path__):
        importlib.import_module(f"{passes.__name__}.{info.name}")


def all_passes() -> dict[str, type]:
    """Every registered pass, by name (built-in passes are imported on first use)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        _load_builtin_passes()
    return dict(sorted(_PASSES.items()))


def get_pass(name: str) -> type:
    from ..errors import PipelineError

    if name in _PASSES:
        return _PASSES[name]
    module = name.replace("-", "_")
    if module.isidentifier():   # a built-in pass is qpasses/passes/<name>.py or <name>/: import only that one
        from .. import passes

        wanted = f"{passes.__name__}.{module}"
        try:
            importlib.import_module(wanted)
        except ModuleNotFoundError as exc:
            if exc.name != wanted:
                raise
        if name in _PASSES:
            return _PASSES[name]
    passes = all_passes()
    if name not in passes:
        import difflib

        close = difflib.get_close_matches(name, passes, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise PipelineError(f"unknown pass '{name}'{hint}; 'qpasses passes' lists them")
    return passes[name]


def establishers(fact: str) -> list[str]:
    """Names of the passes that establish ``fact``."""
    return [n for n, cls in all_passes().items() if fact in cls.establishes]


def unregister(name: str) -> None:
    """Remove a pass from the registry (for tests that register throwaway passes)."""
    _PASSES.pop(name, None)

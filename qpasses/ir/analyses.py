"""Analyses of a QModel: typed keys, results cached per model, dropped when what they read changes.

An analysis is a function of the model declared with ``@analysis(reads)``: the decorated function
becomes an ``Analysis``, the key of its cached result, called as before (``dataflow(model)``).
``reads`` names the parts of the model it is computed from (``Part``); an analysis that asks for
another one while it is built depends on it, and is dropped with it.

What drops results:

- the pass manager, after a pass that reports a modification: every result reading a part the
  pass does not declare ``unchanged`` (``Pass.unchanged``: parts, or single analyses it keeps valid);
  a pass that declares nothing drops them all;
- ``QModel.touch()``: all of them, for a pass that rewrote the graph and reads analyses again.

``stale_analyses`` rebuilds every cached result and names those that differ: ``--verify-each`` and
the pass contract test run it after each pass, so a pass that changes a part it declares unchanged
fails there instead of serving a stale analysis to the passes after it.
"""
from __future__ import annotations

import enum
from typing import Callable, Generic, TypeVar

import numpy as np
import onnx_graphsurgeon as gs

T = TypeVar("T")


class Part(enum.Enum):
    """A part of a QModel that analyses read and passes change."""

    GRAPH = "nodes, their attributes, tensors and their types and shapes, graph inputs and outputs, opsets"
    WEIGHTS = "the values of float constants (weights and biases edited in place)"
    QUANT = "the quantization table"
    RANGES = "calibrated and observed ranges"


GRAPH, WEIGHTS, QUANT, RANGES = Part.GRAPH, Part.WEIGHTS, Part.QUANT, Part.RANGES
ANALYSES: list["Analysis"] = []   # every analysis declared, in import order (for checks and tests)


class Analysis(Generic[T]):
    """A typed key: ``build(model)`` cached in ``model.analyses`` until a part it ``reads`` changes."""

    def __init__(self, build: Callable[..., T], reads: frozenset[Part]):
        self.build, self.reads = build, frozenset(reads)
        self.name = f"{build.__module__}.{build.__qualname__}"
        self.__doc__, self.__wrapped__ = build.__doc__, build
        ANALYSES.append(self)

    def __call__(self, model) -> T:
        return model.analyses.get(self, model)

    def __repr__(self) -> str:
        return f"<analysis {self.name} reads {', '.join(sorted(p.name for p in self.reads))}>"


def analysis(*reads: Part) -> Callable[[Callable[..., T]], Analysis[T]]:
    """Decorator: the function (of the model only) becomes an Analysis reading ``reads``."""
    if not reads or not all(isinstance(p, Part) for p in reads):
        raise TypeError("analysis(...) needs the parts of the model it reads")
    return lambda build: Analysis(build, frozenset(reads))


class AnalysisCache:
    """The cached results of one model, and which results were built from which."""

    def __init__(self):
        self.results: dict[Analysis, object] = {}
        self._users: dict[Analysis, set[Analysis]] = {}   # analysis -> those built from it
        self._building: list[Analysis] = []

    def get(self, key: Analysis[T], model) -> T:
        if self._building:
            self._users.setdefault(key, set()).add(self._building[-1])
        if key not in self.results:
            self._building.append(key)
            try:
                self.results[key] = key.build(model)
            finally:
                self._building.pop()
        return self.results[key]

    def clear(self) -> None:
        self.results.clear()
        self._users.clear()

    def invalidate(self, unchanged=frozenset()) -> None:
        """Drop the results that read a part not in ``unchanged`` (unless their analysis is in it),
        and the results built from a dropped one."""
        parts = {p for p in unchanged if isinstance(p, Part)}
        dropped = [key for key in self.results if key not in unchanged and not key.reads <= parts]
        while dropped:
            key = dropped.pop()
            self.results.pop(key, None)
            dropped.extend(self._users.pop(key, ()))


def stale_analyses(model) -> list[str]:
    """Names of the cached analyses of ``model`` that a fresh build no longer gives (their objects:
    gs tensors, nodes and graphs are compared by identity, the rest by value)."""
    cached = model.analyses
    model.analyses = AnalysisCache()
    try:
        return [key.name for key, result in list(cached.results.items()) if not _same(result, key(model))]
    finally:
        model.analyses = cached


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, (gs.Tensor, gs.Node, gs.Graph)):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(a, "__dict__"):   # attributes built on first use (``_on_demand``) are not compared
        skip = getattr(a, "_on_demand", ())
        return _same({k: v for k, v in vars(a).items() if k not in skip},
                     {k: v for k, v in vars(b).items() if k not in skip})
    return a == b

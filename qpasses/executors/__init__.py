"""Executors: where data-parallel work runs (calibration shards, candidate evaluations).

``get(spec)`` / ``from_config(config)`` return one executor per spec (``config.executor``):
- ``local`` (default): this process, the run as without executors; Ray is never imported;
- ``ray`` or ``ray:ADDRESS``: tasks on a Ray cluster (``ray.init(address=...)``; plain ``ray``
  joins the cluster RAY_ADDRESS names, else starts one on this machine); ``executors.ray``.

An executor has ``workers`` (tasks that run at once), ``parallel`` (whether callers should split
their work), ``put(value)`` (a handle every task can read: Ray's object store holds the value once)
and ``map(fn, items, shared)``: ``fn(item, shared)`` for every item, the results in item order.
``fn`` is a module-level function; an exception it raises is raised again by ``map``.
Callers: ``calibration.sharded`` (sharded statistics), ``executors.scoring`` (variant scores).
"""
from __future__ import annotations

from ..errors import ConfigError, portable  # noqa: F401  (portable: used through this package)

KINDS = ("local", "ray")
_cache: dict = {}


class LocalExecutor:
    """Runs tasks in this process, in order. ``workers`` > 1 only splits the work as a parallel
    executor would (same shards, same merges: the parallel code paths, tested without Ray)."""

    name = "local"

    def __init__(self, workers: int = 1):
        self.workers = max(1, int(workers))

    @property
    def parallel(self) -> bool:
        return self.workers > 1

    def put(self, value):
        return value

    def map(self, fn, items, shared=None):
        for item in items:
            yield fn(item, shared)


def parse(spec) -> tuple[str, str | None]:
    """(kind, address) of an executor spec: ``local``, ``ray`` or ``ray:ADDRESS`` (one-line ConfigError)."""
    text = str(spec or "local").strip()
    kind, colon, address = text.partition(":")
    kind = kind.lower()
    if kind not in KINDS or (colon and (kind != "ray" or not address.strip())):
        raise ConfigError(f"executor: expected local, ray or ray:ADDRESS (e.g. ray:auto, "
                          f"ray:10.0.0.5:6379), got {spec!r}")
    return kind, address.strip() or None


def get(spec="local"):
    """The executor for ``spec`` (one per spec and process: a Ray connection is made once)."""
    kind, address = parse(spec)
    key = (kind, address)
    if key not in _cache:
        if kind == "local":
            _cache[key] = LocalExecutor()
        else:
            from .ray import RayExecutor

            _cache[key] = RayExecutor(address)
    return _cache[key]


def from_config(config):
    """The executor ``config.executor`` names (local when there is no config)."""
    return get(getattr(config, "executor", "local") if config is not None else "local")

"""The Ray executor: tasks on a Ray cluster, shared values in its object store.

When qpasses starts or joins the cluster (``ray.init``), the driver's qpasses package is shipped
to the workers in the job's runtime environment (``py_modules``), so the cluster needs only
qpasses' dependencies (onnx, onnx-graphsurgeon, numpy, networkx, onnxruntime, pyyaml) and the same
Ray version; tasks run the code the driver runs. A program that calls ``ray.init`` itself passes
``runtime_env=runtime_env()`` (or has qpasses installed on the cluster).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import QpassesError, portable

INSTALL = "pip install 'qpasses[ray]'"


class _Failed:
    """An exception raised by a task, carried back as a value (raised again in the driver without
    Ray's traceback text, so a user error stays one line)."""

    def __init__(self, exc: BaseException):
        self.exc = portable(exc)


def _call(fn, item, shared):
    try:
        return fn(item, shared)
    except Exception as exc:
        return _Failed(exc)


def runtime_env() -> dict:
    """The runtime environment of qpasses' tasks: this qpasses package, shipped to the workers."""
    return {"py_modules": [str(Path(__file__).resolve().parent.parent)]}


class RayExecutor:
    """Tasks on the cluster at ``address`` (None: RAY_ADDRESS, else a new local one); an already
    initialised Ray (``ray.init`` called by the program) is used as it is."""

    name = "ray"
    parallel = True

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise QpassesError(f"--executor ray needs Ray, which is not installed: {INSTALL}") from None
        self.ray = ray
        if not ray.is_initialized():
            try:
                ray.init(address=address, runtime_env=runtime_env(), log_to_driver=False,
                         include_dashboard=False, configure_logging=False)
            except Exception as exc:
                raise QpassesError(f"--executor ray:{address or ''}: cannot reach a Ray cluster "
                                   f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})") from None
        self._task = ray.remote(_call).options(num_cpus=1)

    @property
    def workers(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def put(self, value):
        return self.ray.put(value)

    def map(self, fn, items, shared=None):
        """Submit every item (each task gets ``shared`` from the object store), then yield the
        results in item order as they are ready."""
        refs = [self._task.remote(fn, item, shared) for item in items]
        for ref in refs:
            result = self.ray.get(ref)
            if isinstance(result, _Failed):
                raise result.exc
            yield result

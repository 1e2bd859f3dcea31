"""Calibration over shards of the data: each task runs ``collect_stats`` on a contiguous run of
samples and returns mergeable statistics; the driver merges them in sample order.

The merge is exact (``TensorStats.merge``): min/max are extremes, histograms live on a grid fixed
by the extremes alone (``Histogram.merge``), the moving average replays each shard's per-sample
ranges, and the kept feeds for select-by-snr are refilled in order. So a sharded run gives the
statistics, and the model, of the one-process run. The model goes to the object store once (as
ONNX bytes, at most 2 GB); the driver reads and validates the feeds and ships them shard by shard.
"""
from __future__ import annotations

import math
import time

from ..errors import CalibrationDataError, ModelError
from ..ir.model import QModel, constant_bytes, load
from .data import model_inputs, open_data
from .kept import KeptSamples
from .progress import Progress
from .runner import collect_stats, drop_unobserved
from .subgraphs import body_activations

UNKNOWN_COUNT_SHARD = 64   # samples per shard when the data does not say how many it holds
MAX_PROTO_BYTES = 2**31 - 2**24   # a serialised ModelProto must stay below 2 GB
LAST: dict = {}   # the last sharded run: shards and each task's seconds (tools/bench_ray.py)


def shards(feeds, total: int | None, workers: int):
    """(start, [feeds]) runs of the feeds: one per worker when ``total`` is known."""
    size = math.ceil(total / workers) if total else UNKNOWN_COUNT_SHARD
    batch, start = [], 0
    for feed in feeds:
        batch.append(feed)
        if len(batch) == size:
            yield start, batch
            start, batch = start + size, []
    if batch:
        yield start, batch


def shard_task(shard, shared) -> dict:
    """Runs on a worker: the statistics of one shard (``shared``: the model bytes and options)."""
    import onnx

    began = time.perf_counter()
    blob, options = shared
    options = dict(options)
    keep, keep_bytes = options.pop("keep"), options.pop("keep_bytes")
    start, feeds = shard
    kept = KeptSamples(keep - start, keep_bytes) if start < keep else None
    model = load(onnx.load_model_from_string(blob))
    stats, count = collect_stats(model, feeds, kept=kept, shard_start=start, **options)
    return {"stats": stats, "count": count, "kept": kept, "seconds": time.perf_counter() - began}


def sharded_stats(executor, model: QModel, data, *, method: str = "minmax", num_bins: int = 2048,
                  averaging_constant: float | None = None, max_samples: int = 0, progress_stream=None,
                  only: set[str] | None = None, kept: KeptSamples | None = None):
    """``collect_stats`` run as tasks of ``executor`` over shards of ``data``: the same
    ({tensor: TensorStats}, samples). ``LAST`` keeps the shards' task seconds of the last run."""
    if constant_bytes(model.graph) >= MAX_PROTO_BYTES:
        raise ModelError("--executor ray: the model's weights pass 2 GB, which one ONNX message cannot "
                         "hold; calibrate it with --executor local")
    data = open_data(data)
    proto = model.to_proto(metadata=False)
    body = dict(body_activations(proto, only))
    options = {"method": method, "num_bins": num_bins, "averaging_constant": averaging_constant,
               "only": only, "keep": kept.limit if kept is not None else 0,
               "keep_bytes": kept.max_bytes if kept is not None else 0}
    specs = model_inputs(proto)
    shared = executor.put((proto.SerializeToString(), options))   # once, whatever the shards
    del proto
    total = data.count if not max_samples else min(max_samples, data.count or max_samples)
    feeds = data.validated(specs, max_samples)
    stats, count, seconds = None, 0, []
    bar = Progress(f"calibrate ({executor.name})", total, progress_stream)
    for result in executor.map(shard_task, shards(feeds, total, executor.workers), shared):
        if stats is None:
            stats = result["stats"]
        else:
            for name, st in stats.items():
                st.merge(result["stats"][name])
        count += result["count"]
        seconds.append(result["seconds"])
        if kept is not None and result["kept"] is not None:
            _refill(kept, result["kept"])
        bar.update(count)
    bar.close()
    LAST.clear()
    LAST.update(shards=len(seconds), task_seconds=seconds)
    if not count:
        raise CalibrationDataError(f"{data.source}: no samples")
    drop_unobserved(stats, body)
    return stats, count


def _refill(kept: KeptSamples, shard: KeptSamples) -> None:
    """Add a shard's kept feeds as the one-process run would have kept them (in order, same limits)."""
    kept.names = kept.names or shard.names
    for feed, outputs in zip(shard.feeds, shard.outputs):
        kept.add(feed, outputs)
    if shard.full and len(kept.feeds) < kept.limit:
        kept.full = True


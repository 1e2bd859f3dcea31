"""Run the float model once over the calibration samples and stream per-tensor statistics.

One onnxruntime CPU session runs an augmented copy of the model (``augment``):
- min/max methods: every float activation gets ReduceMin/ReduceMax nodes whose scalar results are
  extra graph outputs (reduced inside onnxruntime, nothing large leaves the session);
- histogram methods: every float activation is itself an extra graph output; each sample's arrays
  are counted into the streaming histograms and dropped before the next sample.
Float graph inputs are measured from the feeds directly. Memory therefore stays at one sample's
activations plus a fixed amount per tensor, whatever the number of samples.

Big graphs run as a chain of sessions (``segments.SegmentedModel``), each part measuring the
tensors it computes. onnxruntime copies every initializer into its own buffers, so a session holds
a second copy of the weights. Models with at least SEGMENT_BYTES of constants are therefore cut
into segments of bounded weight bytes that run segment-outer: one session at a time sees every
sample, the values later segments read are stashed per sample, and the session is dropped before
the next one is created (see ``_segment_outer``). Per tensor, updates still arrive in sample
order: the statistics are those of the sample-outer run.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import CalibrationDataError
from ..ir.model import QModel
from . import segments
from .augment import activation_tensors, augment, derived_ranges
from .collectors import HISTOGRAM_METHODS, TensorStats, histogram_bins
from .data import model_inputs, open_data
from .kept import KeptSamples
from .progress import Progress
from .sessions import RunError
from .subgraphs import body_activations, readings, thread_out
from .tensor_types import gs_types

SEGMENT_BYTES = 2**30  # constants from this size on: calibrate segment-outer (a second copy of
                       # smaller weights costs less than the lost cross-segment fusions and extra sessions)
SEGMENT_MIN_WEIGHTS = 256 * 2**20  # weight bytes per segment: at most the larger of this
SEGMENT_PARTS = 8                  # ... and this fraction of all weights
SMALL_TENSOR = 4096  # min/max mode: tensors of at most this many elements (static shape) are fetched
                     # and reduced in numpy (creating a ReduceMin/ReduceMax pair costs more);
                     # histograms: their values are counted a batch of samples at a time
DEFERRED_BYTES = 32 * 2**20   # ... at most this many bytes of them held
REFUSED = "onnxruntime cannot run the model, so it cannot be calibrated"


class _Segment:
    """One part's session (``segments.Part``) and what it measures: tensors fetched whole (``raw``;
    reduced to (min, max) here in min/max mode) and (name, min output, max output) of reductions."""

    def __init__(self, part: segments.Part, raw, reduced, minmax, capture=(), body=None):
        self.part, self.raw, self.reduced, self.minmax = part, raw, reduced, minmax
        self.body = body or {}   # body tensor -> the outputs threading it out (calibration.subgraphs)
        self.capture, self.captured = list(capture), []   # graph outputs, and their last values

    def run(self, env: dict, values: dict | None = None):
        """Run on ``env`` (name -> array, updated in place; ``values``: the part's outputs on it,
        when they were run already); yields (tensor, array) for the raw measurements, or (tensor,
        (min, max)) in min/max mode, and for the reduced ones."""
        values = self.part.run(env) if values is None else values
        self.captured = [np.array(values[name]) for name in self.capture]   # own copies: a view would pin the arena
        if self.minmax:
            yield from _batch_minmax([(name, values[name]) for name in self.raw])
        else:
            for name in self.raw:
                yield name, values[name]
        for name, lo, hi in self.reduced:
            yield name, (values[lo], values[hi])
        yield from readings(self.body, values, self.minmax)


def _batch_minmax(arrays: list[tuple[str, np.ndarray]]):
    """(name, (min, max)) of many small arrays with a few numpy calls per dtype (one call per
    array costs ~8 us, more than onnxruntime spends computing them). Empty arrays are skipped."""
    groups: dict = {}
    for name, arr in arrays:
        if arr.size:
            groups.setdefault(arr.dtype, []).append((name, arr))
    for members in groups.values():
        flat = np.concatenate([arr.reshape(-1) for _, arr in members])
        starts = np.cumsum([0] + [arr.size for _, arr in members[:-1]])
        lows, highs = np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts)
        for (name, _), lo, hi in zip(members, lows, highs):
            yield name, (lo, hi)


class _Plan:
    """What one calibration run needs: the segments (sessions), what to fetch and how to read it.

    A graph of more than CHUNK_NODES top-level nodes runs as a chain of sessions of about that many
    nodes (values crossing a cut go from one session to the next), so building them stays linear.
    A model with at least SEGMENT_BYTES of weights handed over in memory is cut into segments of at
    most max(SEGMENT_MIN_WEIGHTS, weights / SEGMENT_PARTS) weight bytes, run segment-outer
    (``budget`` > 0: the stash bytes that saves) unless the values crossing the cuts, times the
    samples, are known to outweigh the weights saved. Sessions are built by ``build(k)``.
    """

    def __init__(self, model: QModel, use_hist: bool, in_memory_weights: bool | None = None,
                 only: set[str] | None = None, samples: int | None = None, capture: bool = False):
        self.seg = seg = segments.SegmentedModel(model, in_memory_weights=in_memory_weights)
        proto = seg.proto
        self.specs = model_inputs(proto)
        types, sizes = seg.inferred
        self.tensors = activation_tensors(proto, gs_types(model), types=types)
        if only is not None:
            self.tensors = [(n, e) for n, e in self.tensors if n in only]
        tracked = {name for name, _ in self.tensors}
        # tensors of If/Loop/Scan bodies, and the main-graph node holding each
        self.body = dict(body_activations(proto, only))
        self.tensors += [(name, 0) for name in self.body]
        self.inputs = [s.name for s in self.specs if s.name in tracked]
        self.derived = {} if use_hist else derived_ranges(proto, tracked)
        self.inner = [(n, e) for n, e in self.tensors if n not in self.inputs and n not in self.derived]
        self.raw = {n for n, _ in self.inner
                    if n not in self.body and (use_hist or 0 <= sizes.get(n, -1) <= SMALL_TENSOR)}
        self.minmax = not use_hist
        self.deferred = 0   # bytes of small tensors' values held for their histograms
        self.budget = 0
        big = seg.weights is not None and seg.weight_bytes >= SEGMENT_BYTES
        if len(proto.graph.node) > segments.CHUNK_NODES or big:
            seg.cut(max(SEGMENT_MIN_WEIGHTS, seg.weight_bytes // SEGMENT_PARTS) if big else None)
            if len(seg.chain.spans) > 1 and big:
                saved = seg.weight_bytes - max(seg.chain.span_weights)
                stash = seg.chain.stash_bytes(sizes)
                if samples and stash is not None and samples * stash > saved:
                    seg.recut()   # the stash would cost more than the copy it saves
                else:
                    self.budget = saved
        spans = seg.spans
        where = {} if spans == [None] else {o: k for k, span in enumerate(spans) for i in span
                                             for o in proto.graph.node[i].output}
        # the graph outputs (kept for a few samples), each returned by the part computing it; none
        # when one comes from no node (an input or constant) or parts run one at a time (budget)
        outputs = [o.name for o in proto.graph.output]
        whole = spans == [None] or all(o in where for o in outputs)
        self.capture = outputs if capture and whole and not self.budget else []
        self.capture_in = [[o for o in self.capture if spans == [None] or where[o] == k] for k in range(len(spans))]
        measured: list[list] = [[] for _ in spans]     # (name, elem) each part measures, graph order
        holder = {} if spans == [None] else {i: k for k, span in enumerate(spans) for i in span}
        for t in self.inner:
            measured[holder.get(self.body[t[0]], 0) if t[0] in self.body else where.get(t[0], 0)].append(t)
        self.parts = list(zip(spans, measured))
        self.segments: list[_Segment] = []
        self.owned: list[list[str]] = [[] for _ in spans]   # segment-outer: statistics each part updates
        if self.budget:
            owner = dict.fromkeys(self.inputs, 0)
            owner.update((t[0], k) for k, part in enumerate(measured) for t in part)
            for dst, (src, _) in self.derived.items():   # sources first: updated with their source
                owner[dst] = owner.get(src, 0)
            for name, _ in self.tensors:
                self.owned[owner.get(name, 0)].append(name)
        else:  # sample-outer: every session now, then only what they need is kept
            del proto
            built = [self.build(k) for k in range(len(self.parts))]
            if any(part is None and self.capture_in[k] for k, part in enumerate(built)):
                self.capture = []   # no session for a part that computes graph outputs and measures nothing
            self.segments = [s for s in built if s is not None]
            self.release()

    def build(self, k: int) -> "_Segment | None":
        """The session of part ``k`` (None: it measures nothing and passes nothing on)."""
        span, inner = self.parts[k]
        raw, reduced, body = [], [], {}

        def measure(proto) -> list[str]:
            to_reduce = [t for t in inner if t[0] not in self.raw and t[0] not in self.body]
            raw[:] = augment(proto, [t for t in inner if t[0] in self.raw], reduce=False)
            fetch_red = augment(proto, to_reduce, reduce=True)
            reduced[:] = [(n, fetch_red[2 * i], fetch_red[2 * i + 1]) for i, (n, _) in enumerate(to_reduce)]
            body.update(thread_out(proto, [n for n, _ in inner if n in self.body], reduce=self.minmax))
            return raw + fetch_red + [o for outputs in body.values() for o in outputs]

        capture = self.capture_in[k]   # only with a session built anyway (it measures or passes on)
        part = self.seg.build(k, measure, capture, refused=REFUSED)
        return None if part is None else _Segment(part, raw, reduced, self.minmax, capture, body)

    def prune(self, env: dict, k: int) -> int:
        """Drop from ``env`` what no part after ``k`` reads; returns the bytes of what is left."""
        return self.seg.prune(env, k)

    def release(self) -> None:
        """Forget what only building sessions needed."""
        self.seg.release()


def collect_stats(model: QModel, data, *, method: str = "minmax", num_bins: int = 2048,
                  averaging_constant: float | None = None, max_samples: int = 0,
                  progress_stream=None, in_memory_weights: bool | None = None,
                  only: set[str] | None = None, kept: "KeptSamples | None" = None,
                  shard_start: int | None = None, collector=None) -> tuple[dict[str, TensorStats], int]:
    """Run ``model`` on every sample of ``data`` (validated one by one, read once) and return
    ({tensor name: TensorStats} in graph order, number of samples). ``only`` limits the tensors
    measured (fewer model outputs also leave onnxruntime's fusions, e.g. Conv+Relu, intact).
    ``kept``: filled with the first feeds and the model's outputs on them, when one session runs
    the whole model (else left empty). ``shard_start``: the data is a shard of a larger set
    starting at that sample (calibration/sharded.py): errors number samples from there and
    the statistics stay mergeable (``TensorStats.merge``; no tensor is dropped). ``collector``: a
    factory, called with each tensor's name, of objects with ``update(array)`` (and ``min``/``max``)
    fed every whole array instead of TensorStats (e.g. weightonly.hessian, round-weights)."""
    data = open_data(data)
    use_hist = method in HISTOGRAM_METHODS or collector is not None
    total = data.count if not max_samples else min(max_samples, data.count or max_samples)
    plan = _Plan(model, use_hist, in_memory_weights, only, samples=total, capture=kept is not None)
    if kept is not None and plan.capture and not plan.budget:
        kept.names = list(plan.capture)
    else:
        kept = None
    bins = histogram_bins(num_bins) if use_hist else 0
    shard = shard_start is not None
    stats = {name: collector(name) if collector else TensorStats(bins, averaging_constant, mergeable=shard)
             for name, _ in plan.tensors}
    feeds = enumerate(data.validated(plan.specs, max_samples), shard_start or 0)
    progress = lambda label, n: Progress(label, n, progress_stream)  # noqa: E731
    try:
        count = (_segment_outer(plan, feeds, stats, progress, total) if plan.budget
                 else _sample_outer(plan, feeds, stats, progress, total, kept=kept))
    except RunError as exc:
        raise CalibrationDataError(f"{data.source}: sample {exc.index}: onnxruntime cannot run the model "
                                   f"on it ({exc})") from None
    if count == 0 and not shard:
        raise CalibrationDataError(f"{data.source}: no samples")
    flush(stats)
    drop_unobserved(stats, [] if shard else plan.body)
    return stats, count


def drop_unobserved(stats: dict, body) -> None:
    """Forget the tensors of ``body`` that got no range."""
    for name in body:   # a body that never ran (or values that could not be threaded out): no range
        if name in stats and stats[name].min > stats[name].max:
            del stats[name]


def _sample_outer(plan: _Plan, feeds, stats: dict, progress, total, count: int = 0,
                  kept: KeptSamples | None = None) -> int:
    """Every sample through every segment (all sessions alive); returns the number of samples."""
    bar = progress("calibrate", total)
    for index, feed, env, values in _run_ahead(plan.segments, feeds):
        _measure(plan, plan.segments, index, env, feed, stats, ran=values)
        if kept is not None and plan.segments:
            captured = {n: v for segment in plan.segments for n, v in zip(segment.capture, segment.captured)}
            kept.add(feed, [captured[n] for n in plan.capture])
        count += 1
        bar.update(count)
    bar.close()
    return count


def _segment_outer(plan: _Plan, feeds, stats: dict, progress, total) -> int:
    """One session at a time over every sample: the first part reads the samples (once) and
    stashes what later parts read; each session is dropped before the next is built. When the
    stash passes ``plan.budget``, the samples read so far finish segment by segment and the rest
    run sample-outer (no worse than that path's memory). Returns the number of samples."""
    parts = len(plan.parts)
    pending, stash, overflow = [], 0, False
    bar = progress(f"calibrate 1/{parts}", total)
    segment = plan.build(0)
    for index, feed in feeds:
        env = dict(feed)
        _measure(plan, [segment] if segment else [], index, env, feed, stats, plan.owned[0])
        stash += plan.prune(env, 0)
        pending.append((index, env))
        bar.update(len(pending))
        if stash > plan.budget:
            overflow = True
            break
    bar.close()
    segment = None   # the session and its copy of the weights go before the next is built
    for k in range(1, parts if pending else 1):
        segment = plan.build(k)
        bar = progress(f"calibrate {k + 1}/{parts}", len(pending))
        for done, (index, env) in enumerate(pending, 1):
            _measure(plan, [segment] if segment else [], index, env, None, stats, plan.owned[k])
            plan.prune(env, k)
            bar.update(done)
        bar.close()
        segment = None
    count = len(pending)
    pending.clear()
    if overflow:
        plan.segments = [s for s in map(plan.build, range(parts)) if s is not None]
        count = _sample_outer(plan, feeds, stats, progress, total, count)
    plan.release()
    return count


def _run_ahead(segments: list, feeds):
    """(index, feed, env, the one part's outputs or None) per feed. A model in one part runs the
    next feed in onnxruntime on a worker thread while the caller takes this one's statistics (the
    same values, in the same order: ddddocr_det's calibrate 4.4 -> 3.6 s on 2 cores); one feed's
    outputs more are held meanwhile."""
    if len(segments) != 1:
        for index, feed in feeds:
            yield index, feed, dict(feed), None
        return
    part = segments[0].part

    def run(index: int, env: dict) -> dict:
        try:
            return part.run(env)
        except RunError as exc:
            exc.index = index
            raise

    with ThreadPoolExecutor(1, thread_name_prefix="qpasses-calibrate") as pool:
        waiting = None
        for index, feed in feeds:
            env = dict(feed)
            running = (index, feed, env, pool.submit(run, index, env))
            if waiting is not None:
                yield waiting[:3] + (waiting[3].result(),)
            waiting = running
        if waiting is not None:
            yield waiting[:3] + (waiting[3].result(),)


def _measure(plan: _Plan, segments, index: int, env: dict, feed: dict | None, stats: dict,
             names: list[str] | None = None, ran: dict | None = None) -> None:
    """Run one sample (``env``, updated in place) through ``segments`` and update the statistics
    of ``names`` (default: all); ``feed``: the sample's feed when its graph inputs are measured here;
    ``ran``: the first segment's outputs on it, when they were run already (``_run_ahead``)."""
    use_hist = not plan.minmax
    if use_hist and feed is not None:
        for name in plan.inputs:
            stats[name].update(feed[name])
    current, small = {}, []
    try:
        for k, segment in enumerate(segments):
            for name, value in segment.run(env, ran if k == 0 else None):   # one segment's values at a time
                if not use_hist:
                    current[name] = value
                elif np.size(value) <= SMALL_TENSOR and hasattr(stats[name], "defer"):
                    small.append((name, value))
                else:
                    stats[name].update(value)
    except RunError as exc:
        exc.index = index
        raise
    if not use_hist:
        _update_ranges(stats, feed, plan, current, names)
        return
    # small tensors: min/max in a few numpy calls, counted in the histograms by the batch
    values = dict(small)
    for name, (lo, hi) in _batch_minmax(small):
        plan.deferred += stats[name].defer(values.pop(name), float(lo), float(hi))
    for name, value in values.items():   # empty
        stats[name].update(value)
    if plan.deferred > DEFERRED_BYTES:
        flush(stats)
        plan.deferred = 0


def flush(stats: dict) -> None:
    """Count the values the statistics deferred (TensorStats.defer)."""
    for st in stats.values():
        if hasattr(st, "flush"):
            st.flush()


def _update_ranges(stats, feed: dict | None, plan: _Plan, current: dict, names: list[str] | None = None) -> None:
    """Min/max mode: one (min, max) per tensor of ``names`` (default: all) for this sample, measured
    (``current``, plus the graph inputs from ``feed``) or derived."""
    if feed is not None:
        current.update((name, (feed[name].min(), feed[name].max())) for name in plan.inputs if feed[name].size)
    for name, (src, kind) in plan.derived.items():   # graph order: sources come first
        if src in current:
            lo, hi = current[src]
            current[name] = (max(lo, 0), max(hi, 0)) if kind == "Relu" else (lo, hi)
    for name, st in (stats.items() if names is None else ((n, stats[n]) for n in names)):
        if name in current:
            st.update_range(*current[name])
        else:
            st.samples += 1

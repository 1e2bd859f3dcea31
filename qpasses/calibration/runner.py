"""Run the float model once over the calibration samples and stream per-tensor statistics.

One onnxruntime CPU session runs an augmented copy of the model:
- min/max methods: every float activation gets ReduceMin/ReduceMax nodes whose scalar results are
  extra graph outputs (reduced inside onnxruntime, nothing large leaves the session);
- histogram methods: every float activation is itself an extra graph output; each sample's arrays
  are counted into the streaming histograms and dropped before the next sample.
Float graph inputs are measured from the feeds directly. Memory therefore stays at one sample's
activations plus a fixed amount per tensor, whatever the number of samples.

onnxruntime copies every initializer into its own buffers, so a session holds a second copy of
the weights. Models with at least SEGMENT_BYTES of constants are therefore cut into segments of
bounded weight bytes that run segment-outer: one session at a time sees every sample, the values
later segments read are stashed per sample, and the session is dropped before the next one is
created (see ``_segment_outer``). Per tensor, updates still arrive in sample order: the
statistics are those of the sample-outer run.
"""
from __future__ import annotations

import math
import os
import re
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import CalibrationDataError, ModelError, first_line
from ..graphutil import node_reads
from ..ir import IN_MEMORY, QModel, constant_bytes
from .collectors import HISTOGRAM_METHODS, TensorStats, finalise, histogram_bins
from .data import model_inputs, open_data

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE})
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})
MIN_SUFFIX, MAX_SUFFIX = "__qpasses_min", "__qpasses_max"


def activation_tensors(proto: onnx.ModelProto, fallback_types: dict | None = None, *,
                       types: dict | None = None) -> list[tuple[str, int]]:
    """(name, elem_type) of every float activation of the top-level graph, in graph order: float
    graph inputs that are not initializers, then float node outputs that are not constants (a
    Constant node's output, or computed only from initializers and constants). Subgraphs are skipped.
    ``types``: element types already inferred (else shape inference runs here).
    """
    graph = proto.graph
    types = dict(types) if types is not None else _elem_types(proto)
    for name, elem in (fallback_types or {}).items():
        types.setdefault(name, elem)
    constant = {t.name for t in graph.initializer}
    out = [(vi.name, types.get(vi.name, 0)) for vi in graph.input if vi.name not in constant]
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type not in RANDOM_OPS and all(i in constant for i in inputs) and node.domain in ("", "ai.onnx"):
            constant.update(o for o in node.output if o)
            continue
        out.extend((o, types.get(o, 0)) for o in node.output if o)
    seen, result = set(), []
    for name, elem in out:
        if elem in FLOAT_TYPES and name not in seen:
            seen.add(name)
            result.append((name, elem))
    return result


def _elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element types of the top-level tensors (see ``_inferred``)."""
    return _inferred(proto)[0]


def _inferred(proto: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """Element types and static element counts of the top-level tensors, by shape inference on a
    weight-free copy (types do not depend on weight values, and the copy stays small for models of
    any size). Tensors whose shape is not fully static have no count."""
    light = onnx.ModelProto()
    light.ir_version = proto.ir_version
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    g = light.graph
    g.node.extend(proto.graph.node)
    g.input.extend(proto.graph.input)
    g.output.extend(proto.graph.output)
    g.value_info.extend(proto.graph.value_info)
    listed = {vi.name for vi in proto.graph.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in proto.graph.initializer if t.name not in listed)
    try:
        g2 = onnx.shape_inference.infer_shapes(light, strict_mode=False).graph
    except Exception:  # inference failure on exotic ops: keep what the model declares
        g2 = g
    types, sizes = {}, {}
    for vi in list(g2.input) + list(g2.value_info) + list(g2.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            tt = vi.type.tensor_type
            types[vi.name] = tt.elem_type
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                sizes[vi.name] = math.prod(d.dim_value for d in tt.shape.dim)
    return types, sizes


def _gs_types(model: QModel) -> dict[str, int]:
    """Element types gs knows (from the model's own value_info), as ONNX enums."""
    out = {}
    for name, tensor in model.tensors().items():
        dtype = getattr(tensor, "dtype", None)
        if dtype is None:
            continue
        try:
            out[name] = int(dtype) if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        except Exception:
            continue
    return out


# Ops whose output range follows exactly from their input's: min/max mode measures the input only.
_SAME_VALUES = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


def derived_ranges(proto: onnx.ModelProto, tracked: set[str]) -> dict[str, tuple[str, str]]:
    """{output: (source, op)} for tracked outputs of Relu and value-preserving shape ops whose data
    input is tracked too: their per-sample min/max follow exactly from the source's (Relu:
    max(., 0)), so they need no reduction nodes of their own. Sources come first (graph order)."""
    out: dict[str, tuple[str, str]] = {}
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx") or not node.input or not node.output:
            continue
        kind = "Relu" if node.op_type == "Relu" else ("same" if node.op_type in _SAME_VALUES else None)
        src, dst = node.input[0], node.output[0]
        if kind and dst in tracked and src in tracked:
            out[dst] = (src, kind)
    return out


def augment(proto: onnx.ModelProto, tensors: list[tuple[str, int]], reduce: bool) -> list[str]:
    """Edit ``proto`` (a private copy) so its outputs expose the tensors (or their ReduceMin and
    ReduceMax when ``reduce``). Returns the names to fetch."""
    del proto.metadata_props[:]
    graph = proto.graph
    existing = {o.name for o in graph.output}
    taken = existing | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    fetch = []
    for name, elem in tensors:
        if reduce:
            lo, hi = _unique(name + MIN_SUFFIX, taken), _unique(name + MAX_SUFFIX, taken)
            graph.node.append(helper.make_node("ReduceMin", [name], [lo], name=lo, keepdims=0))
            graph.node.append(helper.make_node("ReduceMax", [name], [hi], name=hi, keepdims=0))
            graph.output.extend([helper.make_tensor_value_info(lo, elem, []),
                                 helper.make_tensor_value_info(hi, elem, [])])
            fetch += [lo, hi]
        else:
            if name not in existing:
                graph.output.append(helper.make_tensor_value_info(name, elem, None))
            fetch.append(name)
    return fetch


def _unique(name: str, taken: set) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def session_options(proto: onnx.ModelProto, weights: dict | None = None):
    """onnxruntime SessionOptions for ``proto``; initializers of ``proto`` stubbed out as external
    data at location IN_MEMORY (``QModel.to_proto(weights=...)``) are handed to onnxruntime from
    ``weights`` (``add_external_initializers``: no serialised copy; onnxruntime still makes its
    own). Returns (options, objects that must outlive the session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    names = [t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL
             and any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data)]
    if not names or weights is None:
        return opts, []
    values = [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names]
    opts.add_external_initializers(names, values)
    # big weights: no packed copies as well (a third copy of each; halves calibration time on the
    # 2.4 GB MatMul stack of tools/bench_big_model.py)
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts, values


class Progress:
    """A plain ``\\r`` progress bar on stderr, only on a terminal and without QPASSES_NO_PROGRESS."""

    def __init__(self, label: str, total: int | None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (stream is not None or (self.stream.isatty() and not os.environ.get("QPASSES_NO_PROGRESS")))
        self.label, self.total, self.start = label, total, time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        if self.total:
            filled = int(30 * done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}"
        else:
            bar = f"{done}"
        self.stream.write(f"\r{self.label} {bar} {rate:.1f} samples/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


IN_MEMORY_BYTES = 64 * 2**20  # weights from this size on go to onnxruntime as arrays (always past 2 GB)
CHUNK_NODES = 2000   # top-level nodes per onnxruntime session: session creation grows faster than
                     # linearly with the graph (one session over 12k nodes + measurements: ~2 min)
MAX_IO = 1200        # ... and at most about this many session inputs + node outputs
SEGMENT_BYTES = 2**30  # constants from this size on: calibrate segment-outer (a second copy of
                       # smaller weights costs less than the lost cross-segment fusions and extra sessions)
SEGMENT_MIN_WEIGHTS = 256 * 2**20  # weight bytes per segment: at most the larger of this
SEGMENT_PARTS = 8                  # ... and this fraction of all weights
SMALL_TENSOR = 4096  # min/max mode: tensors of at most this many elements (static shape) are fetched
                     # and reduced in numpy (creating a ReduceMin/ReduceMax pair costs more)


class _RunError(Exception):
    """onnxruntime failed on a sample (``index``: which one, set by ``_measure``)."""

    index = -1


class _Segment:
    """One onnxruntime session over consecutive top-level nodes: the values it reads (None: the
    whole feed), what it returns, which values later segments need and which are no longer needed."""

    def __init__(self, session, inputs, outputs, live_out, done, raw, reduced, minmax, keep=(), capture=()):
        self.session, self.inputs, self.outputs = session, inputs, outputs
        self.keep = keep                         # OrtValues of in-memory weights: live with the session
        self.capture, self.captured = list(capture), []   # graph outputs, and their last values
        self.live_out, self.done = live_out, done
        self.raw, self.reduced = raw, reduced    # measured tensors: fetched whole / (name, min, max)
        self.minmax = minmax                     # reduce the raw ones to (min, max) here

    def run(self, env: dict):
        """Run on ``env`` (name -> array, updated in place); yields (tensor, array) for the raw
        measurements, or (tensor, (min, max)) in min/max mode, and for the reduced ones."""
        feed = env if self.inputs is None else {n: env[n] for n in self.inputs}
        try:
            values = dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        except Exception as exc:
            raise _RunError(first_line(exc)) from None
        self.captured = [np.array(values[name]) for name in self.capture]   # own copies: a view would pin the arena
        for name in self.live_out:
            env[name] = values[name]
        for name in self.done:
            env.pop(name, None)
        if self.minmax:
            yield from _batch_minmax([(name, values[name]) for name in self.raw])
        else:
            for name in self.raw:
                yield name, values[name]
        for name, lo, hi in self.reduced:
            yield name, (values[lo], values[hi])


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
        weight_bytes = constant_bytes(model.graph)
        if in_memory_weights is None:  # hand big weights over as arrays: serialising them for a
            in_memory_weights = weight_bytes >= IN_MEMORY_BYTES  # session peaked at 5x their size
        self.weights: dict | None = {} if in_memory_weights else None
        proto = model.to_proto(metadata=False, weights=self.weights)
        self.specs = model_inputs(proto)
        types, sizes = _inferred(proto)
        self.tensors = activation_tensors(proto, _gs_types(model), types=types)
        if only is not None:
            self.tensors = [(n, e) for n, e in self.tensors if n in only]
        tracked = {name for name, _ in self.tensors}
        self.inputs = [s.name for s in self.specs if s.name in tracked]
        self.derived = {} if use_hist else derived_ranges(proto, tracked)
        self.inner = [(n, e) for n, e in self.tensors if n not in self.inputs and n not in self.derived]
        self.raw = {n for n, _ in self.inner if use_hist or 0 <= sizes.get(n, -1) <= SMALL_TENSOR}
        self.minmax, self.model = not use_hist, model
        self.budget = 0
        big = self.weights is not None and weight_bytes >= SEGMENT_BYTES
        chain = None
        if len(proto.graph.node) > CHUNK_NODES or big:
            limit = max(SEGMENT_MIN_WEIGHTS, weight_bytes // SEGMENT_PARTS) if big else None
            chain = _Chain(model, proto, types, limit)
            if len(chain.spans) > 1 and big:
                saved = weight_bytes - max(chain.span_weights)
                stash = chain.stash_bytes(sizes)
                if samples and stash is not None and samples * stash > saved:
                    chain.recut()   # the stash would cost more than the copy it saves
                else:
                    self.budget = saved
        self._proto, self._chain = proto, chain
        spans = [None] if chain is None or len(chain.spans) == 1 else chain.spans
        # one session over the whole model: it can also return the graph outputs (kept for a few samples)
        self.capture = [o.name for o in proto.graph.output] if capture and spans == [None] else []
        where = {} if spans == [None] else {o: k for k, span in enumerate(spans) for i in span
                                             for o in proto.graph.node[i].output}
        measured: list[list] = [[] for _ in spans]     # (name, elem) each part measures, graph order
        for t in self.inner:
            measured[where.get(t[0], 0)].append(t)
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
            self.segments = [s for s in map(self.build, range(len(self.parts))) if s is not None]
            self.release()

    def build(self, k: int) -> "_Segment | None":
        """The session of part ``k`` (None: it measures nothing and passes nothing on)."""
        import onnxruntime as ort

        span, inner = self.parts[k]
        if span is None:
            proto, inputs, live_out, done = self._proto, None, [], []
            self._proto = None   # augmented in place: built once
        else:
            proto, inputs, live_out, done = self._chain.segment(span)
        to_reduce = [t for t in inner if t[0] not in self.raw]
        fetch_raw = augment(proto, [t for t in inner if t[0] in self.raw], reduce=False)
        fetch_red = augment(proto, to_reduce, reduce=True)
        outputs = list(dict.fromkeys(live_out + fetch_raw + fetch_red))
        if not outputs:
            return None
        capture = self.capture if span is None else []   # only with a session built anyway
        outputs = list(dict.fromkeys(outputs + capture))
        reduced = [(n, fetch_red[2 * i], fetch_red[2 * i + 1]) for i, (n, _) in enumerate(to_reduce)]
        opts, keep = session_options(proto, self.weights)
        if span is not None:  # fusions stay; the layout pass (NCHWc reorders) cost 2x session time, 4x run time
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        data = proto.SerializeToString()
        del proto  # free the exported copy before onnxruntime makes its own
        try:
            session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelError(f"onnxruntime cannot run the model, so it cannot be calibrated: "
                             f"{_unrunnable(self.model, exc)}") from None
        return _Segment(session, inputs, outputs, live_out, done, fetch_raw, reduced, self.minmax, keep, capture)

    def prune(self, env: dict, k: int) -> int:
        """Drop from ``env`` what no part after ``k`` reads; returns the bytes of what is left."""
        stop, last = self.parts[k][0].stop, self._chain.last
        for name in [n for n in env if last.get(n, -1) < stop]:
            del env[name]
        return sum(getattr(v, "nbytes", 0) for v in env.values())

    def release(self) -> None:
        """Forget what only building sessions needed."""
        self._proto = self._chain = None


class _Chain:
    """Cuts a sorted top-level graph into spans of about CHUNK_NODES nodes (and, with a
    ``weight_limit``, at most about that many initializer bytes), only where every value crossing
    the cut is a tensor of known element type (it becomes a session input), and builds the model
    of each span."""

    def __init__(self, model: QModel, proto: onnx.ModelProto, types: dict[str, int],
                 weight_limit: int | None = None):
        self.proto, self.types = proto, types
        self.spans = [range(len(proto.graph.node))]
        self.span_weights: list[int] = []   # initializer bytes each span reads
        nodes = model.graph.nodes
        if model.input_initializers or len(nodes) != len(proto.graph.node):
            return   # user-feedable initializers: keep one session
        self.reads = [node_reads(n) for n in nodes]
        self.last: dict[str, int] = {}
        for i, names in enumerate(self.reads):
            for name in names:
                self.last[name] = i
        self.produced = {o for node in proto.graph.node for o in node.output if o}
        self.initializers = {t.name: t for t in proto.graph.initializer}
        self.nbytes = {t.name: _tensor_bytes(t.data_type, math.prod(t.dims)) or 0 for t in proto.graph.initializer}
        self.spans = self._cut(CHUNK_NODES, weight_limit)

    def recut(self) -> None:
        """Cut again by node and IO counts only."""
        self.spans = self._cut(CHUNK_NODES)

    def _cut(self, chunk: int, weight_limit: int | None = None) -> list[range]:
        """Spans of ``chunk`` nodes, or fewer when their inputs plus outputs reach MAX_IO (session
        creation and onnxruntime's per-run input check grow with the square of those) or when the
        next node's initializers would take the span past ``weight_limit`` bytes."""
        ending: dict[int, list[str]] = {}
        for name, i in self.last.items():
            ending.setdefault(i, []).append(name)
        sources = self.produced | {vi.name for vi in self.proto.graph.input}
        live: set[str] = set()
        here: set[str] = set()       # produced in the current span
        outside: set[str] = set()    # read in the current span, computed before it
        weights: set[str] = set()    # initializers read in the current span
        unknown, start, spans, weight, self.span_weights = 0, 0, [], 0, []
        count = len(self.proto.graph.node)
        for i, node in enumerate(self.proto.graph.node):
            outside.update(n for n in self.reads[i] if n not in here and n in sources)
            if weight_limit:
                weight += self._new_weights(i, weights)
            for o in node.output:
                if o:
                    here.add(o)
                if o and self.last.get(o, -1) > i and o not in live:
                    live.add(o)
                    unknown += o not in self.types
            for name in ending.get(i, ()):
                if name in live:
                    live.discard(name)
                    unknown -= name not in self.types
            full = i + 1 - start >= chunk or len(outside) + len(here) >= MAX_IO
            if weight_limit and weight and i + 1 < count:
                full = full or weight + self._new_weights(i + 1, weights, add=False) > weight_limit
            if full and unknown == 0 and i + 1 < count:
                spans.append(range(start, i + 1))
                self.span_weights.append(weight)
                start, weight = i + 1, 0
                here, outside, weights = set(), set(), set()
        spans.append(range(start, count))
        self.span_weights.append(weight)
        return spans

    def _new_weights(self, i: int, seen: set[str], add: bool = True) -> int:
        """Bytes of the initializers node ``i`` reads that are not in ``seen`` (added to it)."""
        new = [n for n in dict.fromkeys(self.reads[i]) if n in self.nbytes and n not in seen]
        if add:
            seen.update(new)
        return sum(self.nbytes[n] for n in new)

    def stash_bytes(self, sizes: dict[str, int]) -> int | None:
        """Bytes per sample of the values crossing the worst cut (graph inputs still to be read
        included), from static shapes; None when one of them has no static size."""
        nodes = self.proto.graph.node
        delta = [0] * (len(nodes) + 2)     # live bytes change at each node index
        unknown = [0] * (len(nodes) + 2)
        values = [(vi.name, -1) for vi in self.proto.graph.input if vi.name not in self.initializers]
        values += [(o, i) for i, node in enumerate(nodes) for o in node.output if o]
        for name, at in values:
            end = self.last.get(name, -1)
            if end <= at:
                continue
            size = _tensor_bytes(self.types.get(name, 0), sizes.get(name))
            if size is None:
                unknown[at + 1] += 1
                unknown[end + 1] -= 1
            else:
                delta[at + 1] += size
                delta[end + 1] -= size
        live, missing, worst = 0, 0, 0
        starts = {span.start for span in self.spans[1:]}
        for b in range(len(nodes) + 1):
            live, missing = live + delta[b], missing + unknown[b]
            if b in starts:
                if missing:
                    return None
                worst = max(worst, live)
        return worst

    def segment(self, span: range) -> tuple[onnx.ModelProto, list[str], list[str], list[str]]:
        """(model of the span, its inputs, values it passes on, values read for the last time)."""
        g = self.proto.graph
        sub = onnx.ModelProto()
        sub.ir_version = self.proto.ir_version
        sub.opset_import.extend(self.proto.opset_import)
        sub.functions.extend(self.proto.functions)
        sg = sub.graph
        sg.name = g.name
        sg.node.extend(g.node[i] for i in span)
        here = {o for node in sg.node for o in node.output if o}
        read = dict.fromkeys(name for i in span for name in self.reads[i] if name not in here)
        inits = self.initializers
        graph_inputs = {vi.name: vi for vi in g.input}
        inputs = []
        for name in read:
            if name in inits:
                sg.initializer.append(inits[name])
            elif name in graph_inputs:
                sg.input.append(graph_inputs[name])
                inputs.append(name)
            elif name in self.produced:
                sg.input.append(helper.make_tensor_value_info(name, self.types[name], None))
                inputs.append(name)
        live_out = [o for node in sg.node for o in node.output if o and self.last.get(o, -1) >= span.stop]
        sg.output.extend(helper.make_tensor_value_info(o, self.types[o], None) for o in live_out)
        done = [name for name in read if self.last.get(name, -1) < span.stop]
        return sub, inputs, live_out, done


def _tensor_bytes(elem_type: int, count: int | None) -> int | None:
    """Bytes of ``count`` elements of an ONNX element type (None when either is unknown)."""
    if count is None:
        return None
    try:
        return count * np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except Exception:
        return None


def _is_bfloat16(dtype) -> bool:
    if isinstance(dtype, int):  # gs keeps the ONNX enum for types numpy lacks
        return dtype == TensorProto.BFLOAT16
    try:
        return dtype is not None and np.dtype(dtype).name == "bfloat16"
    except TypeError:
        return False


def _unrunnable(model: QModel, exc: Exception) -> str:
    """Why onnxruntime refused the model: the first op of a domain it does not know, else its message."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    known = {k.domain for k in ort_state.get_all_opkernel_def()} | {"ai.onnx"}
    known |= {d.domain for d in (model.graph.functions or ())}
    for node in model.graph.nodes:
        if (node.domain or "") not in known:
            return (f"node '{node.name}' is op '{node.op}' of domain '{node.domain}', which onnxruntime "
                    f"does not implement (without --calib the model is left float)")
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", first_line(exc))
    if any(_is_bfloat16(t.dtype) for t in model.tensors().values()):
        text += " (onnxruntime's CPU provider runs few bfloat16 ops: convert the model to float32 or float16)"
    return text


def collect_stats(model: QModel, data, *, method: str = "minmax", num_bins: int = 2048,
                  averaging_constant: float | None = None, max_samples: int = 0,
                  progress_stream=None, in_memory_weights: bool | None = None,
                  only: set[str] | None = None, kept: "KeptSamples | None" = None) -> tuple[dict[str, TensorStats], int]:
    """Run ``model`` on every sample of ``data`` (validated one by one, read once) and return
    ({tensor name: TensorStats} in graph order, number of samples). ``only`` limits the tensors
    measured (fewer model outputs also leave onnxruntime's fusions, e.g. Conv+Relu, intact).
    ``kept``: filled with the first feeds and the model's outputs on them, when one session runs
    the whole model (else left empty)."""
    data = open_data(data)
    use_hist = method in HISTOGRAM_METHODS
    total = data.count if not max_samples else min(max_samples, data.count or max_samples)
    plan = _Plan(model, use_hist, in_memory_weights, only, samples=total, capture=kept is not None)
    if kept is not None and plan.capture and not plan.budget:
        kept.names = list(plan.capture)
    else:
        kept = None
    bins = histogram_bins(num_bins) if use_hist else 0
    stats = {name: TensorStats(bins, averaging_constant) for name, _ in plan.tensors}
    feeds = enumerate(data.validated(plan.specs, max_samples))
    progress = lambda label, n: Progress(label, n, progress_stream)  # noqa: E731
    try:
        count = (_segment_outer(plan, feeds, stats, progress, total) if plan.budget
                 else _sample_outer(plan, feeds, stats, progress, total, kept=kept))
    except _RunError as exc:
        raise CalibrationDataError(f"{data.source}: sample {exc.index}: onnxruntime cannot run the model "
                                   f"on it ({exc})") from None
    if count == 0:
        raise CalibrationDataError(f"{data.source}: no samples")
    return stats, count


class KeptSamples:
    """The first ``limit`` validated feeds and the float model's outputs (``names``) on them, at
    most ``max_bytes`` in all: what select-by-snr scores variants against, without a second run.
    ``full``: a feed was left out for lack of room."""

    def __init__(self, limit: int, max_bytes: int = 64 * 2**20):
        self.limit, self.max_bytes, self.bytes, self.full = limit, max_bytes, 0, False
        self.names: list[str] = []
        self.feeds: list[dict] = []
        self.outputs: list[list[np.ndarray]] = []

    def add(self, feed: dict, outputs: list) -> None:
        size = sum(v.nbytes for v in feed.values()) + sum(getattr(v, "nbytes", 0) for v in outputs)
        if len(self.feeds) >= self.limit or self.full:
            return
        if self.bytes + size > self.max_bytes:
            self.full = True
            return
        self.feeds.append(feed)
        self.outputs.append(outputs)
        self.bytes += size


def _sample_outer(plan: _Plan, feeds, stats: dict, progress, total, count: int = 0,
                  kept: KeptSamples | None = None) -> int:
    """Every sample through every segment (all sessions alive); returns the number of samples."""
    bar = progress("calibrate", total)
    for index, feed in feeds:
        _measure(plan, plan.segments, index, dict(feed), feed, stats)
        if kept is not None and plan.segments:
            kept.add(feed, plan.segments[0].captured)
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


def _measure(plan: _Plan, segments, index: int, env: dict, feed: dict | None, stats: dict,
             names: list[str] | None = None) -> None:
    """Run one sample (``env``, updated in place) through ``segments`` and update the statistics
    of ``names`` (default: all); ``feed``: the sample's feed when its graph inputs are measured here."""
    use_hist = not plan.minmax
    if use_hist and feed is not None:
        for name in plan.inputs:
            stats[name].update(feed[name])
    current = {}
    try:
        for segment in segments:
            for name, value in segment.run(env):   # one segment's values at a time
                if use_hist:
                    stats[name].update(value)
                else:
                    current[name] = value
    except _RunError as exc:
        exc.index = index
        raise
    if not use_hist:
        _update_ranges(stats, feed, plan, current, names)


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


def calibrate_ranges(model: QModel, data, *, method: str = "minmax", percentile: float = 99.999,
                     num_bins: int = 2048, bits: int = 8, symmetric: bool = False,
                     moving_average: bool = False, averaging_constant: float = 0.01,
                     max_samples: int = 0, progress_stream=None, only: set[str] | None = None,
                     kept: KeptSamples | None = None):
    """Collect statistics and finalise them: returns (ranges, observed, samples), both dicts of
    tensor name -> (float, float) in graph order (``kept``: see collect_stats)."""
    stats, samples = collect_stats(model, data, method=method, num_bins=num_bins,
                                   averaging_constant=averaging_constant if moving_average else None,
                                   max_samples=max_samples, progress_stream=progress_stream, only=only,
                                   kept=kept)
    ranges, observed = {}, {}
    for name, st in stats.items():
        lo, hi = finalise(method, st, percentile=percentile, num_bins=num_bins, bits=bits,
                          symmetric=symmetric, moving_average=moving_average)
        ranges[name] = (_finite(lo), _finite(hi))
        observed[name] = tuple(float(v) for v in st.observed)
    return ranges, observed, samples


def _finite(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else 0.0

"""A segmented onnxruntime executor: a model's top-level graph run in parts, one session per part,
each part fed the tensors it reads (from the feed, or computed by an earlier part).

Building one onnxruntime session grows faster than linearly with the graph (one session over 12k
nodes plus calibration outputs: ~2 min), every session holds its own copy of the weights, and a
model is serialised for onnxruntime, beyond 2 GB not at all. So a ``SegmentedModel``
- hands the weights of models with at least IN_MEMORY_BYTES of constants to onnxruntime as arrays
  (no serialised copy: onnxruntime's own copy is the only one it adds);
- on ``cut()``, cuts the graph into parts of about CHUNK_NODES consecutive nodes (and, given a
  ``weight_limit``, at most about that many weight bytes) where every value crossing the cut has
  a known element type (``Chain``);
- builds the session of part ``k`` on demand (``build(k, extend)``), the part's model extended by
  the caller (extra nodes and outputs: calibration's reductions, correct-bias' probes), so a caller
  can hold one session at a time (calibrate's segment-outer mode) or all of them.
``SegmentedSession`` builds every part up front and runs feeds like one session: ``run(names, feed)``.
"""
from __future__ import annotations

import math
from typing import Callable

import onnx
from onnx import helper

from ..analysis.dtypes import infer_types
from ..errors import ModelError, first_line
from ..ir.graphutil import node_reads
from ..ir.model import QModel, constant_bytes
from .data import model_inputs
from .sessions import RunError, ort_session, session_options, unrunnable
from .tensor_types import tensor_bytes

IN_MEMORY_BYTES = 64 * 2**20  # weights from this size on go to onnxruntime as arrays (always past 2 GB)
CHUNK_NODES = 2000   # top-level nodes per onnxruntime session: session creation grows faster than
                     # linearly with the graph (one session over 12k nodes + measurements: ~2 min)
MAX_IO = 1200        # ... and at most about this many session inputs + node outputs


class Chain:
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
        self.nbytes = {t.name: tensor_bytes(t.data_type, math.prod(t.dims)) or 0 for t in proto.graph.initializer}
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
            size = tensor_bytes(self.types.get(name, 0), sizes.get(name))
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


class Part:
    """One onnxruntime session over consecutive top-level nodes (or the whole model): the values it
    reads (``inputs``; None: the whole feed), what it returns, which values later parts need
    (``live_out``) and which are read for the last time (``done``)."""

    def __init__(self, session, inputs, outputs, live_out, done, keep=()):
        self.session, self.inputs, self.outputs = session, inputs, outputs
        self.live_out, self.done = live_out, done
        self.keep = keep                         # OrtValues of in-memory weights: live with the session

    def run(self, env: dict) -> dict:
        """Run on ``env`` (name -> array: the feed, then what earlier parts passed on; updated in
        place) and return {output: value}. onnxruntime's failure is raised as RunError."""
        feed = env if self.inputs is None else {n: env[n] for n in self.inputs}
        try:
            values = dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        except Exception as exc:
            raise RunError(first_line(exc)) from None
        for name in self.live_out:
            env[name] = values[name]
        for name in self.done:
            env.pop(name, None)
        return values


Extend = Callable[[onnx.ModelProto], list]   # adds nodes and outputs to a part's model; returns what to fetch


class SegmentedModel:
    """``model`` exported for onnxruntime (weights as arrays from IN_MEMORY_BYTES on, or as
    ``in_memory_weights`` says) and, after ``cut``, cut into parts: ``spans[k]`` is the node range
    of part ``k`` (a single None: the whole model). ``build(k)`` creates part ``k``'s session.
    ``optimize``: onnxruntime's graph optimizations (a part of a cut graph gets the extended level:
    the layout pass cost 2x session time and 4x run time there); ``prepacking``: see session_options."""

    def __init__(self, model: QModel, *, in_memory_weights: bool | None = None, optimize: bool = True,
                 prepacking: bool = False):
        self.model, self.optimize, self.prepacking = model, optimize, prepacking
        self.weight_bytes = constant_bytes(model.graph)
        if in_memory_weights is None:  # hand big weights over as arrays: serialising them for a
            in_memory_weights = self.weight_bytes >= IN_MEMORY_BYTES  # session peaked at 5x their size
        self.weights: dict | None = {} if in_memory_weights else None
        self.proto = model.to_proto(metadata=False, weights=self.weights)   # until the whole part is built
        self.chain: Chain | None = None
        self.spans: list = [None]
        self._inferred = None

    @property
    def inferred(self) -> tuple[dict[str, int], dict[str, int]]:
        """Element types and static element counts of the top-level tensors (see infer_types)."""
        if self._inferred is None:
            self._inferred = infer_types(self.proto)
        return self._inferred

    def cut(self, weight_limit: int | None = None) -> None:
        """Cut into parts of about CHUNK_NODES nodes (and about ``weight_limit`` weight bytes)."""
        self.chain = Chain(self.model, self.proto, self.inferred[0], weight_limit)
        self._spans()

    def recut(self) -> None:
        """Cut again by node and IO counts only."""
        self.chain.recut()
        self._spans()

    def cut_at(self, starts: list[int]) -> bool:
        """Cut into parts starting at node indices ``starts`` (and 0); False, left uncut, when the graph
        keeps one session (user-feedable initializers) or a value crossing a cut has no known type."""
        chain = Chain(self.model, self.proto, self.inferred[0])
        count = len(self.proto.graph.node)
        bounds = sorted({0, count} | {s for s in starts if 0 < s < count})
        if not hasattr(chain, "last"):
            return False
        for cut in bounds[1:-1]:
            crossing = {o for node in self.proto.graph.node[:cut] for o in node.output
                        if o and chain.last.get(o, -1) >= cut}
            if crossing - set(chain.types):
                return False
        chain.spans = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        self.chain = chain
        self._spans()
        return True

    def _spans(self) -> None:
        self.spans = [None] if self.chain is None or len(self.chain.spans) == 1 else self.chain.spans

    def part_model(self, k: int) -> tuple[onnx.ModelProto, list[str] | None, list[str], list[str]]:
        """(model of part ``k``, its inputs (None: the feed), values it passes on, values read for
        the last time). The whole model's is handed out once: it is extended in place."""
        if self.spans[k] is None:
            proto, self.proto = self.proto, None
            return proto, None, [], []
        return self.chain.segment(self.spans[k])

    def build(self, k: int, extend: Extend | None = None, capture=(),
              refused: str = "onnxruntime cannot run the model") -> Part | None:
        """The session of part ``k``, its model extended by ``extend`` (whose returned names it
        fetches), also returning ``capture`` (names of tensors it computes anyway); None when it
        fetches nothing and passes nothing on. ``refused``: the error's first words when
        onnxruntime cannot load it (a ModelError)."""
        proto, inputs, live_out, done = self.part_model(k)
        fetch = extend(proto) if extend is not None else []
        outputs = list(dict.fromkeys(live_out + fetch))
        if not outputs:
            return None
        outputs = list(dict.fromkeys(outputs + list(capture)))
        listed = {o.name for o in proto.graph.output}   # a part's own graph outputs are not all listed
        proto.graph.output.extend(helper.make_tensor_value_info(n, self.inferred[0][n], None)
                                  for n in capture if n not in listed)
        opts, keep = session_options(proto, self.weights, prepacking=self.prepacking)
        # with spans or fetched inner tensors, fusions stay and the layout pass goes: its NCHWc
        # reorders cost 2x session time and 4x run time on cut parts, and fetching ddddocr_det's
        # 267 inner tensors took 71-75 ms a run with them against 50-59 without
        level = "none" if not self.optimize else "extended" if self.spans[k] is not None or fetch else None
        data = proto.SerializeToString()
        del proto  # free the exported copy before onnxruntime makes its own
        try:
            session = ort_session(data, opts, optimization=level)
        except Exception as exc:
            raise ModelError(f"{refused}: {unrunnable(self.model, exc)}") from None
        return Part(session, inputs, outputs, live_out, done, keep)

    def prune(self, env: dict, k: int) -> int:
        """Drop from ``env`` what no part after ``k`` reads; returns the bytes of what is left."""
        stop, last = self.spans[k].stop, self.chain.last
        for name in [n for n in env if last.get(n, -1) < stop]:
            del env[name]
        return sum(getattr(v, "nbytes", 0) for v in env.values())

    def release(self) -> None:
        """Forget what only building sessions needed."""
        self.proto = self.chain = self._inferred = None


class SegmentedSession:
    """``model`` run like one onnxruntime session: ``run(names, feed)``. Graphs of more than
    CHUNK_NODES top-level nodes run as a chain of sessions, all built up front; weights go to
    onnxruntime as arrays from IN_MEMORY_BYTES on (prepacked as in a default session, so one
    session over a model computes what ``onnxruntime.InferenceSession`` computes).

    ``extend(proto, available)`` adds nodes and outputs to a part's model and returns the names
    of the outputs it added (``run`` can fetch them): ``available`` are the tensors the part is the
    first to read or compute (graph inputs and node outputs, never initializers), so each is
    offered once. ``graph_outputs=False``: the model's own outputs are not fetched (nor kept as
    outputs of the session, where they would stop fusions). ``specs``: the inputs to validate
    feeds against; ``output_names``: the model's outputs."""

    def __init__(self, model: QModel, *, extend: Callable | None = None, graph_outputs: bool = True,
                 optimize: bool = True, refused: str = "onnxruntime cannot run the model"):
        seg = SegmentedModel(model, optimize=optimize, prepacking=True)
        graph = seg.proto.graph
        self.specs = model_inputs(seg.proto)
        self.output_names = [o.name for o in graph.output] if graph_outputs else []
        computed = {o for node in graph.node for o in node.output if o} | {vi.name for vi in graph.input}
        elem_type = {o.name: o.type.tensor_type.elem_type for o in graph.output}
        if len(graph.node) > CHUNK_NODES and set(self.output_names) <= computed:
            seg.cut()   # (a constant graph output keeps one session)
            elem_type = {n: elem or seg.inferred[0].get(n, 0) for n, elem in elem_type.items()}
        offered: set[str] = set()
        self.parts: list[tuple[Part, list[str]]] = []   # each part, and what run() takes from it
        for k in range(len(seg.spans)):
            taken: list[str] = []

            def extend_part(proto: onnx.ModelProto) -> list[str]:
                g = proto.graph
                made = [o for node in g.node for o in node.output if o]
                inits = {t.name for t in g.initializer}
                available = dict.fromkeys(n for n in [vi.name for vi in g.input] + made
                                          if n not in offered and n not in inits)
                offered.update(available)
                if seg.spans[k] is None:
                    if not graph_outputs:
                        del g.output[:]
                    outputs = list(self.output_names)
                else:   # the graph outputs it computes (those read later are outputs already)
                    ours, listed = set(made), {o.name for o in g.output}
                    outputs = [n for n in self.output_names if n in ours]
                    g.output.extend(helper.make_tensor_value_info(n, elem_type[n], None)
                                    for n in outputs if n not in listed)
                taken[:] = outputs + (extend(proto, set(available)) if extend is not None else [])
                return list(taken)

            part = seg.build(k, extend_part, refused=refused)
            if part is not None:
                self.parts.append((part, taken))
        seg.release()

    def run(self, names: list[str], feed: dict) -> list:
        """The values of ``names`` (graph outputs or names ``extend`` returned) on ``feed``."""
        env, got = dict(feed), {}
        for part, taken in self.parts:
            values = part.run(env)
            got.update((n, values[n]) for n in taken)
        return [got[n] if n in got else feed[n] for n in names]

"""Calibration of If/Loop/Scan bodies: body tensors are observed through the outer runs.

onnxruntime returns only the main graph's outputs, so the calibration copy (a throwaway: the
user's model is never changed) threads every measured body tensor out of its body, level by level,
until it is an output of the main graph. Each measured tensor is first cast to float32, so every
threaded value has one type whatever the model's float types are:

- values (histogram methods): the body computes ``Reshape(Cast(t), [-1])``;
  - If: a new output of both branches; the branch that does not compute it yields an empty
    tensor (If outputs must match in number and type, not in shape);
  - Loop: a loop-carried sequence (``SequenceInsert`` in each iteration, so shapes may vary from one
    iteration to the next), started with one empty tensor and concatenated after the loop;
  - Scan: a scan output, flattened after the node. Scan stacks its iterations, so each must give
    as many values: true unless the body's shapes depend on the data. Values that come from an If
    or Loop nested in a Scan body vary in length, so those tensors are not measured (no range).
- min/max: the body computes ``ReduceMin``/``ReduceMax`` scalars; the If branch that does not
  compute them yields +inf/-inf (neutral), Loop and Scan stack them as scan outputs, reduced to
  scalars again after the node. A tensor whose body never ran is seen as (+inf, -inf): no update.

``body_activations`` says what is measured; ``thread_out`` edits the copy; ``readings`` turns the
fetched arrays into per-sample values or (min, max) for the collectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..ir.graphutil import DEFAULT_DOMAINS, default_opset, proto_subgraphs
from .augment import RANDOM_OPS
from .tensor_types import FLOAT_TYPES

def has_bodies(graph: onnx.GraphProto) -> bool:
    return any(next(proto_subgraphs(node), None) is not None for node in graph.node)


def _body_types(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    for node in graph.node:
        for _, sub in proto_subgraphs(node):
            for vi in list(sub.input) + list(sub.value_info) + list(sub.output):
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    types.setdefault(vi.name, vi.type.tensor_type.elem_type)
            _body_types(sub, types)


def inferred_body_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element types of body tensors: the model's own value_info, completed by shape inference on
    a copy without the main graph's weights."""
    light = onnx.ModelProto(ir_version=proto.ir_version)
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    g, src = light.graph, proto.graph
    for part in ("node", "input", "output", "value_info"):
        getattr(g, part).extend(getattr(src, part))
    listed = {vi.name for vi in g.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in src.initializer if t.name not in listed)
    types: dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False).graph
    except Exception:  # inference failure on exotic ops: what the model declares
        inferred = g
    _body_types(inferred, types)
    return types


def body_activations(proto: onnx.ModelProto, only: set[str] | None = None,
                     types: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """(name, index of the main-graph node holding it) of every float activation defined inside an
    If/Loop/Scan body: body inputs and node outputs not computed from constants alone, whose name
    no other graph defines (the table's key scheme, qpasses.analysis.scopes). ``only``: limit to
    these names (then their type is not checked: the table holds float tensors only)."""
    if not has_bodies(proto.graph):
        return []
    if only is None and types is None:
        types = inferred_body_types(proto)
    count: dict[str, int] = {}
    found: list[tuple[str, int]] = []
    top_constants = {t.name for t in proto.graph.initializer}
    top_constants |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}

    def walk(graph: onnx.GraphProto, constants: set[str], owner: int) -> None:
        constants = constants | {t.name for t in graph.initializer}
        names = [vi.name for vi in graph.input]
        for node in graph.node:
            inputs = [i for i in node.input if i]
            if node.op_type not in RANDOM_OPS and all(i in constants for i in inputs) and not next(proto_subgraphs(node), None):
                constants |= set(node.output)
            else:
                names += [o for o in node.output if o]
            for _, sub in proto_subgraphs(node):
                walk(sub, constants, owner)
        for name in names:
            count[name] = count.get(name, 0) + 1
            if only is not None and name in only or only is None and types.get(name) in FLOAT_TYPES:
                found.append((name, owner))

    for index, node in enumerate(proto.graph.node):
        for _, sub in proto_subgraphs(node):
            walk(sub, top_constants, index)
    top = {vi.name for vi in proto.graph.input} | {o for n in proto.graph.node for o in n.output}
    seen: set[str] = set()
    out = []
    for name, owner in found:
        if count[name] == 1 and name not in top and name not in seen:
            seen.add(name)
            out.append((name, owner))
    return out


@dataclass
class _Level:
    """What threading adds to one graph: nodes at its start and end, outputs of its own."""

    graph: onnx.GraphProto
    head: list = field(default_factory=list)
    tail: list = field(default_factory=list)
    shape: str | None = None        # name of its [-1] constant (values mode)


@dataclass
class _Exposure:
    name: str               # the measured body tensor
    tensors: list[str]      # in the current graph: [values] or [min, max]
    varying: bool = False   # values whose count may vary per iteration (from a nested If/Loop)


class _Threader:
    def __init__(self, proto: onnx.ModelProto, reduce: bool):
        self.reduce = reduce
        self.opset = default_opset(proto, 13)
        self.taken = set()
        self._names(proto.graph)

    def _names(self, graph: onnx.GraphProto) -> None:
        self.taken.update(vi.name for vi in list(graph.input) + list(graph.output))
        self.taken.update(t.name for t in graph.initializer)
        for node in graph.node:
            self.taken.update(node.output)
            self.taken.add(node.name)
            for _, sub in proto_subgraphs(node):
                self._names(sub)

    def new(self, base: str) -> str:
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name

    # -- one graph --------------------------------------------------------------------------
    def expose(self, graph: onnx.GraphProto, wanted: set[str], top: bool = False) -> list[_Exposure]:
        """Make the wanted tensors of ``graph`` and of its bodies tensors of ``graph``."""
        level = _Level(graph)
        found: list[_Exposure] = []
        if not top:
            defined = [vi.name for vi in graph.input] + [o for n in graph.node for o in n.output if o]
            found += [self.measure(level, name) for name in dict.fromkeys(defined) if name in wanted]
        for node in list(graph.node):
            bodies = list(proto_subgraphs(node))
            if bodies:
                found += self.thread(level, node, bodies, wanted)
        nodes = level.head + list(graph.node) + level.tail
        del graph.node[:]
        graph.node.extend(nodes)
        return found

    def measure(self, level: _Level, name: str) -> _Exposure:
        cast = self.new(f"{name}__qp_float")
        level.tail.append(helper.make_node("Cast", [name], [cast], name=cast, to=TensorProto.FLOAT))
        if self.reduce:
            lo, hi = self.new(f"{name}__qp_min"), self.new(f"{name}__qp_max")
            level.tail += [helper.make_node("ReduceMin", [cast], [lo], name=lo, keepdims=0),
                           helper.make_node("ReduceMax", [cast], [hi], name=hi, keepdims=0)]
            return _Exposure(name, [lo, hi])
        flat = self.new(f"{name}__qp_values")
        level.tail.append(helper.make_node("Reshape", [cast, self.flat_shape(level)], [flat], name=flat))
        return _Exposure(name, [flat])

    def flat_shape(self, level: _Level) -> str:
        if level.shape is None:
            level.shape = self.new("qp_flat_shape")
            level.head.append(helper.make_node("Constant", [], [level.shape], name=level.shape,
                                               value=helper.make_tensor(level.shape, TensorProto.INT64, [1], [-1])))
        return level.shape

    def constant(self, level: _Level, base: str, dims: list[int], values: list[float]) -> str:
        name = self.new(base)
        level.head.append(helper.make_node("Constant", [], [name], name=name,
                                           value=helper.make_tensor(name, TensorProto.FLOAT, dims, values)))
        return name

    def reduced(self, level: _Level, tensors: list[str]) -> list[str]:
        """ReduceMin/ReduceMax of the stacked per-iteration scalars (back to scalars)."""
        out = []
        for op, t in zip(("ReduceMin", "ReduceMax"), tensors):
            name = self.new(f"{t}__qp_all")
            level.tail.append(helper.make_node(op, [t], [name], name=name, keepdims=0))
            out.append(name)
        return out

    # -- control flow -----------------------------------------------------------------------
    def thread(self, level: _Level, node: onnx.NodeProto, bodies, wanted: set[str]) -> list[_Exposure]:
        inner = {id(g): self.expose(g, wanted) for _, g in bodies}
        if not any(inner.values()):
            return []
        if node.op_type == "If" and node.domain in DEFAULT_DOMAINS:
            return self.thread_if(node, dict((attr, g) for attr, g in bodies), inner)
        if node.op_type == "Loop" and node.domain in DEFAULT_DOMAINS and len(bodies) == 1:
            return self.thread_loop(level, node, bodies[0][1], inner[id(bodies[0][1])])
        if node.op_type == "Scan" and node.domain in DEFAULT_DOMAINS and len(bodies) == 1 and self.opset >= 9:
            return self.thread_scan(level, node, bodies[0][1], inner[id(bodies[0][1])])
        return []   # other ops holding graphs: their bodies' tensors are not measured

    def _output(self, graph: onnx.GraphProto, name: str, sequence: bool = False) -> None:
        graph.output.append(helper.make_tensor_sequence_value_info(name, TensorProto.FLOAT, None) if sequence
                            else helper.make_tensor_value_info(name, TensorProto.FLOAT, None))

    def thread_if(self, node, branches: dict, inner: dict) -> list[_Exposure]:
        then, other = branches.get("then_branch"), branches.get("else_branch")
        if then is None or other is None:
            return []
        levels = {id(then): _Level(then), id(other): _Level(other)}
        out = []
        for graph, missing in ((then, other), (other, then)):
            for e in inner[id(graph)]:
                fillers = ([self.constant(levels[id(missing)], f"{e.name}__qp_none_{k}", [], [v])
                            for k, v in (("min", np.inf), ("max", -np.inf))] if self.reduce else
                           [self.constant(levels[id(missing)], f"{e.name}__qp_none", [0], [])])
                new = []
                for t, filler in zip(e.tensors, fillers):
                    pair = {id(graph): t, id(missing): filler}
                    for g in (then, other):
                        self._output(g, pair[id(g)])
                    new.append(self.new(f"{t}__qp_if"))
                node.output.extend(new)
                out.append(_Exposure(e.name, new, varying=not self.reduce))
        for lv in levels.values():
            _insert(lv.graph.node, 0, *lv.head)   # constants first
        return out

    def thread_loop(self, level: _Level, node, body: onnx.GraphProto, inner: list[_Exposure]) -> list[_Exposure]:
        out = []
        carried = len(body.input) - 2
        for e in inner:
            if self.reduce:   # per-iteration scalars: scan outputs, appended last
                stacked = []
                for t in e.tensors:
                    self._output(body, t)
                    stacked.append(self.new(f"{t}__qp_loop"))
                node.output.extend(stacked)
                out.append(_Exposure(e.name, self.reduced(level, stacked)))
                continue
            empty = self.constant(level, f"{e.name}__qp_empty", [0], [])
            start, seq_in, seq_out = (self.new(f"{e.name}__qp_seq0"), self.new(f"{e.name}__qp_seq_in"),
                                      self.new(f"{e.name}__qp_seq_out"))
            level.head.append(helper.make_node("SequenceConstruct", [empty], [start], name=start))
            _insert(body.input, 2 + carried, helper.make_tensor_sequence_value_info(seq_in, TensorProto.FLOAT, None))
            body.node.append(helper.make_node("SequenceInsert", [seq_in, e.tensors[0]], [seq_out], name=seq_out))
            _insert(body.output, 1 + carried, helper.make_tensor_sequence_value_info(seq_out, TensorProto.FLOAT, None))
            final = self.new(f"{e.name}__qp_seq")
            node.input.append(start)
            node.output.insert(carried, final)
            carried += 1
            values = self.new(f"{e.name}__qp_loop")
            level.tail.append(helper.make_node("ConcatFromSequence", [final], [values], name=values, axis=0))
            out.append(_Exposure(e.name, [values], varying=True))
        return out

    def thread_scan(self, level: _Level, node, body: onnx.GraphProto, inner: list[_Exposure]) -> list[_Exposure]:
        out = []
        for e in inner:
            if e.varying:
                continue   # a count that varies per iteration cannot be stacked
            stacked = []
            for t in e.tensors:
                self._output(body, t)
                stacked.append(self.new(f"{t}__qp_scan"))
                for attr in node.attribute:
                    if attr.name in ("scan_output_axes", "scan_output_directions"):
                        attr.ints.append(0)
            node.output.extend(stacked)
            if self.reduce:
                out.append(_Exposure(e.name, self.reduced(level, stacked)))
            else:
                flat = self.new(f"{e.name}__qp_scan_values")
                level.tail.append(helper.make_node("Reshape", [stacked[0], self.flat_shape(level)], [flat], name=flat))
                out.append(_Exposure(e.name, [flat]))
        return out


def _insert(field, index: int, *items) -> None:
    """Insert into a repeated protobuf field (composite fields have no insert)."""
    kept = list(field)
    kept[index:index] = items
    del field[:]
    field.extend(kept)


def thread_out(proto: onnx.ModelProto, names, reduce: bool) -> dict[str, list[str]]:
    """Edit ``proto`` (a private copy) so the body tensors ``names`` are observable: returns
    {name: the graph outputs to fetch} ([values] or [min, max]); names it cannot thread are left out."""
    wanted = set(names)
    if not wanted or not has_bodies(proto.graph):
        return {}
    threader = _Threader(proto, reduce)
    exposed = threader.expose(proto.graph, wanted, top=True)
    fetch = {}
    for e in exposed:
        for t in e.tensors:
            proto.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
        fetch[e.name] = e.tensors
    return fetch


def readings(fetch: dict[str, list[str]], values: dict, reduce: bool):
    """(name, one sample's values) or, with ``reduce``, (name, (min, max)) for each threaded tensor;
    a body that did not run gives an empty array or (+inf, -inf), which the collectors ignore."""
    for name, outputs in fetch.items():
        if reduce:
            lo, hi = (np.asarray(values[o]) for o in outputs)
            yield name, (lo.min() if lo.size else np.inf, hi.max() if hi.size else -np.inf)
        else:
            yield name, values[outputs[0]]

"""fold-constants: evaluate every node whose inputs are all constants into initializers."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from ..calibration.sessions import ort_session
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import (has_subgraph, in_default_domain, overridable_initializers, remove_nodes, replace_all_uses,
                            topological_order)
from ..ir.decisions import COMPUTED
from ..ir.model import QModel, choose_ir_version, make_constant

# Never folded: quantization ops (their outputs are what quantization is about) and random ops.
NEVER_FOLD = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
# Inputs that are weights: materialised whatever their size (quantization needs them constant and
# a quantized model stores them anyway). op -> input slots.
WEIGHT_SLOTS = {
    "Conv": {1, 2}, "ConvTranspose": {1, 2}, "Gemm": {0, 1, 2}, "MatMul": {0, 1}, "Gather": {0},
    "BatchNormalization": {1, 2, 3, 4}, "InstanceNormalization": {1, 2}, "LayerNormalization": {1, 2},
    "LSTM": {1, 2, 3}, "GRU": {1, 2, 3}, "RNN": {1, 2, 3}}
CHUNK = 512  # nodes per onnxruntime session
_DIRECT_OPS = ("Constant", "Shape", "Size")


@register
class FoldConstants(Pass):
    """Evaluate nodes whose inputs are all constants and replace their outputs by initializers.

    Reads: the graph; Constant nodes, initializers (not those the user may feed as inputs),
    ConstantOfShape, Shape/Size of tensors with a fully static shape, and any default-domain op on them.

    Writes: folded tensors become initializers under the same name (readers and graph outputs are
    unchanged), their names in ``model.decisions["computed"]`` (what the input model computed, for
    the config's ``computed_weights``); the producer nodes that became dead are removed. Evaluation runs the foldable
    subgraph in onnxruntime (sessions of up to 512 nodes), then onnx.reference, then node by node.

    Invariants: never folds QuantizeLinear/DequantizeLinear, random ops, nodes with subgraphs or
    nodes of other domains; outputs in onnxruntime are unchanged; a second run folds nothing.
    """

    name: ClassVar[str] = "fold-constants"
    example: ClassVar[str] = """\
<ir_version: 10, opset_import: ["" : 17]>
g (float[1,4] x) => (float[1,4] y) {
   shape = Constant <value = int64[1] {4}> ()
   w = ConstantOfShape <value = float[1] {0.5}> (shape)
   two = Constant <value = float {2}> ()
   w2 = Mul (w, two)
   n = Size (x)
   nf = Cast <to = 1> (n)
   w3 = Div (w2, nf)
   y = Add (x, w3)
}"""
    example_prelude: ClassVar[str] = ""

    max_output_mb: float = field(default=64.0, metadata={
        "help": "do not materialise a folded tensor larger than this many MB (Expand/Tile blow-ups of small "
                "constants), unless it is a weight (read as a Conv/Gemm/MatMul/Gather/normalization/RNN "
                "parameter: quantization needs it constant) or a Constant node's value; 0 = no limit"})

    def run(self, model: QModel, ctx) -> PassResult:
        graph = model.graph
        order = topological_order(graph)
        feedable = overridable_initializers(model)
        limit = self.max_output_mb * 2**20 if self.max_output_mb > 0 else None
        kept: set[int] = set()             # ids of foldable nodes that must stay (too big, failed)
        values: dict[str, np.ndarray] = {}
        while True:
            plan = _Plan(order, feedable, kept, {id(t) for t in graph.outputs})
            big = {id(t.inputs[0]) for t in plan.frontier
                   if limit and _static_nbytes(t) > limit and not _size_exempt(t)}
            if big:
                kept |= big
                continue
            failed = _evaluate(plan, [t for t in plan.frontier if t.name not in values], values, model.opset)
            failed |= {id(t.inputs[0]) for t in plan.frontier if t.name in values and (
                       not _storable(values[t.name])
                       or (limit and values[t.name].nbytes > limit and not _size_exempt(t)))}
            if not failed:
                break
            kept |= failed
        outputs = {id(t) for t in graph.outputs}
        for t in plan.frontier:
            replace_all_uses(t, make_constant(t.name, values[t.name]), graph if id(t) in outputs else None)
        if plan.frontier:
            computed = set(model.decisions.get(COMPUTED, [])) | {t.name for t in plan.frontier}
            model.decisions[COMPUTED] = sorted(computed)
        outputs = {id(t) for t in graph.outputs}
        dead: dict[int, gs.Node] = {}
        for node in reversed(plan.needed):
            if all(id(t) not in outputs and all(id(r) in dead for r in t.outputs) for t in node.outputs):
                dead[id(node)] = node
        removed = remove_nodes(graph, dead.values())
        stats = {"folded": len(plan.frontier), "nodes_removed": removed}
        if kept:
            stats["not_folded"] = len(kept)
        return PassResult(model, bool(plan.frontier) or removed > 0, stats)


# -- planning ---------------------------------------------------------------------------------
class _Plan:
    """One linear sweep: which nodes fold, which folded tensors must be materialised (``frontier``:
    read by a node that does not fold, or a graph output) and which foldable nodes they need."""

    def __init__(self, order: list[gs.Node], feedable: set[str], kept: set[int], graph_outputs: set[int]):
        self.direct: dict[int, object] = {}     # node id -> thunk giving its value without a runtime
        foldable: list[gs.Node] = []
        fold_ids: set[int] = set()
        const: set[str] = set()                 # names of tensors produced by foldable nodes
        for node in order:
            if id(node) in kept:
                continue
            thunk = _direct(node, feedable) if node.op in _DIRECT_OPS else None
            if thunk is None and (not node.inputs or not all(
                    not t.name or t.name in const or (isinstance(t, gs.Constant) and t.name not in feedable)
                    for t in node.inputs)):
                continue
            if not _eligible(node):
                continue
            if thunk is not None:
                self.direct[id(node)] = thunk
            foldable.append(node)
            fold_ids.add(id(node))
            const.update(t.name for t in node.outputs if t.name)
        self.frontier: list[gs.Tensor] = []
        for node in foldable:
            for t in node.outputs:
                if t.name and (id(t) in graph_outputs or any(id(r) not in fold_ids for r in t.outputs)):
                    self.frontier.append(t)
        # foldable nodes the frontier depends on, in topological order
        needed: set[int] = set()
        stack = [t.inputs[0] for t in self.frontier]
        while stack:
            node = stack.pop()
            if id(node) in needed:
                continue
            needed.add(id(node))
            if id(node) in self.direct:
                continue
            stack.extend(t.inputs[0] for t in node.inputs if t.inputs and id(t.inputs[0]) in fold_ids)
        self.needed = [n for n in foldable if id(n) in needed]


def _eligible(node: gs.Node) -> bool:
    return (in_default_domain(node) and node.op not in NEVER_FOLD and "Sequence" not in node.op
            and "Optional" not in node.op and not (node.op == "Dropout" and len(node.inputs) > 2)
            and not has_subgraph(node))


def _static_shape(t: gs.Tensor):
    shape = t.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        return None
    return [int(d) for d in shape]


def _direct(node: gs.Node, feedable: set[str]):
    """A thunk computing the (single) output of a node without a runtime, else None."""
    if node.op == "Constant":
        attrs = node.attrs
        if isinstance(attrs.get("value"), gs.Constant):
            return lambda: np.array(attrs["value"].values)
        for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                           ("value_int", np.int64), ("value_ints", np.int64)):
            if key in attrs:
                return lambda: np.asarray(attrs[key], dtype=dtype)
        return None
    if node.op in ("Shape", "Size") and node.inputs:
        src = node.inputs[0]
        if isinstance(src, gs.Constant):
            shape = None if src.name in feedable else list(src.shape)
        else:
            shape = _static_shape(src)
        if shape is None:
            return None
        if node.op == "Size":
            return lambda: np.asarray(int(np.prod(shape)), dtype=np.int64)
        start, end = node.attrs.get("start", 0), node.attrs.get("end", None)
        return lambda: np.asarray(shape[start:end], dtype=np.int64)
    return None


def _static_nbytes(t: gs.Tensor) -> int:
    shape = _static_shape(t)
    if shape is None or t.dtype is None:
        return 0
    try:
        return int(np.prod(shape)) * np.dtype(t.dtype).itemsize
    except TypeError:
        return 0


def _size_exempt(t: gs.Tensor) -> bool:
    """Materialised whatever its size: a Constant node's value (already in the model) or a weight."""
    return t.inputs[0].op == "Constant" or any(
        i in WEIGHT_SLOTS.get(r.op, ()) for r in t.outputs for i, x in enumerate(r.inputs) if x is t)


def _storable(value) -> bool:
    if not isinstance(value, np.ndarray) or value.dtype == object:
        return False
    try:
        helper.np_dtype_to_tensor_dtype(value.dtype)
    except (KeyError, TypeError, ValueError):
        return False
    return True


# -- evaluation -------------------------------------------------------------------------------
def _evaluate(plan: _Plan, wanted: list[gs.Tensor], values: dict, opset: int) -> set[int]:
    """Fill ``values`` for ``wanted`` tensors; returns ids of nodes that could not be evaluated.

    The nodes run in onnxruntime sessions of at most CHUNK nodes each (session creation grows
    faster than linearly with the node count); a chunk ORT and onnx.reference both refuse is
    evaluated node by node.
    """
    for node in plan.needed:
        if id(node) in plan.direct and node.outputs[0].name not in values:
            values[node.outputs[0].name] = plan.direct[id(node)]()
    missing = {t.name for t in wanted if t.name not in values}
    if not missing:
        return set()
    run = [n for n in plan.needed if id(n) not in plan.direct
           and not all(not t.name or t.name in values for t in n.outputs)]
    chunks = [run[i:i + CHUNK] for i in range(0, len(run), CHUNK)]
    last_read = {t.name: k for k, chunk in enumerate(chunks) for n in chunk for t in n.inputs}
    failed: set[int] = set()
    for k, chunk in enumerate(chunks):
        available = set(values)
        nodes = []
        for node in chunk:   # skip nodes downstream of a failure
            if all(not t.name or t.name in available or isinstance(t, gs.Constant) for t in node.inputs):
                nodes.append(node)
                available.update(t.name for t in node.outputs if t.name)
        outs = [t.name for n in nodes for t in n.outputs
                if t.name and (t.name in missing or last_read.get(t.name, -1) > k)]
        if not outs:
            continue
        result = _run(_submodel(nodes, outs, values, opset), outs)
        if result is not None:
            values.update(zip(outs, result))
            continue
        for node in nodes:   # node by node, keeping every intermediate
            if not all(not t.name or t.name in values or isinstance(t, gs.Constant) for t in node.inputs):
                continue
            node_outs = [t.name for t in node.outputs if t.name]
            result = _run(_submodel([node], node_outs, values, opset), node_outs)
            if result is None:
                failed.add(id(node))
            else:
                values.update(zip(node_outs, result))
    return failed


def _submodel(nodes: list[gs.Node], outputs: list[str], values: dict, opset: int) -> onnx.ModelProto:
    """A model computing ``outputs`` from ``nodes`` alone: constant inputs become initializers."""
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    produced = {t.name for n in nodes for t in n.outputs}
    inits, seen = [], set()
    for node in nodes:
        for t in node.inputs:
            if not t.name or t.name in produced or t.name in seen:
                continue
            seen.add(t.name)
            if t.name in values:
                inits.append(numpy_helper.from_array(values[t.name], t.name))
            else:
                proto = onnx.TensorProto()
                proto.CopyFrom(OnnxExporter.export_tensor_proto(t))
                proto.name = t.name
                inits.append(proto)
    graph = helper.make_graph([OnnxExporter.export_node(n) for n in nodes], "fold", [],
                              [onnx.ValueInfoProto(name=n) for n in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = choose_ir_version(7, [("", opset)])
    return model


def _run(proto: onnx.ModelProto, names: list[str]) -> list[np.ndarray] | None:
    """Run with onnxruntime, falling back to onnx.reference; None when both refuse."""
    try:
        # tiny kernels: threads would only spin
        sess = ort_session(proto.SerializeToString(), log=4, optimization="none", threads=1)
        return [np.asarray(v) for v in sess.run(names, {})]
    except Exception:
        pass
    try:
        from onnx.reference import ReferenceEvaluator

        return [np.asarray(v) for v in ReferenceEvaluator(proto).run(names, {})]
    except Exception:
        return None

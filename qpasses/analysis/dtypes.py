"""Float dtypes of the graph's tensors, cached analyses of the graph: what gs knows, completed by
at most one ONNX shape inference per state of the graph (``inferred``).

- ``float_tensors``: the float32/float16 tensors annotate-types and propagate-mixed-precision type;
- ``float_types``: the float type name of table tensors (insert-qdq: their scales' and DQs' type);
- ``float_type_name``: "float32"/"float16"/"bfloat16" of a dtype ("" other types, None unknown).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ..ir.graphutil import proto_subgraphs
from ..ir.analyses import GRAPH, analysis
from ..ir.model import QModel
from ..quant.oprules import FLOAT, rule_for

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
FLOAT_ONNX = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
_FLOAT_NAMES = ("float32", "float16", "bfloat16")


def infer_types(proto: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
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
    for name, elem in _body_types(g2):   # element types only: a body tensor's shape varies per run
        types.setdefault(name, elem)
    return types, sizes


def _body_types(graph: onnx.GraphProto):
    """(name, elem_type) of the tensors of the If/Loop/Scan bodies shape inference typed."""
    for node in graph.node:
        for _, sub in proto_subgraphs(node):
            for vi in list(sub.input) + list(sub.value_info) + list(sub.output):
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    yield vi.name, vi.type.tensor_type.elem_type
            yield from ((t.name, t.data_type) for t in sub.initializer)
            yield from _body_types(sub)


@analysis(GRAPH)
def inferred(model: QModel) -> tuple[dict[str, int], dict[str, int]]:
    """``infer_types`` of the model, run once per state of the graph (big weights are not copied to export it)."""
    try:
        return infer_types(model.to_proto(metadata=False, weights={}))
    except Exception:  # best effort: what stays unknown keeps its default
        return {}, {}


def float_type_name(dtype) -> str | None:
    """"float32"/"float16"/"bfloat16", "" for other types, None when unknown."""
    if dtype is None:
        return None
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return ""
    return name if name in _FLOAT_NAMES else ""


def float_types(model: QModel, names) -> dict[str, str]:
    """Float type name of each tensor ("float32", "float16", "bfloat16"; "" when not float).

    Types gs does not know are float32, unless the model holds float16/bfloat16 tensors: then they
    come from ``inferred`` (it exports the whole model, so only when needed)."""
    tensors = model.tensors()
    out = {n: float_type_name(tensors[n].dtype) for n in names}
    unknown = [n for n, v in out.items() if v is None]
    types = {}
    if unknown and any(float_type_name(t.dtype) in ("float16", "bfloat16") for t in tensors.values()):
        types = inferred(model)[0]
    for n in unknown:
        elem = types.get(n)
        out[n] = (float_type_name(helper.tensor_dtype_to_np_dtype(elem)) or "") if elem else "float32"
    return out

# ops (outside the rule table) whose output 0 has the dtype of input 0
_SAME_DTYPE_OPS = frozenset({"Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Gelu", "Elu", "Selu",
                             "Softplus", "Floor", "Ceil", "Round", "Sin", "Cos", "Pow", "Dropout", "CumSum",
                             "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2"})


@analysis(GRAPH)
def float_tensors(model: QModel) -> set[str]:
    """Names of float32/float16 tensors.

    Dtypes come from the graph, then from the op rules (outputs of rule ops, and of ops like Neg,
    have their data input's dtype); ``inferred`` is read only if a tensor read or written by a rule
    op is still unknown (it exports the whole model, which is slow on big graphs).
    """
    is_float: dict[str, bool] = {}
    for name, tensor in model.tensors().items():
        if tensor.dtype is not None:
            try:
                is_float[name] = np.dtype(tensor.dtype) in FLOAT_DTYPES
            except TypeError:
                is_float[name] = False
    if _propagate_dtypes(model, is_float):   # what inference cannot type stays unknown: not quantized
        tensors = model.tensors()
        for name, elem in inferred(model)[0].items():
            if name in tensors:
                is_float.setdefault(name, elem in FLOAT_ONNX)
        _propagate_dtypes(model, is_float)
    return {name for name, flag in is_float.items() if flag}


def _propagate_dtypes(model: QModel, is_float: dict[str, bool]) -> bool:
    """Fill unknown dtypes from data inputs (graph order); True if a rule op's tensor stays unknown."""
    missing = False
    for node in _all_nodes(model):
        rule = rule_for(node.op)
        if node.op == "Cast":
            if node.outputs and node.outputs[0].name not in is_float:
                is_float[node.outputs[0].name] = node.attrs.get("to") in FLOAT_ONNX
            continue
        if rule is None and node.op not in _SAME_DTYPE_OPS:
            continue
        data = next((t for i, t in enumerate(node.inputs)
                     if t.name and (rule is None or rule.slot(i).kind != FLOAT)), None)
        if data is None:
            continue
        outputs = (0,) if rule is None else rule.outputs
        indices = range(len(node.outputs)) if outputs is None else outputs
        for i in indices:
            if i < len(node.outputs) and node.outputs[i].name and node.outputs[i].name not in is_float \
                    and data.name in is_float:
                is_float[node.outputs[i].name] = is_float[data.name]
        if rule is not None:
            missing = missing or any(t.name and t.name not in is_float for i, t in enumerate(node.inputs)
                                     if rule.slot(i).kind != FLOAT)
            missing = missing or any(node.outputs[i].name not in is_float for i in indices
                                     if i < len(node.outputs) and node.outputs[i].name)
    return missing


def _all_nodes(model: QModel):
    """The main graph's nodes, then those of its If/Loop/Scan bodies (outer tensors typed first)."""
    yield from model.graph.nodes
    for body in model.bodies():
        yield from body.nodes

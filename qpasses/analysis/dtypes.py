"""Float dtypes of the graph's tensors, cached per model generation."""
from __future__ import annotations

import numpy as np
import onnx

from ..ir import QModel
from ..oprules import FLOAT, rule_for

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
FLOAT_ONNX = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)

# ops (outside the rule table) whose output 0 has the dtype of input 0
_SAME_DTYPE_OPS = frozenset({"Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Gelu", "Elu", "Selu",
                             "Softplus", "Floor", "Ceil", "Round", "Sin", "Cos", "Pow", "Dropout", "CumSum",
                             "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2"})


def float_tensors(model: QModel) -> set[str]:
    """Names of float32/float16 tensors (cached per generation).

    Dtypes come from the graph, then from the op rules (outputs of rule ops, and of ops like Neg,
    have their data input's dtype); ONNX shape inference runs only if a tensor read or written by a
    rule op is still unknown (it exports the whole model, which is slow on big graphs).
    """
    def build(m: QModel) -> set[str]:
        is_float: dict[str, bool] = {}
        for name, tensor in m.tensors().items():
            if tensor.dtype is not None:
                try:
                    is_float[name] = np.dtype(tensor.dtype) in FLOAT_DTYPES
                except TypeError:
                    is_float[name] = False
        if _propagate_dtypes(m, is_float):
            try:
                graph = onnx.shape_inference.infer_shapes(m.to_proto()).graph
                for vi in list(graph.value_info) + list(graph.output):
                    elem = vi.type.tensor_type.elem_type
                    if elem and vi.name not in is_float:
                        is_float[vi.name] = elem in FLOAT_ONNX
            except Exception:  # inference is best effort: what stays unknown is not quantized
                pass
            _propagate_dtypes(m, is_float)
        return {name for name, flag in is_float.items() if flag}

    return model.cached("dtypes.float_tensors", build)


def _propagate_dtypes(model: QModel, is_float: dict[str, bool]) -> bool:
    """Fill unknown dtypes from data inputs (graph order); True if a rule op's tensor stays unknown."""
    missing = False
    for node in model.graph.nodes:
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

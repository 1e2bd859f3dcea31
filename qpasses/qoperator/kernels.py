"""What each QDQ node unit becomes: the QLinear operator onnxruntime has a CPU kernel for, its
inputs in that operator's order, or the reason the unit stays QDQ."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from .units import QInput, Unit, same_type_per_tensor

MS = "com.microsoft"
# data movement: with equal input and output qparams the op runs on the 8-bit tensor itself
MOVES = ("MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze")
SINGLE = {"AveragePool": "QLinearAveragePool", "GlobalAveragePool": "QLinearGlobalAveragePool",
          "Sigmoid": "QLinearSigmoid", "LeakyRelu": "QLinearLeakyRelu"}
BINARY = {"Add": "QLinearAdd", "Mul": "QLinearMul"}


@dataclass
class Lowered:
    op: str
    domain: str
    inputs: list
    attrs: dict = field(default_factory=dict)


def _qp(q: QInput) -> list:
    return [q.q, q.scale, q.zero_point]


def _out(unit: Unit) -> list:
    return [unit.output.scale, unit.output.zero_point]


def _weight(unit: Unit, index: int, channel_axis: int) -> QInput | str:
    """The weight DQ: 8-bit, per tensor or per ``channel_axis`` with one zero point for all channels
    (0 for int8; uint8 weights, as protect-pair-sums stores them, have 128)."""
    w = unit.inputs[index] if index < len(unit.inputs) else None
    if w is None or not isinstance(w.q, gs.Constant):
        return "weight is not a dequantized constant"
    if w.dtype not in (np.dtype(np.int8), np.dtype(np.uint8)):
        return "weight is not 8-bit"
    if unit.output.dtype == np.int8 and w.dtype != np.int8:
        return "int8 activations need int8 weights"
    if not w.per_tensor:
        ndim = np.ndim(w.q.values)
        zero_points = np.asarray(w.zero_point.values)
        if (w.axis is None or w.axis % ndim != channel_axis % ndim or np.any(zero_points != zero_points.flat[0])
                or (w.dtype == np.int8 and np.any(zero_points != 0))):
            return "per-channel weight not on the output channel axis or with unequal (int8: non-zero) zero points"
    return w


def _bias(unit: Unit, x: QInput, w: QInput) -> gs.Tensor | None | str:
    """The int32 bias whose scale is x_scale * w_scale (what the kernels assume), None when absent."""
    node = unit.node
    if len(node.inputs) < 3 or not node.inputs[2].name:
        return None
    b = unit.inputs[2]
    if b is None or b.q.dtype != np.int32 or not isinstance(b.q, gs.Constant) or np.any(b.zero_point.values != 0):
        return "bias is not a dequantized int32 constant"
    want = np.float32(x.scale.values) * w.scale.values.astype(np.float32)
    if not np.allclose(b.scale.values, want, rtol=1e-6, atol=0):
        return "bias scale is not input scale * weight scale"
    return b.q


def lower(unit: Unit, opset: int) -> Lowered | str:
    """The replacement of ``unit``, or why it stays QDQ."""
    node, op = unit.node, unit.node.op
    if op in ("Conv", "Gemm", "MatMul"):
        return _weighted(unit)
    if op in BINARY:
        why = same_type_per_tensor(unit, (0, 1))
        return why or Lowered(BINARY[op], MS, _qp(unit.inputs[0]) + _qp(unit.inputs[1]) + _out(unit))
    if op == "Concat":
        why = same_type_per_tensor(unit, range(len(node.inputs)))
        return why or Lowered("QLinearConcat", MS, _out(unit) + [t for q in unit.inputs for t in _qp(q)],
                              {"axis": node.attrs["axis"]})
    if op in SINGLE:
        why = same_type_per_tensor(unit, (0,))
        if why:
            return why
        attrs = {k: v for k, v in node.attrs.items()}
        if op == "AveragePool" and "dilations" in attrs:
            return "AveragePool with dilations"
        if op.endswith("AveragePool"):
            attrs["channels_last"] = 0
        return Lowered(SINGLE[op], MS, _qp(unit.inputs[0]) + _out(unit), attrs)
    if op in MOVES:
        return _move(unit, opset)
    return "no QLinear kernel"


def _weighted(unit: Unit) -> Lowered | str:
    node, op = unit.node, unit.node.op
    why = same_type_per_tensor(unit, (0,))
    if why:
        return why
    x = unit.inputs[0]
    trans_b = bool(node.attrs.get("transB", 0))
    w = _weight(unit, 1, {"Conv": 0, "MatMul": -1, "Gemm": 0 if trans_b else 1}[op])
    if isinstance(w, str):
        return w
    if op == "MatMul":
        if np.ndim(w.q.values) != 2:
            return "MatMul weight is not 2-D"
        return Lowered("QLinearMatMul", "", _qp(x) + _qp(w) + _out(unit))
    bias = _bias(unit, x, w)
    if isinstance(bias, str):
        return bias
    if op == "Conv":
        return Lowered("QLinearConv", "", _qp(x) + _qp(w) + _out(unit) + ([bias] if bias is not None else []),
                       dict(node.attrs))
    if node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0:
        return "Gemm with alpha or beta != 1"
    c = bias if bias is not None else gs.Variable.empty()
    attrs = {k: node.attrs[k] for k in ("transA", "transB") if k in node.attrs}
    return Lowered("QGemm", MS, _qp(x) + _qp(w) + [c] + _out(unit), attrs)


def _move(unit: Unit, opset: int) -> Lowered | str:
    node = unit.node
    why = same_type_per_tensor(unit, (0,))
    if why:
        return why
    x = unit.inputs[0]
    if not (np.array_equal(x.scale.values, unit.output.scale.values)
            and np.array_equal(x.zero_point.values, unit.output.zero_point.values)):
        return "input and output qparams differ"
    if node.op == "MaxPool" and (opset < 12 or len(node.outputs) > 1):
        return "MaxPool on 8-bit needs opset 12 and no indices"
    return Lowered(node.op, node.domain or "", [x.q] + list(node.inputs[1:]), dict(node.attrs))

"""Node units of a QDQ graph: an op whose float inputs all come from DequantizeLinear nodes and
whose only reader is one QuantizeLinear, with the constant scales and zero points around it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..quant.oprules import DQ_OP, Q_OP
from ..quant.qdq import producer

EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


@dataclass(frozen=True)
class QInput:
    """A quantized input: the DQ's quantized tensor with its scale and zero point (constants)."""

    q: gs.Tensor
    scale: gs.Constant
    zero_point: gs.Constant
    axis: int | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.zero_point.values.dtype)

    @property
    def per_tensor(self) -> bool:
        return self.scale.values.size == 1 and self.zero_point.values.size == 1


@dataclass(frozen=True)
class Unit:
    node: gs.Node
    inputs: tuple[QInput | None, ...]   # per node input: its DQ, or None (absent / not a DQ output)
    q: gs.Node                          # the QuantizeLinear reading the node's output
    output: QInput                      # Q's output tensor, scale, zero point


def quantized_input(t: gs.Tensor) -> QInput | None:
    """The DQ feeding ``t`` with constant scale/zero point (zero point given), else None."""
    dq = producer(t)
    if dq is None or dq.op != DQ_OP or len(dq.inputs) < 3:
        return None
    q, scale, zp = dq.inputs[:3]
    if not (isinstance(scale, gs.Constant) and isinstance(zp, gs.Constant)):
        return None
    return QInput(q, scale, zp, dq.attrs.get("axis", 1) if scale.values.size > 1 else None)


def find_unit(node: gs.Node, graph_outputs: set[str]) -> Unit | str:
    """The unit around ``node``, or why there is none."""
    if len(node.outputs) != 1:
        return "not one output"
    out = node.outputs[0]
    readers = list(out.outputs)
    if out.name in graph_outputs or len(readers) != 1 or readers[0].op != Q_OP:
        return "output not read by exactly one QuantizeLinear"
    q = readers[0]
    if len(q.inputs) < 3 or not isinstance(q.inputs[1], gs.Constant) or not isinstance(q.inputs[2], gs.Constant):
        return "QuantizeLinear without constant scale and zero point"
    qout = QInput(q.outputs[0], q.inputs[1], q.inputs[2], None)
    if not qout.per_tensor or qout.dtype not in EIGHT_BIT:
        return "output is not per-tensor 8-bit"
    inputs = tuple(quantized_input(t) if t.name else None for t in node.inputs)
    return Unit(node, inputs, q, qout)


def same_type_per_tensor(unit: Unit, indices) -> str | None:
    """None when the inputs at ``indices`` are per-tensor DQs of the output's 8-bit type."""
    for i in indices:
        qi = unit.inputs[i] if i < len(unit.inputs) else None
        if qi is None:
            return f"input {i} is not dequantized"
        if not qi.per_tensor or qi.dtype != unit.output.dtype:
            return f"input {i} is not per-tensor {unit.output.dtype}"
    return None

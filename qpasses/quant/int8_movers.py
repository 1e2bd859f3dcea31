"""int8 activations at opset 21 in onnxruntime: a float Reshape/Transpose/... after an int8 DQ gets a Q/DQ.

onnxruntime (measured on 1.32) cannot load a model at opset 21 or later in which the
DequantizeLinear of an int8 activation feeds a Reshape, Transpose, Squeeze, Unsqueeze, Slice or
MaxPool whose output is not quantized (an excluded node, say): its QDQ propagation copies the pair past
the op after another of its transformers made the zero point uint8, and keeps output_dtype INT8
("output_dtype INT8 does not match y_zero_point type UINT8"). Such an op's output is given a
QuantizeLinear/DequantizeLinear pair with the DQ's own scale and zero point (and so on down a
chain of such ops): the op only moves or picks values, so they pass the pair unchanged, and the op
itself still runs on the float values.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.graphutil import in_default_domain
from .oprules import DQ_OP, Q_OP, QDQ_PROPAGATED
from .qdq import Placement, new_namer

MOVERS = QDQ_PROPAGATED | {"MaxPool"}
FIRST_OPSET = 21


def requantize_movers(model) -> list[str]:
    """Give each such op of the main graph the pair on its output; returns the ops' names."""
    if model.opset < FIRST_OPSET:
        return []
    namer, place, done = new_namer(model), Placement(model.graph), []
    outputs = {t.name for t in model.graph.outputs}
    waiting = [n for n in model.graph.nodes if n.op == DQ_OP and _int8_activation(n)]
    while waiting:
        dq = waiting.pop()
        for node in list(dq.outputs[0].outputs):
            if node.op not in MOVERS or not in_default_domain(node) or node.inputs[0] is not dq.outputs[0]:
                continue
            out = node.outputs[0]
            if out.outputs and all(r.op == Q_OP for r in out.outputs) and out.name not in outputs:
                continue   # quantized: onnxruntime moves nothing (a float reader beside a Q still breaks it)
            moved = gs.Variable(namer(f"{out.name}_float"), dtype=out.dtype, shape=out.shape)
            node.outputs[0] = moved
            codes = gs.Variable(namer(f"{out.name}_quantized"), dtype=np.int8, shape=out.shape)
            params = list(dq.inputs[1:3])
            pair = [gs.Node(Q_OP, namer(f"{out.name}_q"), inputs=[moved, *params], outputs=[codes]),
                    gs.Node(DQ_OP, namer(f"{out.name}_dq"), inputs=[codes, *params], outputs=[out])]
            place.after(node, pair)
            waiting.append(pair[1])   # the next op of a chain reads it
            done.append(node.name)
    if done:
        place.apply()
        model.touch()
    return done


def requantize_movers_stats(model) -> dict:
    """``requantize_movers`` as a pass's stats: {"movers_requantized": count}, or nothing."""
    movers = requantize_movers(model)
    return {"movers_requantized": len(movers)} if movers else {}


def _int8_activation(dq: gs.Node) -> bool:
    """A per-tensor DequantizeLinear of a computed (not stored) int8 tensor."""
    zero = dq.inputs[2] if len(dq.inputs) > 2 else None
    return (not isinstance(dq.inputs[0], gs.Constant) and isinstance(zero, gs.Constant)
            and zero.values.dtype == np.int8 and zero.values.size == 1 and "axis" not in dq.attrs)

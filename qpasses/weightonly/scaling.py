"""Divide an input by per-channel scales for the nodes reading it (AWQ): folded into the gain and
bias of a LayerNormalization that only those nodes read, else a Mul by 1/s before them."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


def _private_constant(t, readers: int = 1) -> bool:
    return isinstance(t, gs.Constant) and len(t.outputs) == readers


def divide_input(model, x: gs.Tensor, readers: list[gs.Node], scales: np.ndarray, namer) -> str:
    """Make ``readers`` see x / scales (last axis); returns "folded" or "mul"."""
    producer = x.inputs[0] if x.inputs else None
    outputs = {t.name for t in model.graph.outputs}
    if producer is not None and producer.op == "LayerNormalization" and x.name not in outputs \
            and {id(n) for n in x.outputs} <= {id(n) for n in readers} and producer.outputs[0] is x \
            and all(_private_constant(t) for t in producer.inputs[1:3] if t.name):
        for t in producer.inputs[1:3]:
            if t.name:
                values = np.asarray(t.values)
                t.values = (values / scales.astype(values.dtype)).astype(values.dtype)
        return "folded"
    dtype = np.dtype(getattr(x, "dtype", None) or np.float32)
    inverse = gs.Constant(namer(f"{x.name}_awq_inverse_scale"), (1.0 / scales).astype(dtype))
    scaled = gs.Variable(namer(f"{x.name}_awq"), dtype=x.dtype, shape=x.shape)
    mul = gs.Node("Mul", namer(f"{x.name}_awq_Mul"), inputs=[x, inverse], outputs=[scaled])
    for node in readers:
        node.inputs[0] = scaled
    index = min(model.graph.nodes.index(n) for n in readers)
    model.graph.nodes.insert(index, mul)
    return "mul"

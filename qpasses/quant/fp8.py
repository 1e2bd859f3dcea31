"""FP8 Q/DQ in onnxruntime: keep a Relu from being dropped in front of an FP8 QuantizeLinear.

onnxruntime (measured on 1.32) removes a Relu whose only reader is a QuantizeLinear (its
ReluQuantFusion, meant for integer types whose zero point clamps at 0) also when that Q is FP8,
whose grid is symmetric around 0: the negative values then pass. Its QDQ propagation moves a Q
up through MaxPool/Reshape/Transpose/... first, so any Relu with one reader is at risk. Such a
Relu is written as ``Max(x, 0)``, which computes the same and which no fusion removes.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.dtypes import float_types
from ..ir.graphutil import in_default_domain
from .qdq import new_namer, scale_dtype


def guard_relus(model) -> int:
    """Rewrite every single-reader Relu of the main graph as Max(x, 0); returns how many."""
    relus = [n for n in model.graph.nodes if n.op == "Relu" and in_default_domain(n)
             and len(n.outputs) == 1 and len(n.outputs[0].outputs) == 1 and not n.outputs[0].name in
             {o.name for o in model.graph.outputs}]
    if not relus:
        return 0
    namer = new_namer(model)
    dtypes = float_types(model, [n.inputs[0].name for n in relus])
    zeros: dict[str, gs.Constant] = {}
    for node in relus:
        dtype = dtypes.get(node.inputs[0].name) or "float32"
        if dtype not in zeros:
            zeros[dtype] = gs.Constant(namer(f"relu_zero_{dtype}"), np.zeros((), scale_dtype(dtype)))
        node.op, node.attrs = "Max", {}
        node.inputs.append(zeros[dtype])
    model.touch()
    return len(relus)

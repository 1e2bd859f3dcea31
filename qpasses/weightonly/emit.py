"""Graph edits: a quantized weight as com.microsoft.MatMulNBits or as a block-wise DequantizeLinear."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.graphutil import has_subgraph
from .blocks import Blocked
from .matmulnbits import dq_inputs, nbits_attrs, nbits_inputs
from .mx import MXBlocked
from .targets import Target

QDQ_OPSET = 21   # int4/uint4, float8 and DequantizeLinear's block_size


def output_arrays(target: Target, w: Blocked | MXBlocked, fmt: str) -> dict:
    """The initializers of the node ``fmt`` gives the weight (no graph edit: any thread may run it)."""
    dtype = target.dtype
    if fmt == "matmulnbits":
        return nbits_inputs(w, dtype)
    if isinstance(w, MXBlocked):
        return w.dq_arrays(target.transposed, dtype)
    return dq_inputs(w, target.transposed, dtype)


def to_matmulnbits(target: Target, w: Blocked, namer, arrays: dict | None = None) -> gs.Node:
    """Replace the MatMul/Gemm by MatMulNBits (a Gemm's bias becomes the op's bias input)."""
    node, base = target.node, target.weight.name
    dtype = target.dtype
    arrays = arrays or output_arrays(target, w, "matmulnbits")
    inputs = [node.inputs[0], gs.Constant(namer(f"{base}_Q{w.bits}"), arrays["B"]),
              gs.Constant(namer(f"{base}_scales"), arrays["scales"])]
    if arrays["zero_points"] is not None:
        inputs.append(gs.Constant(namer(f"{base}_zero_points"), arrays["zero_points"]))
    if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
        bias = np.asarray(node.inputs[2].values).reshape(-1).astype(dtype)
        inputs += [gs.Variable.empty()] * (5 - len(inputs)) + [gs.Constant(namer(f"{base}_bias"), bias)]
    n = w.n
    new = gs.Node("MatMulNBits", node.name, attrs=nbits_attrs(w, n), inputs=inputs,
                  outputs=list(node.outputs), domain="com.microsoft")
    node.outputs.clear()
    node.inputs.clear()
    return new


def to_dequantize(target: Target, w: Blocked | MXBlocked, namer, arrays: dict | None = None) -> gs.Node:
    """A DequantizeLinear(axis, block_size) writing the weight's float value for the node to read."""
    node, base = target.node, target.weight.name
    dtype = target.dtype
    arrays = arrays or output_arrays(target, w, "qdq")
    inputs = [gs.Constant(namer(f"{base}_q"), arrays["x"]), gs.Constant(namer(f"{base}_scale"), arrays["scale"])]
    if arrays["zero_point"] is not None:
        inputs.append(gs.Constant(namer(f"{base}_zero_point"), arrays["zero_point"]))
    out = gs.Variable(namer(f"{base}_dequantized"), dtype=dtype, shape=list(target.weight.shape))
    dq = gs.Node("DequantizeLinear", namer(f"{base}_DequantizeLinear"), inputs=inputs, outputs=[out],
                 attrs={"axis": 1 if target.transposed else 0, "block_size": int(w.block_size)})
    node.inputs[1] = out
    return dq


def is_rewrite(node: gs.Node) -> bool:
    """The node is one ``to_matmulnbits`` or ``to_dequantize`` wrote (a DequantizeLinear with a
    block_size whose output a MatMul/Gemm reads as its weight)."""
    if node.op == "MatMulNBits":
        return True
    return node.op == "DequantizeLinear" and "block_size" in node.attrs and any(
        r.op in ("MatMul", "Gemm") and len(r.inputs) > 1 and r.inputs[1] is node.outputs[0]
        for r in node.outputs[0].outputs)


def drop_dead_nodes(graph: gs.Graph) -> None:
    """gs's cleanup (nodes that no graph output needs go), skipped when a scan by name shows every
    node has an output some node or the graph reads: then, the graph being acyclic, every node leads
    to an output. Bodies, functions or a produced graph input: always gs's cleanup."""
    read = {t.name for node in graph.nodes for t in node.inputs} | {t.name for t in graph.outputs}
    if (graph.functions or any(t.inputs for t in graph.inputs) or any(has_subgraph(n) for n in graph.nodes)
            or not all(any(t.name and t.name in read for t in n.outputs) for n in graph.nodes)):
        graph.cleanup(remove_unused_graph_inputs=False)

"""One-line summaries of a quantized model: how much of it runs in 8 bits, what stayed float."""
from __future__ import annotations

import onnx

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_EIGHT_BIT = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.UINT8})


def weighted_ops(proto: onnx.ModelProto) -> tuple[int, int]:
    """(weighted ops whose data input and constant weight both come from an 8-bit DequantizeLinear,
    weighted ops with a constant weight) in the main graph."""
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    consts = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}

    def constant(name: str) -> bool:
        node = producer.get(name)
        while node is not None and node.op_type in ("DequantizeLinear", "Transpose", "Reshape"):
            name = node.input[0]
            node = producer.get(name)
        return name in inits or name in consts

    def eight_bit(name: str) -> bool:
        node = producer.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return False
        source = node.input[0]
        if source in inits:
            return inits[source].data_type in _EIGHT_BIT
        q = producer.get(source)
        if q is not None and q.op_type == "QuantizeLinear" and len(q.input) > 2 and q.input[2] in inits:
            return inits[q.input[2]].data_type in _EIGHT_BIT
        return False

    total = quantized = 0
    for node in graph.node:
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2 or not constant(node.input[1]):
            continue
        total += 1
        quantized += eight_bit(node.input[0]) and eight_bit(node.input[1])
    return quantized, total


def summary_line(proto: onnx.ModelProto, floats: dict) -> str:
    """'8-bit: 94 % of weighted ops (47 of 50); kept float: 6 tensors (a, b, c, ...)'."""
    quantized, total = weighted_ops(proto)
    share = f"{100 * quantized / total:.0f} % of weighted ops ({quantized} of {total})" if total else "no weighted op"
    compute = sum(1 for n in proto.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear"))
    if not any(n.op_type == "DequantizeLinear" for n in proto.graph.node):
        inside = sum(len(g.node) for n in proto.graph.node for a in n.attribute if a.type == a.GRAPH for g in [a.g])
        where = f"; {inside} nodes sit inside If/Loop/Scan bodies, which stay float" if inside else ""
        return f"nothing quantized: 0 of {compute} compute nodes{where}"
    names = list(floats)
    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    kept = f"; kept float: {len(names)} tensors ({listed})" if names else "; nothing kept float"
    return f"8-bit: {share}{kept}"

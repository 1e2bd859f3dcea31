"""Which weighted ops onnxruntime actually runs as integer kernels: read off its optimized graph.

8-bit DequantizeLinear inputs do not make an op run in 8 bits: a Conv without a Q after it, or a
DQ -> MatMul -> Add fused into a Gemm with no Q after the Add, runs in float on the CPU provider.
"""
from __future__ import annotations

import os
import tempfile

import onnx

from ..calibration.sessions import ort_session
from ..ir.graphutil import proto_subgraphs

# onnxruntime's integer kernels for weighted ops -> the position of their weight input
INTEGER_KERNELS = {"QLinearConv": 3, "QLinearMatMul": 3, "QGemm": 3, "MatMulIntegerToFloat": 1,
                   "ConvInteger": 1, "MatMulInteger": 1, "DynamicQuantizeMatMul": 1}
MAX_NODES = 5000   # above this the optimized copy is not worth its time for a summary line
MAX_BYTES = 1 << 30   # ... nor above this many bytes of weights


def integer_kernels(proto: onnx.ModelProto) -> int | None:
    """How many integer kernels with a constant weight onnxruntime's CPU provider runs for
    ``proto`` at its default optimization level (If/Loop/Scan bodies included); None when the
    model is too big to check here, holds external data, or onnxruntime refuses it."""
    if not worth_counting(proto):
        return None
    try:
        data = proto.SerializeToString()
    except Exception:   # past 2 GB protobuf refuses
        return None
    if len(data) > MAX_BYTES:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        try:
            ort_session(data, optimized_to=path)
        except Exception:   # the summary stays DQ-based; loading the model is checked elsewhere
            return None
        return optimized_kernels(path)


def worth_counting(proto: onnx.ModelProto) -> bool:
    """Whether the optimized copy ``integer_kernels`` reads is worth its time for a summary line."""
    from ..ir.model import tensor_bytes

    return len(proto.graph.node) <= MAX_NODES and tensor_bytes(proto) <= MAX_BYTES


def optimized_kernels(path) -> int | None:
    """``integer_kernels`` read off the optimized model onnxruntime wrote to ``path`` (a session's
    ``optimized_model_filepath``); None when there is none."""
    try:
        optimized = onnx.load(str(path))
    except Exception:
        return None
    return _count(optimized.graph, set())


def _count(graph: onnx.GraphProto, outer: set[str]) -> int:
    consts = outer | {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output}
    count = 0
    for node in graph.node:
        at = INTEGER_KERNELS.get(node.op_type)
        count += at is not None and len(node.input) > at and node.input[at] in consts
        for _, sub in proto_subgraphs(node):
            count += _count(sub, consts)
    return count

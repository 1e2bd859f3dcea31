"""One-line summaries of a quantized model: how much of it runs in 8 bits, what stayed float."""
from __future__ import annotations

import re
from collections import Counter

import onnx

from ..ir.graphutil import proto_graphs
from ..quant.oprules import QDQ_OPS as _QDQ, WEIGHTED_OPS
from ..quant.qtypes import EIGHT_BIT, qtype

_EIGHT_BIT = frozenset(qtype(name).onnx_type for name in EIGHT_BIT)   # the same, as ONNX element types


def weighted_ops(proto: onnx.ModelProto) -> tuple[int, int]:
    """(weighted ops whose data input and constant weight both come from an 8-bit DequantizeLinear,
    weighted ops with a constant weight), in the main graph and its If/Loop/Scan bodies (a body
    reads outer tensors by name: names are looked up model-wide)."""
    graphs = list(proto_graphs(proto.graph))
    producer = {o: n for g in graphs for n in g.node for o in n.output}
    inits = {t.name: t for g in graphs for t in g.initializer}
    consts = {n.output[0]: n for g in graphs for n in g.node if n.op_type == "Constant"}

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
    for node in (n for g in graphs for n in g.node):
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2 or not constant(node.input[1]):
            continue
        total += 1
        quantized += eight_bit(node.input[0]) and eight_bit(node.input[1])
    return quantized, total


def reason_shape(reason: str) -> str:
    """A reason without the names it quotes: the reasons of one kind compare equal."""
    return re.sub(r"'[^']*'", "'*'", reason)


def _commonest_reason(floats: dict) -> str:
    """'; most often (3 of 5 float tensors): <reason>', the reasons compared by ``reason_shape``."""
    reasons = [row.get("reason", "") if isinstance(row, dict) else str(row) for row in floats.values()]
    if not reasons:
        return ""
    shapes = Counter(reason_shape(r) for r in reasons)
    shape, count = shapes.most_common(1)[0]
    example = next(r for r in reasons if reason_shape(r) == shape)
    return f"; most often ({count} of {len(reasons)} float tensors): {example}"


def kept_float(proto: onnx.ModelProto, floats: dict) -> dict:
    """The entries of ``floats`` (tensor -> why it stays float) that are computed at run time: graph
    inputs and outputs of nodes other than Constant, not weights, biases, shapes or other constants
    (nor tensors a later pass removed), in graph order."""
    graphs = list(proto_graphs(proto.graph))
    position = {}
    for g in graphs:
        for t in g.input:
            position.setdefault(t.name, len(position))
        for node in g.node:
            if node.op_type != "Constant":
                for out in node.output:
                    position.setdefault(out, len(position))
    constant = {t.name for g in graphs for t in g.initializer}
    return {n: floats[n] for n in sorted((n for n in floats if n in position and n not in constant), key=position.get)}


def summary_line(proto: onnx.ModelProto, floats: dict, kernels: int | None = None) -> str:
    """'8-bit: 94 % of weighted ops (47 of 50); kept float: 6 tensors (a, b, c, ...)' (compute
    tensors: ``kept_float``), or, when no
    tensor is quantized, 'nothing quantized: 0 of N compute nodes (...)' with the commonest reason.
    ``kernels``: how many of them onnxruntime runs as integer kernels (qpasses.evaluation.integer_kernels), said when
    it differs."""
    quantized, total = weighted_ops(proto)
    runs = f"; onnxruntime runs {kernels} as integer kernels" if kernels is not None and kernels != quantized else ""
    share = f"{100 * quantized / total:.0f} % of weighted ops ({quantized} of {total}{runs})" if total else "no weighted op"
    graphs = list(proto_graphs(proto.graph))
    if not any(n.op_type == "DequantizeLinear" for g in graphs for n in g.node):
        compute = [sum(1 for n in g.node if n.op_type not in _QDQ) for g in graphs]
        inside = sum(compute[1:])
        where = f" ({inside} of them inside If/Loop/Scan bodies)" if inside else ""
        return f"nothing quantized: 0 of {sum(compute)} compute nodes{where}{_commonest_reason(floats)}"
    names = list(kept_float(proto, floats))
    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    kept = f"; kept float: {len(names)} tensors ({listed})" if names else "; nothing kept float"
    return f"8-bit: {share}{kept}"


def run_summary(model, floats: dict, proto=None, optimized=None) -> tuple[str, int | None]:
    """(summary_line, integer kernels onnxruntime runs) of a model after a run (kernels: only once
    Q/DQ are inserted, else None). ``proto``: the model exported, if it is; ``optimized``: the path
    of the graph onnxruntime optimized from it, if a session wrote one."""
    from .integer_kernels import integer_kernels, optimized_kernels

    proto = proto if proto is not None else model.to_proto(metadata=False)
    kernels = None
    if "qdq-inserted" in model.facts:
        kernels = optimized_kernels(optimized) if optimized is not None else integer_kernels(proto)
    return summary_line(proto, floats, kernels), kernels


# Below this share of the weighted ops' int8 latency gain left 8-bit, the search's float ops cost
# the speed users quantize for: yolo_detector's 12 dB target left 0.29 and its output ran 1.05x the
# float model's latency, 2.07x onnxruntime's all-int8 model (tools/RESULTS.md).
SLOW_SHARE = 0.5


def slow_share(decision: dict) -> str:
    """A line on a search that left under SLOW_SHARE of the weighted ops' int8 latency gain 8-bit, else ''."""
    share = decision.get("int8_share")
    if share is None or share >= SLOW_SHARE:
        return ""
    return (f"search-precision kept {100 * (1 - share):.0f} % of the latency the weighted ops' int8 kernels save "
            f"in float for the {decision['metric']} target {decision['target']:g}: the model may run no faster "
            f"than the float one (--vs-onnxruntime measures it; --target {decision['metric']}=0 keeps every "
            f"weighted op 8-bit)")


def shortfall(decision: dict) -> str:
    """How a search that missed its target fell short, in a line (the CLI's warning)."""
    reached, counted, confidence = decision["reached"], decision.get("reached_counted"), decision.get("confidence", 0)
    counted = (f" (counted as {counted}: less {confidence:g} standard error)"
               if confidence and counted is not None and counted != reached else "")
    blocking = decision.get("blocking") or {}
    nexts = ("; next in the ranking, not promoted: " + ", ".join(f"{n} (local error {db:+.1f} dB)" for n, db in blocking.items())
             if blocking else "")
    confirmed = decision.get("confirmed", {})
    if confirmed.get("met") is False:
        read = (f"reached {reached} {decision['metric']} on its {decision['feeds']} check feeds but "
                f"{confirmed['score']} on all {confirmed['feeds']} calibration feeds it confirmed on")
    else:
        read = f"reached {reached} {decision['metric']}{counted}"
    asked = decision.get("requested") or []
    kept = (f"; kept as the config asks, never promoted: {', '.join(asked[:5])}"
            f"{f' and {len(asked) - 5} more' if len(asked) > 5 else ''}" if asked else "")
    return (f"{read}, short of the target {decision['target']:g}, with {len(decision['promoted'])} tensors "
            f"promoted{nexts}{kept}")

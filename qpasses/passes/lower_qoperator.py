"""lower-qoperator: rewrite QDQ node units into onnxruntime's QLinear* operators (QOperator format)."""
from __future__ import annotations

from collections import Counter
from typing import ClassVar

import onnx
import onnx_graphsurgeon as gs

from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import in_default_domain, remove_nodes
from ..ir.model import QModel
from ..qoperator.kernels import MS, Lowered, lower
from ..qoperator.units import Unit, find_unit
from ..quant.oprules import DQ_OP, QDQ_OPS
from ..quant.qdq import new_namer

NAME = "lower-qoperator"


def plan_lowering(model: QModel) -> tuple[list[tuple[Unit, Lowered]], dict[str, str]]:
    """(unit, replacement) for every node unit onnxruntime has a kernel for; why the others stay QDQ."""
    outputs = {t.name for t in model.graph.outputs}
    done, skipped = [], {}
    for node in model.graph.nodes:
        if node.op in QDQ_OPS or not in_default_domain(node):
            continue
        unit = find_unit(node, outputs)
        lowered = lower(unit, model.opset) if isinstance(unit, Unit) else unit
        if isinstance(lowered, Lowered):
            done.append((unit, lowered))
        elif isinstance(unit, Unit):   # a unit without a kernel; plain float nodes are not news
            skipped[node.name] = lowered
    return done, skipped


def apply_lowering(model: QModel, plan: list[tuple[Unit, Lowered]]) -> Counter:
    """Each unit's op becomes its QLinear node (in place: the graph stays sorted), writing the
    Q's output; the Q and the DQs nothing reads any more are removed."""
    graph, namer = model.graph, new_namer(model)
    replace, dead, counts = {}, [], Counter()
    for unit, low in plan:
        out = unit.q.outputs[0]
        unit.q.outputs.clear()
        new = gs.Node(low.op, namer(f"{unit.node.name or out.name}_quant"), attrs=low.attrs,
                      inputs=low.inputs, outputs=[out], domain=low.domain or None)
        replace[id(unit.node)] = new
        dead += [unit.node, unit.q]
        counts[low.op] += 1
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes]
    remove_nodes(graph, dead)
    outputs = {t.name for t in graph.outputs}
    unread = [n for n in graph.nodes if n.op == DQ_OP and not n.outputs[0].outputs and n.outputs[0].name not in outputs]
    counts["dq_removed"] = remove_nodes(graph, unread)
    if any(low.domain == MS for _, low in plan):
        _import(graph, MS, 1)
    return counts


def _import(graph: gs.Graph, domain: str, version: int) -> None:
    domains = list(graph.import_domains or [onnx.helper.make_opsetid("", graph.opset)])
    if not any(d.domain == domain for d in domains):
        domains.append(onnx.helper.make_opsetid(domain, version))
    graph.import_domains = domains


@register
class LowerQOperator(Pass):
    """Rewrite QDQ node units into QLinearConv, QLinearMatMul, QGemm, QLinearAdd, ... (QOperator).

    Reads: every node whose float inputs come from DequantizeLinear nodes (constant scales and zero
    points; activations per tensor, 8-bit) and whose output only a QuantizeLinear reads.
    Writes: Conv -> QLinearConv, MatMul (2-D constant weight) -> QLinearMatMul, Gemm (alpha = beta = 1)
    -> com.microsoft QGemm, each with its int32 bias when its scale is input scale * weight scale;
    Add/Mul -> QLinearAdd/QLinearMul, Concat -> QLinearConcat, AveragePool/GlobalAveragePool ->
    QLinearAveragePool/QLinearGlobalAveragePool, Sigmoid -> QLinearSigmoid, LeakyRelu ->
    QLinearLeakyRelu (com.microsoft); MaxPool/Reshape/Transpose/Flatten/Squeeze/Unsqueeze with
    equal input and output qparams run on the 8-bit tensor. The new node writes the Q's output;
    DQs left without readers go. Everything else stays QDQ (the reasons are in the findings).
    Invariants: outputs within 1 LSB of onnxruntime's fused execution of the QDQ model; graph
    inputs and outputs unchanged; a second run changes nothing.
    """

    name: ClassVar[str] = NAME
    example: ClassVar[str] = """\
<ir_version: 10, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float s = {0.02}, uint8 z = {128}, int8[2,2,1,1] w = {64, -32, 16, 127},
    float ws = {0.01}, int8 wz = {0}, float ys = {0.03}, uint8 yz = {120}> {
   xq = QuantizeLinear (x, s, z)
   xd = DequantizeLinear (xq, s, z)
   wd = DequantizeLinear (w, ws, wz)
   c = Conv (xd, wd)
   cq = QuantizeLinear (c, ys, yz)
   y = DequantizeLinear (cq, ys, yz)
}"""
    example_prelude: ClassVar[str] = ""

    def run(self, model: QModel, ctx) -> PassResult:
        plan, skipped = plan_lowering(model)
        if skipped:
            ctx.findings.update(NAME, {"kept_qdq": skipped})
        if not plan:
            return PassResult(model, False, {"kept_qdq": len(skipped)})
        counts = apply_lowering(model, plan)
        model.touch()
        return PassResult(model, True, {**counts, "kept_qdq": len(skipped)})

"""quantize-dynamic: int8 weights, activations quantized at run time (onnxruntime's IntegerOps form)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..core.facts import claim
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import in_default_domain, overridable_initializers
from ..ir.model import QModel, make_constant
from ..quant.qdq import new_namer, require_opset, to_onnx_storage
from ..quant.qparams import compute_qparams, quantize, value_range
from ..quant.qtypes import PER_AXIS_MIN_OPSET, qtype

NAME = "quantize-dynamic"
DECISIONS, FACT = "dynamic", "dynamic-quantized"
OP_TYPES = ("Conv", "MatMul", "Gemm")
MIN_OPSET = 11   # DynamicQuantizeLinear
FORMS = ("integer", "qdq")


@dataclass(frozen=True)
class Target:
    node: str
    op: str            # Conv | MatMul | Gemm
    data: str          # the float activation input
    weight: str
    axis: int | None   # per-channel axis of the weight as the quantized op reads it (None: per tensor)
    transpose: bool = False   # Gemm transB: the weight is transposed first (as onnxruntime does)


@dataclass
class Plan:
    targets: list[Target] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def plan_dynamic(model: QModel, config) -> Plan:
    """Which nodes to quantize, and why the others of the selected op types stay float."""
    chosen = config.op_types_to_quantize
    op_types = set(OP_TYPES) if chosen in (None, "all") else set(chosen) & set(OP_TYPES)
    feedable = overridable_initializers(model)
    plan = Plan()
    for node in model.graph.nodes:
        if node.op not in op_types or not in_default_domain(node):
            continue
        if node.name in config.nodes_to_exclude or (config.nodes_to_quantize is not None
                                                     and node.name not in config.nodes_to_quantize):
            continue
        why = _why_not(node, feedable)
        if why:
            plan.skipped[node.name] = why
            continue
        w = node.inputs[1]
        if node.op == "Conv":
            axis = None    # ConvInteger's output is scaled by one product (onnxruntime: per tensor)
        else:
            axis = w.values.ndim - 1 if config.per_channel else None
        plan.targets.append(Target(node.name, node.op, node.inputs[0].name, w.name, axis,
                                   node.op == "Gemm" and bool(node.attrs.get("transB", 0))))
    return plan


def _why_not(node: gs.Node, feedable: set[str]) -> str | None:
    if len(node.inputs) < 2 or not isinstance(node.inputs[1], gs.Constant) or node.inputs[1].name in feedable:
        return "weight is not a constant"
    x, w = node.inputs[0], node.inputs[1]
    if w.values.dtype != np.float32 or getattr(x, "dtype", np.float32) not in (np.float32, None):
        return "not float32"
    if isinstance(x, gs.Variable) and x.inputs and x.inputs[0].op in ("DequantizeLinear", "DynamicQuantizeLinear"):
        return "input already quantized"
    if node.op == "MatMul" and w.values.ndim < 2:
        return "1-D weight"
    if node.op == "Gemm":
        a = node.attrs
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0) or w.values.ndim != 2:
            return "Gemm with alpha/beta != 1 or transA (onnxruntime leaves it too)"
    return None


def _weight(values: np.ndarray, axis, config):
    """(quantized, scale, zero point) as onnxruntime's quantize_data: the value range per tensor or
    per channel, compute_qparams (bit for bit its compute_scale_zp), round half to even."""
    qt = qtype(config.weight_type)
    lo, hi = value_range(values, axis)
    scale, zp = compute_qparams(lo, hi, qt, symmetric=bool(config.weight_symmetric),
                                reduce_range=config.reduce_range)
    q = quantize(values, scale, zp, qt, axis)
    return to_onnx_storage(q, qt), scale.astype(np.float32), to_onnx_storage(zp.astype(qt.storage), qt)


class _Builder:
    """Emits the replacement nodes of each target, one DynamicQuantizeLinear per activation."""

    def __init__(self, model: QModel, config, form: str):
        self.model, self.config, self.form = model, config, form
        self.namer = new_namer(model)
        self.dynamic: dict[str, tuple] = {}
        self.nodes: list[gs.Node] = []

    def var(self, base: str, dtype=np.float32) -> gs.Variable:
        return gs.Variable(self.namer(base), dtype=dtype)

    def node(self, op: str, inputs, outputs, name: str, **attrs) -> gs.Node:
        n = gs.Node(op, self.namer(name), attrs=attrs, inputs=list(inputs), outputs=list(outputs))
        self.nodes.append(n)
        return n

    def activation(self, x: gs.Tensor):
        if x.name not in self.dynamic:
            outs = [self.var(f"{x.name}_quantized", np.uint8), self.var(f"{x.name}_scale"),
                    self.var(f"{x.name}_zero_point", np.uint8)]
            self.node("DynamicQuantizeLinear", [x], outs, f"{x.name}_QuantizeLinear")
            self.dynamic[x.name] = tuple(outs)
        return self.dynamic[x.name]

    def rewrite(self, node: gs.Node, t: Target) -> None:
        x, w = node.inputs[0], node.inputs[1]
        values = w.values.T if t.transpose else w.values
        base = f"{w.name}_Transposed" if t.transpose else w.name
        q, scale, zp = _weight(values, t.axis, self.config)
        wq, ws, wz = (make_constant(self.namer(f"{base}{s}"), v) for s, v in
                      (("_quantized", q), ("_scale", scale), ("_zero_point", zp)))
        xq, xs, xz = self.activation(x)
        out, bias = node.outputs[0], node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        prefix = node.name or out.name
        if self.form == "qdq":
            xd = self.dq(xq, xs, xz, None, f"{x.name}_dequantized")
            wd = self.dq(wq, ws, wz, t.axis, f"{base}_dequantized")
            inputs = [xd, wd] if t.op == "MatMul" else [xd, wd] + ([bias] if bias is not None else [])
            attrs = {k: v for k, v in node.attrs.items() if not (t.transpose and k == "transB")}
            self.node(t.op, inputs, [out], f"{prefix}_dequantized_op", **attrs)
            return
        op = "ConvInteger" if t.op == "Conv" else "MatMulInteger"
        attrs = dict(node.attrs) if t.op == "Conv" else {}
        acc = self.var(f"{out.name}_output_quantized", np.int32)
        self.node(op, [xq, wq, xz, wz], [acc], f"{prefix}_quant", **attrs)
        cast = self.var(f"{acc.name}_cast_output")
        self.node("Cast", [acc], [cast], f"{acc.name}_cast", to=1)
        both = self.var(f"{prefix}_scales_mul:0")
        self.node("Mul", [xs, ws], [both], f"{prefix}_scales_mul")
        scaled = out if bias is None else self.var(f"{out.name}_scaled")
        self.node("Mul", [cast, both], [scaled], f"{prefix}_output_scale_mul")
        if bias is None:
            return
        if t.op == "Conv":   # the bias on the channel axis: reshaped to [1, C, 1, ...]
            shape = np.ones(values.ndim, np.int64)
            shape[1] = -1
            reshaped = self.var(f"{out.name}_bias_reshape_output")
            self.node("Reshape", [bias, make_constant(self.namer(f"{out.name}_bias_reshape_shape"), shape)],
                      [reshaped], f"{out.name}_bias_reshape")
            bias = reshaped
        self.node("Add", [scaled, bias], [out], f"{prefix}_bias_add")

    def dq(self, q, scale, zp, axis, base) -> gs.Variable:
        out = self.var(base)
        self.node("DequantizeLinear", [q, scale, zp], [out], f"{base}_node", **({} if axis is None else {"axis": axis}))
        return out


def apply_plan(model: QModel, plan: Plan, config, form: str) -> Counter:
    """Replace each planned node in place (the graph stays sorted)."""
    by_name = {t.node: t for t in plan.targets}
    builder = _Builder(model, config, form)
    nodes, counts = [], Counter()
    for node in model.graph.nodes:
        t = by_name.get(node.name)
        if t is None:
            nodes.append(node)
            continue
        builder.nodes = []
        builder.rewrite(node, t)
        node.inputs.clear()
        node.outputs.clear()
        nodes.extend(builder.nodes)
        counts[f"{t.op.lower()}_quantized"] += 1
    model.graph.nodes = nodes
    counts["dynamic_quantize_nodes"] = len(builder.dynamic)
    return counts


@claim(FACT)
def nodes_rewritten(model: QModel) -> list[str]:
    """No node ``decisions["dynamic"]`` names is left as a Conv/MatMul/Gemm reading its float weight."""
    claimed = model.decisions.get(DECISIONS, {})
    return [f"node '{n.name}' ({n.op}) is reported quantized but still reads its float weight '{n.inputs[1].name}'"
            for n in model.graph.nodes if n.name in claimed and n.op in OP_TYPES and len(n.inputs) > 1
            and isinstance(n.inputs[1], gs.Constant)]


@register
class QuantizeDynamic(Pass):
    """Quantize Conv/MatMul/Gemm weights to int8 and their inputs at run time (dynamic quantization).

    Reads: Conv, MatMul and Gemm nodes with a constant float32 weight (the config's
    op_types_to_quantize, nodes_to_quantize, nodes_to_exclude select them); the config's
    weight_type, weight_symmetric, per_channel and reduce_range.
    Writes (``form=integer``, onnxruntime's quantize_dynamic form, which it fuses into
    DynamicQuantizeMatMul): DynamicQuantizeLinear (uint8) per input tensor, the weight quantized
    (MatMul: per channel on its last axis with ``per_channel``; Conv: per tensor), MatMulInteger
    or ConvInteger, Cast to float, Mul by input scale * weight scale, Add of the bias (Conv: reshaped
    to the channel axis). A Gemm (alpha = beta = 1, no transA) becomes MatMul + Add, its weight
    transposed when transB. ``form=qdq``: DynamicQuantizeLinear -> DequantizeLinear and a weight
    DequantizeLinear around the original op instead.
    Invariants: the same weights, scales and outputs as onnxruntime's quantize_dynamic with the same
    options; graph inputs and outputs keep their names; a second run changes nothing.
    ``model.decisions["dynamic"]``: what each rewritten node became (a claim checked on the graph).
    """

    name: ClassVar[str] = NAME
    establishes: ClassVar[frozenset] = frozenset({FACT})
    form: str = field(default="integer", metadata={"choices": FORMS})
    example: ClassVar[str] = """\
<ir_version: 10, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,2] y) <float[4,2] w = {0.5, -1, 0.25, 2, -0.75, 1, 1.5, -0.5}> {
   y = MatMul (x, w)
}"""
    example_prelude: ClassVar[str] = ""

    def run(self, model: QModel, ctx) -> PassResult:
        plan = plan_dynamic(model, ctx.config)
        stats = Counter({"skipped": len(plan.skipped)})
        if plan.skipped:
            ctx.findings.update(NAME, {"float": plan.skipped})
        if not plan.targets:
            return PassResult(model, False, dict(stats))
        per_axis = self.form == "qdq" and any(t.axis is not None for t in plan.targets)
        if require_opset(model, PER_AXIS_MIN_OPSET if per_axis else MIN_OPSET):
            plan = plan_dynamic(model, ctx.config)
        stats.update(apply_plan(model, plan, ctx.config, self.form))
        done = model.decisions.setdefault(DECISIONS, {})
        done.update((t.node, f"{NAME}: {t.op} weight '{t.weight}' {ctx.config.weight_type}"
                             f"{' per channel' if t.axis is not None else ''}, input quantized at run time ({self.form})")
                    for t in plan.targets)
        model.decisions[DECISIONS] = dict(sorted(done.items()))
        model.touch()
        return PassResult(model, True, dict(stats))

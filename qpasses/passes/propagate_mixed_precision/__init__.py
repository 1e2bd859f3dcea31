"""propagate-mixed-precision: turn the user's mixed_precision requests into a valid typed table."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from ...analysis.dtypes import float_tensors
from ...config.targets import apply_target_rules
from ...core.pipeline import Pass, PassResult
from ...core.registry import register
from ...ir.analyses import GRAPH, RANGES, WEIGHTS
from ...ir.annotations import Convert, QuantTable
from ...ir.dataflow import dataflow
from ...ir.model import QModel
from ...quant.oprules import holds, rule_for
from .plan import MixedPrecisionPlan, load_constraints, parse_requests, plan_mixed_precision

__all__ = ["PropagateMixedPrecision", "apply_plan", "float_tensors", "sharing_nodes"]


@register
class PropagateMixedPrecision(Pass):
    """Grow each mixed_precision request into a region of that type, with converts at its borders.

    Reads: config ``mixed_precision`` ({tensor: type | {quant_type, symmetric}}), the dataflow view,
    the quantization table, and ``targets/<config.target>.constraints.json`` when it exists.
    Writes: ``qtype``/``symmetric``/``convert`` of table entries (with ``why`` lines) and
    the findings' ``mixed_precision_plan``; plan entries for tensors the table does not quantize
    are skipped and listed under ``skipped``. Table ``shares`` links tie regions together (with
    ``extend_through_shape_ops``); a link left between two types is dropped.
    Invariants: every node's quantized activation inputs and outputs share one type once converts are
    applied; the plan equals onnxruntime's MixedPrecisionTensorQuantOverridesFixer output when
    ``extend_through_shape_ops=false`` and the target has no op constraints.
    """

    name = "propagate-mixed-precision"
    requires = frozenset({"types-annotated"})
    preserves = frozenset({"types-annotated", "calibrated"})
    unchanged = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table only
    example: ClassVar[str] = """
    g (float[1,8] x) => (float[1,8] y) {
      [sig] a = Sigmoid (x)
      [tanh] b = Tanh (a)
      [mul] c = Mul (a, b)
      [relu] y = Relu (c)
    }"""
    example_prelude: ClassVar[str] = "calibrate,annotate-types"
    example_config: ClassVar[dict] = {"mixed_precision": {"b": "uint16"}, "op_types_to_quantize": "all"}

    extend_through_shape_ops: bool = field(default=True, metadata={
        "help": "grow regions through shape-only ops (Reshape, Transpose, ...) so no convert sits "
                "between such an op and its input; false gives onnxruntime's plan exactly"})

    def run(self, model: QModel, ctx) -> PassResult:
        config = ctx.config
        if not config.mixed_precision:
            return PassResult(model, False, {})
        plan = plan_mixed_precision(
            dataflow(model), parse_requests(config.mixed_precision), float_tensors(model),
            config.activation_type, config.activation_symmetric,
            extend_through_shape_ops=self.extend_through_shape_ops, sharing_nodes=sharing_nodes(model),
            ties=[(name, tq.shares) for name, tq in model.quant.items() if tq.shares],
            constraints=load_constraints(config.target))
        changed, skipped = apply_plan(model.quant, plan, prefix=f"{self.name}: ")
        report = plan.to_dict()
        report["skipped"] = skipped
        ctx.findings.set("mixed_precision_plan", report)
        if changed:
            apply_target_rules(model, config)   # fixed qparams per type, ... after types changed
        stats = {"requests": len(config.mixed_precision), "changed": changed, "converts": plan.converts,
                 "skipped": len(skipped)}
        return PassResult(model, bool(changed), stats)


def apply_plan(table: QuantTable, plan: MixedPrecisionPlan, prefix: str = "") -> tuple[int, list[str]]:
    """Write the plan into the table; returns (entries changed, planned tensors the table lacks)."""
    changed, skipped = 0, []
    for tensor, (override,) in plan.overrides.items():
        tq = table.get(tensor)
        if tq is None:
            skipped.append(tensor)
            continue
        before = (tq.qtype, tq.symmetric, _convert_key(tq.convert))
        tq.qtype = override["quant_type"]
        tq.symmetric = override.get("symmetric", tq.symmetric)
        conv = override.get("convert")
        want = conv and (conv["quant_type"], conv.get("symmetric"), conv["recv_nodes"])
        if conv and _convert_key(tq.convert) != want:
            tq.convert = Convert(conv["quant_type"], list(conv["recv_nodes"]), conv.get("symmetric"))
        if (tq.qtype, tq.symmetric, _convert_key(tq.convert)) != before:
            changed += 1
            tq.why.extend(prefix + line for line in plan.why.get(tensor, ()) if prefix + line not in tq.why)
    for tensor, tq in table.items():  # a shares link across two types cannot hold: drop it
        target = table.get(tq.shares) if tq.shares else None
        if target is not None and target.qtype != tq.qtype:
            tq.because(f"{prefix}no longer shares the qparams of '{tq.shares}' "
                       f"({target.qtype}, this is {tq.qtype})")
            tq.shares = None
            changed += 1
    return changed, skipped


def _convert_key(conv: Convert | None):
    return None if conv is None else (conv.qtype, conv.symmetric, sorted(conv.recv_nodes))


def sharing_nodes(model: QModel) -> set[str]:
    """Names of the nodes whose outputs share input 0's qparams (oprules ``shares`` and its condition)."""
    out = set()
    for node in model.graph.nodes:
        rule = rule_for(node.op, model.opset)
        if rule is not None and rule.shares and holds(rule.share_if, node):
            out.add(node.name)
    return out

"""annotate-types: decide which tensors are quantized, to which type, and why."""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.dtypes import FLOAT_DTYPES, float_tensors
from ..analysis.requests import float_by_default, requests, selected_nodes
from ..analysis.scopes import all_nodes, scopes
from ..config.overrides import TensorOverride, raise_problems, validate
from ..config.quant_config import QuantConfig
from ..config.targets import apply_target_rules, chosen, load_target
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir import decisions
from ..ir.analyses import GRAPH, RANGES, WEIGHTS
from ..ir.annotations import Convert, TensorQuant
from ..ir.dataflow import dataflow
from ..ir.graphutil import unique_name
from ..ir.model import QModel
from ..quant.islands import unanchored
from ..quant.oprules import (ACTIVATION, BIAS, FLOAT, NOT_BY_DEFAULT, OpRule, QDQ_OPS, WEIGHT, float_output_bias, holds,
                             rule_for, weight_axis)
from ..quant.qtypes import qtype
from ..quant.upgrade import PER_TENSOR

_OWN_QPARAM_KEYS = {"quant_type", "scale", "zero_point", "symmetric", "rmin", "rmax"}


@register
class AnnotateTypes(Pass):
    """Create a table entry (role, type, symmetry, axis, sharing, why) for every tensor the selected ops quantize.

    Reads: the graph, the op rules (qpasses.quant.oprules), the config (types, symmetry, per_channel,
    reduce_range, op/node selection, quantize_bias, tensor_overrides) and its target preset.
    Writes: ``model.quant``, rebuilt from scratch (no scale/zero_point except fixed ones from overrides
    or the preset); a bias constant read by several quantized nodes is copied so each has its own.
    Nodes inside If/Loop/Scan bodies are selected as the main graph's are; a tensor name several
    bodies define stays float, with its reason (the key scheme: qpasses.ir.annotations).
    Invariants: only float tensors get entries; ``shares`` and ``derived_from`` name table entries;
    invalid overrides or node names raise one ConfigError before anything changes.
    """

    name = "annotate-types"
    establishes = frozenset({"types-annotated"})
    preserves = frozenset({"calibrated"})   # ranges are per tensor: a new table does not change them
    unchanged = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table (bias copies it makes: model.touch())
    example: ClassVar[str] = """
    g (float[1,3,8,8] x, float[1,4,8,8] s) => (float[1,4,8,8] y) <float[4,3,1,1] w = {1,2,3,4,5,6,7,8,9,10,11,12}, float[4] b = {1,2,3,4}> {
      c = Conv (x, w, b)
      r = Relu (c)
      a = Add (r, s)
      y = Transpose <perm = [0,1,3,2]> (a)
    }"""
    example_prelude: ClassVar[str] = ""

    def run(self, model: QModel, ctx) -> PassResult:
        config = ctx.config
        overrides = validate(model, config)
        copies = unshare_biases(model, config, overrides)
        if copies:
            model.touch()
        planner = TypePlanner(model, config, overrides)
        entries = planner.plan()
        before = dict(model.quant.items())     # compared by value: to_json is slow on big tables
        model.quant.clear()
        for name, tq in entries.items():
            model.quant[name] = tq
        target_changes = apply_target_rules(model, config)
        floats_before = model.decisions.pop(decisions.FLOAT, None)   # decided again from the new table
        decisions.leave_float(model, planner.left_float(), self.name)
        if planner.report:
            ctx.findings.set(self.name, planner.report)
        roles = [tq.role for _, tq in model.quant.items()]
        stats = {"activations": roles.count("activation"), "weights": roles.count("weight"),
                 "biases": roles.count("bias"), **planner.stats, "target_rules": target_changes,
                 "bias_copies": copies}
        return PassResult(model, bool(copies) or dict(model.quant.items()) != before
                          or model.decisions.get(decisions.FLOAT) != floats_before,
                          {k: v for k, v in stats.items() if v})


def _integer_pair(x: str, w: str) -> bool:
    """onnxruntime's integer MatMul kernels: 8-bit inputs, a signed input with a signed weight."""
    return x in ("uint8", "int8") and w in ("uint8", "int8") and (x == "uint8" or w == "int8")


def _is_float_constant(t) -> bool:
    return isinstance(t, gs.Constant) and np.dtype(t.values.dtype) in FLOAT_DTYPES


def unshare_biases(model: QModel, config: QuantConfig, overrides: dict) -> int:
    """Give every quantized bias its own constant (a bias's scale depends on its node); returns copies made."""
    if not config.quantize_bias:
        return 0
    flow = dataflow(model)
    remaining = {name: len(ids) for name, ids in flow.consumers.items()}
    for node, _ in scopes(model).body_nodes():   # constants read inside bodies: count their readers
        for t in node.inputs:
            if isinstance(t, gs.Constant) and t.name not in remaining:
                remaining[t.name] = len({id(n) for n in t.outputs})
    taken = set(model.tensors())
    copies = 0
    for node, rule in selected_nodes(model, config):
        for i, t in enumerate(node.inputs):
            if rule.slot(i).kind != BIAS or not _is_float_constant(t) or t.name in overrides:
                continue
            if remaining.get(t.name, 0) > 1:
                remaining[t.name] -= 1
                name = unique_name(f"{t.name}_{node.name}", taken)
                node.inputs[i] = gs.Constant(name, np.array(t.values, copy=True))
                copies += 1
    return copies


class TypePlanner:
    """Builds the table entries for one model and config (reads the graph, changes nothing)."""

    def __init__(self, model: QModel, config: QuantConfig, overrides: dict[str, TensorOverride]):
        self.model, self.config, self.overrides = model, config, overrides
        self.flow = dataflow(model)
        self.floats = float_tensors(model)
        self.scopes = scopes(model)
        self.qdq_outputs = {t.name for n in all_nodes(model) if n.op in QDQ_OPS for t in n.outputs}
        self.requests = requests(model, config)
        self.forced = set(self.requests.forced)
        self.nodes = selected_nodes(model, config, self.forced)
        self.entries: dict[str, TensorQuant] = {}
        self.kind: dict[str, str] = {}          # activation | act_const | weight | bias | shared
        self.biases: list[tuple[gs.Node, OpRule, int]] = []
        self.stats = {"shared": 0, "merged": 0, "overrides": 0}
        self.report: dict = {}
        self.float_biases: dict[str, str] = {}
        self.float_outputs: dict[str, str] = {}  # weight MatMul outputs left float (and islands): why
        self.quantized: set[str] = set()        # names of the nodes quantize_node ran on
        given, self.chosen = config.given, chosen(config)
        self.computed = set(model.decisions.get(decisions.COMPUTED, [])) if config.computed_weights == "activation" else set()
        defaults = load_target(config.target).defaults if config.target else {}
        self.source = {key: f"target {config.target} default" if key in defaults and key not in given
                       else "config default" for key in ("activation_type", "weight_type")}

    # -- driver -----------------------------------------------------------------------------
    def plan(self) -> dict[str, TensorQuant]:
        self.quantize_selected()
        missing = {n for t, nodes in self.requests.carriers.items() if t not in self.entries for n in nodes}
        if missing - self.forced:      # overridden tensors the selection leaves float: their carriers
            self.forced |= missing
            self.nodes = selected_nodes(self.model, self.config, self.forced)
            self.quantize_selected()
        self.apply_overrides()
        self.drop_islands()
        self.resolve_shares()
        self.float_matmul_outputs()
        self.derive_biases()
        self.merge_removable()
        self.stats["shared"] = sum(tq.shares is not None for tq in self.entries.values())
        return self.entries

    def quantize_selected(self) -> None:
        """Quantize the selected nodes not quantized yet: first those that start quantized regions (and
        the forced ones), then those quantized only inside regions (rule ``needs``)."""
        force = self.config.force_quantize_no_input_check
        for node, rule in self.nodes:
            if node.name not in self.quantized and (not rule.needs or node.name in self.forced
                                                    or (force and rule.removable_if is None)):
                self.quantize_node(node, rule)
        selected = {node.name: rule for node, rule in self.nodes}
        for node, rule in self.nodes:
            if node.name not in self.quantized and rule.needs and self.meets_needs(node, rule) \
                    and (force or self.table_read_quantized(node, rule, selected)):
                self.quantize_node(node, rule)

    def left_float(self) -> dict[str, str]:
        """Why each float tensor read or written by a node has no entry (after ``plan``)."""
        tensors, selected = self.model.tensors(), {node.name for node, _ in self.nodes}
        out = {}
        for name in sorted(self.floats - self.entries.keys() - self.qdq_outputs):
            t = tensors.get(name)
            nodes = list(t.inputs) + list(t.outputs) if t is not None else []
            if nodes:
                out[name] = self.float_biases.get(name) or self._float_reason(name, nodes, selected)
        out.update({name: why for name, why in self.float_outputs.items() if name in self.floats})
        return out

    def _float_reason(self, name: str, nodes: list, selected: set[str]) -> str:
        cfg, opset = self.config, self.model.opset
        if name in self.scopes.ambiguous:
            return self.scopes.ambiguous_reason(name)
        ruled = [n for n in nodes if rule_for(n.op, opset) is not None]
        if not ruled:
            ops = ", ".join(sorted({n.op for n in nodes}))
            return f"no node around it is quantized: qpasses has no quantization rule for {ops}"
        for n in ruled:
            if n.name in cfg.nodes_to_exclude:
                return f"{n.op} '{n.name}' is in the config's nodes_to_exclude"
        for n in ruled:
            if n.name not in selected and float_by_default(cfg, n):
                return (f"MatMul '{n.name}' multiplies two computed tensors (attention) and stays float by "
                        "default (op_types_to_quantize: all, or a list naming MatMul, quantizes it)")
            if n.name not in selected and cfg.op_types_to_quantize is None and n.op in NOT_BY_DEFAULT:
                return (f"{n.op} '{n.name}' stays float by default (an element-wise op: "
                        f"op_types_to_quantize: all, or a list naming {n.op}, quantizes it)")
            if n.name not in selected:
                return (f"{n.op} '{n.name}' is not selected by the config "
                        f"(op_types_to_quantize / nodes_to_quantize)")
        for n in ruled:
            rule = rule_for(n.op, opset)
            unmet = [n.inputs[i].name for i in rule.needs if i < len(n.inputs) and n.inputs[i].name not in self.entries]
            if unmet == [name] and rule.constant_meets_needs and isinstance(n.inputs[0], gs.Constant):
                return (f"{n.op} '{n.name}' looks up this constant table, and no quantized op reads what it "
                        "selects: an 8-bit table would only add rounding")
            if unmet == [name]:
                return f"{n.op} '{n.name}' is quantized only inside a quantized region, and nothing quantized feeds it"
            if unmet:
                return f"{n.op} '{n.name}' is quantized only when its input is, and '{unmet[0]}' stays float"
        n = ruled[0]
        return f"{n.op} '{n.name}' reads or writes it as a float value (the op rules: a shape, index or float slot)"

    def quantizable(self, t) -> bool:
        return (bool(t.name) and t.name in self.floats and t.name not in self.qdq_outputs
                and t.name not in self.scopes.ambiguous)

    def meets_needs(self, node: gs.Node, rule: OpRule) -> bool:
        for i in rule.needs:
            t = node.inputs[i] if i < len(node.inputs) else None
            if t is None or not t.name:
                return False
            if t.name not in self.entries and not (rule.constant_meets_needs and isinstance(t, gs.Constant)
                                                   and self.quantizable(t)):
                return False
        return True

    def table_read_quantized(self, node: gs.Node, rule: OpRule, selected: dict) -> bool:
        """A lookup in a constant table (an embedding Gather) joins a quantized region only when a
        quantized op reads what it selects, directly or through selected data-movement ops: otherwise
        quantizing the table only adds rounding (bert_encoder: the token table alone, 8-bit per tensor,
        cost as much as all its weight MatMuls, 29.8 dB). Not for a target preset: its quantizer
        quantizes every selected lookup (onnxruntime's its table and output)."""
        if self.config.target or not (rule.constant_meets_needs and isinstance(node.inputs[0], gs.Constant)
                and node.inputs[0].name not in self.entries):
            return True
        seen, stack = set(), [t for t in node.outputs]
        while stack:
            t = stack.pop()
            if t.name in self.entries:
                return True
            for reader in t.outputs:
                r = selected.get(reader.name)
                if r is None or reader.name in seen:
                    continue
                seen.add(reader.name)
                if not r.needs:
                    return True
                if r.shares:
                    stack.extend(reader.outputs)
        return False

    # -- entries ----------------------------------------------------------------------------
    def quantize_node(self, node: gs.Node, rule: OpRule) -> None:
        where = f"{node.op} '{node.name}'"
        if node.name in self.forced and node.name in self.requests.why:
            where += f", quantized as {self.requests.why[node.name]}"
        self.quantized.add(node.name)
        for i, t in enumerate(node.inputs):
            slot = rule.slot(i)
            if slot.kind == FLOAT or not self.quantizable(t):
                continue
            if slot.kind == BIAS:
                if isinstance(t, gs.Constant):
                    if t.name in self.overrides:      # onnxruntime: an overridden bias is a weight
                        self.add_weight(t, node, slot, f"bias of {where}, overridden, so quantized as a weight")
                    elif self.config.quantize_bias:
                        self.biases.append((node, rule, i))
            elif slot.kind == WEIGHT and isinstance(t, gs.Constant) and t.name in self.computed:
                self.add_activation(t.name, f"weight of {where} that the input model computes (a Constant node's "
                                            "value or ops on initializers): quantized as an activation, as "
                                            "onnxruntime's quantize_static does (computed_weights: activation)",
                                    constant=True)
            elif slot.kind == WEIGHT and isinstance(t, gs.Constant):
                self.add_weight(t, node, slot, f"weight of {where}")
            elif isinstance(t, gs.Constant):
                self.add_activation(t.name, f"constant read as an activation by {where}: typed like the "
                                            "op's other inputs so they match", constant=True)
            else:
                self.add_activation(t.name, f"input of {where}")
        if node.op in self.config.op_types_to_exclude_output_quantization:
            return
        share = rule.shares and holds(rule.share_if, node) and node.inputs and node.inputs[0].name in self.entries
        indices = range(len(node.outputs)) if rule.outputs is None else rule.outputs
        for i in indices:
            if i < len(node.outputs) and self.quantizable(node.outputs[i]):
                if share:
                    self.add_shared(node.outputs[i].name, node.inputs[0].name, node)
                else:
                    self.add_activation(node.outputs[i].name, f"output of {where}")

    def _new(self, name: str, kind: str, tq: TensorQuant) -> None:
        self.entries[name], self.kind[name] = tq, kind

    def add_activation(self, name: str, where: str, constant: bool = False) -> None:
        if name in self.entries:
            return
        cfg = self.config
        tq = TensorQuant(cfg.activation_type, "weight" if constant else "activation",
                         symmetric=cfg.activation_symmetric,
                         reduce_range=cfg.reduce_range if constant else False,
                         why=[f"{self.source['activation_type']} activation_type={cfg.activation_type} ({where})"])
        tq.restricted = self.restricted(tq)
        self._new(name, "act_const" if constant else "activation", tq)

    def add_weight(self, t: gs.Constant, node: gs.Node, slot, where: str) -> None:
        if t.name in self.entries:
            return
        cfg = self.config
        axis = None
        if cfg.per_channel:
            axis = weight_axis(slot, node.attrs, len(t.shape), cfg.per_channel_axes.get(node.op))
        blocked = self.model.decisions.get(PER_TENSOR) if axis is not None and self.model.opset < 13 else None
        axis = None if blocked else axis
        line = f"{self.source['weight_type']} weight_type={cfg.weight_type} ({where}"
        line += f", per-channel axis {axis})" if axis is not None else ")"
        tq = TensorQuant(cfg.weight_type, "weight", symmetric=self.weight_symmetric(cfg.weight_type, axis),
                         axis=axis, reduce_range=cfg.reduce_range, why=[line])
        if blocked:
            tq.because(f"per-tensor: per-channel weights need opset 13: {blocked}")
        if axis is not None and not (cfg.weight_symmetric if "weight_symmetric" in self.chosen
                                     else qtype(cfg.weight_type).signed):
            tq.because("symmetric: per-channel weights are symmetric (as onnxruntime)")
        elif axis is None and "weight_symmetric" not in self.chosen and not tq.symmetric:
            tq.because("asymmetric: a per-tensor weight grid spans [min, max] (weight_symmetric not set; "
                       "per-tensor int8 symmetric lost 2-11 dB on the trained benchmark models; select-by-snr "
                       "may still choose symmetric)")
        self._new(t.name, "weight", tq)

    def add_shared(self, name: str, source: str, node: gs.Node) -> None:
        src = self.entries[source]
        if src.converted_for(node.name):
            self.add_activation(name, f"output of {node.op} '{node.name}', not shared: its input is converted")
            return
        self._new(name, "shared", TensorQuant(
            src.qtype, "activation", shares=source,
            why=[f"same type as '{source}': {node.op} '{node.name}' only moves data, so its output "
                 "shares the input's qparams"]))

    def weight_symmetric(self, qt: str, axis: int | None) -> bool:
        """Per-channel: symmetric; per-tensor: the config's weight_symmetric, else asymmetric (one
        grid for the whole tensor: [min, max] wastes no levels when the values are not centred)."""
        if axis is not None:
            return True
        return "weight_symmetric" in self.chosen and bool(self.config.weight_symmetric)

    def restricted(self, tq: TensorQuant) -> bool:
        return (self.config.activation_restricted_asymmetric and tq.qtype == "uint8" and not tq.symmetric)

    # -- overrides ----------------------------------------------------------------------------
    def apply_overrides(self) -> None:
        unused = []
        for name in sorted(self.overrides):
            ov = self.overrides[name]
            if name not in self.entries:
                unused.append(name)
                continue
            if ov.keys:
                self.apply_override(name, ov)
                self.stats["overrides"] += 1
        if unused:   # the checks found a carrier for each: one that still has no entry cannot be honoured
            raise_problems([f"tensor_overrides['{name}']: cannot be quantized: "
                            f"{'a QuantizeLinear or DequantizeLinear already writes it' if name in self.qdq_outputs else 'no quantized node reads or writes it'}"
                            for name in unused])

    def apply_override(self, name: str, ov: TensorOverride) -> None:
        tq, kind = self.entries[name], self.kind[name]
        keys = set(ov.keys)
        if kind == "shared" and keys & _OWN_QPARAM_KEYS:
            tq.because(f"override: own qparams instead of sharing '{tq.shares}'")
            tq.shares, kind = None, "activation"
            self.kind[name] = kind
            tq.symmetric = self.config.activation_symmetric
        if ov.quant_type is not None and ov.quant_type != tq.qtype:
            tq.why.insert(0, f"override quant_type={ov.quant_type} (default was {tq.qtype})")
            tq.qtype = ov.quant_type
        if kind in ("weight", "act_const") and tq.axis != ov.axis:
            tq.because(f"override axis={ov.axis} (per-channel)" if ov.axis is not None
                       else "override is per-tensor (no 'axis')")
            tq.axis = ov.axis
        if kind == "weight":
            tq.symmetric = self.weight_symmetric(tq.qtype, tq.axis)
        elif kind in ("activation", "act_const"):
            tq.symmetric = self.config.activation_symmetric
        for key in ("symmetric", "reduce_range", "rmin", "rmax"):
            value = getattr(ov, key)
            if value is not None:
                setattr(tq, key, value)
                tq.because(f"override {key}={value}")
        if kind in ("activation", "act_const"):
            tq.restricted = self.restricted(tq)
        if ov.fixed:
            tq.scale, tq.zero_point, tq.fixed = list(ov.scale), list(ov.zero_point), True
            shown = ov.scale[0] if len(ov.scale) == 1 else f"{len(ov.scale)} channels"
            tq.because(f"override scale/zero_point: fixed ({shown})")
        if ov.convert is not None:
            cv = ov.convert
            recv = cv.recv_nodes if cv.recv_nodes is not None else sorted(self.flow.readers(name))
            symmetric = cv.symmetric if cv.symmetric is not None else self.config.activation_symmetric
            tq.convert = Convert(cv.quant_type, list(recv), symmetric,
                                 None if cv.scale is None else [cv.scale],
                                 None if cv.zero_point is None else [cv.zero_point])
            tq.because(f"override convert to {cv.quant_type} for {', '.join(recv) or 'no reader'}")

    # -- derived decisions --------------------------------------------------------------------
    def resolve_shares(self) -> None:
        """Shared outputs take their source's type (sources come first: graph order)."""
        for name, tq in self.entries.items():
            if tq.shares is None:
                continue
            src = self.entries[tq.shares]
            if src.axis is not None:
                tq.because(f"not shared: '{tq.shares}' is per-channel")
                tq.shares = None
                self.kind[name] = "activation"
                continue
            tq.qtype, tq.symmetric, tq.restricted = src.qtype, src.symmetric, src.restricted

    def drop_islands(self) -> None:
        """Quantized activations no computing op reads or writes, even through quantized data movement,
        stay float (qpasses.quant.islands): their Q -> DQ would only round. Only under the default op
        selection: an explicit op_types_to_quantize, a target preset (its provider wants every op
        quantized) or force_quantize_no_input_check keeps them."""
        cfg = self.config
        if cfg.op_types_to_quantize is not None or cfg.target or cfg.force_quantize_no_input_check:
            return
        nodes = [(rule.shares, [t.name for t in node.inputs], [t.name for t in node.outputs])
                 for node, rule in self.nodes if node.name in self.quantized]
        acts = {n for n, kind in self.kind.items() if kind in ("activation", "act_const", "shared")}
        keep = set(self.requests.tensors) | (set(self.entries) - acts)   # weights and biases feed integer kernels
        keep |= {t.name for node, _ in self.nodes if node.name in self.forced
                 for t in list(node.inputs) + list(node.outputs)}
        for name in sorted(unanchored(nodes, set(self.entries), keep) & acts):
            del self.entries[name], self.kind[name]
            self.float_outputs[name] = ("only data movement reads or writes it between float ops: no integer "
                                        "kernel would use an 8-bit grid here, it would only round")

    def float_matmul_outputs(self) -> None:
        """A weight MatMul or Gemm whose output only float readers read leaves it float (no Q -> DQ)
        when onnxruntime still runs it as an integer kernel with a float output (oprules.float_output_bias);
        a MatMul's bias Add constant becomes an int32 bias. That 8-bit rounding bought nothing
        (4 draws: bert_encoder +1.0 dB and 9 % faster, byte_classifier +20 dB; tools/README.md,
        "Weight MatMuls with float outputs"). Not for a target preset: its provider wants Q -> DQ there."""
        if self.config.target:
            return
        for node, _ in self.nodes:
            if node.op not in ("MatMul", "Gemm") or node.name not in self.quantized or len(node.inputs) < 2:
                continue
            x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
            tx, tw, ty = (self.entries.get(t.name) for t in (x, w, y))
            if (tx is None or tw is None or ty is None or self.kind.get(w.name) != "weight"
                    or self.kind.get(y.name) != "activation" or len(w.shape) != 2 or y.name in self.requests.tensors
                    or ty.fixed or ty.convert is not None or ty.rmin is not None or ty.rmax is not None
                    or not _integer_pair(tx.qtype, tw.qtype) or not y.outputs or self.scopes.in_body(y.name)
                    or any(t is y for t in self.model.graph.outputs)
                    or any(r.name in self.quantized or self.scopes.scope_of(r) != 0 for r in y.outputs)
                    or (node.op == "Gemm" and not self.gemm_bias_int32(node))):
                continue
            integer, bias = float_output_bias(node)
            if not integer or (bias is not None and not self.add_float_output_bias(node, bias)):
                continue
            del self.entries[y.name], self.kind[y.name]
            kernel = "MatMulIntegerToFloat" if node.op == "MatMul" and bias is None else "QGemm"
            added = " with its bias Add" if bias is not None else ""
            self.float_outputs[y.name] = (
                f"output of {node.op} '{node.name}', read only as a float value: onnxruntime runs the {node.op}"
                f"{added} as {kernel} (integer, float output), so an 8-bit Q -> DQ here would only add rounding")

    def gemm_bias_int32(self, node: gs.Node) -> bool:
        """A Gemm with a float output is QGemm only if it has no bias or an int32 one (beta 1)."""
        if len(node.inputs) < 3 or not node.inputs[2].name:
            return True
        bias = node.inputs[2]
        return (self.config.quantize_bias and _is_float_constant(bias) and bias.name not in self.overrides
                and float(node.attrs.get("beta", 1.0)) == 1.0
                and self.bias_problem(node, bias, node.inputs[0].name, node.inputs[1].name)[0] is None)

    def add_float_output_bias(self, node: gs.Node, bias) -> bool:
        """An int32 entry for the constant ``bias`` added to ``node``'s output (False: not possible)."""
        cfg, x, w = self.config, node.inputs[0].name, node.inputs[1].name
        if (not cfg.quantize_bias or not _is_float_constant(bias) or bias.name in self.entries
                or bias.name in self.overrides or bias.name in self.model.input_initializers
                or len({id(n) for n in bias.outputs}) != 1):
            return False
        problem, axis = self.bias_problem(node, bias, x, w)
        if problem:
            return False
        self._new(bias.name, "bias", TensorQuant(
            "int32", "bias", symmetric=True, axis=axis, derived_from=[x, w],
            why=[f"int32 bias of MatMul '{node.name}' (its output stays float and onnxruntime fuses the Add "
                 f"into a QGemm): scale = scale('{x}') * scale('{w}')"]))
        return True

    def derive_biases(self) -> None:
        left_float = []
        for node, rule, i in self.biases:
            bias = node.inputs[i]
            if bias.name in self.entries:
                continue
            inp = node.inputs[rule.first(ACTIVATION)].name
            w_index = rule.first(WEIGHT)
            weight = node.inputs[w_index].name if w_index is not None and w_index < len(node.inputs) else ""
            problem, axis = self.bias_problem(node, bias, inp, weight)
            if problem:
                left_float.append(f"{bias.name} ({node.op} '{node.name}'): {problem}")
                self.float_biases[bias.name] = f"bias of {node.op} '{node.name}': {problem}"
                continue
            self._new(bias.name, "bias", TensorQuant(
                "int32", "bias", symmetric=True, axis=axis, derived_from=[inp, weight],
                why=[f"int32 bias of {node.op} '{node.name}': scale = scale('{inp}') * scale('{weight}')"]))
        if left_float:
            self.report["float_biases"] = left_float

    def bias_problem(self, node, bias, inp: str, weight: str) -> tuple[str | None, int | None]:
        tin, tw = self.entries.get(inp), self.entries.get(weight)
        if tin is None or tw is None:
            return f"'{inp if tin is None else weight or '(none)'}' is not quantized", None
        if tin.axis is not None:
            return f"input '{inp}' is per-channel", None
        for name, tq in ((inp, tin), (weight, tw)):
            if tq.converted_for(node.name):
                return f"'{name}' is converted for this node", None
        if tw.axis is None:
            return None, None
        channels = self.model.tensors()[weight].shape[tw.axis]
        if len(bias.shape) != 1 or bias.shape[0] != channels:
            return (f"shape {list(bias.shape)} does not match the {channels} channels of '{weight}' "
                    f"(axis {tw.axis})"), None
        return None, 0

    def merge_removable(self) -> None:
        """Relu/Clip reading a quantized producer's output: the input shares the output's qparams."""
        for node, rule in self.nodes:
            if rule.removable_if is None or not node.inputs or not node.outputs:
                continue
            inp, out = node.inputs[0].name, node.outputs[0].name
            tin, tout = self.entries.get(inp), self.entries.get(out)
            if tin is None or tout is None or not self.can_merge(node, rule, inp, tin, tout):
                continue
            tin.shares, tin.qtype, tin.symmetric, tin.restricted = out, tout.qtype, False, tout.restricted
            exact = ("the output range starts at 0" if node.op == "Relu"
                     else "min <= 0 <= max, and quantizing to the output's range clips the same way")
            tin.because(f"{node.op} merged into the producer's range (exact: {exact}): {node.op} "
                        f"'{node.name}' is dropped and '{inp}' shares the qparams of '{out}'")
            self.stats["merged"] += 1

    def can_merge(self, node, rule, inp: str, tin: TensorQuant, tout: TensorQuant) -> bool:
        cfg = self.config
        writer, consumers = self._writer_and_consumers(inp)
        return (not cfg.keep_removable_activations
                and holds(rule.removable_if, node)
                and writer is not None                            # produced by a node (not an input)
                and consumers == 1                                # read only here, not a graph output
                and inp not in self.requests.tensors and self.kind.get(inp) == "activation"
                and tin.shares is None and not tin.fixed and tin.rmin is None and tin.rmax is None
                and tin.convert is None and tout.convert is None
                and tin.qtype == tout.qtype and not tin.symmetric and not tout.symmetric
                and not cfg.calibration.symmetric)

    def _writer_and_consumers(self, name: str) -> tuple[str | None, int]:
        """(the node writing ``name`` or None, how many nodes and graph outputs read it)."""
        t = self.model.tensors()[name]
        if not self.scopes.in_body(name):   # the dataflow view sees the main graph's readers only
            inner = len({id(n) for n in t.outputs if self.scopes.scope_of(n) != 0})
            return self.flow.writer(name), len(self.flow.consumers.get(name, [])) + inner
        outputs = self.scopes.scopes[self.scopes.home[name]].graph.outputs
        return (t.inputs[0].name if t.inputs else None,
                len({id(n) for n in t.outputs}) + sum(o is t for o in outputs))

"""What the config names explicitly, and the nodes that carry it: explicit beats default.

A tensor named in ``tensor_overrides`` or ``mixed_precision``, a node named in ``nodes_to_quantize``
and an op type named in ``op_types_to_quantize`` are requests, not hints: the default selection
(oprules.DEFAULT_OP_TYPES, attention MatMuls float, data movement only inside quantized regions,
islands dropped) gives way to them, and no accuracy pass takes them back out of the graph.

- A named tensor is *carried* by its producer when the producer's rule quantizes that output, and by
  each reader whose rule reads it in a quantized slot (not a shape, index or float slot), unless the
  node is in ``nodes_to_exclude``. A ``mixed_precision`` request quantizes its whole region, as
  onnxruntime's mixed-precision fixer plans it: the producer and every reader that carries it. A
  ``tensor_overrides`` tensor the selection leaves without an entry gets its carriers quantized: the
  producer when it carries it, else its carrying readers.
- A named node is quantized whatever its op type (it must have a rule), even outside a quantized
  region; ``nodes_to_quantize`` with an ``op_types_to_quantize`` list that leaves out its type, or with
  ``nodes_to_exclude`` naming it too, is a contradiction.
- What cannot be honoured (no rule, a float slot, a non-float tensor, every carrier excluded) is a
  problem naming the tensor, node or op type and why: :func:`requests` lists them and annotate-types
  raises them as one ConfigError before anything changes.

``selected_nodes`` is the node selection annotate-types quantizes (what preflight reports too).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from ..ir.model import QModel
from ..quant.oprules import FLOAT, FLOAT_WEIGHT_OPS, RULES, OpRule, multiplies_activations, rule_for, selected_op_types
from .dtypes import float_tensors
from .scopes import all_nodes, scopes


@dataclass
class Requests:
    tensors: dict[str, str] = field(default_factory=dict)           # named tensor -> the key naming it
    region: set[str] = field(default_factory=set)                   # nodes quantized for mixed_precision
    nodes: set[str] = field(default_factory=set)                    # nodes_to_quantize
    carriers: dict[str, list[str]] = field(default_factory=dict)    # tensor_overrides tensor -> nodes to force
    problems: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)               # forced node -> the request forcing it

    @property
    def forced(self) -> set[str]:
        """Nodes quantized whatever the default selection says (before the overrides' fallback)."""
        return self.region | self.nodes


def named_tensors(config) -> dict[str, str]:
    """Tensor -> the config key naming it (``mixed_precision`` wins: it grows a region)."""
    out = {str(t): "tensor_overrides" for t in (config.tensor_overrides or {})}
    out.update((str(t), "mixed_precision") for t in (config.mixed_precision or {}))
    return out


def _carries(node: gs.Node, tensor: gs.Tensor, opset: int, config, as_output: bool) -> str | None:
    """None when ``node``'s rule quantizes ``tensor`` (an output of it, or an input), else why not."""
    where = f"{node.op} '{node.name}'"
    rule = rule_for(node.op, opset)
    if rule is None:
        return f"{where} has no quantization rule" + (f" at opset {opset}" if node.op in RULES else "")
    if node.name in config.nodes_to_exclude:
        return f"{where} is in nodes_to_exclude"
    if as_output:
        index = next(i for i, t in enumerate(node.outputs) if t is tensor)
        if (rule.outputs is not None and index not in rule.outputs) \
                or node.op in config.op_types_to_exclude_output_quantization:
            return f"{where} writes it as an output its rule leaves float"
        return None
    if any(rule.slot(i).kind != FLOAT for i, t in enumerate(node.inputs) if t is tensor):
        return None
    return f"{where} reads it as a float value (a shape, index or bound)"


def requests(model: QModel, config) -> Requests:
    """The config's explicit requests on ``model``: forced nodes, override carriers and problems."""
    out = Requests(tensors=named_tensors(config))
    opset = model.opset
    nodes = {n.name: n for n in all_nodes(model)}
    _check_node_lists(out, nodes, opset, config)
    if not out.tensors:
        return out
    tensors, floats, sc = model.tensors(), float_tensors(model), scopes(model)
    for name, key in out.tensors.items():
        t = tensors.get(name)
        if t is None:
            continue   # unknown names: the overrides' and the planner's own checks say so
        where = f"{key}['{name}']"
        if name in sc.ambiguous:
            out.problems.append(f"{where}: cannot be quantized: {sc.ambiguous_reason(name)}")
            continue
        if name not in floats:
            out.problems.append(f"{where}: cannot be quantized: not a float tensor")
            continue
        producer = t.inputs[0] if isinstance(t, gs.Variable) and t.inputs else None
        writers = [producer] if producer is not None else []
        readers = list({id(n): n for n in t.outputs}.values())
        why = {n.name: _carries(n, t, opset, config, as_output=True) for n in writers}
        why.update((n.name, _carries(n, t, opset, config, as_output=False)) for n in readers)
        able = [n for n in writers + readers if why[n.name] is None]
        if not able:
            reasons = " and ".join(dict.fromkeys(why.values())) or "no node reads or writes it"
            out.problems.append(f"{where}: cannot be quantized: {reasons}")
        elif key == "mixed_precision":
            out.region.update(n.name for n in able)
            for n in able:
                out.why.setdefault(n.name, f"{where} asks for it")
        else:
            out.carriers[name] = [producer.name] if any(n is producer for n in able) else [n.name for n in able]
            for n in out.carriers[name]:
                out.why.setdefault(n, f"{where} asks for it")
    return out


def _check_node_lists(out: Requests, nodes: dict, opset: int, config) -> None:
    """Named nodes and op types that cannot be quantized as named."""
    listed = config.op_types_to_quantize if "op_types_to_quantize" in config.given else None
    for name in config.nodes_to_quantize or ():
        node = nodes.get(name)
        if node is None:
            continue   # overrides.node_list_problems names unknown nodes
        where = f"nodes_to_quantize: '{name}'"
        if rule_for(node.op, opset) is None:
            out.problems.append(f"{where} is a {node.op}, which qpasses has no quantization rule for"
                                + (f" at opset {opset}" if node.op in RULES else ""))
        elif name in config.nodes_to_exclude:
            out.problems.append(f"{where} is also in nodes_to_exclude")
        elif isinstance(listed, list) and node.op not in listed:
            out.problems.append(f"{where} is a {node.op}, which op_types_to_quantize does not list")
        else:
            out.nodes.add(name)
            out.why[name] = "nodes_to_quantize names it"
    if isinstance(listed, list):
        present: dict[str, str] = {}
        for node in nodes.values():
            present.setdefault(node.op, node.name)
        for op in listed:
            if op in present and rule_for(op, opset) is None:
                out.problems.append(f"op_types_to_quantize: qpasses has no quantization rule for {op}"
                                    + (f" at opset {opset}" if op in RULES else "")
                                    + f" (node '{present[op]}'): remove it from the list")


def pinned(model: QModel, config) -> set[str]:
    """Table tensors no accuracy pass may take out of the graph: the named tensors, what the named
    and region nodes read and write, and the constant weight of a Conv/ConvTranspose/Gemm reading
    one of those (a float weight there makes it read the float tensor: oprules.FLOAT_WEIGHT_OPS)."""
    req = requests(model, config)
    names = set(req.tensors)
    nodes = all_nodes(model)
    for node in nodes:
        if node.name in req.forced:
            names.update(t.name for t in list(node.inputs) + list(node.outputs) if t.name)
    for node in nodes:
        if node.op in FLOAT_WEIGHT_OPS and len(node.inputs) > 1 and node.inputs[0].name in names \
                and isinstance(node.inputs[1], gs.Constant):
            names.add(node.inputs[1].name)
    return {n for n in names if n in model.quant}


def selected_nodes(model: QModel, config, forced: set[str] | None = None
                   ) -> list[tuple[gs.Node, OpRule]]:
    """(node, rule) of the nodes quantized under the config's op/node selection, in graph order
    (the main graph's, then those of the If/Loop/Scan bodies, each body after its enclosing graph).
    ``forced`` (default: the config's explicit requests, qpasses.analysis.requests) are selected
    whatever their op type; with ``nodes_to_quantize`` nothing else is."""
    ops = selected_op_types(config.op_types_to_quantize)
    only = bool(config.nodes_to_quantize)
    excluded = set(config.nodes_to_exclude)
    forced = requests(model, config).forced if forced is None else forced
    out = []
    for node in all_nodes(model):
        rule = rule_for(node.op, model.opset)
        if rule is None or node.name in excluded:
            continue
        if node.name in forced or (not only and (not ops or node.op in ops) and not float_by_default(config, node)):
            out.append((node, rule))
    return out


def float_by_default(config, node: gs.Node) -> bool:
    """A node of a selected type the default selection still leaves float (oprules.multiplies_activations)."""
    return config.op_types_to_quantize is None and multiplies_activations(node)

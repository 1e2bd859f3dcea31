"""Raise a model's default opset without changing what it computes: onnx.version_converter, plus
qpasses' own rewrites where the converter is wrong (each measured in onnxruntime: tests/ir/test_opset_convert.py).

- Resize-10 and Upsample read output pixel ``i`` from input coordinate ``i / scale`` (onnxruntime's
  'asymmetric'), and nearest rounds down when enlarging and up when shrinking. The converter gives
  Resize-11's defaults (half_pixel, round_prefer_floor): linear results change. qpasses sets
  ``coordinate_transformation_mode='asymmetric'`` and ``nearest_mode`` floor or ceil from the constant
  scales (from opset 13 without the converter's unused roi). A nearest Resize whose scales are computed at run time, or that enlarges some axes while
  shrinking others, has no one opset-11 form: :func:`convert` raises a ModelError naming it.
- Hardmax before 13 flattens its input to 2-D at ``axis``; the converter leaves the node as it is
  (Hardmax-13 works along ``axis`` alone). qpasses first writes ``Reshape(Hardmax(Flatten(x, axis),
  axis=1), Shape(x))``, which means the same at every opset.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError, first_line
from .graphutil import DEFAULT_DOMAINS, default_opset, proto_graphs, unique_name

def _nodes(proto: onnx.ModelProto, ops: tuple[str, ...]):
    for graph in proto_graphs(proto.graph):
        for node in graph.node:
            if node.op_type in ops and node.domain in DEFAULT_DOMAINS:
                yield graph, node


def _constants(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by tensor name (every graph of the model)."""
    out = {}
    for graph in proto_graphs(proto.graph):
        out.update((t.name, numpy_helper.to_array(t)) for t in graph.initializer)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
                for attr in node.attribute:
                    if attr.name == "value":
                        out[node.output[0]] = numpy_helper.to_array(attr.t)
    return out


def _attr(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def resize_modes(proto: onnx.ModelProto) -> dict[str, dict | str]:
    """For each Resize-10 or Upsample (by its output's name): the opset-11 attributes that keep its
    results, or why there are none. Call on a model below opset 11."""
    constants = _constants(proto)
    out: dict[str, dict | str] = {}
    for _, node in _nodes(proto, ("Resize", "Upsample")):
        mode = _attr(node, "mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        attrs: dict = {"coordinate_transformation_mode": "asymmetric"}
        if mode == "nearest":
            scales = _attr(node, "scales")
            if scales is None and len(node.input) > 1:
                scales = constants.get(node.input[1])
            where = f"node '{node.name or node.output[0]}' ({node.op_type}, nearest)"
            if scales is None:
                out[node.output[0]] = (f"{where} has scales computed at run time: whether it rounds down "
                                       "(enlarging) or up (shrinking) is not known before it runs")
                continue
            scales = np.asarray(scales, np.float64).ravel()
            if (scales > 1).any() and (scales < 1).any():
                out[node.output[0]] = (f"{where} enlarges some axes and shrinks others: its rounding (down, "
                                       "resp. up) has no single opset-11 nearest_mode")
                continue
            attrs["nearest_mode"] = "ceil" if (scales < 1).any() else "floor"
        out[node.output[0]] = attrs
    return out


def _set_attrs(node: onnx.NodeProto, attrs: dict) -> None:
    keep = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend(keep + [helper.make_attribute(k, v) for k, v in attrs.items()])


def _flatten_hardmax(proto: onnx.ModelProto) -> None:
    """Hardmax(x, axis) -> Reshape(Hardmax(Flatten(x, axis), axis=1), Shape(x)), in place."""
    taken = {n for g in proto_graphs(proto.graph) for node in g.node for n in list(node.output) + [node.name]}
    taken |= {t.name for g in proto_graphs(proto.graph) for t in list(g.initializer) + list(g.input)}

    def fresh(base: str) -> str:
        return unique_name(base, taken)

    for graph in proto_graphs(proto.graph):
        nodes = []
        for node in graph.node:
            if node.op_type != "Hardmax" or node.domain not in DEFAULT_DOMAINS:
                nodes.append(node)
                continue
            x, y, axis = node.input[0], node.output[0], _attr(node, "axis", 1)
            flat, hard, shape = fresh(f"{y}_flat"), fresh(f"{y}_2d"), fresh(f"{y}_shape")
            base = node.name or y
            nodes += [helper.make_node("Flatten", [x], [flat], name=fresh(f"{base}_flatten"), axis=axis),
                      helper.make_node("Hardmax", [flat], [hard], name=node.name or fresh(base), axis=1),
                      helper.make_node("Shape", [x], [shape], name=fresh(f"{base}_shape")),
                      helper.make_node("Reshape", [hard, shape], [y], name=fresh(f"{base}_reshape"))]
        del graph.node[:]
        graph.node.extend(nodes)


def convert(proto: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """A copy of ``proto`` at default opset ``opset`` computing the same results (ModelError if impossible)."""
    old = default_opset(proto)
    resizes = resize_modes(proto) if old < 11 <= opset else {}
    blocked = [why for why in resizes.values() if isinstance(why, str)]
    if blocked:
        raise ModelError(blocked[0])
    if old < 13 <= opset and any(True for _ in _nodes(proto, ("Hardmax",))):
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        _flatten_hardmax(copy)
        proto = copy
    try:
        converted = onnx.version_converter.convert_version(proto, opset)
    except Exception as exc:  # the converter raises assorted C++ errors
        raise ModelError(f"onnx.version_converter failed ({first_line(exc)})") from None
    orphans: dict[int, tuple[onnx.GraphProto, set[str]]] = {}
    for graph, node in _nodes(converted, ("Resize",)):
        if node.output[0] in resizes:
            _set_attrs(node, resizes[node.output[0]])
            if opset >= 13 and len(node.input) > 1 and node.input[1]:   # the converter's roi: unused
                orphans.setdefault(id(graph), (graph, set()))[1].add(node.input[1])
                node.input[1] = ""
    for graph, names in orphans.values():
        names -= {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        kept = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in names)]
        del graph.node[:]
        graph.node.extend(kept)
    return converted

"""What calibration measures and how a model copy exposes it.

- ``activation_tensors``: the float activations of the top-level graph (what gets a range);
- ``derived_ranges``: tensors whose per-sample min/max follow from another measured tensor's
  (Relu, value-preserving shape ops), so they need no reduction nodes of their own;
- ``augment``: edits a model copy so its outputs expose tensors whole, or their ReduceMin and
  ReduceMax (scalar extra outputs: reduced inside onnxruntime, nothing large leaves the session).
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..analysis.dtypes import infer_types
from ..ir.graphutil import DEFAULT_DOMAINS, unique_name
from .tensor_types import FLOAT_TYPES

RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})
MIN_SUFFIX, MAX_SUFFIX = "__qpasses_min", "__qpasses_max"


def activation_tensors(proto: onnx.ModelProto, fallback_types: dict | None = None, *,
                       types: dict | None = None) -> list[tuple[str, int]]:
    """(name, elem_type) of every float activation of the top-level graph, in graph order: float
    graph inputs that are not initializers, then float node outputs that are not constants (a
    Constant node's output, or computed only from initializers and constants). Subgraphs are skipped.
    ``types``: element types already inferred (else shape inference runs here).
    """
    graph = proto.graph
    types = dict(types) if types is not None else infer_types(proto)[0]
    for name, elem in (fallback_types or {}).items():
        types.setdefault(name, elem)
    constant = {t.name for t in graph.initializer}
    out = [(vi.name, types.get(vi.name, 0)) for vi in graph.input if vi.name not in constant]
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type not in RANDOM_OPS and all(i in constant for i in inputs) and node.domain in DEFAULT_DOMAINS:
            constant.update(o for o in node.output if o)
            continue
        out.extend((o, types.get(o, 0)) for o in node.output if o)
    seen, result = set(), []
    for name, elem in out:
        if elem in FLOAT_TYPES and name not in seen:
            seen.add(name)
            result.append((name, elem))
    return result


# Ops whose output range follows exactly from their input's: min/max mode measures the input only.
_SAME_VALUES = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


def derived_ranges(proto: onnx.ModelProto, tracked: set[str]) -> dict[str, tuple[str, str]]:
    """{output: (source, op)} for tracked outputs of Relu and value-preserving shape ops whose data
    input is tracked too: their per-sample min/max follow exactly from the source's (Relu:
    max(., 0)), so they need no reduction nodes of their own. Sources come first (graph order)."""
    out: dict[str, tuple[str, str]] = {}
    for node in proto.graph.node:
        if node.domain not in DEFAULT_DOMAINS or not node.input or not node.output:
            continue
        kind = "Relu" if node.op_type == "Relu" else ("same" if node.op_type in _SAME_VALUES else None)
        src, dst = node.input[0], node.output[0]
        if kind and dst in tracked and src in tracked:
            out[dst] = (src, kind)
    return out


def augment(proto: onnx.ModelProto, tensors: list[tuple[str, int]], reduce: bool) -> list[str]:
    """Edit ``proto`` (a private copy) so its outputs expose the tensors (or their ReduceMin and
    ReduceMax when ``reduce``). Returns the names to fetch."""
    del proto.metadata_props[:]
    graph = proto.graph
    existing = {o.name for o in graph.output}
    taken = existing | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    fetch = []
    for name, elem in tensors:
        if reduce:
            lo, hi = unique_name(name + MIN_SUFFIX, taken), unique_name(name + MAX_SUFFIX, taken)
            graph.node.append(helper.make_node("ReduceMin", [name], [lo], name=lo, keepdims=0))
            graph.node.append(helper.make_node("ReduceMax", [name], [hi], name=hi, keepdims=0))
            graph.output.extend([helper.make_tensor_value_info(lo, elem, []),
                                 helper.make_tensor_value_info(hi, elem, [])])
            fetch += [lo, hi]
        else:
            if name not in existing:
                graph.output.append(helper.make_tensor_value_info(name, elem, None))
            fetch.append(name)
    return fetch

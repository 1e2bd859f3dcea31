"""fold-batchnorm: fold inference BatchNormalization into the Conv/ConvTranspose/Gemm before it."""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import (in_default_domain, overridable_initializers, remove_nodes, topological_order, unique_name,
                            used_names)
from ..ir.model import QModel, make_constant

PRODUCERS = ("Conv", "ConvTranspose", "Gemm")


@register
class FoldBatchnorm(Pass):
    """Fold inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm producing its input.

    Reads: BatchNormalization nodes (one output, not training mode) whose input comes from a
    Conv/ConvTranspose (any group count) or Gemm (any transB) that only this BN reads, with
    constant weights, bias and BN parameters (not initializers the user may feed).

    Writes: the producer gets new weight and bias initializers, under the old names when only
    it read them (so config names such as tensor_overrides still apply), else ``<weight>_bn``,
    ``<bias>_bn`` (``<node>_bias`` when it had no bias; Gemm gets beta=1), and writes the BN's
    output tensor; the BN node is removed. Original arrays are never modified (they may be shared).

    Invariants: tensor names read by other nodes and graph outputs are unchanged; outputs in
    onnxruntime are unchanged within float rounding; a second run folds nothing.
    """

    name: ClassVar[str] = "fold-batchnorm"
    example: ClassVar[str] = """\
<ir_version: 10, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] w = {1,0,0,1}, float[2] scale = {2,1},
    float[2] bias = {0,1}, float[2] mean = {0.5,0}, float[2] var = {1,4}> {
   c = Conv (x, w)
   y = BatchNormalization <epsilon = 0.0> (c, scale, bias, mean, var)
}"""
    example_prelude: ClassVar[str] = ""

    def run(self, model: QModel, ctx) -> PassResult:
        graph = model.graph
        feedable = overridable_initializers(model)
        outputs = {id(t) for t in graph.outputs}
        taken: set[str] | None = None
        folded, skipped = [], {}
        for bn in topological_order(graph):
            if bn.op != "BatchNormalization" or not in_default_domain(bn):
                continue
            producer = _producer(bn, outputs)
            if producer is None:
                continue
            reason = _why_not(bn, producer, feedable)
            if reason:
                skipped[bn.name] = reason
                continue
            if taken is None:
                taken = used_names(graph)
            _fold(bn, producer, taken, outputs)
            folded.append(bn)
        remove_nodes(graph, folded)
        if skipped:
            ctx.findings.update(self.name, {"not_folded": skipped})
        stats = {"folded": len(folded)}
        if skipped:
            stats["not_folded"] = len(skipped)
        return PassResult(model, bool(folded), stats)


def _producer(bn: gs.Node, graph_outputs: set[int]) -> gs.Node | None:
    """The Conv/ConvTranspose/Gemm whose output only this BN reads (and is no graph output)."""
    x = bn.inputs[0]
    if len(x.inputs) != 1 or id(x) in graph_outputs or len(x.outputs) != 1:
        return None
    node = x.inputs[0]
    if node.op not in PRODUCERS or not in_default_domain(node) or len(node.outputs) != 1:
        return None
    if sum(t is x for t in bn.inputs) != 1:
        return None
    return node


def _const(t: gs.Tensor, feedable: set[str]) -> bool:
    return isinstance(t, gs.Constant) and t.name not in feedable


def _why_not(bn: gs.Node, producer: gs.Node, feedable: set[str]) -> str | None:
    if bn.attrs.get("training_mode", 0) or sum(bool(t.name) and bool(t.outputs) for t in bn.outputs[1:]):
        return "training-mode BatchNormalization"
    if len(bn.inputs) != 5 or not all(_const(t, feedable) for t in bn.inputs[1:]):
        return "BatchNormalization parameters are not constants"
    if len(producer.inputs) < 2 or not _const(producer.inputs[1], feedable):
        return f"weight of {producer.op} '{producer.name}' is not a constant"
    bias = producer.inputs[2] if len(producer.inputs) > 2 and producer.inputs[2].name else None
    if bias is not None and not _const(bias, feedable):
        return f"bias of {producer.op} '{producer.name}' is not a constant"
    weight = producer.inputs[1].values
    if not np.issubdtype(weight.dtype, np.floating):
        return f"weight of {producer.op} '{producer.name}' is not floating point"
    channels = bn.inputs[1].values.size
    if any(t.values.size != channels for t in bn.inputs[2:]) or _out_channels(producer, weight) != channels:
        return f"channel count of {producer.op} '{producer.name}' does not match the BatchNormalization"
    return None


def _out_channels(node: gs.Node, weight: np.ndarray) -> int | None:
    if node.op == "Conv":
        return weight.shape[0] if weight.ndim >= 3 else None
    if node.op == "ConvTranspose":
        return weight.shape[1] * int(node.attrs.get("group", 1)) if weight.ndim >= 3 else None
    if weight.ndim != 2:
        return None
    return weight.shape[0] if node.attrs.get("transB", 0) else weight.shape[1]


def _fold(bn: gs.Node, node: gs.Node, taken: set[str], graph_outputs: set[int]) -> None:
    """Rewrite ``node`` to compute ``bn``'s output: y = x*s + t, s = gamma/sqrt(var+eps), t = beta-mean*s."""
    gamma, beta, mean, var = (np.asarray(t.values, np.float64).ravel() for t in bn.inputs[1:])
    s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
    t = beta - mean * s
    w_tensor = node.inputs[1]
    w = np.asarray(w_tensor.values, np.float64)
    bias_tensor = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    b = np.asarray(bias_tensor.values, np.float64) if bias_tensor is not None else None
    if node.op == "Conv":
        w = w * s.reshape((-1,) + (1,) * (w.ndim - 1))
        b = (0.0 if b is None else b) * s + t
    elif node.op == "ConvTranspose":  # weight (C_in, C_out/group, k...): output channel = g*C_out/g + j
        group = int(node.attrs.get("group", 1))
        shape = w.shape
        w = (w.reshape((group, shape[0] // group) + shape[1:])
             * s.reshape((group, 1, shape[1]) + (1,) * (w.ndim - 2))).reshape(shape)
        b = (0.0 if b is None else b) * s + t
    else:  # Gemm: y = alpha*A'B' + beta*C  ->  alpha*A'(B' s) + (beta*C*s + t), beta = 1
        w = w * (s[:, None] if node.attrs.get("transB", 0) else s[None, :])
        b = t if b is None else float(node.attrs.get("beta", 1.0)) * b * s + t
        node.attrs["beta"] = 1.0
    dtype = w_tensor.values.dtype
    new_w = make_constant(_new_name(w_tensor, node, taken, graph_outputs), w.astype(dtype))
    bias_name = (_new_name(bias_tensor, node, taken, graph_outputs) if bias_tensor is not None
                 else unique_name(f"{node.name or w_tensor.name}_bias", taken))
    new_b = make_constant(bias_name, np.asarray(b).astype(dtype))
    node.inputs[1] = new_w
    if len(node.inputs) > 2:
        node.inputs[2] = new_b
    else:
        node.inputs.append(new_b)
    y = bn.outputs[0]
    list.clear(bn.outputs)  # detach the BN from its output so the producer can take it
    list.__setitem__(y.inputs, slice(None), [n for n in y.inputs if n is not bn])
    node.outputs[0] = y


def _new_name(old: gs.Tensor, node: gs.Node, taken: set[str], graph_outputs: set[int]) -> str:
    """The old constant's name when ``node`` is its only reader, else a fresh ``<name>_bn``."""
    if len(old.outputs) == 1 and old.outputs[0] is node and id(old) not in graph_outputs \
            and sum(t is old for t in node.inputs) == 1:
        return old.name
    return unique_name(f"{old.name}_bn", taken)

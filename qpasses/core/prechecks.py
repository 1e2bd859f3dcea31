"""Checks of a quantizing pipeline that refuse, up front, what would give a broken model.

They run as instruments of the user's pipeline (``run_pipeline`` adds them when it quantizes):

- ``QuantizableValues``: before annotate-types, a ``per_channel_axes`` axis must lie within the rank
  of the weights of its op type (else the weight would silently fall back to per-tensor); after it,
  every constant the table quantizes (weights, biases, constant operands) must be finite and at most
  FLT_MAX / 2 in magnitude: a NaN/Inf weight has no grid, and a larger one's range (max - min)
  overflows float32, so its scale is Inf. Refused with exit 2 naming each tensor.
- ``LoadableTypes``: 4-bit activations that onnxruntime's optimizer fuses into kernels without 4-bit
  support (a Conv with 8-bit or float weights becomes QLinearConv; MaxPool runs on the quantized
  values, also when only its output is quantized, directly or past float Reshape/Transpose/...
  nodes: the quantization is moved before it; a Clip
  followed by a 4-bit QuantizeLinear meets a fusion that reads 8/16-bit zero points only):
  onnxruntime cannot load such a model at its default optimization level. Checked once the
  types are final (before the first pass after the last pass that may change them, or at the end),
  refused naming each node.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import ConfigError, ModelError
from ..quant.oprules import QDQ_PROPAGATED
from .instruments import Instrument

FLOAT32_LIMIT = float(np.finfo(np.float32).max) / 2   # a range [-x, x] must fit in float32
TYPE_PASSES = frozenset({"annotate-types", "propagate-mixed-precision", "search-precision"})
FOUR_BIT = ("int4", "uint4")
THROUGH_MOVERS = " through float Reshape/Transpose/... nodes"   # which onnxruntime moves Q/DQ past


class QuantizableValues(Instrument):
    def before(self, index, p, model, ctx):
        if ctx.depth == 0 and p.name == "annotate-types":
            axis_problems(model, ctx.config)

    def after(self, index, p, model, record, ctx):
        if ctx.depth == 0 and p.name == "annotate-types":
            value_problems(model)


def axis_problems(model, config) -> None:
    """per_channel_axes entries out of the rank of the weights they apply to (one ConfigError)."""
    if not config.per_channel or not config.per_channel_axes:
        return
    from ..quant.oprules import WEIGHT, rule_for

    problems: dict[str, list[str]] = {}
    for node in model.graph.nodes:
        axis = config.per_channel_axes.get(node.op)
        rule = rule_for(node.op, model.opset)
        if axis is None or rule is None:
            continue
        for i, t in enumerate(node.inputs):
            slot = rule.slot(i)
            rank = len(t.shape) if isinstance(t, gs.Constant) else 0
            if slot.kind == WEIGHT and rank >= slot.min_rank and not -rank <= axis < rank:
                problems.setdefault(f"axis {axis} for {node.op}", []).append(
                    f"'{t.name}' (rank {rank}, node '{node.name}')")
    if problems:
        raise ConfigError("per_channel_axes: " + "; ".join(
            f"{what} is outside the rank of weight {', '.join(dict.fromkeys(where))}" for what, where in problems.items()))


def value_problems(model) -> None:
    """Constants the table quantizes that hold NaN/Inf or values beyond FLT_MAX / 2 (one ModelError)."""
    tensors = model.tensors()
    problems = []
    for name in model.quant:
        t = tensors.get(name)
        values = getattr(t, "values", None) if isinstance(t, gs.Constant) else None
        if values is None or not isinstance(values, np.ndarray) or values.dtype.kind != "f" or not values.size:
            continue
        finite = np.isfinite(values)
        if not finite.all():
            kinds = [k for k, bad in (("NaN", np.isnan(values)), ("Inf", np.isinf(values))) if bad.any()]
            problems.append(f"tensor '{name}' holds {' and '.join(kinds)} ({int((~finite).sum())} of "
                            f"{values.size} values): it cannot be quantized")
            continue
        peak = float(np.max(np.abs(values.astype(np.float64))))
        if peak > FLOAT32_LIMIT:
            problems.append(f"tensor '{name}' holds {peak:.3g}: its quantization range overflows float32 "
                            f"(|values| must stay within {FLOAT32_LIMIT:.3g})")
    if problems:
        raise ModelError("; ".join(problems) + " (fix the weights, or keep the node float: nodes_to_exclude)")


class LoadableTypes(Instrument):
    """Refuses 4-bit activations onnxruntime cannot load (see the module docstring)."""

    def __init__(self, pass_names: list[str]):
        last = max((i for i, n in enumerate(pass_names) if n in TYPE_PASSES), default=-1)
        self.check_at = last + 1          # index of the pass before which the types are final
        self.count = len(pass_names)
        self.done = False

    def before(self, index, p, model, ctx):
        if ctx.depth == 0 and not self.done and index >= self.check_at:
            self._check(model)

    def after(self, index, p, model, record, ctx):
        if ctx.depth == 0 and not self.done and index == self.count - 1:
            self._check(model)

    def _check(self, model) -> None:
        self.done = True
        problems = unloadable_4bit(model)
        if problems:
            raise ConfigError("; ".join(problems) + ": onnxruntime cannot load such a model (give these "
                              "tensors 8 bits with mixed_precision or tensor_overrides, use 4-bit weights "
                              "for the Conv, or keep the node float: nodes_to_exclude)")


def _quantized_after(model, node) -> bool:
    """Whether ``node``'s output is quantized, or read only by Relu/Clip nodes whose outputs are
    (onnxruntime drops a Relu/Clip in front of a QuantizeLinear and fuses what is left)."""
    if not node.outputs:
        return False
    out = node.outputs[0]
    if out.name in model.quant:
        return True
    readers = list(out.outputs)
    return bool(readers) and all(r.op in ("Relu", "Clip") and r.outputs and r.outputs[0].name in model.quant
                                 for r in readers)


def _read_type(model, name: str, node) -> str | None:
    """The type ``node`` reads tensor ``name`` as (its convert's type if it is a converted reader)."""
    tq = model.quant.get(name)
    if tq is None:
        return None
    c = tq.convert
    if c is not None and (not c.recv_nodes or node.name in c.recv_nodes):
        return c.qtype
    return tq.qtype


def _moved_from(model, node) -> tuple[str, str | None]:
    """The tensor a MaxPool reads through a chain of float movers, and the type it is read as (None:
    not quantized)."""
    reader, t = node, node.inputs[0]
    while t.name not in model.quant and len(t.inputs) == 1 and t.inputs[0].op in QDQ_PROPAGATED and t.inputs[0].inputs:
        reader, t = t.inputs[0], t.inputs[0].inputs[0]
    return t.name, _read_type(model, t.name, reader)


def _moved_to(model, node, graph_outputs: set[str]) -> tuple[str, str | None]:
    """The tensor a MaxPool's output reaches through a chain of float movers, each its input's only
    reader, and the type it is written as (None: not quantized): onnxruntime moves its
    QuantizeLinear up past them to the MaxPool."""
    t = node.outputs[0]
    while (t.name not in model.quant and t.name not in graph_outputs and len(t.outputs) == 1
           and t.outputs[0].op in QDQ_PROPAGATED and t.outputs[0].outputs):
        t = t.outputs[0].outputs[0]
    tq = model.quant.get(t.name)
    return t.name, tq.qtype if tq is not None else None


def unloadable_4bit(model) -> list[str]:
    """Nodes reading a 4-bit activation that onnxruntime fuses into a kernel without 4-bit types
    (in the main graph and in its If/Loop/Scan bodies)."""
    from ..ir.model import body_graphs

    problems, graph_outputs = [], {t.name for t in model.graph.outputs}
    for node in [n for g in (model.graph, *body_graphs(model.graph)) for n in g.nodes]:
        if node.op not in ("Conv", "MaxPool", "Clip") or not node.inputs:
            continue
        out = node.outputs[0].name if node.outputs else ""
        written = model.quant[out].qtype if out in model.quant else None
        if node.op == "Clip":   # Clip -> QuantizeLinear fusion: it reads 8/16-bit zero points only
            if written in FOUR_BIT:
                problems.append(f"node '{node.name}' (Clip) writes '{out}' as {written} (onnxruntime's "
                                f"Clip/QuantizeLinear fusion has no {written} support)")
            continue
        x = node.inputs[0].name
        qt = _read_type(model, x, node)
        through = ""
        if node.op == "MaxPool" and qt is None:   # onnxruntime moves a DQ down to it through float movers
            x, qt = _moved_from(model, node)
            through = THROUGH_MOVERS + ", which onnxruntime moves its DequantizeLinear past"
        ahead = ""
        if node.op == "MaxPool" and written is None:   # onnxruntime moves a Q up to it through float movers
            out, written = _moved_to(model, node, graph_outputs)
            ahead = THROUGH_MOVERS
        if node.op == "MaxPool" and qt not in FOUR_BIT and written in FOUR_BIT:
            problems.append(f"node '{node.name}' (MaxPool) writes '{out}' as {written}{ahead} (onnxruntime moves "
                            f"the quantization before it; MaxPool has no {written} kernel)")
            continue
        if qt not in FOUR_BIT:
            continue
        if node.op == "Conv":
            if not _quantized_after(model, node):
                continue   # no Q after it: nothing to fuse
            wq = model.quant.get(node.inputs[1].name) if len(node.inputs) > 1 else None
            if wq is not None and wq.qtype not in ("int8", "uint8"):
                continue   # 4- or 16-bit weights: onnxruntime keeps the Q/DQ Conv
            kernel = "QLinearConv"
        else:
            kernel = "MaxPool"
        problems.append(f"node '{node.name}' ({node.op}) reads '{x}' as {qt}{through} ({kernel} has no {qt} kernel)")
    return problems

"""Which quantized activations hurt most, and how a group of them moves to a higher precision.

A *group* is an entry whose qparams come from its own range or values (``shares`` is None: an
activation or a weight) with every entry sharing them (directly or down a chain): they change
type together.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..calibration.subgraphs import thread_out
from ..evaluation.evaluate import session
from ..ir.decisions import leave_float
from ..ir.graphutil import subgraphs, weight_positions
from ..ir.model import QModel
from ..quant.oprules import OUTPUT_QUANTIZED_OPS, WEIGHTED_OPS
from ..quant.qparams import dequantize, quantize
from ..quant.qtypes import EIGHT_BIT
from . import op_costs
from .scopes import scopes
from .walks import EightBitShare


def promotion_groups(model: QModel, pinned: frozenset | set = frozenset()) -> dict[str, list[str]]:
    """Root -> the entries of its group (root first), for every quantized activation and weight; a
    group holding a ``pinned`` entry (what the config asked for: qpasses.analysis.requests) is not one."""
    table = model.quant
    root_of: dict[str, str] = {}

    def root(name: str) -> str:
        chain = []
        while name not in root_of and table[name].shares in table and name not in chain:
            chain.append(name)
            name = table[name].shares
        top = root_of.get(name, name)
        for member in chain + [name]:
            root_of[member] = top
        return top

    groups: dict[str, list[str]] = {}
    for name, tq in table.items():
        if tq.role != "bias" and not tq.fixed:
            groups.setdefault(root(name), []).append(name)
    return {r: sorted(members, key=lambda m: m != r) for r, members in sorted(groups.items())
            if table[r].role != "bias" and not table[r].fixed and not pinned.intersection(members)}


def promote(model: QModel, groups: list[list[str]], fallback: str, reasons: dict[str, str]) -> None:
    """Move each group to ``fallback``: "float" removes the entries (and the biases derived from
    them, which cannot be int32 without an integer input); a 16-bit type retypes them."""
    members = [name for group in groups for name in group]
    if fallback != "float":
        for group in groups:
            why = reasons.get(group[0])
            weight = model.quant[group[0]].role == "weight"
            for name in group:
                tq = model.quant[name]
                tq.qtype, tq.restricted = ("int16" if weight else fallback), False
                tq.symmetric = tq.symmetric or weight or fallback.startswith("int")
                if why:
                    tq.because(why if name == group[0] else f"{why.split(':')[0]}: shares '{group[0]}'")
        return
    gone = set(members)
    gone |= {name for name, tq in model.quant.items()
             if tq.derived_from and gone.intersection(tq.derived_from)}
    gone |= {name for name, tq in model.quant.items() if tq.shares in gone}
    float_reasons = {}
    for group in groups:
        why = reasons.get(group[0])
        for name in group:
            float_reasons[name] = why if name == group[0] else f"shares the qparams of '{group[0]}', kept float"
    for name in sorted(gone - set(members)):
        float_reasons[name] = "derived from a tensor kept float"
    for name in gone:
        del model.quant[name]
    if reasons:
        leave_float(model, {k: v.split(": ", 1)[-1] for k, v in float_reasons.items() if v}, "search-precision")


def local_errors(model: QModel, entries: dict, feeds: list[dict]) -> dict[str, float]:
    """Root -> 20*log10(RMS error of quantizing it alone / median |non-zero value|) in dB (higher:
    worse), for each root -> its computed TensorQuant in ``entries``: weights from their values, activations from one float
    run on ``feeds`` with them as extra outputs. A tensor whose few large values stretch the grid
    over its many small ones (an additive mask over scores, boxes beside probabilities) ranks high."""
    constants = model.tensors()
    wanted = [r for r, tq in entries.items()
              if tq is not None and tq.scale and not isinstance(constants.get(r), gs.Constant)]
    proto = model.to_proto(metadata=False)
    present = {o.name for o in proto.graph.output}
    inner = scopes(model)   # tensors of If/Loop/Scan bodies come out through calibration's threading
    top = [r for r in wanted if not inner.in_body(r)]
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(r) for r in top if r not in present)
    fetch = {r: outputs[0] for r, outputs in thread_out(proto, [r for r in wanted if inner.in_body(r)], False).items()}
    names = top + list(fetch.values())
    sess = session(proto) if names else None
    runs = [dict(zip(names, sess.run(names, feed))) for feed in feeds] if names else []
    out = {r: -400.0 for r in entries}
    for name, tq in entries.items():
        if tq is None or not tq.scale or (name in wanted and name not in top and name not in fetch):
            continue
        if name in wanted:
            x = np.concatenate([np.ravel(run[fetch.get(name, name)]) for run in runs]).astype(np.float32)
        else:
            x = np.asarray(constants[name].values, np.float32)
        out[name] = _relative_error_db(x, tq)
    return out


def _relative_error_db(x: np.ndarray, tq) -> float:
    per_axis = tq.axis is not None and len(tq.scale) > 1 and x.ndim > tq.axis
    axis = tq.axis if per_axis else None
    scale = np.asarray(tq.scale, np.float32) if per_axis else tq.scale[0]
    zero_point = np.asarray(tq.zero_point) if per_axis else tq.zero_point[0]
    q = dequantize(quantize(x, scale, zero_point, tq.qtype, axis), scale, zero_point, axis)
    err = float(np.sqrt(np.mean(np.square(q.astype(np.float64) - x))))
    magnitude = np.abs(x)
    nonzero = magnitude[magnitude != 0]
    typical = float(np.median(nonzero, overwrite_input=True)) if nonzero.size else 0.0   # a scratch copy
    return float(20 * np.log10(max(err, 1e-30) / typical)) if typical else -400.0


def eight_bit_share(model: QModel, groups: dict[str, list[str]], keep: float, table: dict | None = None) -> EightBitShare:
    """Which weighted ops (Conv/ConvTranspose/Gemm/MatMul with a constant weight, in bodies too)
    run as integer kernels, and which of them each group's promotion takes out of 8 bits, each
    counted by the latency it loses in float (``op_costs.costs`` on ``table``, pattern ->
    picoseconds per multiply-accumulate; None: the table shipped). An op runs so when its input and
    weight are 8-bit and, for a Conv or ConvTranspose, its output too (without a QuantizeLinear
    after it onnxruntime runs a Conv in float); a member among those takes it out."""
    owner = {member: root for root, members in groups.items() for member in members}
    reads: dict[str, set[int]] = {root: set() for root in groups}
    ops, eight = weighted_ops(model), set()
    for node in ops:
        names = (node.inputs[0].name, node.inputs[1].name)
        names += (node.outputs[0].name,) if node.op in OUTPUT_QUANTIZED_OPS else ()
        if all(n in model.quant and model.quant[n].qtype in EIGHT_BIT for n in names):
            eight.add(id(node))
            for name in names:
                if name in owner:
                    reads[owner[name]].add(id(node))
    cost = op_costs.costs(ops, macs(ops), op_costs.shipped() if table is None else table)
    constants = model.tensors()
    weights = {root: sum(constants[m].values.size for m in members if isinstance(constants.get(m), gs.Constant))
               for root, members in groups.items()}
    return EightBitShare(reads, sum(cost[i] for i in eight), sum(cost.values()), keep, cost,
                         {root: n for root, n in weights.items() if n})


def weighted_ops(model: QModel) -> list[gs.Node]:
    """The Conv/ConvTranspose/Gemm/MatMul nodes with a constant weight, in bodies too."""
    return [node for scope in scopes(model).scopes for node in scope.graph.nodes
            if node.op in WEIGHTED_OPS and len(node.inputs) >= 2 and isinstance(node.inputs[1], gs.Constant)]


def macs(nodes: list[gs.Node]) -> dict[int, float]:
    """id(node) -> its multiply-accumulates per run: its weight's elements times the positions each
    is applied at (a Conv's output positions, a ConvTranspose's input positions, a MatMul's or Gemm's
    output rows) where that shape is known; where it is not, the median positions of the ops whose
    shape is (1 if none is), so that unknown shapes neither vanish nor dominate."""
    positions = {id(node): weight_positions(node) for node in nodes}
    known = [p for p in positions.values() if p is not None]
    typical = float(np.median(known)) if known else 1.0
    return {id(node): float(node.inputs[1].values.size) * (positions[id(node)] or typical) for node in nodes}


def graph_order(model: QModel, groups: dict[str, list[str]], ranked: list[str]) -> list[str]:
    """Group roots in the order the graph first touches a member (a body's tensors at the node
    holding the body), ties in the order of ``ranked``: the inputs' end of the model first."""
    first: dict[str, int] = {}

    def visit(graph, at: int | None) -> None:
        for i, node in enumerate(graph.nodes):
            where = i if at is None else at
            for tensor in itertools.chain(node.inputs, node.outputs):
                first.setdefault(tensor.name, where)
            for body in subgraphs(node):
                visit(body, where)

    visit(model.graph, None)
    place = {name: i for i, name in enumerate(ranked)}
    at = {root: min(first.get(m, math.inf) for m in members) for root, members in groups.items()}
    return sorted(groups, key=lambda root: (at[root], place.get(root, math.inf), root))

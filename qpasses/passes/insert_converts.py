"""insert-converts: re-quantize a tensor to a second type for the readers that need it (DQ -> Q)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import onnx_graphsurgeon as gs

from ..core.facts import claim
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import ModelError, QpassesError
from ..ir.model import QModel, relaxed_gc
from ..quant.int8_movers import requantize_movers_stats
from ..quant.qdq import (Placement, QParams, dequantizer, float_dtype, keeps_float_input, make_dq, make_q, min_opset,
                         new_namer, qparam_constants, redirect, require_opset, scale_dtype)

NAME = "insert-converts"
FACT = "converts-inserted"


@dataclass(frozen=True)
class ConvertFacts:
    """Where a converted tensor's value reaches its readers today."""

    dequantized: str           # the DQ output its readers read (the tensor itself for graph outputs)
    readers: tuple[str, ...]   # nodes reading that DQ output
    is_output: bool            # that DQ output is a graph output
    dtype: str                 # its float type


@dataclass(frozen=True)
class ConvertStep:
    tensor: str
    qparams: QParams
    dtype: str
    recv: tuple[str, ...]      # readers to move onto the converted value
    clone: bool                # others still read the original DQ: feed the convert from a copy of it


def analyse(model: QModel) -> dict[str, ConvertFacts]:
    """For every table entry with a convert: the DQ output carrying its value (graph order). An
    entry without one whose readers all keep the float value (qdq.keeps_float_input: a Gemm whose
    weight stays float; cleanup removed the unread Q/DQ) has nothing to convert."""
    tensors = model.tensors()
    outputs = {t.name for t in model.graph.outputs}
    facts = {}
    for name, entry in model.quant.items():
        if entry.convert is None or name not in tensors:
            continue
        dq = dequantizer(tensors[name])
        if dq is None and all(keeps_float_input(n, tensors[name]) for n in tensors[name].outputs):
            continue
        if dq is None:
            raise ModelError(f"tensor '{name}' has a convert to {entry.convert.qtype} but no Q/DQ "
                             f"(run insert-qdq first)")
        out = dq.outputs[0]
        facts[name] = ConvertFacts(out.name, tuple(dict.fromkeys(n.name for n in out.outputs)),
                                   out.name in outputs, float_dtype(out).name)
    return facts


def plan_converts(table, facts: dict[str, ConvertFacts]) -> list[ConvertStep]:
    """The converts still to insert (readers already moved are done); pure."""
    steps = []
    for name, f in facts.items():
        conv = table[name].convert
        wanted = set(conv.recv_nodes) if conv.recv_nodes else set(f.readers)
        recv = tuple(r for r in f.readers if r in wanted)
        if not recv:
            continue
        if conv.scale is not None and len(conv.scale) > 1:
            raise ModelError(f"tensor '{name}': a convert must be per-tensor, got {len(conv.scale)} scales")
        qp = QParams.make(name, conv.qtype, conv.scale, conv.zero_point)
        clone = f.is_output or len(recv) < len(f.readers)
        steps.append(ConvertStep(name, qp, f.dtype, recv, clone))
    return steps


def apply_converts(model: QModel, steps: list[ConvertStep], facts: dict[str, ConvertFacts]) -> Counter:
    """Insert [DQ copy ->] Q -> DQ after each tensor's DQ and move the receiving readers onto it."""
    tensors = model.tensors()
    namer, place = new_namer(model), Placement(model.graph)
    counts: Counter = Counter()
    for step in steps:
        base = f"{step.tensor}_convert"
        dq_out = tensors[facts[step.tensor].dequantized]
        dq = dq_out.inputs[0]
        src, new = dq_out, []
        if step.clone:
            copy = gs.Node(dq.op, namer(f"{base}_in_dq"), attrs=dict(dq.attrs), inputs=list(dq.inputs),
                           outputs=[gs.Variable(namer(f"{base}_in"), dtype=dq_out.dtype, shape=dq_out.shape)])
            src = copy.outputs[0]
            new.append(copy)
            counts["dq_nodes"] += 1
        params = qparam_constants(namer, base, step.qparams, scale_dtype(step.dtype))
        q = make_q(namer, base, src, params, step.qparams)
        dq2 = make_dq(namer, base, q.outputs[0], params, step.qparams, scale_dtype(step.dtype),
                      shape=dq_out.shape)
        new += [q, dq2]
        redirect(dq_out, dq2.outputs[0], only=set(step.recv))
        place.after(dq, new)
        counts["converts"] += 1
        counts["q_nodes"] += 1
        counts["dq_nodes"] += 1
        counts["readers_moved"] += len(step.recv)
    place.apply()
    model.touch()
    return counts


@claim(FACT)
def converts_in_graph(model: QModel) -> list[str]:
    """No convert of the table is left to insert: its receiving readers read the converted value."""
    try:
        steps = plan_converts(model.quant, analyse(model))
    except QpassesError as exc:
        return [str(exc)]
    return [f"tensor '{s.tensor}' has a convert to {s.qparams.qtype.name} that node '{s.recv[0]}' does not read"
            for s in steps]


@register
class InsertConverts(Pass):
    """Re-quantize tensors with a `convert` to the second type for their receiving readers.

    Reads: the table's `convert` entries (qtype, recv_nodes, scale, zero_point); the Q/DQ that
    insert-qdq placed.
    Writes: the receiving nodes read DQ(original) -> Q(convert type) -> DQ(convert type); other
    readers and graph outputs keep the original DQ (a copy of it feeds the convert then). No
    recv_nodes means every reader converts. Raises the opset when the convert type needs it.
    Invariants: graph outputs keep their name and float type; a second run changes nothing.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qdq-inserted"})
    establishes: ClassVar[frozenset] = frozenset({FACT})
    preserves: ClassVar[frozenset] = frozenset({"calibrated", "qparams-computed", "qdq-inserted"})
    example: ClassVar[str] = """
g (float[1,4] x) => (float[1,4] y, float[1,4] z)
{
  a = Relu(x)
  y = Sigmoid(a)
  z = Tanh(a)
}
"""
    example_prelude: ClassVar[str] = "calibrate,annotate-types,propagate-mixed-precision,compute-qparams,insert-qdq"
    example_config: ClassVar[dict] = {"mixed_precision": {"y": "uint16"}, "op_types_to_quantize": "all"}

    def run(self, model: QModel, ctx) -> PassResult:
        stats = Counter(converts=0, q_nodes=0, dq_nodes=0, readers_moved=0)
        facts = analyse(model)
        steps = plan_converts(model.quant, facts)
        if not steps:
            return PassResult(model, False, dict(stats))
        opset = max(min_opset(s.qparams, scale_dtype(s.dtype)) for s in steps)
        raised = require_opset(model, opset)
        if raised:  # the graph may have been rewritten by the version converter
            facts = analyse(model)
            steps = plan_converts(model.quant, facts)
        with relaxed_gc():
            stats.update(apply_converts(model, steps, facts))
        stats.update(requantize_movers_stats(model))   # a convert may make a DQ int8 (qpasses/quant/int8_movers.py)
        stats["opset_raised_to"] = model.opset if raised else 0
        return PassResult(model, True, dict(stats))

"""insert-qdq: put QuantizeLinear/DequantizeLinear around every tensor of the quantization table."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.bias_fixes import clipping_biases
from ..analysis.dtypes import float_types
from ..analysis.scopes import scopes
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import ModelError, PreconditionError
from ..ir.decisions import leave_float
from ..ir.model import QModel, relaxed_gc
from ..quant.fp8 import guard_relus
from ..quant.int8_movers import requantize_movers_stats
from ..quant.qdq import (QParams, ScopedPlacement, dequantize_in_bodies, is_quantized, keeps_float_input, make_dq,
                         make_q, min_opset, new_namer, producer, qparam_constants, quantized_values, redirect,
                         require_opset, scale_dtype)
from . import CONV_RELU_EXAMPLE

NAME = "insert-qdq"
CLAMPS = ("Relu", "Clip")
_CLIP6_DEFAULT = 3.4028234663852886e38  # Clip-6 attribute defaults: float32 lowest/max


# -- analyse: what the plan needs to know about the graph ------------------------------------
@dataclass(frozen=True)
class TensorFacts:
    kind: str                  # "node" | "input" | "constant" | "feedable" (initializer that is also an input)
    readers: tuple[str, ...]   # names of the nodes reading it
    is_output: bool
    quantized: bool            # already has Q/DQ (produced by a DQ or read by a Q)
    dtype: str                 # float type name ("float32", "float16", ...); "" for non-float tensors
    rank: int | None = None
    weighted_readers: tuple[tuple[str, str], ...] = ()   # (reader, its float constant weight): see FLOAT_WEIGHT_OPS


@dataclass(frozen=True)
class Clamp:
    """A Relu/Clip node that may be merged into its input's Q/DQ."""

    node: str
    input: str
    output: str
    lo: float
    hi: float


@dataclass
class GraphFacts:
    tensors: dict[str, TensorFacts]   # table tensors present in the graph, in graph order
    clamps: list[Clamp] = field(default_factory=list)


def analyse(model: QModel) -> GraphFacts:
    """Facts about the table's tensors and the Relu/Clip nodes between two table tensors, in the
    main graph and in its If/Loop/Scan bodies (a body tensor's ``is_output``: an output of its body)."""
    table, tensors, sc = model.quant, model.tensors(), scopes(model)
    outputs = set()
    order: dict[str, None] = {}
    clamps = []
    for index, scope in enumerate(sc.scopes):
        graph = scope.graph
        outputs.update(t.name for t in graph.outputs if sc.home.get(t.name, 0) == index)
        for t in graph.inputs:
            order[t.name] = None
        for node in graph.nodes:
            for t in list(node.inputs) + list(node.outputs):
                if t.name in table:
                    order[t.name] = None
            if node.op in CLAMPS and node.inputs and node.outputs:
                clamp = _clamp(node, model.opset)
                if (clamp and clamp.input in table and clamp.output in table
                        and sc.home.get(clamp.input, 0) == sc.home.get(clamp.output, 0)):
                    clamps.append(clamp)
        for t in graph.outputs:
            order[t.name] = None
    names = [n for n in order if n in table and n in tensors and n not in sc.ambiguous]
    dtypes = float_types(model, names)
    facts = {}
    for name in names:
        t = tensors[name]
        if isinstance(t, gs.Constant):
            kind = "feedable" if name in model.input_initializers else "constant"
        else:
            kind = "node" if producer(t) is not None else "input"
        shape = getattr(t, "shape", None)
        facts[name] = TensorFacts(kind, tuple(dict.fromkeys(n.name for n in t.outputs)), name in outputs,
                                  is_quantized(t), dtypes[name], None if shape is None else len(shape),
                                  _weighted_readers(t))
    return GraphFacts(facts, clamps)


def _weighted_readers(t: gs.Tensor) -> tuple[tuple[str, str], ...]:
    """(reader, weight) for each FLOAT_WEIGHT_OPS node reading ``t`` as its data input with a float
    constant weight."""
    return tuple((node.name, node.inputs[1].name) for node in t.outputs if keeps_float_input(node, t))


def _clamp(node: gs.Node, opset: int) -> Clamp | None:
    if node.op == "Relu":
        return Clamp(node.name, node.inputs[0].name, node.outputs[0].name, 0.0, math.inf)
    if opset < 11:
        lo, hi = node.attrs.get("min", -_CLIP6_DEFAULT), node.attrs.get("max", _CLIP6_DEFAULT)
    else:
        bounds = []
        for i, default in ((1, -math.inf), (2, math.inf)):
            t = node.inputs[i] if len(node.inputs) > i else None
            if t is None or not t.name:
                bounds.append(default)
            elif (value := _scalar(t)) is not None:
                bounds.append(value)
            else:
                return None
        lo, hi = bounds
    return Clamp(node.name, node.inputs[0].name, node.outputs[0].name, float(lo), float(hi))


def _scalar(t: gs.Tensor) -> float | None:
    """The value of a one-element constant (an initializer or a Constant node's output)."""
    node = producer(t)
    if node is not None and node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
        t = node.attrs["value"]
    if isinstance(t, gs.Constant) and np.size(t.values) == 1:
        return float(np.ravel(t.values)[0])
    return None


# -- plan: a pure function of the table and the facts ----------------------------------------
@dataclass(frozen=True)
class Insert:
    tensor: str
    how: str                   # "pair": Q -> DQ after the producer; "stored": quantized initializer -> DQ
    role: str
    qparams: QParams
    dtype: str                 # float type of the tensor, hence of its scale and DQ output
    params_of: str             # tensor whose scale/zero-point initializers are used (itself unless shared)
    dq_writes: str | None = None   # existing tensor the DQ writes (graph output, merged Relu/Clip output)
    merged: str | None = None      # Relu/Clip node removed: the DQ writes its output
    float_readers: tuple[str, ...] = ()   # readers that keep the float value (FLOAT_WEIGHT_OPS)


@dataclass
class Plan:
    inserts: list[Insert]
    skipped: dict[str, str]    # tensor -> why it is left float
    opset: int                 # oldest default opset the new Q/DQ need


def plan_qdq(table, facts: GraphFacts) -> Plan:
    """Decide every Q/DQ to insert, keyed by tensor name; touches no graph."""
    merged: dict[str, Clamp] = {}
    merged_outputs: set[str] = set()
    for c in facts.clamps:  # in graph order; a chain of clamps merges only its first one
        if c.input not in merged_outputs and _mergeable(table, facts, c):
            merged[c.input] = c
            merged_outputs.add(c.output)
    inserts: dict[str, Insert] = {}
    skipped: dict[str, str] = {}
    for name, f in facts.tensors.items():
        entry = table[name]
        if name in merged_outputs or f.quantized or not (f.readers or (f.kind == "node" and f.is_output)):
            continue
        if not f.dtype:
            skipped[name] = "not a float tensor"
            continue
        stored = f.kind == "constant"
        if entry.role == "bias" and not stored:
            skipped[name] = "bias is not a constant (no int32 QuantizeLinear)"
            continue
        qp = QParams.of(name, entry, f.rank)
        if not stored and qp.qtype.name == "int32":
            raise ModelError(f"tensor '{name}': QuantizeLinear cannot produce int32 "
                             f"(only constant biases can be int32)")
        clamp = merged.get(name)
        dq_writes = clamp.output if clamp else name if f.kind == "node" and f.is_output else None
        inserts[name] = Insert(name, "stored" if stored else "pair", entry.role, qp, f.dtype, name,
                               dq_writes, clamp.node if clamp else None)
    for name, ins in inserts.items():   # a weight fed as an input too gets a pair: it is quantized
        keep = tuple(r for r, w in facts.tensors[name].weighted_readers
                     if w not in inserts and not (w in facts.tensors and facts.tensors[w].quantized))
        inserts[name] = replace(ins, params_of=_share_root(table, inserts, name),
                                float_readers=keep if ins.how == "pair" else ())
    opset = max((min_opset(i.qparams, scale_dtype(i.dtype)) for i in inserts.values()), default=0)
    return Plan(list(inserts.values()), skipped, opset)


def _share_root(table, inserts: dict[str, Insert], name: str) -> str:
    """Follow ``shares`` while the next tensor gets identical Q/DQ in this plan (reuse its initializers)."""
    root, seen = name, {name}
    while True:
        nxt = table[root].shares
        if nxt is None or nxt in seen or nxt not in inserts:
            return root
        a, b = inserts[root], inserts[nxt]
        if (a.qparams, a.dtype) != (b.qparams, b.dtype):
            return root
        root = nxt
        seen.add(root)


def _mergeable(table, facts: GraphFacts, c: Clamp) -> bool:
    """A Relu/Clip can go when its input shares its output's qparams and the Q saturates exactly as it clamps."""
    ex, ey = table.get(c.input), table.get(c.output)
    fx, fy = facts.tensors.get(c.input), facts.tensors.get(c.output)
    if ex is None or ey is None or fx is None or fy is None:
        return False
    if ex.shares != c.output or ex.convert or ey.convert or ex.role != "activation" or ey.role != "activation":
        return False
    if fx.kind not in ("node", "input") or fx.is_output or fx.readers != (c.node,) or fx.quantized or fy.quantized:
        return False
    if fx.dtype != fy.dtype or not fx.dtype:
        return False
    qx, qy = QParams.of(c.input, ex), QParams.of(c.output, ey)
    if qx != qy or qx.axis is not None:
        return False
    scale, zp, qt = qx.scale[0], qx.zero_point[0], qx.qtype
    return (qt.qmin - zp) * scale >= c.lo - scale / 2 and (qt.qmax - zp) * scale <= c.hi + scale / 2


# -- apply -----------------------------------------------------------------------------------
def apply_plan(model: QModel, plan: Plan) -> Counter:
    """Edit the graph as planned; returns the counts for the stats."""
    tensors, sc = model.tensors(), scopes(model)
    namer, places = new_namer(model), ScopedPlacement(sc)
    by_name = {i.tensor: i for i in plan.inserts}
    made: dict[str, tuple[gs.Constant, gs.Constant]] = {}
    counts: Counter = Counter()
    outputs = {o.name for o in model.graph.outputs}
    dequantized = []   # (DQ node, scope index): body readers of its output get a DQ of their own

    def params(name: str):
        if name not in made:
            ins = by_name[name]
            made[name] = qparam_constants(namer, name, ins.qparams, scale_dtype(ins.dtype))
        return made[name]

    for ins in plan.inserts:
        name, qp, t = ins.tensor, ins.qparams, tensors[ins.tensor]
        home = sc.home.get(name, 0)
        place = places[home]
        qdq_params = params(ins.params_of)
        dtype = scale_dtype(ins.dtype)
        if ins.how == "stored":
            stored = gs.Constant(namer(f"{name}_quantized"), quantized_values(t.values, qp))
            dq = make_dq(namer, name, stored, qdq_params, qp, t.values.dtype, shape=t.shape)
            place.before_first_reader(t, [dq])
            redirect(t, dq.outputs[0])
            dequantized.append((dq, home))
            if not t.outputs and name not in outputs:   # unreachable now: free the float values before
                t.values = np.zeros(0, dtype=t.values.dtype)  # the next weight is quantized (big models)
            counts["biases_quantized" if ins.role == "bias" else "weights_quantized"] += 1
            counts["dq_nodes"] += 1
            continue
        src, out, anchor = t, None, producer(t)
        if ins.merged:
            out = tensors[ins.dq_writes]
            clamp = producer(out)
            place.drop(clamp)
            clamp.inputs.clear()
            clamp.outputs.clear()
            counts["merged"] += 1
        elif ins.dq_writes == name:  # graph output: the producer writes <t>_float, the DQ writes t
            src = gs.Variable(namer(f"{name}_float"), dtype=t.dtype, shape=t.shape)
            anchor.outputs[[o is t for o in anchor.outputs].index(True)] = src
            out = t
        q = make_q(namer, name, src, qdq_params, qp)
        dq = make_dq(namer, name, q.outputs[0], qdq_params, qp, dtype, out=out, shape=t.shape)
        keep = [n for n in t.outputs if n.name in ins.float_readers]
        if out is None:
            redirect(t, dq.outputs[0], skip=[q] + keep)
        elif keep and src is not t:   # a graph output: those readers read the producer's float value
            for node in keep:
                node.inputs[0] = src
        counts["float_readers"] += len(keep)
        place.after(anchor, [q, dq])
        dequantized.append((dq, home))
        counts["q_nodes"] += 1
        counts["dq_nodes"] += 1
    counts["dq_nodes"] += dequantize_in_bodies(dequantized, places, namer)
    places.apply()
    model.touch()
    return counts


def refuse_clipping_biases(model: QModel, config) -> None:
    """A PreconditionError if fix-bias-scales would still raise a weight for an int32 bias that
    clips (the same rule: analysis.bias_fixes), e.g. compute-qparams or correct-bias ran after it."""
    clipping = clipping_biases(model, config)
    if clipping:
        more = f" (and {len(clipping) - 1} more)" if len(clipping) > 1 else ""
        raise PreconditionError(f"pass '{NAME}': int32 bias '{clipping[0]}'{more} clips at its scale: run "
                                f"fix-bias-scales after compute-qparams/correct-bias (or set fix_bias_scales: false)")


@register
class InsertQDQ(Pass):
    """Insert QuantizeLinear/DequantizeLinear for every tensor in the quantization table.

    Reads: the table (qtype, scale, zero_point, axis, shares, role); model.opset.
    Writes: activations get producer -> Q -> DQ -> readers (one pair per tensor; graph outputs keep
    their name, written by the DQ); weights and biases become `<w>_quantized` initializers -> DQ;
    all in the graph holding the tensor (main graph or If/Loop/Scan body), and each body reading a
    quantized outer tensor gets a DQ of its own (onnxruntime fuses DQs with readers of their graph);
    a Relu/Clip whose input shares its output's qparams is dropped when the Q clamps exactly as it
    does. A Conv/ConvTranspose/Gemm whose weight stays float reads its input's float value, not the
    DQ (onnxruntime would give that weight a per-tensor int8 grid). With FP8 activations, a Relu
    with one reader becomes Max(x, 0) (onnxruntime drops a Relu before an FP8 QuantizeLinear:
    qpasses/quant/fp8.py). Scales are stored in the tensor's float type (Q/DQ need it), zero points in the qtype.
    Raises the default opset when the types need it (per-axis 13, float16 scales 19,
    int16/uint16/int4/uint4 21, float8 19), rewriting ops with onnx.version_converter if a plain bump is unsafe.
    Invariants: graph inputs/outputs keep names and float types; tensors that already have Q/DQ are
    left alone, so a second run changes nothing. With config ``fix_bias_scales`` (the default) it
    refuses an int32 bias that fix-bias-scales would still fix (a PreconditionError), so
    recomputing qparams or correcting biases after fix-bias-scales cannot silently undo it.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    establishes: ClassVar[frozenset] = frozenset({"qdq-inserted"})
    preserves: ClassVar[frozenset] = frozenset({"calibrated", "qparams-computed"})
    example: ClassVar[str] = CONV_RELU_EXAMPLE
    example_prelude: ClassVar[str] = "calibrate,annotate-types,compute-qparams"

    def run(self, model: QModel, ctx) -> PassResult:
        if ctx.config.fix_bias_scales:
            refuse_clipping_biases(model, ctx.config)
        plan = plan_qdq(model.quant, analyse(model))
        stats = Counter(q_nodes=0, dq_nodes=0, weights_quantized=0, biases_quantized=0, merged=0)
        if plan.skipped:
            leave_float(model, plan.skipped, NAME)
        if not plan.inserts:
            return PassResult(model, False, dict(stats))
        raised = require_opset(model, plan.opset)
        if raised:  # the graph may have been rewritten by the version converter
            plan = plan_qdq(model.quant, analyse(model))
        with relaxed_gc():
            stats.update(apply_plan(model, plan))
        if any(i.how == "pair" and i.qparams.qtype.is_float for i in plan.inserts):
            stats["relus_as_max"] = guard_relus(model)   # onnxruntime would drop them (qpasses/quant/fp8.py)
        stats.update(requantize_movers_stats(model))   # else onnxruntime cannot load it (qpasses/quant/int8_movers.py)
        stats["opset_raised_to"] = model.opset if raised else 0
        return PassResult(model, True, dict(stats))

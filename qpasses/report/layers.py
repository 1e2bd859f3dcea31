"""Per-layer numbers of a QDQ model against its float model on a few feeds.

For every quantized activation of the main graph (the table saved in the QDQ model):
- *local SNR*: the float tensor against itself quantized with its own qparams (its grid alone);
- *accumulated SNR*: the float tensor against the DequantizeLinear output that the QDQ model's
  readers see (onnxruntime with graph optimizations disabled: the simulation), i.e. the error of
  every quantized tensor up to here;
- *sensitivity*: analysis.sensitivity.local_errors, the RMS error of its grid relative to its
  typical value (dB; what search-precision ranks tensors by);
- a histogram of its float values with the clip range of its grid and the calibrated range.
The float model's tensor names are the QDQ model's (folding keeps the names of what it keeps).
Sums run feed by feed: memory holds one feed's tensors, not all of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..analysis.sensitivity import local_errors
from ..evaluation.evaluate import session, snr_from_sums
from ..ir.model import QModel
from ..quant.oprules import QDQ_OPS
from ..quant.qparams import dequantize, quantize
from ..quant.qtypes import qtype

BINS = 64


@dataclass
class Layer:
    tensor: str
    producer: str           # op type writing it ("input" for a graph input)
    order: int              # the producer's index in the QDQ graph (topological)
    qtype: str
    scale: list
    zero_point: list
    why: list
    clip: tuple[float, float]                    # the grid's representable range
    calibrated: tuple[float, float] | None       # the range calibration settled on
    local_snr: float = math.nan
    accumulated_snr: float = math.nan
    sensitivity: float = math.nan
    counts: list = field(default_factory=list)   # histogram of the float values
    edges: list = field(default_factory=list)
    upstream: list = field(default_factory=list)  # the quantized tensors its producer reads (through float ops)


def _clip(tq) -> tuple[float, float]:
    """The float range a per-tensor grid represents (per-channel: the widest channel's)."""
    lo, hi = qtype(tq.qtype).limits(tq.symmetric, tq.reduce_range)
    scales, zps = np.asarray(tq.scale, np.float64), np.asarray(tq.zero_point, np.float64)
    return float(np.min((lo - zps) * scales)), float(np.max((hi - zps) * scales))


def _calibrated(qdq: QModel, name: str) -> tuple[float, float] | None:
    """The calibrated range of ``name``, or of the tensor whose grid it shares."""
    seen = set()
    while name not in qdq.ranges and name in qdq.quant and qdq.quant[name].shares and name not in seen:
        seen.add(name)
        name = qdq.quant[name].shares
    return tuple(qdq.ranges[name]) if name in qdq.ranges else None


def _fake_quant(x: np.ndarray, tq) -> np.ndarray:
    return dequantize(quantize(x, tq.scale[0], tq.zero_point[0], tq.qtype), tq.scale[0], tq.zero_point[0])


def quantized_names(proto: onnx.ModelProto, names) -> dict[str, str]:
    """Tensor -> the output of its QuantizeLinear (the integer tensor) when a DequantizeLinear reads
    it, in the QDQ graph (main graph)."""
    q_of = {n.input[0]: n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    read = {n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return {name: q_of[name] for name in names if name in q_of and q_of[name] in read}


def simulated_names(proto: onnx.ModelProto, names) -> dict[str, str]:
    """Tensor -> the output of the DequantizeLinear its readers see in the QDQ graph (main graph)."""
    dq_of = {n.input[0]: n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return {name: dq_of[q] for name, q in quantized_names(proto, names).items()}


def quantized_activations(fproto: onnx.ModelProto, qdq: QModel, qproto: onnx.ModelProto) -> dict[str, tuple]:
    """Every quantized activation of ``qdq``'s main graph (``qproto``) that the float model
    ``fproto`` also computes and a Q -> DQ pair realises: name -> (TensorQuant, producer op type
    ("input" for a graph input), the producer's index in the QDQ graph)."""
    made = {o: (i, n.op_type) for i, n in enumerate(qproto.graph.node) for o in n.output}
    made.update({i.name: (-1, "input") for i in qproto.graph.input})
    in_float = {o for n in fproto.graph.node for o in n.output} | {i.name for i in fproto.graph.input}
    entries = {name: tq for name, tq in qdq.quant.items()
               if tq.role == "activation" and tq.scale and name in made and name in in_float}
    return {name: (entries[name], made[name][1], made[name][0]) for name in quantized_names(qproto, entries)}


def upstream(proto, q_of: dict[str, str]) -> dict[str, list[str]]:
    """Tensor -> the quantized tensors (keys of ``q_of``) whose DequantizeLinear outputs reach
    its producer through float ops only (no other Q/DQ on the way); the graph is sorted."""
    tensor_of = {q: t for t, q in q_of.items()}
    reach: dict[str, set] = {}
    for node in proto.graph.node:
        if node.op_type == "QuantizeLinear":
            continue
        if node.op_type == "DequantizeLinear":
            reach[node.output[0]] = {tensor_of[node.input[0]]} if node.input[0] in tensor_of else set()
            continue
        found = set().union(*(reach.get(i, ()) for i in node.input))
        for out in node.output:
            reach[out] = found
    return {t: sorted(reach.get(t, ())) for t in q_of}


def _with_outputs(proto: onnx.ModelProto, names) -> bytes:
    present = {o.name for o in proto.graph.output} | {i.name for i in proto.graph.input}
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    out.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return out.SerializeToString()


def layers(float_model: QModel, qdq: QModel, feeds: list[dict], *, probe_samples: int = 2) -> list[Layer]:
    """The Layer of every quantized activation of ``qdq``'s main graph that ``float_model`` also
    computes, in the QDQ graph's order, measured on ``feeds``."""
    qproto = qdq.to_proto(metadata=False)
    fproto = float_model.to_proto(metadata=False)
    found = quantized_activations(fproto, qdq, qproto)
    entries = {name: tq for name, (tq, _, _) in found.items()}
    seen = simulated_names(qproto, entries)
    rows = {name: Layer(name, op, order, tq.qtype, list(tq.scale), list(tq.zero_point),
                        list(tq.why), _clip(tq), _calibrated(qdq, name))
            for name, (tq, op, order) in found.items()}
    if not rows:
        return []
    names = list(rows)
    fsess = session(_with_outputs(fproto, names))
    qsess = session(_with_outputs(qproto, [seen[n] for n in names]), optimize=False)
    sums = {n: np.zeros(3) for n in names}   # signal, accumulated error, local error
    for n in names:
        row, observed = rows[n], qdq.observed.get(n)
        lo, hi = min([row.clip[0], *list(observed or ())[:1]]), max([row.clip[1], *list(observed or ())[1:]])
        row.edges = list(np.linspace(lo, hi if hi > lo else lo + 1, BINS + 1))
        row.counts = [0] * BINS
    fouts = [o.name for o in fsess.get_outputs()]
    for feed in feeds:
        fvals = dict(zip(fouts, fsess.run(None, feed)))
        fvals.update({k: v for k, v in feed.items() if k in rows})
        qvals = dict(zip([seen[n] for n in names], qsess.run([seen[n] for n in names], feed)))
        for n in names:
            x = np.asarray(fvals[n], np.float32)
            xd = x.astype(np.float64)
            acc = qvals[seen[n]].astype(np.float64) - xd
            loc = _fake_quant(x, entries[n]).astype(np.float64) - xd
            sums[n] += (np.sum(xd * xd), np.sum(acc * acc), np.sum(loc * loc))
            inside = np.clip(x[np.isfinite(x)], rows[n].edges[0], rows[n].edges[-1])
            rows[n].counts = list(np.add(rows[n].counts, np.histogram(inside, bins=rows[n].edges)[0]).astype(int))
    sensitivity = local_errors(float_model, entries, feeds[:max(1, probe_samples)]) if feeds else {}
    ups = upstream(qproto, quantized_names(qproto, entries))
    for n, row in rows.items():
        signal, acc, loc = sums[n]
        row.accumulated_snr, row.local_snr = snr_from_sums(signal, acc), snr_from_sums(signal, loc)
        row.sensitivity = sensitivity.get(n, math.nan)
        row.upstream = [u for u in ups.get(n, []) if u in rows]
    return sorted(rows.values(), key=lambda r: (r.order, r.tensor))


def precision_cells(proto: onnx.ModelProto) -> list[tuple[str, str]]:
    """(node label, precision) for every compute node of a QDQ model's main graph, in order: the
    type of the weight a weighted op reads through a DequantizeLinear, else of its first input
    read through one, else "float" (what onnxruntime can run in integers, at most)."""
    inits = {t.name: t.data_type for t in proto.graph.initializer}
    zero_point = {n.output[0]: inits.get(n.input[2]) for n in proto.graph.node
                  if n.op_type == "QuantizeLinear" and len(n.input) > 2}
    dq_type = {}
    for n in proto.graph.node:
        if n.op_type == "DequantizeLinear":
            elem = inits.get(n.input[0], zero_point.get(n.input[0]))
            if elem is not None:
                dq_type[n.output[0]] = onnx.helper.tensor_dtype_to_np_dtype(elem).name
    cells, constant = [], _dq_of_constant(proto)
    for node in proto.graph.node:
        if node.op_type in QDQ_OPS or node.op_type == "Constant":
            continue
        read = [dq_type[i] for i in node.input if i in dq_type]
        weight = [dq_type[i] for i in node.input[1:2] if i in dq_type and i in constant]
        cells.append((f"{node.op_type} '{node.name}'", (weight or read or ["float"])[0]))
    return cells


def _dq_of_constant(proto: onnx.ModelProto) -> set[str]:
    inits = {t.name for t in proto.graph.initializer}
    return {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}

"""Softmax inputs: the row maxima bound the useful range from below and from above.

``Softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m)`` with ``m`` the row maximum: a value more than
NEGLIGIBLE below its row's maximum weighs less than e^-NEGLIGIBLE (2e-9) of the largest term, finer
than even a 16-bit output grid resolves. Clipping a tensor read only by Softmax at
(smallest row maximum seen in calibration) - NEGLIGIBLE therefore leaves the outputs unchanged,
while an additive attention mask (-10000, -1e9, finfo.min) no longer stretches an 8-bit grid over
thousands of units (encoder_block: 9.5 -> 20+ dB at 8 bits).

From above, the row maxima are what decides the outputs, and there is one per row: among the
values of a 6,625-class row, a percentile of the whole tensor cuts most of them (ppocr_v4_rec's
logits reach 23.7 and a 99.98 percentile range ended at 12). So the top of the range is raised to
the calibrated range of the row maxima: the method decides which rows are outliers, not which
classes.

calibrate measures the row maxima through probe nodes it adds for the run only
(``ReduceMax(x, softmax axes)`` -> ``<x>::softmax_row_max``; their calibrated entries stay in
``model.ranges`` / ``model.observed`` under that name) and compute-qparams applies the bound.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.graphutil import consumers, in_default_domain
from ..ir.model import QModel

ROW_MAX_SUFFIX = "::softmax_row_max"
NEGLIGIBLE = 20.0


def _axis(node: gs.Node, opset: int) -> int:
    """Softmax's axis: it normalises over that axis (opset >= 13), or over the 2-D coercion of the
    input at that axis (opset < 13: rows are the flattened leading dims)."""
    return int(node.attrs.get("axis", -1 if opset >= 13 else 1))


def softmax_inputs(model: QModel, names) -> dict[str, int]:
    """{tensor: axis} for the ``names`` read only by default-domain Softmax nodes with the same axis."""
    readers = consumers(model.graph)
    out = {}
    for name in sorted(names):
        nodes = readers.get(name, [])
        if not nodes or any(n.op != "Softmax" or not in_default_domain(n) for n in nodes):
            continue
        axes = {_axis(n, model.opset) for n in nodes}
        if len(axes) == 1:
            out[name] = axes.pop()
    return out


@contextmanager
def row_max_probes(model: QModel, names):
    """Add ``ReduceMax(x, axis, keepdims=0) -> <x>::softmax_row_max`` (opset < 13: of
    ``Flatten(x, axis)`` over axis 1) after the producer of each Softmax-only input among ``names``
    for the duration of the block; yields the probe names."""
    targets = softmax_inputs(model, names)
    tensors = model.tensors()
    targets = {n: a for n, a in targets.items() if n + ROW_MAX_SUFFIX not in tensors}
    if not targets:
        yield []
        return
    graph, opset = model.graph, model.opset
    saved = list(graph.nodes)
    probes: dict[str, list[gs.Node]] = {}
    for name, axis in targets.items():
        probe = name + ROW_MAX_SUFFIX
        source, nodes = tensors[name], []
        dtype = source.dtype or np.float32
        if opset < 13:
            flat = gs.Variable(probe + "_2d", dtype=dtype)
            nodes.append(gs.Node("Flatten", probe + "_2d", {"axis": axis}, [source], [flat]))
            source, axis = flat, 1
        out = gs.Variable(probe, dtype=dtype)
        if opset >= 18:
            axes = gs.Constant(probe + "_axes", np.asarray([axis], dtype=np.int64))
            nodes.append(gs.Node("ReduceMax", probe, {"keepdims": 0}, [source, axes], [out]))
        else:
            nodes.append(gs.Node("ReduceMax", probe, {"keepdims": 0, "axes": [axis]}, [source], [out]))
        probes[name] = nodes
    first = [p for t in graph.inputs for p in probes.get(t.name, [])]
    ordered = first + [x for node in saved for x in
                       [node] + [p for t in node.outputs for p in probes.get(t.name, [])]]
    graph.nodes = ordered
    model.touch()
    try:
        yield [n + ROW_MAX_SUFFIX for n in targets]
    finally:
        for node in (p for nodes in probes.values() for p in nodes):
            for t in node.inputs:
                if node in t.outputs:
                    t.outputs.remove(node)
            node.outputs.clear()
        graph.nodes = saved
        model.touch()


def _row_max_end(name: str, sources: tuple[dict, dict], end: int) -> float | None:
    """One end (0: bottom, 1: top) of a Softmax input's row maxima, from the first of ``sources``
    (model.observed / model.ranges) that has them; None when not measured or not finite."""
    seen = sources[0].get(name + ROW_MAX_SUFFIX) or sources[1].get(name + ROW_MAX_SUFFIX)
    return float(seen[end]) if seen is not None and np.isfinite(seen[end]) else None


def lower_bound(model: QModel, name: str) -> tuple[float, float] | None:
    """(bound, smallest row maximum) for a Softmax input measured by calibrate, else None."""
    smallest = _row_max_end(name, (model.observed, model.ranges), 0)
    return None if smallest is None else (smallest - NEGLIGIBLE, smallest)


def upper_bound(model: QModel, name: str) -> float | None:
    """The top of the calibrated range of the row maxima of a Softmax input, else None."""
    return _row_max_end(name, (model.ranges, model.observed), 1)

"""Concats whose inputs' ranges differ too much for one 8-bit grid (boxes beside probabilities)."""
from __future__ import annotations

import numpy as np

from ..ir.analyses import GRAPH, QUANT, RANGES, WEIGHTS, analysis
from ..ir.model import QModel

MAX_RATIO = 16.0   # an input 16x narrower than the widest keeps under 16 of the grid's 256 steps


@analysis(GRAPH, WEIGHTS, QUANT, RANGES)
def mixed_range_concats(model: QModel) -> dict[str, str]:
    """Concat output -> why one grid would erase an input, for Concats whose widest input range is
    more than ``MAX_RATIO`` times their narrowest (ranges: calibrated, or a constant's values)."""
    out = {}
    for node in model.graph.nodes:
        if node.op != "Concat" or not node.outputs or node.outputs[0].name not in model.quant:
            continue
        widths = {t.name: _width(model, t) for t in node.inputs}
        known = {name: w for name, w in widths.items() if w}
        if len(known) < 2:
            continue
        wide, narrow = max(known, key=known.get), min(known, key=known.get)
        ratio = known[wide] / known[narrow]
        if ratio > MAX_RATIO:
            out[node.outputs[0].name] = (
                f"Concat '{node.name}' joins ranges {ratio:.0f}x apart ('{wide}' spans {known[wide]:.4g}, "
                f"'{narrow}' {known[narrow]:.4g}): one 8-bit grid would leave '{narrow}' "
                f"{256 / ratio:.1f} steps (each input keeps its own Q/DQ)")
    return out


def _width(model: QModel, tensor) -> float:
    values = getattr(tensor, "values", None)
    if values is not None:
        array = np.asarray(values, np.float64)
        return float(array.max() - array.min()) if array.size else 0.0
    lo_hi = model.ranges.get(tensor.name)
    return float(lo_hi[1] - lo_hi[0]) if lo_hi else 0.0

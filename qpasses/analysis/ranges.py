"""Ranges behind qparams: which tensors need a calibrated range, and the range (with its source)
an entry's qparams are computed from (calibration, observed min/max, MaxPool and Softmax bounds,
weight values)."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..calibration.softmax import NEGLIGIBLE, lower_bound, upper_bound
from ..config.quant_config import QuantConfig
from ..errors import ModelError
from ..ir.analyses import GRAPH, QUANT, RANGES, analysis
from ..ir.annotations import TensorQuant
from ..ir.model import QModel
from ..quant.qparams import value_range
from ..quant.qtypes import qtype
from .scopes import all_nodes

MAX_POOLS = frozenset({"MaxPool", "GlobalMaxPool"})
CLIPPING_METHODS = ("percentile", "entropy", "mse")


def fmt(x) -> str:
    """A number for a ``why`` line."""
    return f"{float(x):.6g}"


@analysis(GRAPH)
def max_pooled(model: QModel) -> dict[str, list[str]]:
    """Tensor -> the MaxPool outputs computed from it: they hold the top of its values, so a clipped
    range of the tensor clips them far more (compute-qparams widens the tensor's range to theirs)."""
    out: dict[str, list[str]] = {}
    for node in all_nodes(model):
        if node.op in MAX_POOLS and node.inputs and node.outputs:
            out.setdefault(node.inputs[0].name, []).append(node.outputs[0].name)
    return out


def tensors_needing_ranges(model: QModel) -> set[str] | None:
    """Activations whose qparams are computed from a calibrated range, and MaxPool outputs of
    quantized tensors (None: not annotated yet)."""
    if "types-annotated" not in model.facts:
        return None
    return {name for name, tq in model.quant.items()
            if tq.role == "activation" and tq.shares is None and not tq.fixed
            and (tq.rmin is None or tq.rmax is None or tq.convert is not None)} | {
        pooled for name, outputs in max_pooled(model).items() if name in model.quant for pooled in outputs}


def activation_range(model: QModel, name: str, tq: TensorQuant, qt: str, config: QuantConfig):
    """(rmin, rmax, source text) for an activation, or None when nothing gives it a range.

    The entry's own rmin/rmax win; otherwise the calibrated range, or the observed min/max when
    the calibration method clips and the type is wider than 8 bits or the tensor is a graph output
    (unless ``calibration.clip_graph_outputs``).
    """
    calibration = config.calibration
    calibrated = model.decisions.get("calibration", {})
    method = calibrated.get("method", calibration.method)  # select-by-snr may change it
    chosen = f", chosen by {calibrated['chosen_by']} over {calibrated['over']}" if "chosen_by" in calibrated else ""
    base, source = model.ranges.get(name), f"calibration ({method}{chosen})"
    if method in CLIPPING_METHODS and name in model.observed:
        if qtype(qt).bits > 8:
            base = model.observed[name]
            source = f"observed min/max ({qt} is wider than 8 bits: the {method} range would waste precision)"
        elif not calibration.clip_graph_outputs and name in _graph_outputs(model):
            base = model.observed[name]
            source = "observed min/max (a graph output: clipping it would show directly in the result)"
    if tq.rmin is not None and tq.rmax is not None:
        return float(tq.rmin), float(tq.rmax), "the entry's rmin/rmax"
    if base is None:
        return None
    for pooled in _max_pool_outputs(model).get(name, ()):   # it holds the top values: clip them less
        lo, hi = model.ranges[pooled]
        if lo < base[0] or hi > base[1]:
            base = (min(base[0], lo), max(base[1], hi))
            source += f", widened to the range of its max-pooled '{pooled}'"
    rmin = float(base[0]) if tq.rmin is None else float(tq.rmin)
    rmax = float(base[1]) if tq.rmax is None else float(tq.rmax)
    if tq.rmin is not None or tq.rmax is not None:
        source += " with a bound from the entry"
    top = upper_bound(model, name) if tq.rmax is None else None
    if top is not None and top > rmax:
        rmax = top
        source += (f", upper end raised to {fmt(top)}: read only by Softmax, whose row maxima reach it "
                   f"(each decides its row's probabilities)")
    softmax = lower_bound(model, name) if tq.rmin is None else None
    if softmax is not None and softmax[0] > rmin:
        rmin = min(softmax[0], rmax)
        source += (f", lower end raised to {fmt(rmin)}: read only by Softmax, whose smallest row maximum "
                   f"was {fmt(softmax[1])} (values {NEGLIGIBLE:g} below a row's maximum vanish)")
    return rmin, rmax, source


@analysis(GRAPH, QUANT, RANGES)
def _max_pool_outputs(model: QModel) -> dict[str, list[str]]:
    """Tensor -> the calibrated MaxPool outputs computed from it (through tensors sharing its qparams)."""
    def root(name: str) -> str:
        seen = {name}
        while name in model.quant and model.quant[name].shares is not None and model.quant[name].shares not in seen:
            name = model.quant[name].shares
            seen.add(name)
        return name

    out: dict[str, list[str]] = {}
    for name, outputs in max_pooled(model).items():
        out.setdefault(root(name), []).extend(o for o in outputs if o in model.ranges)
    return out


@analysis(GRAPH)
def _graph_outputs(model: QModel) -> set[str]:
    return {t.name for t in model.graph.outputs}


def weight_range(model: QModel, name: str, tq: TensorQuant):
    """(rmin, rmax, source) of a constant weight, per channel along ``tq.axis``; None if not constant."""
    tensor = model.tensors().get(name)
    if not isinstance(tensor, gs.Constant):
        return None
    values = np.asarray(tensor.values)
    if tq.axis is not None and not -values.ndim <= tq.axis < values.ndim:
        raise ModelError(f"weight '{name}': axis {tq.axis} is out of range for shape {list(values.shape)}")
    rmin, rmax = value_range(values, tq.axis)
    if tq.rmin is not None:
        rmin = np.full_like(rmin, float(tq.rmin))
    if tq.rmax is not None:
        rmax = np.full_like(rmax, float(tq.rmax))
    where = "" if tq.axis is None else f" per channel (axis {tq.axis}, {np.size(rmin)} channels)"
    return rmin, rmax, f"the weight's values{where}"


def entry_range(model: QModel, name: str, tq: TensorQuant, config: QuantConfig):
    """(rmin, rmax, source) from a constant weight's values, else the activation range; or None."""
    found = weight_range(model, name, tq) if tq.role == "weight" else None
    return found if found is not None else activation_range(model, name, tq, tq.qtype, config)

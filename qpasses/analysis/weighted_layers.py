"""The weighted layers whose integer codes a pass may choose (round-weights, reconstruct-weights):
a Conv/ConvTranspose/MatMul/Gemm with a constant weight of its own that the table gives integer
qparams, and how its weight maps to [groups, output channels, inputs] rows."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..calibration.kept import KeptSamples
from ..evaluation.evaluate import Reference
from ..evaluation.objective import Objective, recorded
from ..executors.scoring import trial_bytes
from ..ir.decisions import PRECISION_SEARCH
from ..ir.graphutil import subgraphs
from ..ir.model import QModel
from ..quant.qtypes import qtype
from ..quant.rounding import Geometry, Hessian, conv_geometry, most_rows
from .scopes import scopes

OPS = ("Conv", "MatMul", "Gemm")


@dataclass
class Target:
    """One weight to round: the node reading it, the weight constant, how the layer reads its input,
    and how its array maps to [groups, output channels, inputs] (``to_rows``/``from_rows``)."""

    node: gs.Node
    weight: gs.Constant
    geo: Geometry
    layout: str          # conv | convT ([C, O/g, k...]) | kn (MatMul, Gemm transB=0: [K, N]) | nk (Gemm transB=1: [N, K])
    scope: int = 0       # the graph holding the node (analysis.scopes)
    hessian: Hessian | None = None

    def to_rows(self, values: np.ndarray) -> np.ndarray:
        if self.layout == "conv":
            return values.reshape(self.geo.groups, values.shape[0] // self.geo.groups, -1)
        if self.layout == "convT":   # the equivalent Conv's [G, O/g, C/g * k...]: channels swapped, kernel flipped
            g, rank = self.geo.groups, values.ndim - 2
            per = values.reshape(g, values.shape[0] // g, *values.shape[1:])
            per = np.flip(per, axis=tuple(range(3, 3 + rank)))
            return np.swapaxes(per, 1, 2).reshape(g, values.shape[1], -1)
        return (values.T if self.layout == "kn" else values)[None]

    def from_rows(self, rows: np.ndarray, shape: tuple) -> np.ndarray:
        if self.layout == "conv":
            return rows.reshape(shape)
        if self.layout == "convT":
            g, rank = self.geo.groups, len(shape) - 2
            per = np.swapaxes(rows.reshape(g, shape[1], shape[0] // g, *shape[2:]), 1, 2)
            return np.flip(per, axis=tuple(range(3, 3 + rank))).reshape(shape)
        return rows[0].T if self.layout == "kn" else rows[0]

    def per_row(self, values, shape: tuple) -> np.ndarray:
        """A per-tensor or per-output-channel qparam of this weight (of ``shape``) as [groups, rows]."""
        arr = np.asarray(values, np.float64).ravel()
        groups = self.geo.groups
        rows = {"conv": shape[0] // groups, "convT": shape[1], "kn": shape[-1], "nk": shape[0]}[self.layout]
        if arr.size == 1:
            return np.full((groups, rows), arr[0])
        if self.layout == "convT":   # axis 1: the same channels in every group
            return np.broadcast_to(arr, (groups, rows)).copy()
        return arr.reshape(groups, rows)


def types_of(tq) -> list[str]:
    """The quantized types a tensor's readers may see (its own, and its convert's)."""
    return [tq.qtype] + ([tq.convert.qtype] if tq.convert is not None else [])


def find_targets(model: QModel, activation_bits: int, ops=OPS, bodies: bool = False,
                 also: frozenset[str] = frozenset()) -> list[Target]:
    """The ``ops`` layers (Conv/ConvTranspose 1-D or 2-D, MatMul, Gemm with transA = 0) of the main
    graph (and, with ``bodies``, of If/Loop/Scan bodies) whose constant weight, read by that node only,
    has integer qparams in the table (no convert, per tensor or per output channel) and whose data
    input is a tensor left float or quantized to at least ``activation_bits`` bits (or whose weight
    is in ``also``, whatever its input); graph order."""
    inner, out = scopes(model), []
    for node in _in_order(model.graph, bodies):
        scope = inner.scope_of(node)
        if node.op not in ops or len(node.inputs) < 2 or (scope and not bodies):
            continue
        data, weight = node.inputs[0], node.inputs[1]
        tq = model.quant.get(weight.name)
        if (isinstance(data, gs.Constant) or not isinstance(weight, gs.Constant) or len(weight.outputs) != 1
                or tq is None or tq.role != "weight" or not tq.scale or tq.convert is not None
                or qtype(tq.qtype).is_float or np.asarray(weight.values).dtype.kind != "f"):
            continue
        source = model.quant.get(data.name)
        if (source is not None and weight.name not in also
                and min(qtype(t).bits for t in types_of(source)) < activation_bits):
            continue
        shape = np.shape(weight.values)
        if node.op in ("Conv", "ConvTranspose"):
            transposed = node.op == "ConvTranspose"
            geo, layout, axis = conv_geometry(node.attrs, shape, transposed), "convT" if transposed else "conv", int(transposed)
        elif node.op == "Gemm" and not node.attrs.get("transA", 0) and len(shape) == 2:
            layout = "nk" if node.attrs.get("transB", 0) else "kn"
            geo, axis = Geometry("dense", shape[1] if layout == "nk" else shape[0]), int(layout == "kn")
        elif node.op == "MatMul" and len(shape) == 2:
            geo, layout, axis = Geometry("dense", shape[0]), "kn", 1
        else:
            continue
        if geo is None or (geo.kind == "conv" and shape[0] % geo.groups):
            continue
        if len(tq.scale) > 1 and (tq.axis is None or tq.axis % len(shape) != axis):
            continue
        out.append(Target(node, weight, geo, layout, scope))
    return out


def _in_order(graph: gs.Graph, bodies: bool):
    """The graph's nodes in order, each If/Loop/Scan's body nodes (with ``bodies``) just before it."""
    for node in graph.nodes:
        if bodies:
            for sub in subgraphs(node):
                yield from _in_order(sub, bodies)
        yield node


def checked_values(model: QModel, ctx, changed: dict[str, np.ndarray], then, samples: int,
                   tolerance_db: float, after: int = 0) -> dict:
    """Whether the constants ``changed`` (name -> new values; ``model`` holds round-to-nearest's) are
    kept: the worst output component (search-precision's metric) of the QDQ model ``then`` makes of
    ``model`` as it is and with them, on ``samples`` calibration feeds after the ones search-precision
    chose its promotions on and the first ``after`` (those favour the values chosen on them), else on
    the first ones. Kept unless lower by more than ``tolerance_db`` (other metrics: 0) plus one
    standard error of the paired difference (Objective.paired_difference: one feed holding most of
    the error cannot decide); a model that does not score finite is not kept. Kept after the first
    half of the feeds when it scores at least as high there (a negative ``tolerance_db``: that much
    higher): the other half could only undo that by reading ``tolerance_db`` and two standard
    errors lower (``feeds`` says how many were read)."""
    search = model.decisions.get(PRECISION_SEARCH, {})
    start = (model.decisions.get("calibration", {}).get("held_out_from") or 0 if search.get("held_out") else 0)
    start = max(start + search.get("feeds", 0), after)
    half = max(1, samples // 2)
    floats = ctx.cache.get(KeptSamples.CACHE_KEY)   # the float outputs calibrate kept: no float run on those
    reference = Reference.for_rest(model, ctx.calibration_data, floats, start, False, half)
    if reference is None:   # no feed left after those
        start, reference = 0, Reference.for_rest(model, ctx.calibration_data, floats, 0, False, half)
    objective = Objective(search.get("metric", ctx.config.accuracy.metric), model=model)   # its weights as stubs: not copied

    def edit(trial: QModel) -> None:
        tensors = trial.tensors()
        for name, values in changed.items():
            tensors[name].values = values

    fresh = model.copier()   # the model does not change during the check
    trials = [trial_bytes(model, then, ctx, None, fresh), trial_bytes(model, then, ctx, edit, fresh)]
    runs = [reference.runs_of(trial, judged=True) for trial in trials]
    ref_runs = reference.runs()
    before, score = _overall(objective, ref_runs, runs, reference.names)
    allowed = tolerance_db if objective.metric == "snr" else 0.0
    if not (np.isfinite(score) and score >= before + max(0.0, -allowed)) and len(reference.feeds) < samples:
        more = Reference.for_rest(model, ctx.calibration_data, floats, start + len(reference.feeds), False,
                                  samples - len(reference.feeds))
        if more is not None:
            runs = [r + more.runs_of(trial, judged=True) for r, trial in zip(runs, trials)]
            reference = reference.plus(more)
            ref_runs = reference.runs()
            before, score = _overall(objective, ref_runs, runs, reference.names)
    difference, error = objective.paired_difference(ref_runs, *runs, reference.names)
    if not math.isfinite(error):   # a leave-one-out score without error: the pooled scores decide
        error = 0.0
    kept = bool(score == before or (np.isfinite(score) and difference >= -(allowed + error)))
    return {"feeds": len(reference.feeds), "from": start, "metric": objective.metric,
            "round_to_nearest": recorded(before), "rounded": recorded(score),
            "difference_se": recorded(error), "kept": kept}


def _overall(objective, ref_runs: list, runs: list, names: list[str]) -> tuple[float, ...]:
    """The objective's overall score of each of ``runs`` against the reference's ``ref_runs``."""
    return tuple(objective.overall(objective.scores_from_runs(ref_runs, r, names)) for r in runs)


def restore(values: dict) -> None:
    """Give each constant its values back (name -> (gs.Constant, array))."""
    for constant, array in values.values():
        constant.values = array


class Readers:
    """The collectors (Hessians, analysis.saturation.PairSums) of every layer reading one tensor:
    collect_stats feeds it whole arrays."""

    min = max = 0.0   # collect_stats' test for body tensors that never ran

    def __init__(self, readers: list):
        self.readers = readers

    def update(self, x, *_) -> None:
        for r in self.readers:
            r.update(x)


def batches(targets: list[Target], budget: float):
    """``targets`` in graph order, as batches whose X^T X together fit ``budget`` bytes."""
    batch, used = [], 0
    for t in targets:
        if batch and used + t.geo.h_bytes > budget:
            yield batch
            batch, used = [], 0
        batch.append(t)
        used += t.geo.h_bytes
    if batch:
        yield batch


def measure(model: QModel, data, batch: list[Target], samples: int, min_rows: float = 0.0) -> int:
    """Each target's ``hessian``: X^T X of its float input over ``samples`` calibration feeds, in one
    streamed run; returns the feeds read. A target whose input cannot give ``min_rows`` rows per
    input in that many feeds (rounding.most_rows) is not measured: its ``hessian`` stays None."""
    from ..calibration.runner import collect_stats

    by_input: dict[str, list[Hessian]] = {}
    for k, t in enumerate(batch):   # seeds by place in the batch, measured or not
        t.hessian = None
        if samples * most_rows(t.node.inputs[0].shape, t.geo) >= min_rows * t.geo.k:
            t.hessian = Hessian(t.geo, seed=k)
            by_input.setdefault(t.node.inputs[0].name, []).append(t.hessian)
    if not by_input:
        return 0
    _, count = collect_stats(model, data, max_samples=samples, only=set(by_input),
                             collector=lambda name: Readers(by_input.get(name, [])))
    return count

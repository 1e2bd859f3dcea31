"""equalize-cross-layer: cross-layer equalization of Conv -> (ReLU) -> Conv chains (Nagel et al. 2019)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import in_default_domain, overridable_initializers, unique_name, used_names
from ..ir.model import QModel, make_constant

NAME = "equalize-cross-layer"
DECISION = "cross_layer_equalization"   # model.decisions key: the pairs equalized (a second run does nothing)
# f(x / s) = f(x) / s for s > 0, per channel: these may sit between the two convolutions
HOMOGENEOUS = ("Relu", "LeakyRelu", "PRelu", "Clip")


@dataclass
class Link:
    """An op between the convolutions: a positively homogeneous activation, or Mul/Add/Sub/Div
    with a constant (the constant is scaled per channel when it is added)."""

    node: gs.Node
    const: int | None = None    # index of the constant input to scale by 1/s (Add/Sub), None: nothing to scale


@dataclass
class Pair:
    """conv1 -> links -> conv2, conv1's output channels = conv2's input channels."""

    conv1: gs.Node
    conv2: gs.Node
    links: list[Link]

    @property
    def via(self) -> str:
        return "->".join(["Conv"] + [link.node.op for link in self.links] + ["Conv"])


def _is_const(t: gs.Tensor, feedable: set[str]) -> bool:
    return isinstance(t, gs.Constant) and t.name not in feedable \
        and np.issubdtype(np.asarray(t.values).dtype, np.floating)


def _conv(node: gs.Node, feedable: set[str]) -> bool:
    if node.op != "Conv" or not in_default_domain(node) or len(node.inputs) < 2:
        return False
    if not _is_const(node.inputs[1], feedable) or np.asarray(node.inputs[1].values).ndim < 3:
        return False
    return len(node.inputs) < 3 or not node.inputs[2].name or _is_const(node.inputs[2], feedable)


def _channel_const(values: np.ndarray, channels: int, rank: int) -> bool:
    """Whether a constant broadcast against a [N, C, ...] tensor of ``rank`` varies at most along C."""
    if values.ndim > rank:
        return False
    shape = (1,) * (rank - values.ndim) + values.shape
    return shape[1] in (1, channels) and all(d == 1 for i, d in enumerate(shape) if i != 1)


def _link(node: gs.Node, t: gs.Tensor, channels: int, rank: int, feedable: set[str]) -> tuple[Link | None, str | None]:
    """(the link, None) when ``node`` (reading ``t``) commutes with a per-channel scale, else (None, why)."""
    if not in_default_domain(node) or len(node.outputs) != 1 or not node.inputs or node.inputs[0] is not t:
        return None, f"{node.op} '{node.name}' between the convolutions"
    op = node.op
    if op in ("Relu", "LeakyRelu"):
        return Link(node), None
    if op == "PRelu":   # slope per channel or shared: PRelu(x / s) = PRelu(x) / s
        if len(node.inputs) == 2 and _is_const(node.inputs[1], feedable) \
                and _channel_const(np.asarray(node.inputs[1].values), channels, rank):
            return Link(node), None
        return None, f"PRelu '{node.name}' slope is not a per-channel constant"
    if op == "Clip":
        lo = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1].name else None
        hi = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        lo_v = node.attrs.get("min") if lo is None else (np.asarray(lo.values) if isinstance(lo, gs.Constant) else None)
        hi_v = node.attrs.get("max") if hi is None else (np.asarray(hi.values) if isinstance(hi, gs.Constant) else None)
        if lo is not None and lo_v is None or hi is not None and hi_v is None:
            return None, f"Clip '{node.name}' bounds are not constants"
        if lo_v is None or float(np.asarray(lo_v)) != 0.0:
            return None, f"Clip '{node.name}' does not start at 0"
        if hi_v is not None and np.isfinite(float(np.asarray(hi_v))):
            return None, f"Clip '{node.name}' has an upper bound ({float(np.asarray(hi_v)):g}): not positively homogeneous"
        return Link(node), None
    if op in ("Mul", "Div", "Add", "Sub") and len(node.inputs) == 2:
        c = node.inputs[1]
        if not _is_const(c, feedable) or not _channel_const(np.asarray(c.values), channels, rank):
            return None, f"{op} '{node.name}' is not by a per-channel constant"
        return Link(node, 1 if op in ("Add", "Sub") else None), None
    return None, f"{op} '{node.name}' is not positively homogeneous"


def find_pairs(model: QModel) -> tuple[list[Pair], dict[str, str]]:
    """Conv -> (Relu | LeakyRelu | PRelu | Clip(0, inf) | Mul/Div/Add/Sub by a per-channel constant)* ->
    Conv chains where each tensor in between has one reader and is no graph output, and the
    channel counts match (any groups, depthwise included); and why other Conv -> ... -> Conv
    chains were left alone (by first conv)."""
    feedable = overridable_initializers(model)
    graph_outputs = {t.name for t in model.graph.outputs}
    pairs, skipped = [], {}
    for conv1 in model.graph.nodes:
        if not _conv(conv1, feedable):
            continue
        w1 = np.asarray(conv1.inputs[1].values)
        channels, rank = w1.shape[0], w1.ndim
        t, links, why = conv1.outputs[0], [], None
        while True:
            if t.name in graph_outputs or len(t.outputs) != 1:
                break
            node = t.outputs[0]
            if sum(u is t for u in node.inputs) != 1:
                break
            if node.op == "Conv":
                if node.inputs[0] is not t or not _conv(node, feedable):
                    why = f"Conv '{node.name}' has no constant weight"
                    break
                w2 = np.asarray(node.inputs[1].values)
                if w2.shape[1] * int(node.attrs.get("group", 1)) != channels or w2.ndim != rank:
                    why = f"channel counts of Conv '{node.name}' do not match"
                    break
                pairs.append(Pair(conv1, node, links))
                why = None
                break
            link, why = _link(node, t, channels, rank, feedable)
            if link is None:
                if not _leads_to_conv(node):
                    why = None   # not a Conv -> ... -> Conv chain at all
                break
            links.append(link)
            t = node.outputs[0]
        if why:
            skipped[conv1.name] = why
    return pairs, skipped


def _leads_to_conv(node: gs.Node) -> bool:
    """Whether ``node``'s only output is read by a Conv and nothing else."""
    return len(node.outputs) == 1 and len(node.outputs[0].outputs) == 1 and node.outputs[0].outputs[0].op == "Conv"


# -- plan: the scales (pure numpy on copies of the weights) -----------------------------------------
def input_channel_view(w2: np.ndarray, group: int) -> np.ndarray:
    """conv2's weight [C_out, C_in/group, k...] as [C_in, entries reading that input channel]."""
    c_out, c_group = w2.shape[:2]
    v = w2.reshape(group, c_out // group, c_group, -1).transpose(0, 2, 1, 3)
    return v.reshape(group * c_group, -1)


def from_input_channel_view(v: np.ndarray, shape: tuple, group: int) -> np.ndarray:
    c_out, c_group = shape[:2]
    return v.reshape(group, c_group, c_out // group, -1).transpose(0, 2, 1, 3).reshape(shape)


def pair_scale(w1: np.ndarray, w2_view: np.ndarray, limit: float = 1e3) -> np.ndarray:
    """s_i = sqrt(r1_i / r2_i): conv1's output channel i divided by s_i and conv2's input channel i
    multiplied by it leave both with the range sqrt(r1_i r2_i) (1 where a range is 0)."""
    r1 = np.abs(w1.reshape(w1.shape[0], -1)).max(axis=1)
    r2 = np.abs(w2_view).max(axis=1)
    s = np.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    return np.clip(s, 1 / limit, limit)


def plan_scales(pairs: list[Pair], iterations: int, tolerance: float) -> tuple[dict[str, np.ndarray], list[np.ndarray], int]:
    """Equalize every pair in turn, ``iterations`` rounds at most (until no scale moves by more than
    ``tolerance``): returns the new conv weights by node name, each pair's total scale, and the rounds run."""
    weights: dict[str, np.ndarray] = {}
    for p in pairs:
        for conv in (p.conv1, p.conv2):
            weights.setdefault(conv.name, np.asarray(conv.inputs[1].values, np.float64).copy())
    totals = [np.ones(np.asarray(p.conv1.inputs[1].values).shape[0]) for p in pairs]
    rounds = 0
    for rounds in range(1, max(iterations, 1) + 1):
        moved = 0.0
        for k, p in enumerate(pairs):
            w1, w2 = weights[p.conv1.name], weights[p.conv2.name]
            group = int(p.conv2.attrs.get("group", 1))
            view = input_channel_view(w2, group)
            s = pair_scale(w1, view)
            weights[p.conv1.name] = w1 / s.reshape((-1,) + (1,) * (w1.ndim - 1))
            weights[p.conv2.name] = from_input_channel_view(view * s[:, None], w2.shape, group)
            totals[k] = totals[k] * s
            moved = max(moved, float(np.abs(np.log(s)).max(initial=0.0)))
        if moved <= tolerance:
            break
    return weights, totals, rounds


# -- apply ----------------------------------------------------------------------------------------
def _replace(node: gs.Node, index: int, values: np.ndarray, taken: set[str], graph_outputs: set[str]) -> None:
    old = node.inputs[index]
    alone = old.name not in graph_outputs and len(old.outputs) == 1 and sum(u is old for u in node.inputs) == 1
    node.inputs[index] = make_constant(old.name if alone else unique_name(old.name + "_cle", taken),
                                       values.astype(np.asarray(old.values).dtype))


def _channel_scaled(values: np.ndarray, s: np.ndarray, rank: int) -> np.ndarray:
    """A per-channel constant (broadcast against [N, C, ...]) divided by s along C."""
    v = np.asarray(values, np.float64)
    full = v.reshape((1,) * (rank - v.ndim) + v.shape)
    out = full / s.reshape((1, -1) + (1,) * (rank - 2))
    keep = max(v.ndim, rank - 1)   # at least up to the channel axis
    return out.reshape(out.shape[rank - keep:])


@register
class EqualizeCrossLayer(Pass):
    """Equalize the weight ranges of Conv -> (ReLU) -> Conv chains channel by channel (cross-layer equalization).

    Reads: the float graph: Conv -> (Relu | LeakyRelu | PRelu | Clip(0, no max) | Mul/Div/Add/Sub
    by a per-channel constant)* -> Conv chains with constant weights (biases), every tensor in
    between read once and no graph output, conv1's output channels = conv2's input channels (any
    group count: depthwise either side). No data.
    Writes: per channel i, s_i = sqrt(r1_i / r2_i) (r1: range of conv1's output channel i, r2: of
    conv2's weights reading input channel i): conv1's weight row and bias divided by s_i, an
    Add/Sub constant between them too, conv2's weights reading channel i multiplied by s_i, so
    both ranges become sqrt(r1_i r2_i); every pair in turn, repeated until no scale moves by more
    than ``tolerance`` (at most ``iterations`` rounds). New constants ``<w>_cle`` when others read
    a weight. ``model.decisions["cross_layer_equalization"]`` (pairs and rounds); chains left alone
    and why in the findings (Clip(0, 6) and other activations that are not positively homogeneous).
    Invariants: outputs are unchanged in float (rounding only); runs before annotate-types (it
    changes weights); a second run (the decision exists) does nothing. Not in the default
    pipeline: on the shared corpus it helps ppocr_v4_det but costs ppocr_v4_rec decoded text with
    per-channel weights (tools/README.md); insert it after the first cleanup to use it.
    """

    name: ClassVar[str] = NAME
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) <float[2, 2, 1, 1] w1 = {4, 0.5, 0.1, 0.2},
        float[2] b1 = {1, -0.1}, float[2, 1, 3, 3] w2 = {0.1, 0.2, 0.1, 0.2, 0.4, 0.2, 0.1, 0.2, 0.1,
        2, -1, 3, 1, 8, 1, 3, -1, 2}>
        {
            c = Conv(x, w1, b1)
            r = Relu(c)
            y = Conv <group = 2, pads = [1, 1, 1, 1]> (r, w2)
        }
    """
    example_prelude: ClassVar[str] = ""

    iterations: int = field(default=20, metadata={"help": "rounds over all pairs at most"})
    tolerance: float = field(default=1e-3, metadata={
        "help": "stop when no scale of a round moves by more than this (|log s|)"})

    def run(self, model: QModel, ctx) -> PassResult:
        if DECISION in model.decisions:
            return PassResult(model, False, {"pairs": 0})
        pairs, skipped = find_pairs(model)
        if skipped:
            ctx.findings.update(NAME, {"not_equalized": skipped})
        if not pairs:
            return PassResult(model, False, {"pairs": 0})
        weights, totals, rounds = plan_scales(pairs, self.iterations, self.tolerance)
        moved = [k for k, s in enumerate(totals) if np.abs(np.log(s)).max(initial=0.0) > self.tolerance]
        if not moved:
            ctx.findings.update(NAME, {"pairs": len(pairs), "equalized": 0, "rounds": rounds})
            return PassResult(model, False, {"pairs": 0})
        taken = used_names(model.graph)
        graph_outputs = {t.name for t in model.graph.outputs}
        done: set[str] = set()
        for p in pairs:
            for conv in (p.conv1, p.conv2):
                if conv.name not in done:
                    done.add(conv.name)
                    _replace(conv, 1, weights[conv.name], taken, graph_outputs)
        rows = []
        for p, s in zip(pairs, totals):
            rank = np.asarray(p.conv1.inputs[1].values).ndim
            if len(p.conv1.inputs) > 2 and p.conv1.inputs[2].name:
                _replace(p.conv1, 2, np.asarray(p.conv1.inputs[2].values, np.float64) / s, taken, graph_outputs)
            for link in p.links:
                if link.const is not None:
                    _replace(link.node, link.const, _channel_scaled(link.node.inputs[link.const].values, s, rank),
                             taken, graph_outputs)
            rows.append({"conv1": p.conv1.name, "conv2": p.conv2.name, "via": p.via,
                         "scale_min": round(float(s.min()), 4), "scale_max": round(float(s.max()), 4)})
        ctx.findings.update(NAME, {"pairs": rows, "rounds": rounds})
        model.decisions[DECISION] = {"by": NAME, "rounds": rounds,
                                     "pairs": [[r["conv1"], r["conv2"]] for r in rows]}
        return PassResult(model, True, {"pairs": len(pairs), "rounds": rounds})

"""smooth-quant: migrate per-channel activation outliers into the weights of MatMul/Gemm (SmoothQuant)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.smoothing import capture, choose, rereadable
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import CalibrationDataError, first_line
from ..evaluation.evaluate import max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ..ir.graphutil import in_default_domain, overridable_initializers, unique_name, used_names
from ..ir.model import QModel, make_constant
from ..quant.qtypes import qtype

NAME = "smooth-quant"
DECISION = "smooth_quant"   # model.decisions key: the layers smoothed (a second run does nothing)


# -- analyse: the layers ---------------------------------------------------------------------------
@dataclass
class Reader:
    """A MatMul/Gemm reading the activation as its first input with a constant 2-D weight."""

    node: gs.Node
    transposed: bool     # Gemm transB=1: the weight is [N, K]

    @property
    def weight(self) -> gs.Constant:
        return self.node.inputs[1]

    def kn(self) -> np.ndarray:
        """The weight as [K, N] (input channels first)."""
        w = np.asarray(self.weight.values)
        return w.T if self.transposed else w


@dataclass
class Group:
    """An activation tensor and the MatMul/Gemm nodes that read it (they share one scale)."""

    tensor: gs.Tensor
    readers: list[Reader]

    @property
    def channels(self) -> int:
        return self.readers[0].kn().shape[0]


def _is_const(t: gs.Tensor, feedable: set[str]) -> bool:
    return isinstance(t, gs.Constant) and t.name not in feedable


def _reader(node: gs.Node, feedable: set[str]) -> Reader | None:
    if not in_default_domain(node) or node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    w = node.inputs[1]
    if not _is_const(w, feedable) or node.inputs[0] is w:
        return None
    values = np.asarray(w.values)
    if values.ndim != 2 or not np.issubdtype(values.dtype, np.floating):
        return None
    if node.op == "Gemm" and node.attrs.get("transA", 0):
        return None
    return Reader(node, node.op == "Gemm" and bool(node.attrs.get("transB", 0)))


def find_groups(model: QModel) -> list[Group]:
    """Every float activation read (as input 0) by MatMul/Gemm nodes with a constant 2-D weight,
    with those readers (in graph order), when they agree on the channel count."""
    feedable = overridable_initializers(model)
    groups: dict[str, Group] = {}
    for node in model.graph.nodes:
        reader = _reader(node, feedable)
        if reader is None:
            continue
        x = node.inputs[0]
        if isinstance(x, gs.Constant) or not x.name:
            continue
        group = groups.setdefault(x.name, Group(x, []))
        group.readers.append(reader)
    return [g for g in groups.values() if len({r.kn().shape[0] for r in g.readers}) == 1]


# -- apply: fold 1/s into the producer, or a Mul -----------------------------------------------------
@dataclass
class Edit:
    """Replace input ``index`` of ``node`` (a constant) by ``fn(values)``."""

    node: gs.Node
    index: int
    kind: str    # "last": times 1/s on the last axis; "div_last": times s; "cols": [.., K] columns times 1/s;
                 # "rows": [K, ..] rows times 1/s


def _last_axis_ok(c: np.ndarray, k: int) -> bool:
    return c.ndim == 0 or c.shape[-1] in (1, k)


def _single_reader(t: gs.Tensor, node: gs.Node, graph_outputs: set[str]) -> bool:
    return t.name not in graph_outputs and len(t.outputs) == 1 and t.outputs[0] is node \
        and sum(u is t for u in node.inputs) == 1


def fold_plan(t: gs.Tensor, k: int, feedable: set[str], graph_outputs: set[str], depth: int = 0) -> list[Edit] | None:
    """Edits that make the producer of ``t`` (read only by the layers being smoothed) write t / s
    exactly in float: LayerNormalization (scale, bias), Mul/Div by a constant, Add/Sub of a
    constant (and the producer of the other operand), MatMul/Gemm with a constant weight (its
    output columns and bias), through Relu/LeakyRelu/PRelu (positively homogeneous). None when
    the chain ends anywhere else."""
    if len(t.inputs) != 1 or depth > 8 or t.name in graph_outputs:
        return None
    p = t.inputs[0]
    if not in_default_domain(p) or not p.outputs or p.outputs[0] is not t:
        return None
    const = [i for i, u in enumerate(p.inputs) if _is_const(u, feedable)
             and np.issubdtype(np.asarray(u.values).dtype, np.floating)]

    def values(i):
        return np.asarray(p.inputs[i].values)

    def upstream(i):
        u = p.inputs[i]
        if isinstance(u, gs.Constant) or not _single_reader(u, p, graph_outputs):
            return None
        return fold_plan(u, k, feedable, graph_outputs, depth + 1)

    if p.op == "LayerNormalization":
        if len(p.inputs) < 2 or 1 not in const or values(1).ndim == 0 or values(1).shape[-1] != k:
            return None
        edits = [Edit(p, 1, "last")]
        if len(p.inputs) > 2 and p.inputs[2].name:
            if 2 not in const or values(2).ndim == 0 or values(2).shape[-1] != k:
                return None
            edits.append(Edit(p, 2, "last"))
        return edits
    if p.op == "Mul" and len(p.inputs) == 2 and len(const) == 1 and _last_axis_ok(values(const[0]), k):
        return [Edit(p, const[0], "last")]
    if p.op == "Div" and len(p.inputs) == 2 and const == [1] and _last_axis_ok(values(1), k):
        return [Edit(p, 1, "div_last")]
    if p.op in ("Add", "Sub") and len(p.inputs) == 2 and len(const) == 1 and _last_axis_ok(values(const[0]), k):
        rest = upstream(1 - const[0])
        return None if rest is None else [Edit(p, const[0], "last")] + rest
    if p.op in ("Relu", "LeakyRelu") or (p.op == "PRelu" and const == [1]):
        return upstream(0)
    if p.op == "MatMul" and len(p.inputs) == 2 and const == [1] and values(1).ndim == 2 and values(1).shape[1] == k:
        return [Edit(p, 1, "cols")]
    if p.op == "Gemm" and 1 in const and values(1).ndim == 2 and not p.attrs.get("transA", 0):
        trans = bool(p.attrs.get("transB", 0))
        if values(1).shape[0 if trans else 1] != k:
            return None
        edits = [Edit(p, 1, "rows" if trans else "cols")]
        if len(p.inputs) > 2 and p.inputs[2].name:
            if 2 not in const or not _last_axis_ok(values(2), k):
                return None
            edits.append(Edit(p, 2, "last"))
        return edits
    return None


def _scaled(values: np.ndarray, kind: str, s: np.ndarray) -> np.ndarray:
    v = values.astype(np.float64)
    if kind == "last":
        out = (v if v.ndim else v.reshape(1)) / s
    elif kind == "div_last":
        out = (v if v.ndim else v.reshape(1)) * s
    elif kind == "cols":
        out = v / s[None, :]
    else:  # rows
        out = v / s[:, None]
    return out.astype(values.dtype)


def _replace_constant(node: gs.Node, index: int, values: np.ndarray, taken: set[str], graph_outputs: set[str],
                      suffix: str) -> None:
    """Give input ``index`` of ``node`` new values: in place when only this node reads the
    constant (once), else as a new constant ``<name><suffix>``."""
    old = node.inputs[index]
    name = old.name if _single_reader(old, node, graph_outputs) else unique_name(old.name + suffix, taken)
    node.inputs[index] = make_constant(name, values)


def apply_scale(model: QModel, group: Group, s: np.ndarray, edits: list[Edit] | None, taken: set[str],
                graph_outputs: set[str]) -> str:
    """Scale the group's weights by diag(s) and divide its activation by s: through ``edits`` in the
    producer chain, else with a new Mul by 1/s. Returns how (for the decision and findings)."""
    for r in group.readers:
        w = np.asarray(r.weight.values)
        new = (w.astype(np.float64) * (s[None, :] if r.transposed else s[:, None])).astype(w.dtype)
        _replace_constant(r.node, 1, new, taken, graph_outputs, "_smooth")
    if edits is not None:
        for e in edits:
            _replace_constant(e.node, e.index, _scaled(np.asarray(e.node.inputs[e.index].values), e.kind, s),
                              taken, graph_outputs, "_smooth")
        return "folded into " + ", ".join(dict.fromkeys(f"{e.node.op} '{e.node.name}'" for e in edits))
    x = group.tensor
    dtype = np.dtype(x.dtype) if x.dtype is not None else np.float32
    inv = make_constant(unique_name(f"{x.name}_smooth_scale", taken), (1.0 / s).astype(dtype))
    out = gs.Variable(unique_name(f"{x.name}_smoothed", taken), dtype=x.dtype, shape=x.shape)
    mul = gs.Node("Mul", unique_name(f"{x.name}_smooth", taken), inputs=[x, inv], outputs=[out])
    readers = {id(r.node) for r in group.readers}
    first = next(i for i, n in enumerate(model.graph.nodes) if id(n) in readers)
    for r in group.readers:
        r.node.inputs[0] = out
    model.graph.nodes.insert(first, mul)
    return f"Mul '{mul.name}' by 1/s"


def _grid(text: str) -> list[float]:
    return [float(a) for a in str(text).replace(";", ",").split(",") if a.strip()]


def _bits(name: str, default: int = 8) -> int:
    try:
        t = qtype(name)
    except Exception:
        return default
    return t.bits if t.name != "int32" else default


@register
class SmoothQuant(Pass):
    """Move per-channel activation outliers into the weights of the MatMul/Gemm reading them (SmoothQuant).

    Reads: the float graph, the first ``samples`` calibration feeds (one float run with the
    activations read by MatMul/Gemm nodes with a constant 2-D weight as extra outputs, streaming:
    per input channel min/max and up to ``max_rows`` sampled rows per activation), and the config's
    activation/weight types and ``per_channel``. For an activation whose largest channel range is
    ``min_outlier_ratio`` times its median or more, s_j = max|x_j|^alpha / max|W_j|^(1-alpha)
    (max|W_j| over every reader's input channel j, so all readers share s), with alpha taken per
    activation from ``alphas`` by the measured error of its readers' outputs (per-tensor
    activation x per-channel weight fake-quantized in numpy against float, on the sampled rows);
    kept only when it beats no smoothing by ``min_gain_db``.
    Writes: W' = diag(s) W for every reader (a new constant ``<w>_smooth`` when others read W) and
    x' = x / s folded exactly into the producer (LayerNormalization scale and bias, Mul/Div by a
    constant, Add/Sub of a constant with the MatMul/Gemm before it, through Relu) when only the
    smoothed layers read x, else a new ``Mul(x, 1/s)`` before them; ``model.decisions["smooth_quant"]``
    (each smoothed activation: alpha, outlier ratio, error before/after, how); the per-layer
    measurements in the findings.
    Invariants: outputs are unchanged in float (rounding only); runs before annotate-types (it
    changes weights); nothing is done (it says why) without re-readable calibration data, above
    ``max_nodes``/``max_weight_mb``, or when ``model.decisions["smooth_quant"]`` exists.
    """

    name: ClassVar[str] = NAME
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 16, 8] x) => (float[1, 16, 4] y) <float[8] gamma = {1, 1, 40, 1, 1, 1, 25, 1},
        float[8] beta = {0, 0.1, 0, 0, -0.1, 0, 0, 0},
        float[8, 4] w = {0.3, -0.2, 0.1, 0.5, -0.4, 0.2, 0.6, -0.1, 0.05, -0.3, 0.2, 0.1, 0.4, 0.1, -0.5, 0.3,
        -0.2, 0.6, 0.1, -0.3, 0.1, -0.1, 0.4, 0.2, 0.02, 0.3, -0.1, 0.2, -0.6, 0.2, 0.3, -0.4}>
        {
            h = LayerNormalization <axis = -1> (x, gamma, beta)
            y = MatMul(h, w)
        }
    """
    example_prelude: ClassVar[str] = ""

    alphas: str = field(default="0.5,0.6,0.7,0.75,0.8,0.85,0.9,0.95", metadata={
        "help": "migration strengths tried per layer (comma-separated); the one with the least measured error is kept"})
    samples: int = field(default=8, metadata={"help": "calibration feeds measured"})
    max_rows: int = field(default=512, metadata={
        "help": "activation rows (tokens/positions) sampled per layer for the error measurement"})
    min_outlier_ratio: float = field(default=10.0, metadata={
        "help": "smooth an activation only when its largest channel range is this many times its median "
                "(measured: 22-68 on a BERT encoder's LayerNorm outputs, at most 9 on the shared corpus, "
                "where smoothing every layer cost ppocr_v4_rec one text line in 32)"})
    min_gain_db: float = field(default=3.0, metadata={
        "help": "keep a smoothing only when it lowers the layer's measured quantization error by this many dB "
                "(measured: +24 to +31 dB on the BERT outlier layers, at most +3.3 dB elsewhere)"})
    max_nodes: int = max_nodes_option(20000)
    max_weight_mb: float = max_weight_mb_option(1024.0, "one float session")

    def run(self, model: QModel, ctx) -> PassResult:
        if DECISION in model.decisions:
            return PassResult(model, False, {"examined": 0, "layers": 0})
        if not ctx.config.smooth_quant:
            ctx.findings.set(NAME, {"skipped": "smooth_quant is false in the config"})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        groups = find_groups(model)
        if not groups:
            return PassResult(model, False, {"examined": 0, "layers": 0})
        alphas = _grid(self.alphas)
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip is None and not alphas:
            skip = "no alpha to try (option alphas is empty)"
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        if not rereadable(ctx.calibration_data):
            ctx.findings.set(NAME, {"skipped": "the calibration data can be read only once (an iterator, or a "
                                             "reader without rewind()), and calibrate needs it"})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        try:
            tensors = {g.tensor.name: g.tensor.dtype if g.tensor.dtype is not None
                       else np.asarray(g.readers[0].weight.values).dtype for g in groups}
            stats, count = capture(model, tensors, ctx.calibration_data, self.samples, self.max_rows)
        except CalibrationDataError as exc:
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({exc})"})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        except Exception as exc:   # onnxruntime cannot run the model as it is: calibrate will say why
            ctx.findings.set(NAME, {"skipped": f"the float run failed ({first_line(exc)})"})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        if not count:
            ctx.findings.set(NAME, {"skipped": "no calibration sample could be read again"})
            return PassResult(model, False, {"examined": 0, "layers": 0})
        config = ctx.config
        kw = dict(activation_bits=_bits(config.activation_type), weight_bits=_bits(config.weight_type),
                  per_channel=bool(config.per_channel))
        feedable = overridable_initializers(model)
        graph_outputs = {t.name for t in model.graph.outputs}
        taken: set[str] | None = None
        rows, layers = [], {}
        for g in groups:
            st = stats[g.tensor.name]
            if st.cmin.shape[0] != g.channels:
                continue
            weights = [r.kn().astype(np.float32) for r in g.readers]
            c = choose(st, weights, alphas, min_ratio=self.min_outlier_ratio, min_gain_db=self.min_gain_db, **kw)
            row = {"tensor": g.tensor.name, "readers": [r.node.name for r in g.readers],
                   "outlier_ratio": round(c.outlier_ratio, 2)}
            if c.errors:
                row["error_db"] = {str(a): _db(e) for a, e in c.errors.items()}
            if c.alpha is None:
                row["left"] = ("no outlier channels" if not c.errors
                               else f"no alpha gains {self.min_gain_db:g} dB")
                rows.append(row)
                continue
            if taken is None:
                taken = used_names(model.graph)
            readers = {id(r.node) for r in g.readers}
            only_them = g.tensor.name not in graph_outputs and all(id(n) in readers for n in g.tensor.outputs)
            edits = fold_plan(g.tensor, g.channels, feedable, graph_outputs) if only_them else None
            how = apply_scale(model, g, c.scale, edits, taken, graph_outputs)
            row.update(alpha=c.alpha, how=how)
            rows.append(row)
            layers[g.tensor.name] = {"alpha": c.alpha, "readers": row["readers"], "outlier_ratio": row["outlier_ratio"],
                                     "error_db_before": _db(c.errors["none"]), "error_db_after": _db(c.errors[c.alpha]),
                                     "how": how}
        ctx.findings.set(NAME, {"samples": count, "layers": rows})
        stats_out = {"examined": len(rows), "layers": len(layers)}
        if not layers:
            return PassResult(model, False, stats_out)
        model.decisions[DECISION] = {"by": NAME, "layers": layers}
        return PassResult(model, True, stats_out)


def _db(err: float) -> float | None:
    """A relative squared error as an SNR in dB (rounded; None for no error)."""
    return round(-10 * math.log10(err), 2) if err > 0 else None

"""correct-bias: take the mean output shift that weight quantization causes out of the bias."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from ..analysis.scopes import scopes
from ..calibration.data import open_data
from ..calibration.segments import SegmentedSession
from ..core.pipeline import Pass, PassResult
from ..core.progress import progress
from ..core.registry import register
from ..errors import CalibrationDataError
from ..evaluation.evaluate import max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ..ir.analyses import GRAPH, RANGES
from ..ir.model import QModel
from ..quant.conv_pads import auto_pad_of, conv_pads
from ..quant.qdq import QParams, quantized_values
from ..quant.qparams import dequantize
from ..quant.qtypes import qtype

NAME = "correct-bias"
DECISION = "bias_correction"   # model.decisions key: who decided, and whether biases were corrected
WHY_PREFIX = NAME + ":"
CORRECTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})


@dataclass
class Target:
    """One layer to correct: its node, bias constant and weight quantization error, and the graph
    output of its probe (``probe``): for Conv/ConvTranspose the mean of each input tap over the
    output positions, [C_in, K1, ..., Kr] as ``taps`` lays them out; for Gemm the mean row of A."""

    node: gs.Node
    bias: str
    error: np.ndarray        # dequantized weight - weight
    probe: str = ""

    def shift(self, probes: np.ndarray) -> np.ndarray:
        """The mean output shift per output channel [F, C_out] from the probes' values of F feeds
        (for Conv/ConvTranspose laid out by ``taps``: [F, C_in, K])."""
        error, op = self.error.astype(np.float64), self.node.op
        groups = int(self.node.attrs.get("group", 1))
        if op == "Conv":   # error [C_out, C_in/group, K...]
            c_out, c_group = error.shape[:2]
            per_group = probes.reshape(len(probes), groups, c_group, -1)
            error = error.reshape(groups, c_out // groups, c_group, -1)
            return np.einsum("gcik,fgik->fgc", error, per_group).reshape(len(probes), c_out)
        if op == "ConvTranspose":   # error [C_in, C_out/group, K...]: input channel i feeds its group's outputs
            c_in, c_group = error.shape[:2]
            per_group = probes.reshape(len(probes), groups, c_in // groups, -1)
            error = error.reshape(groups, c_in // groups, c_group, -1)
            return np.einsum("giok,fgik->fgo", error, per_group).reshape(len(probes), -1)
        alpha = float(self.node.attrs.get("alpha", 1.0))   # Gemm: probe is the mean row of A
        return alpha * (probes @ error.T if self.node.attrs.get("transB", 0) else probes @ error)


def _weight_error(model: QModel, weight: str) -> np.ndarray | None:
    """dequantize(quantize(w)) - w for a constant weight with qparams, else None."""
    tq, tensor = model.quant.get(weight), model.tensors().get(weight)
    if tq is None or not tq.scale or not isinstance(tensor, gs.Constant) or tq.convert is not None:
        return None
    values = np.asarray(tensor.values)
    qp = QParams.make(weight, tq.qtype, tq.scale, tq.zero_point, tq.axis, values.ndim)
    restored = dequantize(quantized_values(values, qp).astype(np.int64), qp.scale, qp.zero_point, qp.axis)
    return (restored.astype(np.float64) - values.astype(np.float64)).astype(values.dtype)


def _bias_layers(model: QModel):
    """(bias name, its table entry, the Conv/ConvTranspose/Gemm reading it) for each constant bias
    the table quantizes (not fixed) with one such reader."""
    tensors, inner = model.tensors(), scopes(model)
    for name in sorted(model.quant):
        tq, bias = model.quant[name], tensors.get(name)
        if (tq.role == "bias" and not tq.fixed and isinstance(bias, gs.Constant) and len(bias.outputs) == 1
                and bias.outputs[0].op in CORRECTED_OPS
                and inner.scope_of(bias.outputs[0]) == 0):   # probes read main-graph tensors only
            yield name, tq, bias.outputs[0]


def has_candidates(model: QModel) -> bool:
    """Whether some Conv/ConvTranspose/Gemm reads a bias the table quantizes (before compute-qparams)."""
    return next(_bias_layers(model), None) is not None


def find_targets(model: QModel, activation_bits: int) -> list[Target]:
    """Conv/ConvTranspose/Gemm layers with a quantized constant weight and bias whose input is
    quantized to at least ``activation_bits`` bits."""
    targets = []
    for name, tq, node in _bias_layers(model):
        if not tq.derived_from or len(tq.derived_from) != 2:
            continue
        inp = model.quant.get(tq.derived_from[0])
        if (inp is None or qtype(inp.qtype).bits < activation_bits or node.inputs[0].name != tq.derived_from[0]
                or (node.op == "Gemm" and node.attrs.get("transA", 0))):
            continue
        error = _weight_error(model, tq.derived_from[1])
        if error is not None and np.any(error):
            targets.append(Target(node, name, error))
    return targets


def corrected_biases(model: QModel) -> dict[str, tuple[np.ndarray, str]]:
    """{bias: (values, why line)} of the biases this pass corrected (its ``why`` line is their last)."""
    tensors = model.tensors()
    return {name: (tensors[name].values, tq.why[-1]) for name, tq, _ in _bias_layers(model)
            if tq.why and tq.why[-1].startswith(WHY_PREFIX)}


def _reduce_mean(name: str, source: str, axes: list[int], opset: int) -> tuple[list, list]:
    """(nodes, initializers) of ReduceMean(source, axes, keepdims=0) -> name, for ``opset``."""
    if opset >= 18:
        axes_name = name + "_axes"
        return ([helper.make_node("ReduceMean", [source, axes_name], [name], keepdims=0)],
                [numpy_helper.from_array(np.asarray(axes, np.int64), axes_name)])
    return [helper.make_node("ReduceMean", [source], [name], axes=axes, keepdims=0)], []


def tap_indicators(node: gs.Node, in_shape, out_shape) -> list[np.ndarray] | None:
    """Per spatial axis of a Conv/ConvTranspose with these input and output shapes, the [size,
    kernel] matrix that maps the input positions to each kernel offset's mean over the output
    positions: contracting the input with all of them gives the mean of every input tap. None
    when the layer's padding cannot be told (ConvTranspose with auto_pad or output_shape)."""
    rank = len(in_shape) - 2
    kernel = list(node.inputs[1].shape[2:]) if node.inputs[1].shape else []
    attrs = node.attrs
    strides, dilations = attrs.get("strides", [1] * rank), attrs.get("dilations", [1] * rank)
    auto_pad = auto_pad_of(attrs)
    transposed = node.op == "ConvTranspose"
    if len(kernel) != rank or (transposed and (auto_pad != "NOTSET" or "output_shape" in attrs)):
        return None
    begins, _ = conv_pads(auto_pad, attrs.get("pads", [0] * 2 * rank), in_shape[2:], kernel, strides, dilations)
    out = []
    for j in range(rank):
        size, n_out, k, s, d = in_shape[2 + j], out_shape[2 + j], kernel[j], strides[j], dilations[j]
        begin = begins[j]
        matrix = np.zeros((size, k), np.float32)
        for tap in range(k):
            if transposed:   # input i reaches output i*s + tap*d - begin
                inputs = np.arange(size)
                outputs = inputs * s + tap * d - begin
            else:            # output o reads input o*s + tap*d - begin
                outputs = np.arange(n_out)
                inputs = outputs * s + tap * d - begin
            valid = (inputs >= 0) & (inputs < size) & (outputs >= 0) & (outputs < n_out)
            matrix[inputs[valid], tap] = 1
        out.append(matrix / n_out)
    return out


def shape_session(model: QModel, targets: list[Target]) -> tuple[SegmentedSession, list[str]]:
    """The float model (run in parts when big: SegmentedSession) whose outputs are the Shape of
    the Conv/ConvTranspose targets' inputs and outputs, and those tensors' names (none: no session
    runs, only ``specs`` is of use)."""
    names = sorted({n for t in targets if t.node.op != "Gemm" for n in (t.node.inputs[0].name, t.node.outputs[0].name)})

    def add_shapes(proto: onnx.ModelProto, available: set[str]) -> list[str]:
        added = []
        for name in names:
            if name in available:
                proto.graph.node.append(helper.make_node("Shape", [name], [f"{NAME}/shape/{name}"]))
                proto.graph.output.append(helper.make_tensor_value_info(f"{NAME}/shape/{name}", TensorProto.INT64, None))
                added.append(f"{NAME}/shape/{name}")
        return added

    return SegmentedSession(model, extend=add_shapes, graph_outputs=False), names


def _layer_shapes(shapes: SegmentedSession, names: list[str], feed: dict) -> dict[str, tuple]:
    """The shapes of the tensors ``names`` on ``feed`` (one run of ``shapes``, see shape_session)."""
    if not names:
        return {}
    values = shapes.run([f"{NAME}/shape/{name}" for name in names], feed)
    return {name: tuple(int(v) for v in value) for name, value in zip(names, values)}


def add_probes(proto: onnx.ModelProto, targets: list[Target], shapes: dict[str, tuple], opset: int,
               available: set[str] | None = None) -> list[str]:
    """Add to the float model ``proto`` (or a part of it: only the targets whose input is in
    ``available``) one probe output per target (see Target) and return their names: for
    Conv/ConvTranspose, the input contracted with each spatial axis' tap_indicators (MatMuls of
    C_in * size * kernel products: far fewer than the layer's) and averaged over the batch; for
    Gemm, the mean row. A layer whose shapes or padding are not known gets no probe (``probe``
    stays empty)."""
    graph, added = proto.graph, []
    for k, t in enumerate(targets):
        node, prefix, source = t.node, f"{NAME}/{k}", t.node.inputs[0].name
        if available is not None and source not in available:
            continue
        axes = [0]
        if node.op != "Gemm":
            in_shape, out_shape = shapes.get(source), shapes.get(node.outputs[0].name)
            indicators = tap_indicators(node, in_shape, out_shape) if in_shape and out_shape else None
            if indicators is None:
                continue
            if t.error.dtype != np.float32:
                graph.node.append(helper.make_node("Cast", [source], [f"{prefix}/x"], to=TensorProto.FLOAT))
                source = f"{prefix}/x"
            rank = len(indicators)
            for j in reversed(range(rank)):   # contract the last spatial axis, then bring the next one last
                if j < rank - 1:
                    perm = [a for a in range(2 + rank) if a != 2 + j] + [2 + j]
                    graph.node.append(helper.make_node("Transpose", [source], [f"{prefix}/t{j}"], perm=perm))
                    source = f"{prefix}/t{j}"
                graph.initializer.append(numpy_helper.from_array(indicators[j], f"{prefix}/a{j}"))
                graph.node.append(helper.make_node("MatMul", [source, f"{prefix}/a{j}"], [f"{prefix}/m{j}"]))
                source = f"{prefix}/m{j}"
        t.probe = f"{prefix}/mean"
        nodes, inits = _reduce_mean(t.probe, source, axes, opset)
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
        elem = TensorProto.FLOAT if node.op != "Gemm" else helper.np_dtype_to_tensor_dtype(t.error.dtype)
        graph.output.append(helper.make_tensor_value_info(t.probe, elem, None))
        added.append(t.probe)
    return added


def taps(node: gs.Node, probe_value: np.ndarray) -> np.ndarray:
    """A probe's value laid out as [C_in, K1 * ... * Kr] (the MatMuls leave the axes as [C_in, Kr, ..., K1])."""
    probe_value = np.asarray(probe_value)
    if node.op == "Gemm":
        return probe_value
    rank = probe_value.ndim - 1
    return probe_value.transpose(0, *range(rank, 0, -1)).reshape(probe_value.shape[0], -1)


@register
class CorrectBias(Pass):
    """Subtract from each bias the mean output shift its layer's quantized weight causes.

    Reads: the table after compute-qparams (weights' scale/zero point, the input's type), the
    float graph and the first ``samples`` calibration feeds. For each Conv/ConvTranspose/Gemm with a
    quantized constant weight and a bias, whose input is quantized to at least ``activation_bits``
    bits, E[y_q - y] per output channel = the layer applied to (float input, dequantized weight -
    weight), averaged over the feeds and positions. It is linear in the mean of each input tap over
    the output positions, which one float run per feed measures with two small MatMuls per layer
    (exact for strides, pads, dilations and groups; the first feed's shapes are used, feeds of
    other shapes are skipped). Writes: that shift subtracted from the float bias (insert-qdq quantizes the result),
    a ``why`` line on the bias, ``model.decisions["bias_correction"]`` (so a second run does nothing). Rounding a weight moves every
    output by the same amount on average whenever the input's mean is not 0, and filters whose taps
    nearly cancel (ppocr's 3x3 depthwise edge filters on inputs far from 0) turn it into a large
    error: output SNR +2.9 to +17.5 dB at U16/S8 on the benchmark CNNs (tools/bench_correct_bias.py).
    At U8/S8 the activations' own rounding dominates: -0.1 to +4.2 dB with the default ranges,
    -1 to -2.4 dB on ppocr_v4_det with min/max ranges, for one more float run over the feeds
    (+4 s on resnet50_rand); hence ``activation_bits`` = 16 by default (16-bit and mixed-precision
    layers).
    Rounding does not always err one way, and the mean shift of a channel is only corrected where
    it stands ``significance`` standard errors (over the feeds) from 0 (default 0: all).
    ``select-by-snr{bias_correction=true}`` scores the model with and without it and decides, and
    then this pass does nothing more.
    Invariants: the graph and the weights are unchanged; only bias values move; nothing is done (it
    says why) without re-readable calibration data or above ``max_nodes`` / ``max_weight_mb``, or
    when ``model.decisions["bias_correction"]`` exists (it ran, or select-by-snr decided).
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, RANGES})   # it changes bias values and the table
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 1, 4, 4] x) => (float[1, 2, 4, 4] y) <float[2, 1, 3, 3] w = {0.31, -0.52, 0.2, -0.45,
        0.93, -0.41, 0.17, -0.49, 0.26, 0.05, 0.11, 0.021, 0.13, 0.7, 0.09, 0.033, 0.12, 0.06},
        float[2] b = {0.5, -0.25}>
        {
            y = Conv <pads = [1, 1, 1, 1]> (x, w, b)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate,compute-qparams"
    example_config: ClassVar[dict] = {"activation_type": "uint16"}   # it corrects 16-bit layers by default

    samples: int = field(default=32, metadata={"help": "calibration feeds the shifts are averaged over"})
    activation_bits: int = field(default=16, metadata={
        "help": "correct only layers whose input is quantized to at least this many bits (8: all; "
                "at 8 bits the measured effect was -2.4 to +4.2 dB and it costs a float run)"})
    significance: float = field(default=0.0, metadata={
        "help": "correct a channel only where its mean shift is this many standard errors from 0 "
                "(an SE-block Conv after GlobalAveragePool sees one value per sample: its mean is noise)"})
    max_nodes: int = max_nodes_option(2000, "one onnxruntime session over the whole float graph; calibrate cuts "
                                            "bigger ones into parts")
    max_weight_mb: float = max_weight_mb_option(512.0, "the weight errors are added to a copy")

    def run(self, model: QModel, ctx) -> PassResult:
        if DECISION in model.decisions:   # done already, or select-by-snr decided
            return PassResult(model, False, {"layers": 0})
        if not has_candidates(model):
            return PassResult(model, False, {"layers": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"layers": 0})
        targets = find_targets(model, self.activation_bits)
        if not targets:
            return PassResult(model, False, {"layers": 0})
        bar = progress(ctx, NAME, self.samples)
        try:
            shape_sess, names = shape_session(model, targets)   # the float model, run in parts when big
            feeds = open_data(ctx.calibration_data).validated(shape_sess.specs, self.samples)
            count, other_shapes, sess, shape_of = 0, 0, None, None
            for feed in feeds:
                if sess is None:   # the probes are built for the first feed's shapes
                    shape_of = {name: np.shape(v) for name, v in feed.items()}
                    shapes, shape_sess = _layer_shapes(shape_sess, names, feed), None
                    sess = SegmentedSession(model, graph_outputs=False, extend=lambda proto, available: add_probes(
                        proto, targets, shapes, model.opset, available))
                    targets = [t for t in targets if t.probe]
                    probes: list[list] = [[] for _ in targets]   # per target, its probe's value per feed
                    if not targets:
                        break
                if any(np.shape(v) != shape_of[name] for name, v in feed.items()):
                    other_shapes += 1
                    continue
                for k, value in enumerate(sess.run([t.probe for t in targets], feed)):
                    probes[k].append(taps(targets[k].node, value))
                count += 1
                bar.update(count)
        except CalibrationDataError as exc:
            bar.close()
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({exc})"})
            return PassResult(model, False, {"layers": 0})
        bar.close()
        if not targets:
            ctx.findings.set(NAME, {"skipped": "no layer with known shapes and padding to correct"})
            return PassResult(model, False, {"layers": 0})
        if count < 2:
            where = " in the first one's shapes" if other_shapes else ""
            ctx.findings.set(NAME, {"skipped": f"{count} calibration sample(s) could be read again{where}; "
                                             f"at least 2 are needed"})
            return PassResult(model, False, {"layers": 0})
        tensors, kept, channels = model.tensors(), 0, 0
        for t, values in zip(targets, probes):
            per_feed = t.shift(np.asarray(values, np.float64))
            mean = per_feed.mean(axis=0)
            spread = per_feed.std(axis=0, ddof=1) / np.sqrt(count)   # standard error of the mean
            significant = np.abs(mean) > self.significance * spread
            shift = np.where(significant, mean, 0.0)   # per output channel: the bias' last axis
            bias = tensors[t.bias]
            values = np.asarray(bias.values)
            bias.values = (values.astype(np.float64) - shift).astype(values.dtype)
            kept, channels = kept + int(significant.sum()), channels + significant.size
            model.quant[t.bias].because(
                f"{WHY_PREFIX} minus the mean output shift of the quantized weight over {count} calibration "
                f"samples on {int(significant.sum())} of {significant.size} channels (largest "
                f"{float(np.abs(shift).max(initial=0.0)):.3g}; the others are within "
                f"{self.significance:g} standard errors of 0)")
        ctx.findings.set(NAME, {"layers": len(targets), "samples": count, "channels": channels,
                                "channels_corrected": kept}
                         | ({"samples_of_other_shapes": other_shapes} if other_shapes else {}))
        model.decisions[DECISION] = {"by": NAME, "applied": True}
        return PassResult(model, True, {"layers": len(targets), "samples": count})

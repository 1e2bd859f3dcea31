"""correct-bias: take the mean output shift that weight quantization causes out of the bias."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from ..calibration.data import model_inputs, open_data
from ..errors import CalibrationDataError
from ..evaluate import rerun_skip_reason, session
from ..ir import QModel
from ..pipeline import Pass, PassResult
from ..qdq import QParams, quantized_values
from ..qparams import dequantize
from ..qtypes import qtype
from ..registry import register

NAME = "correct-bias"
WHY_PREFIX = NAME + ":"
CORRECTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})
TAP_OUTPUTS = 8   # Conv outputs per group up to which running the layer on its error is cheaper than tap means


@dataclass
class Target:
    """One layer to correct: its node, bias constant and weight quantization error, and the graph
    output measuring what the shift is computed from (``probe``)."""

    node: gs.Node
    bias: str
    error: np.ndarray        # dequantized weight - weight
    probe: str = ""
    direct: bool = False     # the probe is the layer run on the weight error: it is the shift

    def shift(self, probe_mean: np.ndarray) -> np.ndarray:
        """The mean output shift per output channel from the probe's mean over the samples."""
        error, op = self.error, self.node.op   # probe_mean is float64: the products are too
        if self.direct:
            return probe_mean
        if op == "Conv":   # probe: mean of each input tap (channel ci, kernel offset k) over the outputs
            groups = int(self.node.attrs.get("group", 1))
            c_out, c_group = error.shape[:2]
            taps = probe_mean.reshape(groups, c_group, -1)[np.arange(c_out) // (c_out // groups)]
            return np.einsum("oik,oik->o", error.reshape(c_out, c_group, -1), taps)
        if op == "Gemm":   # probe: mean row of A
            alpha = float(self.node.attrs.get("alpha", 1.0))
            return alpha * (error @ probe_mean if self.node.attrs.get("transB", 0) else probe_mean @ error)
        raise AssertionError(f"no tap probe for {op}")


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
    tensors = model.tensors()
    for name in sorted(model.quant):
        tq, bias = model.quant[name], tensors.get(name)
        if (tq.role == "bias" and not tq.fixed and isinstance(bias, gs.Constant) and len(bias.outputs) == 1
                and bias.outputs[0].op in CORRECTED_OPS):
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


def _tap_kernel(channels: int, kernel: tuple[int, ...], dtype) -> np.ndarray:
    """Depthwise one-hot kernels: output channel ci*K + k copies input channel ci at kernel offset k."""
    taps = int(np.prod(kernel))
    bank = np.zeros((channels * taps, 1, taps), dtype)
    bank[np.arange(channels * taps), 0, np.tile(np.arange(taps), channels)] = 1
    return bank.reshape(channels * taps, 1, *kernel)


def probe_model(model: QModel, targets: list[Target]) -> onnx.ModelProto:
    """The float model with one averaged probe per target: for Conv with more than TAP_OUTPUTS
    outputs per group, the mean of each input tap over the output positions (a one-hot depthwise
    Conv with the layer's strides, pads and dilations: C_in*K outputs instead of the layer's
    C_out*C_in/group*K products); for Gemm, the mean row; else (depthwise Conv, ConvTranspose) the
    layer itself run on its weight error."""
    proto = model.to_proto(metadata=False)
    graph = proto.graph
    del graph.output[:]
    for k, t in enumerate(targets):
        node, prefix = t.node, f"{NAME}/{k}"
        t.probe, rank = f"{prefix}/mean", t.error.ndim
        attrs = {key: v for key, v in node.attrs.items() if key not in ("beta", "alpha", "group", "transB")}
        groups = int(node.attrs.get("group", 1))
        t.direct = node.op == "ConvTranspose" or (node.op == "Conv" and t.error.shape[0] // groups <= TAP_OUTPUTS)
        if t.direct:
            attrs = dict(node.attrs)
            const = t.error
        elif node.op == "Conv":
            channels = t.error.shape[1] * groups
            attrs["group"] = channels
            const = _tap_kernel(channels, t.error.shape[2:], t.error.dtype)
        else:
            const = None
        if const is None:
            source, axes = node.inputs[0].name, [0]
        else:
            source, axes = f"{prefix}/out", [0, *range(2, rank)]
            graph.initializer.append(numpy_helper.from_array(const, f"{prefix}/kernel"))
            graph.node.append(helper.make_node(node.op, [node.inputs[0].name, f"{prefix}/kernel"], [source], **attrs))
        nodes, inits = _reduce_mean(t.probe, source, axes, model.opset)
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
        elem = helper.np_dtype_to_tensor_dtype(t.error.dtype)
        graph.output.append(helper.make_tensor_value_info(t.probe, elem, None))
    return proto


@register
class CorrectBias(Pass):
    """Subtract from each bias the mean output shift its layer's quantized weight causes.

    Reads: the table after compute-qparams (weights' scale/zero point, the input's type), the
    float graph and the first ``samples`` calibration feeds. For each Conv/ConvTranspose/Gemm with a
    quantized constant weight and a bias, whose input is quantized to at least ``activation_bits``
    bits, E[y_q - y] per output channel = the layer applied to (float input, dequantized weight -
    weight), averaged over the feeds and positions (probe_model measures it in one onnxruntime run
    per feed). Writes: that shift subtracted from the float bias (insert-qdq quantizes the result),
    a ``why`` line on the bias, ``model.report["correct-bias"]``. Rounding a weight moves every
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
    when ``model.report["correct-bias"]`` exists (select-by-snr decided).
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    establishes: ClassVar[frozenset] = frozenset({"bias-corrected"})
    invalidates: ClassVar[frozenset] = frozenset({"bias-scales-fixed"})
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

    samples: int = field(default=32, metadata={"help": "calibration feeds the shifts are averaged over"})
    activation_bits: int = field(default=16, metadata={
        "help": "correct only layers whose input is quantized to at least this many bits (8: all; "
                "at 8 bits the measured effect was -2.4 to +4.2 dB and it costs a float run)"})
    significance: float = field(default=0.0, metadata={
        "help": "correct a channel only where its mean shift is this many standard errors from 0 "
                "(an SE-block Conv after GlobalAveragePool sees one value per sample: its mean is noise)"})
    max_nodes: int = field(default=2000, metadata={
        "help": "do nothing for graphs with more nodes than this (one onnxruntime session over the "
                "whole float graph; calibrate cuts bigger ones into parts)"})
    max_weight_mb: float = field(default=512.0, metadata={
        "help": "do nothing for models with more weight data than this (the weight errors are added to a copy)"})

    def run(self, model: QModel) -> PassResult:
        if NAME in model.report:   # select-by-snr already applied it, or scored it worse
            return PassResult(model, False, {"layers": 0})
        if not has_candidates(model):
            return PassResult(model, False, {"layers": 0})
        skip = rerun_skip_reason(model, self.max_nodes, self.max_weight_mb)
        if skip:
            model.report[NAME] = {"skipped": skip}
            return PassResult(model, False, {"layers": 0})
        targets = find_targets(model, self.activation_bits)
        if not targets:
            return PassResult(model, False, {"layers": 0})
        proto = probe_model(model, targets)
        try:
            feeds = open_data(model.calibration_data).validated(model_inputs(proto), self.samples)
            sess = session(proto)
            sums, squares, count = [0.0] * len(targets), [0.0] * len(targets), 0
            for feed in feeds:
                for k, (t, value) in enumerate(zip(targets, sess.run([t.probe for t in targets], feed))):
                    shift = t.shift(np.asarray(value, np.float64))
                    sums[k], squares[k] = sums[k] + shift, squares[k] + shift * shift
                count += 1
        except CalibrationDataError as exc:
            model.report[NAME] = {"skipped": f"the calibration data cannot be read again ({exc})"}
            return PassResult(model, False, {"layers": 0})
        if count < 2:
            model.report[NAME] = {"skipped": f"{count} calibration sample(s) could be read again; at least 2 are needed"}
            return PassResult(model, False, {"layers": 0})
        tensors, kept, channels = model.tensors(), 0, 0
        for t, total, square in zip(targets, sums, squares):
            mean = total / count
            spread = np.sqrt(np.maximum(square / count - mean * mean, 0.0) * count / (count - 1) / count)
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
        model.report[NAME] = {"layers": len(targets), "samples": count, "channels": channels,
                              "channels_corrected": kept}
        return PassResult(model, True, {"layers": len(targets), "samples": count})

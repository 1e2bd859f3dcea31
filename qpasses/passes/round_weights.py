"""round-weights: choose each integer weight's codes to minimise its layer's output error (GPTQ)."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.saturation import pair_grids, within_pairs
from ..analysis.weighted_layers import Target, batches, checked_values, find_targets, measure, restore as _restore
from ..core.pipeline import Pass, PassResult, Pipeline, pipeline_option
from ..core.registry import register
from ..errors import CalibrationDataError, first_line
from ..evaluation.evaluate import max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ..ir.analyses import GRAPH, RANGES
from ..ir.decisions import PRECISION_SEARCH
from ..ir.model import QModel
from ..quant.qtypes import qtype
from ..quant.rounding import round_codes

NAME = "round-weights"
DECISION = "weight_rounding"


@register
class RoundWeights(Pass):
    """Pick each integer weight's codes to minimise its layer's output error on calibration data (GPTQ).

    Reads: the table's scale and zero point of each constant Conv/MatMul/Gemm weight (after
    compute-qparams) and the calibration data (X^T X of each layer's float input, sampled rows of
    its receptive fields, one streamed float run per batch of layers). Writes: each such weight's
    float values become its rounded codes dequantized (on its grid, so insert-qdq stores exactly
    those codes), with a why-line; ``model.decisions["weight_rounding"]``. Round-to-nearest error
    is spread over the inputs not yet rounded, weighted by the inverse of X^T X (on ppocr_v4_rec,
    8-bit weights alone: 14.9 -> 28.9 dB output SNR); then the rounded weights' mean output change on
    the calibration data leaves the bias (without it one ppocr_v4_rec A16W8 draw fell from 22.1 to
    15.5 dB; with it every draw gains). Layers whose input is 8-bit are left alone by default
    (``below_aim``: also when search-precision ended below its aim), except those protect-pair-sums
    put on a pair-safe grid: its coarser steps are what GPTQ recovers (crnn_lstm, 32 held-out samples:
    39.1 -> 41.6 dB), and their codes keep every pair within int16 (analysis.saturation.within_pairs). With ``check``, the model with
    the new codes and with round-to-nearest go through ``then`` and are scored (the worst output
    component, search-precision's metric) on ``check_samples`` calibration feeds after the ones
    search-precision chose its promotions on (else the first ones); the codes are kept unless they
    score lower by more than ``tolerance_db`` plus one standard error of the paired difference
    (``weight_rounding["checked"]``).
    Invariants: codes within the type's range; scales and zero points unchanged; a second run
    changes nothing.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, RANGES})   # it changes weight and bias values and the table
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 3, 5, 5] x) => (float[1, 2, 5, 5] y) <float[2, 3, 1, 1] w = {0.31, -0.52, 0.2, -0.45,
        0.93, -0.41}, float[2] b = {0.5, -0.25}>
        {
            y = Conv (x, w, b)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate,compute-qparams"
    example_config: ClassVar[dict] = {"activation_type": "uint16"}   # it rounds layers with 16-bit inputs by default

    activation_bits: int = field(default=16, metadata={
        "help": "round only layers whose input is float or quantized to at least this many bits (8: all; "
                "with 8-bit inputs the activation grids set the error: no gain measured on ppocr_v4_rec, "
                "bert_encoder, ppocr_v2_cls, crnn_lstm, for a float run)"})
    grids: bool = field(default=True, metadata={
        "help": "round the layers protect-pair-sums put on a pair-safe grid whatever their input's bits"})
    below_aim: bool = field(default=False, metadata={
        "help": "round the layers with 8-bit inputs too when search-precision ended below its aim; off by default: "
                "over 8 ppocr_v4_rec draws it gave +0.4 dB mean but text 0.859 against 0.883, one draw 3 dB lower "
                "(ppocr_v4_det +0.3 dB over 4; tools/README.md)"})
    samples: int = field(default=16, metadata={"help": "calibration feeds X^T X is accumulated over"})
    min_rows: float = field(default=8.0, metadata={
        "help": "round a layer only when its sampled input rows are at least this many times its inputs "
                "per channel (a Conv after GlobalAveragePool sees one row per sample: GPTQ on 16 rows "
                "of 480 inputs fitted those rows and cost ppocr_v4_rec 7 dB on other data)"})
    correct_bias: bool = field(default=True, metadata={
        "help": "take the rounded weights' mean output change on the calibration data out of the bias"})
    check: bool = field(default=True, metadata={
        "help": "keep the codes only if the worst output component scores (almost) as high with them as "
                "with round-to-nearest (one ppocr_v2_cls draw: 33.3 -> 14.1 dB with the codes of a layer "
                "search-precision kept float)"})
    check_samples: int = field(default=16, metadata={
        "help": "calibration feeds the check scores (the first half only when the codes score at least as "
                "high there): those after the ones search-precision chose its "
                "promotions on, which favour round-to-nearest (on 8 of them one ppocr_v4_rec draw read "
                "-2.2 dB for codes that gained 0.4 on its eval set)"})
    tolerance_db: float = field(default=1.0, metadata={
        "help": "dB of SNR the codes may score below round-to-nearest and still be kept (other metrics: none)"})
    then: Pipeline = pipeline_option("fix-bias-scales,insert-qdq,insert-converts",
                                     "the passes that turn the model into the QDQ model the check scores")
    damping: float = field(default=0.01, metadata={"help": "added to diag(X^T X), times its mean"})
    max_hessian_mb: float = field(default=256.0, metadata={
        "help": "X^T X of the layers measured in one float run (more layers: more runs); a layer "
                "whose own X^T X is larger keeps round-to-nearest"})
    max_nodes: int = max_nodes_option(20000)
    max_weight_mb: float = max_weight_mb_option(1024.0, than_this=False)

    def run(self, model: QModel, ctx) -> PassResult:
        if DECISION in model.decisions:
            return PassResult(model, False, {"rounded": 0})
        short = self.below_aim and model.decisions.get(PRECISION_SEARCH, {}).get("aim_met") is False
        grids = frozenset(pair_grids(model)) if self.grids else frozenset()   # coarser steps: rounded whatever their input
        targets = find_targets(model, 8 if short else self.activation_bits, also=grids)
        if not targets:
            return PassResult(model, False, {"rounded": 0})
        if model.decisions.get("weight_reconstruction", {}).get("reconstructed"):
            ctx.findings.set(NAME, {"skipped": "reconstruct-weights chose the codes"})
            return PassResult(model, False, {"rounded": 0})
        if model.decisions.get("bias_correction", {}).get("applied"):
            ctx.findings.set(NAME, {"skipped": "the biases were corrected for round-to-nearest weights"})
            return PassResult(model, False, {"rounded": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"rounded": 0})
        budget = self.max_hessian_mb * 2**20
        targets = [t for t in targets if t.geo.h_bytes <= budget]
        rounded, samples, few, originals, notes = 0, 0, 0, {}, []
        try:
            for batch in batches(targets, budget):
                samples = measure(model, ctx.calibration_data, batch, self.samples, self.min_rows) or samples
                for t in batch:
                    if t.hessian is None or t.hessian.rows < self.min_rows * t.geo.k:
                        few += 1
                        t.hessian = None
                    else:
                        rounded += self._round(model, t, samples, originals, notes, t.weight.name in grids)
            checked = None
            if self.check and rounded:   # scored from the float model the codes were chosen for
                new = {name: c.values for name, (c, _) in originals.items()}
                _restore(originals)
                checked = checked_values(model, ctx, new, self.then, self.check_samples, self.tolerance_db)
                if checked["kept"]:
                    _restore({name: (c, new[name]) for name, (c, _) in originals.items()})
        except CalibrationDataError as exc:
            _restore(originals)
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
            return PassResult(model, False, {"rounded": 0})
        if checked is not None and not checked["kept"]:
            rounded, notes = 0, []
        for tq, why in notes:
            tq.because(why)
        summary = {"layers": len(targets), "rounded": rounded, "samples": samples, "too_few_rows": few,
                   **({"checked": checked} if checked else {})}
        model.decisions[DECISION] = {"by": NAME} | summary
        ctx.findings.set(NAME, summary)
        return PassResult(model, True, {"rounded": rounded, "samples": samples})

    def _round(self, model: QModel, t: Target, samples: int, originals: dict, notes: list, grid: bool) -> bool:
        tq = model.quant[t.weight.name]
        values = np.asarray(t.weight.values)
        rows = t.to_rows(values.astype(np.float64))
        scale, zero = t.per_row(tq.scale, values.shape), t.per_row(tq.zero_point, values.shape)
        qt = qtype(tq.qtype)
        codes = round_codes(rows, scale, zero, qt.qmin, qt.qmax, t.hessian.h, self.damping)
        if grid:   # protect-pair-sums' grid: zero point 0
            codes = within_pairs(t, codes, rows / scale[..., None], qt)
        rounded = (codes - zero[..., None]) * scale[..., None]
        new = t.from_rows(rounded, values.shape).astype(values.dtype)
        shift = np.einsum("grk,gk->gr", rounded - rows, t.hessian.mean).ravel()   # mean output change
        t.hessian = None
        if np.array_equal(new, values):
            return False
        originals[t.weight.name] = (t.weight, values)
        t.weight.values = new
        bias = t.node.inputs[2] if len(t.node.inputs) > 2 and t.node.op != "MatMul" else None
        if self.correct_bias and isinstance(bias, gs.Constant) and np.size(bias.values) == shift.size \
                and len(bias.outputs) == 1:
            if t.node.op == "Gemm":   # y = alpha A B + beta C
                shift = shift * float(t.node.attrs.get("alpha", 1.0)) / float(t.node.attrs.get("beta", 1.0) or 1.0)
            old = np.asarray(bias.values)
            originals[bias.name] = (bias, old)
            bias.values = (old.astype(np.float64) - shift.reshape(old.shape)).astype(old.dtype)
            if bias.name in model.quant:
                notes.append((model.quant[bias.name], f"{NAME}: minus the rounded weights' mean output change on "
                                                      f"{samples} calibration samples"))
        notes.append((tq, f"{NAME}: codes chosen to minimise the output error of '{t.node.name}' on {samples} "
                          f"calibration samples (GPTQ with these scales)"))
        return True

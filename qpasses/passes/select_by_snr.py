"""select-by-snr: quantize a few variants end to end and keep the one whose outputs are closest to float."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np

from ..calibration.data import open_data
from ..calibration.softmax import ROW_MAX_SUFFIX
from ..errors import CalibrationDataError, first_line
from ..evaluate import Reference, rerun_skip_reason
from ..ir import QModel
from ..pipeline import Pass, PassManager, PassResult
from ..registry import register
from .compute_qparams import config_of
from .correct_bias import NAME as CORRECT_BIAS, corrected_biases, has_candidates

NAME = "select-by-snr"
MIN_SAMPLES = 8


@dataclass
class Variant:
    """One choice on one axis: a name, what it does to a model, and its handicap in dB."""

    axis: str
    name: str
    apply: Callable[[QModel], None]
    changes: bool = True                 # False: the model as it is
    penalty_db: float = 0.0
    why: tuple[list[str], str] = ([], "")  # table entries it changes and the reason it gives them


def range_variants(model: QModel) -> list[Variant]:
    """The calibrated ranges, or the observed min/max (only when the user did not pick the method)."""
    info = model.report.get("calibrate", {})
    method = info.get("method", config_of(model).calibration.method)
    if info.get("method_given", True) or method == "minmax":
        return []
    observed = {k: v for k, v in model.observed.items() if not k.endswith(ROW_MAX_SUFFIX)}
    if all(model.ranges.get(k) == v for k, v in observed.items()):
        return []

    def use_minmax(m: QModel) -> None:
        m.ranges = {k: observed.get(k, v) for k, v in m.ranges.items()}
        m.report.setdefault("calibrate", {}).update(method="minmax", chosen=f", chosen by {NAME} over {method}")

    return [Variant("ranges", method, lambda m: None, changes=False), Variant("ranges", "minmax", use_minmax)]


GEMM_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


def _gemm_weight(tensor) -> bool:
    """Read only as the weight (second input) of Conv/ConvTranspose/MatMul/Gemm."""
    readers = tensor.outputs if tensor is not None else []
    return bool(readers) and all(n.op in GEMM_OPS and len(n.inputs) > 1 and n.inputs[1] is tensor
                                 for n in readers)


def asymmetric_weights(model: QModel) -> list[str]:
    """Per-tensor Conv/MatMul/Gemm weights that are asymmetric by default (neither the config nor
    an override asks for it)."""
    config = config_of(model)
    if "weight_symmetric" in config.given:
        return []
    overridden = {name for name, rows in config.tensor_overrides.items()
                  if any("symmetric" in row for row in rows)}
    tensors = model.tensors()
    return [name for name, tq in model.quant.items()
            if tq.role == "weight" and tq.axis is None and not tq.symmetric and not tq.fixed
            and tq.convert is None and name not in overridden and _gemm_weight(tensors.get(name))]


def weight_variants(model: QModel, penalty_db: float) -> list[Variant]:
    """Per-tensor weights symmetric (onnxruntime's fastest int8 kernels) or asymmetric."""
    names = asymmetric_weights(model)
    if not names:
        return []

    def symmetric(m: QModel) -> None:
        for name in names:
            m.quant[name].symmetric = True

    why = (names, f"symmetric: {NAME} scored symmetric per-tensor weights best (report['{NAME}'])")
    return [Variant("weights", "asymmetric", lambda m: None, changes=False, penalty_db=penalty_db),
            Variant("weights", "symmetric", symmetric, why=why)]


def _label(combo) -> str:
    return ", ".join(f"{v.axis} {v.name}" for v in combo)


@register
class SelectBySnr(Pass):
    """Quantize each open variant on a copy, score its output SNR vs float, keep the best.

    Reads: the table, ranges and observed min/max (after calibrate and annotate-types), the first
    ``samples`` calibration feeds (fewer, at least 8, for big outputs or inputs) with the float
    outputs calibrate kept for them (else the float model runs on them again). Open axes: ``ranges`` (the calibrated ranges or the observed
    min/max; only when ``calibration.method`` was not chosen by the user) and ``weights``
    (per-tensor weights symmetric or asymmetric; only when ``weight_symmetric`` was not given).
    Each combination runs ``then`` on a copy of the model and is scored by the lowest output SNR
    over the feeds, minus a penalty: ``asymmetric_penalty_db`` trades accuracy for onnxruntime's
    faster symmetric kernels (by default it only settles ties); then the first wins (calibrated
    ranges, asymmetric weights: the measured defaults). With ``bias_correction``, the chosen variant
    is scored once more with correct-bias run after compute-qparams; its corrected biases are kept
    only if the SNR is higher. Writes: the chosen variant into ``model.ranges`` / the table (with a
    ``why`` line), the corrected bias values (or not) and ``model.report["correct-bias"]`` (so the
    correct-bias pass does nothing more), ``model.report["select-by-snr"]`` (every score).
    Invariants: the graph is not changed (copies share its weight arrays, read-only); nothing is
    done (and it says why) without re-readable calibration data or above ``max_weight_mb`` /
    ``max_nodes``.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    establishes: ClassVar[frozenset] = frozenset({"variant-selected"})
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 8] x) => (float[1, 4] y) <float[8, 4] w = {0.9, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.4,
        0.2, 0.3, 0.4, 0.5, 0.3, 0.4, 0.5, 0.6, 0.4, 0.5, 0.6, 0.7, 0.5, 0.6, 0.7, 0.8, 0.6, 0.7, 0.8,
        0.9, 0.7, 0.8, 0.9, -0.1}>
        {
            y = MatMul(x, w)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate"

    samples: int = field(default=32, metadata={"help": "calibration feeds each variant is scored on "
                                                          "(16 could not tell ppocr_v2_cls' weight grids apart)"})
    output_values: int = field(default=2**20, metadata={
        "help": "fewer feeds (at least 8) once the outputs compared hold this many values (big outputs "
                "average out noise: a detection map needs fewer images than class scores)"})
    asymmetric_penalty_db: float = field(default=0.05, metadata={
        "help": "dB asymmetric per-tensor weights must gain to be chosen: onnxruntime's int8 kernels "
                "run them up to ~14 % slower (the default only settles ties)"})
    max_weight_mb: float = field(default=512.0, metadata={
        "help": "do nothing for models with more weight data than this (each variant quantizes a copy)"})
    max_nodes: int = field(default=2000, metadata={
        "help": "do nothing for graphs with more nodes than this (each variant costs a quantization "
                "and an onnxruntime session)"})
    fused_nodes: int = field(default=1000, metadata={
        "help": "score with onnxruntime's fused integer kernels up to this many nodes; above, the "
                "Q/DQ nodes run as written (fusing a 3,200-Conv QDQ graph takes onnxruntime 8 s)"})
    bias_correction: bool = field(default=False, metadata={
        "help": "also score the chosen variant with correct-bias and keep the corrected biases only "
                "if they score higher (else correct-bias does nothing); off by default: on the "
                "benchmark it cost time and chose worse than always correcting (tools/README.md)"})
    then: str = field(default="compute-qparams,fix-bias-scales,insert-qdq,insert-converts", metadata={
        "help": "the passes that turn a variant into the QDQ model that is scored"})

    def run(self, model: QModel) -> PassResult:
        axes = [a for a in (range_variants(model), weight_variants(model, self.asymmetric_penalty_db)) if a]
        bias = self.bias_correction and "compute-qparams" in self.then.split(",") and has_candidates(model)
        if not axes and not bias:
            return PassResult(model, False, {"variants": 0})
        skip = rerun_skip_reason(model, self.max_nodes, self.max_weight_mb)
        if skip:
            model.report[NAME] = {"skipped": skip}
            return PassResult(model, False, {"variants": 0})
        reference = self._reference(model)
        model.kept_samples = None   # scored from here on: free them before the rest of the pipeline
        if reference is None:
            model.report[NAME] = {"skipped": "the calibration data cannot be read again"}
            return PassResult(model, False, {"variants": 0})
        scored, failed = [], []
        for combo in itertools.product(*axes):
            snr = self._score(model, combo, reference, failed)
            if snr is not None:
                scored.append((snr - sum(v.penalty_db for v in combo), snr, combo))
        report = {"samples": len(reference.feeds)}
        if failed:
            report["failed"] = failed
        if not scored:   # the passes after this one will meet the same problem and say so
            model.report[NAME] = report | {"skipped": "no variant could be quantized and run"}
            return PassResult(model, False, {"variants": 0})
        best = max(scored, key=lambda s: s[0])   # first wins ties: the order above is the preference
        for variant in best[2]:
            variant.apply(model)
            names, reason = variant.why
            for name in names:
                model.quant[name].because(reason)
        report |= {"chosen": _label(best[2]) or "as configured",
                   "variants": [{"variant": _label(c) or "as configured", "snr_db": round(snr, 2),
                                 "penalty_db": round(snr - s, 2)} for s, snr, c in scored]}
        corrected = self._bias_correction(model, best[1], reference, report) if bias else False
        model.report[NAME] = report
        return PassResult(model, any(v.changes for v in best[2]) or corrected, {"variants": len(scored)})

    def _bias_correction(self, model: QModel, snr: float, reference: Reference, report: dict) -> bool:
        """Score the chosen variant with correct-bias; keep its biases if that scores higher. Either
        way ``model.report["correct-bias"]`` says what happened, and the pass itself does nothing more."""
        then = self.then.split(",")
        cut = then.index("compute-qparams") + 1
        try:
            trial = model.copy(share_weights=True)
            PassManager(",".join(then[:cut] + [CORRECT_BIAS])).run(trial)
            info, biases = trial.report.get(CORRECT_BIAS, {}), corrected_biases(trial)
            corrected = self._finish_and_score(trial, ",".join(then[cut:]), reference)
        except Exception as exc:   # scored like any variant: a failure is reported, not fatal
            report.setdefault("failed", []).append({"variant": CORRECT_BIAS, "error": f"{type(exc).__name__}: {first_line(exc)}"})
            model.report[CORRECT_BIAS] = {"skipped": f"{NAME}: it failed on a copy ({first_line(exc)})"}
            return False
        gain = corrected - snr
        report["bias_correction"] = {"snr_db": round(corrected, 2), "gain_db": round(gain, 2), "applied": gain > 0}
        if gain <= 0 or not biases:
            model.report[CORRECT_BIAS] = {"skipped": f"{NAME} scored the model {gain:+.2f} dB with it" if biases
                                          else info.get("skipped", "no layer to correct")}
            return False
        tensors = model.tensors()
        for name, (values, why) in biases.items():
            tensors[name].values = values
            model.quant[name].because(why)
        model.report[CORRECT_BIAS] = info | {"applied_by": NAME, "gain_db": round(gain, 2)}
        return True

    def _score(self, model: QModel, combo, reference: Reference, failed: list) -> float | None:
        """Output SNR of ``combo`` quantized on a copy of ``model`` (None: it failed; noted in ``failed``)."""
        try:
            trial = model.copy(share_weights=True)
            for variant in combo:
                variant.apply(trial)
            return self._finish_and_score(trial, self.then, reference)
        except Exception as exc:   # a variant that cannot be built or run is not chosen
            failed.append({"variant": _label(combo), "error": f"{type(exc).__name__}: {first_line(exc)}"})
            return None

    def _finish_and_score(self, trial: QModel, passes: str, reference: Reference) -> float:
        """Run ``passes`` on the copy ``trial`` and return its output SNR against ``reference``."""
        fused = len(trial.graph.nodes) <= self.fused_nodes   # the float graph's size, before Q/DQ
        PassManager(passes).run(trial)
        return reference.score(trial.to_proto(metadata=False), optimize=fused)["snr_db"]

    def _reference(self, model: QModel) -> Reference | None:
        kept = model.kept_samples
        if kept is not None and kept.feeds:
            per_feed = sum(np.size(v) for v in kept.outputs[0])
            n = min(self.samples, max(MIN_SAMPLES, -(-self.output_values // max(per_feed, 1))), len(kept.feeds))
            if n >= MIN_SAMPLES or not kept.full:   # calibrate kept enough: no second float run
                return Reference(kept.names, list(kept.feeds[0]), kept.feeds[:n], kept.outputs[:n])
        try:
            feeds = open_data(model.calibration_data)
            reference = Reference.run(model.to_proto(metadata=False), feeds, self.samples,
                                      enough_values=self.output_values, min_samples=MIN_SAMPLES)
        except CalibrationDataError:
            return None
        return reference if reference.feeds else None
